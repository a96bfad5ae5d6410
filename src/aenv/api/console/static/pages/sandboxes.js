// The sandbox table: server-side pages of GET /v2/sandboxes, totals from /aenv/sandboxes/summary, CPU and
// memory of the rows shown from GET /sandboxes/metrics, and live updates from the lifecycle event stream.
import { act, age, api, bytes, el, get, left, meta, onLifecycle, stateBadge } from "../app.js";
import * as A from "./actions.js";

const PAGE = 50;
const filters = { state: "running,paused", template: "", metadata: "", node: "" };

export async function render(main, args, ctx) {
  if (args[0] !== undefined) filters.metadata = args[0]; // #/sandboxes/run=X: one run's sandboxes
  const tokens = [null]; // the nextToken of each page seen, to go back
  let page = 0;
  let refreshTimer = null;
  const cards = el("div", { class: "cards", id: "summary" });
  const body = el("div", { id: "sandbox-table" });
  const pager = el("div", { class: "pager" });
  const firstPaint = performance.now();

  const input = (key, placeholder) => el("input", { id: `filter-${key}`, placeholder, value: filters[key], onchange: (e) => { filters[key] = e.target.value.trim(); reset(); } });
  const stateSel = el("select", { id: "filter-state", onchange: (e) => { filters.state = e.target.value; reset(); } },
    [["running,paused", "running + paused"], ["running", "running"], ["paused", "paused"]].map(([v, t]) => el("option", { value: v, selected: filters.state === v }, t)));
  const killRunBtn = el("button", { class: "danger", id: "kill-run", onclick: async () => {
    if (!filters.metadata) { window.alert("Give the run's metadata filter first (e.g. run=abc)."); return; }
    if (!window.confirm(`Kill every sandbox whose metadata has ${filters.metadata}?`)) return;
    const out = await act("kill run", async () => (await A.killRun(filters.metadata)).data);
    if (out) reset();
  } }, "Kill every sandbox of this run");
  main.replaceChildren(el("h1", {}, "Sandboxes"), cards,
    el("div", { class: "bar" }, stateSel, input("template", "template"), input("metadata", "metadata: run=abc"),
      ctx.session.role === "gateway" ? input("node", "node") : "", el("button", { onclick: () => reset() }, "Refresh"), killRunBtn),
    body, pager);

  function reset() { tokens.length = 1; page = 0; load(); }

  function query(token) {
    const q = new URLSearchParams({ limit: String(PAGE), state: filters.state });
    if (filters.template) q.set("template", filters.template);
    if (filters.metadata) q.set("metadata", filters.metadata);
    if (filters.node) q.set("node", filters.node);
    if (token) q.set("nextToken", token);
    return q;
  }

  async function loadSummary() {
    const q = filters.metadata ? `?metadata=${encodeURIComponent(filters.metadata)}` : "";
    const s = await get(`/aenv/sandboxes/summary${q}`);
    const runs = Object.entries(s.byRun || {}).sort((a, b) => sum(b[1]) - sum(a[1])).slice(0, 8);
    cards.replaceChildren(
      el("div", { class: "card" }, el("b", { id: "total" }, s.total), "sandboxes"),
      ...Object.entries(s.byState).map(([k, n]) => el("div", { class: "card" }, el("b", {}, n), k)),
      ...runs.map(([run, states]) => el("div", { class: "card run", title: `${s.runKey}=${run}`, onclick: () => { filters.metadata = `${s.runKey}=${run}`; document.getElementById("filter-metadata").value = filters.metadata; reset(); } },
        el("b", {}, sum(states)), `${s.runKey}=${run}`, el("div", { class: "muted" }, Object.entries(states).map(([k, n]) => `${n} ${k}`).join(", ")))));
  }

  async function load() {
    let rows; let next;
    try {
      const got = await api(`/v2/sandboxes?${query(tokens[page])}`);
      rows = got.data; next = got.headers.get("X-Next-Token");
    } catch (e) { body.replaceChildren(el("p", { class: "muted" }, e.message)); return; }
    tokens[page + 1] = next;
    body.replaceChildren(renderRows(rows, ctx));
    body.dataset.rows = String(rows.length);
    if (!main.dataset.painted) { main.dataset.painted = String(Math.round(performance.now() - firstPaint)); }
    pager.replaceChildren(
      el("button", { disabled: page === 0, onclick: () => { page--; load(); } }, "← Newer"),
      el("span", { class: "muted" }, `page ${page + 1}`),
      el("button", { disabled: !next, id: "next-page", onclick: () => { page++; load(); } }, "Older →"));
    loadSummary().catch(() => {});
    fillMetrics(rows);
  }

  async function fillMetrics(rows) {
    const ids = rows.filter((r) => r.state === "running").map((r) => r.sandboxID);
    if (!ids.length) return;
    try {
      const m = (await get(`/sandboxes/metrics?sandbox_ids=${ids.map(encodeURIComponent).join(",")}`)).sandboxes || {};
      for (const [sid, s] of Object.entries(m)) {
        const cpu = document.querySelector(`[data-cpu="${CSS.escape(sid)}"]`);
        const mem = document.querySelector(`[data-mem="${CSS.escape(sid)}"]`);
        if (cpu) cpu.textContent = `${s.cpuUsedPct}%`;
        if (mem) mem.textContent = bytes(s.memUsed);
      }
    } catch { /* metrics are a nicety: the table stands without them */ }
  }

  // Live: an event changes the table at once from what it carries (a new row on top, a state, a row gone),
  // batched per animation frame; the page is reloaded from the server at most every RECONCILE_MS after
  // events, for what events cannot tell (rows pushed off the page, totals, CPU and memory).
  let queued = [];
  let frame = 0;
  const apply = () => {
    frame = 0;
    const tbody = main.querySelector("#sandboxes tbody");
    let reload = false;
    for (const e of queued.splice(0)) {
      const state = e.event === "paused" ? "paused" : e.event === "killed" ? null : "running";
      const old = main.querySelector(`#sandboxes tr[data-id="${CSS.escape(e.sandboxID)}"]`);
      const shows = state !== null && matches(e, state);
      if (old && !shows) old.remove();
      else if (old) old.replaceWith(rowOf({ ...e, state }, ctx));
      else if (shows && page === 0 && tbody) {
        tbody.prepend(rowOf({ ...e, state }, ctx));
        while (tbody.rows.length > PAGE) tbody.lastElementChild.remove();
      } else if (shows && page === 0) reload = true; // the first row: the table itself is drawn by a load
    }
    if (reload || (tbody && !tbody.rows.length)) load();
  };
  const stop = onLifecycle((e) => {
    if (e.event === "resync") { load(); return; }
    queued.push(e);
    if (!frame) frame = requestAnimationFrame(apply);
    if (!refreshTimer) refreshTimer = setTimeout(() => { refreshTimer = null; if (page === 0) load(); else loadSummary().catch(() => {}); }, RECONCILE_MS);
  });
  await load();
  return () => { stop(); clearTimeout(refreshTimer); cancelAnimationFrame(frame); queued = []; };
}

