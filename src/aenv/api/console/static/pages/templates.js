// Templates and builds: the list with a pull form (#/templates), and one template's tags, builds, a
// build's steps and its log, followed live while it builds (#/template/<id>).
import { age, bytes, el, get, stateBadge, table, toast } from "../app.js";

export async function render(main, args, ctx, pageName) {
  return pageName === "template" ? renderOne(main, args[0]) : renderList(main);
}

async function renderList(main) {
  const list = el("div", { id: "template-list" });
  main.replaceChildren(el("h1", {}, "Templates"), pullForm(() => loadList(list)), list);
  await loadList(list);
}

// The templates, and the builds whose template does not exist yet (a first build makes it when ready).
async function loadList(host) {
  const [rows, builds] = await Promise.all([get("/templates"), get("/aenv/builds").catch(() => [])]);
  const count = {};
  for (const b of builds) count[b.templateID] = (count[b.templateID] || 0) + 1;
  const link = (t) => el("a", { href: `#/template/${encodeURIComponent(t.templateID)}`, "data-template": t.templateID }, (t.aliases || [])[0] || t.templateID);
  const ids = new Set(rows.map((t) => t.templateID));
  const pending = builds.filter((b) => !ids.has(b.templateID) && ["waiting", "building"].includes(b.status));
  host.replaceChildren(table([
    ["name", link], ["ID", (t) => el("span", { class: "mono" }, t.templateID)], ["kind", (t) => t.kind || ""],
    ["public", (t) => (t.public ? "yes" : "no")], ["size", (t) => bytes(t.sizeBytes)],
    ["built", (t) => (t.createdAt ? `${age(t.createdAt)} ago` : "")], ["last used", (t) => (t.lastSpawnedAt ? `${age(t.lastSpawnedAt)} ago` : "")],
    ["builds", (t) => String(count[t.templateID] ?? t.buildCount ?? "")], ["source", (t) => t.source || "", "wrap"],
  ], rows, { empty: "No templates." }),
  pending.length ? el("h2", {}, "Builds in progress") : "", pending.length ? table([
    ["name", (b) => el("a", { href: `#/template/${encodeURIComponent(b.templateID)}`, "data-template": b.templateID }, b.alias)],
    ["build", (b) => el("span", { class: "mono" }, b.buildID)], ["status", (b) => stateBadge(b.status)], ["started", (b) => (b.startedAt ? `${age(b.startedAt)} ago` : "")],
  ], pending) : "");
}

// POST /aenv/templates/pull answers NDJSON: {"event": PullEvent} lines, then {"template"} or {"error"}.
function pullForm(onPulled) {
  const image = el("input", { id: "pull-image", placeholder: "image, e.g. python:3.12-slim", size: 40 });
  const name = el("input", { id: "pull-name", placeholder: "template name (optional)" });
  const bar = el("progress", { id: "pull-progress", max: 1, value: 0, style: "display:none" });
  const note = el("span", { class: "muted", id: "pull-status" });
  const button = el("button", { class: "primary", id: "pull", onclick: async () => {
    if (!image.value.trim()) return;
    button.disabled = true; bar.style.display = ""; bar.removeAttribute("value");
    try { await pull({ image: image.value.trim(), ...(name.value.trim() ? { name: name.value.trim() } : {}) }, bar, note); await onPulled(); }
    catch (e) { note.textContent = e.message; toast(`pull: ${e.message}`, true); }
    finally { button.disabled = false; }
  } }, "Pull image");
  return el("div", { class: "bar panel" }, el("b", {}, "Pull an image:"), image, name, button, bar, note);
}

async function pull(body, bar, note) {
  const resp = await fetch("/aenv/templates/pull", { method: "POST", credentials: "same-origin",
    headers: { "X-Aenv-Console": "1", "Content-Type": "application/json" }, body: JSON.stringify(body) });
  if (!resp.ok) { const t = await resp.text(); let m = t; try { m = JSON.parse(t).message; } catch { /* plain text */ } throw new Error(m || resp.statusText); }
  const layers = {};
  const reader = resp.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let nl;
    while ((nl = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, nl).trim(); buf = buf.slice(nl + 1);
      if (!line) continue;
      const item = JSON.parse(line);
      if (item.error) throw new Error(item.error.message);
      if (item.template) { bar.value = 1; note.textContent = `ready: ${(item.template.aliases || [])[0] || item.template.templateID}`; toast("pull: done"); return; }
      const ev = item.event || {};
      if (ev.layer) layers[ev.layer] = ev;
      const known = Object.values(layers).filter((l) => l.total > 0);
      const total = known.reduce((a, l) => a + l.total, 0);
      const doneBytes = known.reduce((a, l) => a + (["done", "cached"].includes(l.status) ? l.total : Math.min(l.current, l.total)), 0);
      if (total) bar.value = doneBytes / total;
      const finished = Object.values(layers).filter((l) => ["done", "cached"].includes(l.status)).length;
      note.textContent = `${ev.status}${ev.layer ? ` ${ev.layer.slice(7, 19)}` : ""} — ${finished}/${Object.keys(layers).length} layers, ${bytes(doneBytes)} of ${bytes(total)}${ev.message ? ` — ${ev.message}` : ""}`;
    }
  }
}

