// One sandbox: what it is, what happened to it, its CPU and memory over time, its files and a terminal.
import { act, age, api, bytes, el, get, left, meta, onLifecycle, stateBadge, toast, vendor } from "../app.js";
import * as A from "./actions.js";
import { envd } from "./envd.js";
import { openTerminal } from "./terminal.js";

export async function render(main, [sid], ctx) {
  await vendor("xterm.css", "uplot.css", "xterm.js", "addon-fit.js", "uplot.js");
  const id = encodeURIComponent(sid);
  let sbx;
  try {
    const got = await api(`/sandboxes/${id}`);
    sbx = { ...got.data, node: got.headers.get("X-Aenv-Node") || "" }; // a gateway names the node it asked
  } catch (e) {
    main.replaceChildren(el("h1", {}, sid), el("p", { class: "muted" }, e.message), el("h2", {}, "Lifecycle"), await eventsPanel(id));
    return null;
  }
  const client = envd(sbx);
  let term = null;
  const info = el("div", { class: "panel" },
    el("table", {}, el("tbody", {},
      [["state", stateBadge(sbx.state)], ["template", sbx.alias || sbx.templateID], ["started", `${sbx.startedAt} (${age(sbx.startedAt)} ago)`],
        ["ends", sbx.state === "running" ? `${sbx.endAt} (in ${left(sbx.endAt)})` : ""], ["size", `${sbx.cpuCount} vCPU, ${sbx.memoryMB} MiB, disk ${sbx.diskSizeMB} MiB`],
        ["metadata", meta(sbx.metadata)], ["internet", String(sbx.allowInternetAccess)], ["node", sbx.node || ""]]
        .map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", { class: "wrap" }, v))))));
  const actions = el("div", { class: "bar" },
    el("button", { onclick: () => act("pause", () => A.pause(sid)).then(reload) }, "Pause"),
    el("button", { onclick: () => act("resume", () => A.resume(sid)).then(reload) }, "Resume"),
    el("button", { onclick: () => { const n = Number(window.prompt("Timeout from now, in seconds?", "300")); if (n > 0) act("timeout", () => A.setTimeoutS(sid, n)).then(reload); } }, "Set timeout"),
    el("button", { onclick: () => { const n = A.askCount(); if (n) act(`fork ×${n}`, () => A.fork(sid, n)); } }, "Fork ×N"),
    el("button", { id: "snapshot", onclick: () => act("snapshot", () => A.snapshot(sid, window.prompt("Snapshot name (optional)") || undefined)) }, "Snapshot"),
    el("a", { href: `#/checkpoints/${id}` }, el("button", {}, "Checkpoint tree")),
    el("button", { class: "danger", onclick: async () => { if (await act("kill", () => A.kill(sid))) location.hash = "#/sandboxes"; } }, "Kill"));
  const charts = el("div", { class: "panel", id: "charts" });
  const files = el("div", { class: "panel", id: "files" });
  const termHost = el("div", { id: "terminal" });
  const termPanel = el("div", {}, el("button", { id: "open-terminal", onclick: () => {
    if (term) return;
    termHost.replaceChildren();
    term = openTerminal(termHost, client);
    term.term.focus();
  } }, "Open terminal"), termHost);
  const events = el("div", { id: "events" }, await eventsPanel(id));
  main.replaceChildren(el("h1", { class: "mono" }, sid), actions,
    el("div", { class: "grid2" }, info, charts), el("h2", {}, "Terminal"), termPanel,
    el("h2", {}, "Files"), files, el("h2", {}, "Lifecycle"), events);

  function reload() { window.dispatchEvent(new HashChangeEvent("hashchange")); }
  drawCharts(charts, id).catch((e) => charts.replaceChildren(el("p", { class: "muted" }, `metrics: ${e.message}`)));
  if (sbx.state === "running") browse(files, client, "/home/user"); else files.replaceChildren(el("p", { class: "muted" }, "Files show while the sandbox runs."));
  const timer = setInterval(() => drawCharts(charts, id).catch(() => {}), 5000);
  const stop = onLifecycle(async (e) => { if (e.sandboxID === sid) events.replaceChildren(await eventsPanel(id)); });
  return () => { clearInterval(timer); stop(); if (term) term.close(); };
}

async function eventsPanel(id) {
  const logs = (await get(`/v2/sandboxes/${id}/logs?limit=200`).catch(() => ({ logs: [] }))).logs;
  return el("table", { id: "lifecycle" }, el("tbody", {}, logs.map((l) => el("tr", {},
    el("td", {}, l.timestamp), el("td", {}, l.fields && l.fields.event ? el("b", {}, l.fields.event) : l.level), el("td", { class: "wrap" }, l.message)))));
}

async function drawCharts(host, id) {
  const samples = await get(`/sandboxes/${id}/metrics`);
  if (!samples.length) { host.replaceChildren(el("p", { class: "muted" }, "No metrics yet (sampled every few seconds).")); return; }
  const t = samples.map((s) => s.timestampUnix);
  const cpu = samples.map((s) => s.cpuUsedPct);
  const mem = samples.map((s) => s.memUsed / 1048576);
  const width = Math.max(300, host.clientWidth - 20);
  const opts = (title, label, color) => ({ title, width, height: 150, series: [{}, { label, stroke: color, width: 2 }], axes: [{}, { size: 60 }] });
  host.replaceChildren();
  new window.uPlot(opts("CPU", "CPU %", "#2f5bd3"), [t, cpu], host);
  new window.uPlot(opts("Memory", "MiB used", "#1e8e3e"), [t, mem], host);
  host.dataset.samples = String(samples.length);
}

async function browse(host, client, path) {
  let listing;
  try { listing = await client.listDir(path); } catch (e) { host.replaceChildren(el("p", { class: "muted" }, `${path}: ${e.message}`)); return; }
  const entries = (listing.entries || []).sort((a, b) => (a.type > b.type ? 1 : -1) || a.name.localeCompare(b.name));
  const parent = path.replace(/\/[^/]+\/?$/, "") || "/";
  const upload = el("input", { type: "file", id: "upload", onchange: async (e) => {
    const f = e.target.files[0];
    if (f && await act("upload", () => client.upload(`${path.replace(/\/$/, "")}/${f.name}`, f))) browse(host, client, path);
  } });
  host.replaceChildren(
    el("div", { class: "bar" }, el("b", { class: "mono", id: "cwd" }, path), path !== "/" ? el("button", { onclick: () => browse(host, client, parent) }, "Up") : "", "Upload here:", upload),
    el("table", {}, el("tbody", {}, entries.map((e) => el("tr", { "data-file": e.name },
      el("td", {}, e.type === "FILE_TYPE_DIRECTORY" ? el("a", { href: "javascript:void 0", onclick: () => browse(host, client, e.path) }, `${e.name}/`) : e.name),
      el("td", {}, e.type === "FILE_TYPE_DIRECTORY" ? "" : bytes(e.size)),
      el("td", {}, e.type === "FILE_TYPE_DIRECTORY" ? "" : el("span", {},
        el("button", { onclick: () => view(host, client, e.path) }, "Read"), " ",
        el("button", { onclick: () => save(client, e) }, "Download"))))))),
    el("pre", { class: "log", id: "file-view", style: "display:none" }));
}

async function view(host, client, path) {
  try {
    const blob = await client.download(path);
    const pre = host.querySelector("#file-view");
    pre.textContent = (await blob.slice(0, 256 * 1024).text());
    pre.style.display = "block";
  } catch (e) { toast(`read ${path}: ${e.message}`, true); }
}

async function save(client, entry) {
  try {
    const url = URL.createObjectURL(await client.download(entry.path));
    const a = el("a", { href: url, download: entry.name });
    document.body.append(a); a.click(); a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10000);
  } catch (e) { toast(`download: ${e.message}`, true); }
}