const RECONCILE_MS = 2000;

// Whether a sandbox an event describes belongs in the table under the current filters.
function matches(e, state) {
  if (!filters.state.split(",").includes(state)) return false;
  if (filters.template && e.templateID !== filters.template && e.alias !== filters.template) return false;
  if (filters.node && e.node !== filters.node) return false;
  for (const pair of filters.metadata.split("&").filter(Boolean)) {
    const [k, v] = pair.split("=");
    if ((e.metadata || {})[k] !== v) return false;
  }
  return true;
}

const sum = (states) => Object.values(states).reduce((a, b) => a + b, 0);

function renderRows(rows, ctx) {
  if (!rows.length) return el("p", { class: "muted", id: "no-sandboxes" }, "No sandboxes match.");
  const head = ["ID", "state", "template", ...(ctx.session.role === "gateway" ? ["node"] : []), "metadata", "age", "TTL left", "CPU", "memory", ""];
  return el("table", { id: "sandboxes" }, el("thead", {}, el("tr", {}, head.map((h) => el("th", {}, h)))),
    el("tbody", {}, rows.map((r) => rowOf(r, ctx))));
}

function rowOf(r, ctx) {
  return el("tr", { "data-id": r.sandboxID },
    el("td", {}, el("a", { href: `#/sandbox/${encodeURIComponent(r.sandboxID)}`, class: "mono" }, r.sandboxID)),
    el("td", {}, stateBadge(r.state)),
    el("td", {}, r.alias || r.templateID),
    ctx.session.role === "gateway" ? el("td", {}, r.node || "") : "",
    el("td", { class: "wrap" }, meta(r.metadata)),
    el("td", {}, age(r.startedAt)),
    el("td", {}, r.state === "running" ? left(r.endAt) : ""),
    el("td", { "data-cpu": r.sandboxID }, `${r.cpuCount} vCPU`),
    el("td", { "data-mem": r.sandboxID }, `${r.memoryMB} MiB`),
    el("td", {}, rowActions(r)));
}

function rowActions(r) {
  const sid = r.sandboxID;
  return el("span", {},
    r.state === "running" ? el("button", { onclick: () => act("pause", () => A.pause(sid)) }, "Pause") : el("button", { onclick: () => act("resume", () => A.resume(sid)) }, "Resume"),
    " ", el("button", { onclick: () => { const n = Number(window.prompt("Timeout from now, in seconds?", "300")); if (n > 0) act("timeout", () => A.setTimeoutS(sid, n)); } }, "Timeout"),
    " ", el("button", { onclick: () => { const n = A.askCount(); if (n) act(`fork ×${n}`, () => A.fork(sid, n)); } }, "Fork"),
    " ", el("button", { onclick: () => act("snapshot", () => A.snapshot(sid)) }, "Snapshot"),
    " ", el("button", { class: "danger", "data-kill": sid, onclick: () => act("kill", () => A.kill(sid)) }, "Kill"));
}