async function renderOne(main, tid) {
  const id = encodeURIComponent(tid);
  // A template's first build has no template row until it is ready: its page shows the build alone.
  // (read from the list, not GET /templates/<id>: a 404 there would be a console error for a page that expects it)
  const t = (await get("/templates")).find((r) => r.templateID === tid) || { templateID: tid, aliases: [], missing: true };
  const [tags, builds] = await Promise.all([t.missing ? [] : get(`/templates/${id}/tags`).catch(() => []), get(`/aenv/builds?templateID=${id}`).catch(() => [])]);
  const detail = el("div", { id: "build-detail" });
  let stop = () => {};
  const show = (b) => { stop(); stop = showBuild(detail, b); };
  main.replaceChildren(el("h1", {}, (t.aliases || [])[0] || t.templateID, " ", el("span", { class: "muted mono" }, t.templateID)),
    t.missing ? el("p", { class: "muted", id: "not-built" }, "No template of this ID yet (a first build makes it when it is ready).") : el("div", { class: "panel" }, el("table", { class: "kv" }, el("tbody", {},
      [["kind", t.kind], ["public", t.public ? "yes" : "no"], ["size", `${t.cpuCount} vCPU, ${t.memoryMB} MiB, ${bytes(t.sizeBytes)}`],
        ["created", t.createdAt], ["source", t.source]].map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", { class: "wrap" }, v ?? "")))))),
    el("h2", {}, "Tags"), table([["tag", (x) => el("b", { "data-tag": x.tag }, x.tag)], ["build", (x) => el("span", { class: "mono" }, x.buildID)], ["at", (x) => x.createdAt]], tags, { empty: "No tags (only built templates have tags)." }),
    el("h2", {}, "Builds"), el("div", { id: "builds" }, table([
      ["build", (b) => el("a", { href: "javascript:void 0", "data-build": b.buildID, class: "mono", onclick: () => show(b) }, b.buildID)],
      ["status", (b) => stateBadge(b.status)], ["name", (b) => b.alias], ["from", (b) => b.fromImage || b.fromTemplate || ""],
      ["steps", (b) => String(b.steps.length)], ["started", (b) => (b.startedAt ? `${age(b.startedAt)} ago` : "")], ["log lines", (b) => String(b.logCount)],
    ], builds, { empty: "No builds of this template on record (pulled and snapshot templates have none)." })), detail);
  if (builds.length) show(builds[0]);
  return () => stop();
}

// A build's steps and log: the status route pages the log by offset; it is polled while the build runs.
function showBuild(host, b) {
  const log = el("pre", { class: "log", id: "build-log" });
  const status = el("span", { id: "build-status" }, stateBadge(b.status));
  host.replaceChildren(el("h2", {}, "Build ", el("span", { class: "mono" }, b.buildID), " ", status),
    table([["#", (s) => String(s.i + 1)], ["step", (s) => s.type], ["args", (s) => s.args.join(" "), "wrap"], ["force", (s) => (s.force ? "yes" : "")]],
      b.steps.map((s, i) => ({ ...s, i })), { empty: "No steps recorded." }), b.reason ? el("p", { class: "bad" }, b.reason) : "", log);
  let offset = 0; let timer = null; let stopped = false; let running = false;
  const path = `/templates/${encodeURIComponent(b.templateID)}/builds/${encodeURIComponent(b.buildID)}/status`;
  async function poll() {
    try {
      const s = await get(`${path}?logsOffset=${offset}&limit=1000`);
      offset += s.logEntries.length;
      const atEnd = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
      log.append(...s.logEntries.map((e) => `${e.timestamp.slice(11, 19)} ${e.level === "info" ? "" : `[${e.level}] `}${e.step ? `(${e.step}) ` : ""}${e.message}\n`));
      if (atEnd) log.scrollTop = log.scrollHeight;
      status.replaceChildren(stateBadge(s.status));
      if (running && (s.status === "ready" || s.status === "error")) { window.dispatchEvent(new HashChangeEvent("hashchange")); return; } // its template and tags now exist
      running = s.status === "building" || s.status === "waiting";
      log.dataset.lines = String(offset);
      if (!stopped && (s.status === "building" || s.status === "waiting" || s.logEntries.length === 1000)) timer = setTimeout(poll, 1000);
    } catch (e) { log.append(`(log: ${e.message})\n`); }
  }
  poll();
  return () => { stopped = true; clearTimeout(timer); };
}
