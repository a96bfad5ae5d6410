// The console's shell: session, router, and the helpers every page uses.
// Pages are ES modules under pages/; each exports render(main, args, ctx) and may return a cleanup function.

export const ctx = { session: null, events: null };

export class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

// A call to the public API, with the session cookie (and the header that says it is the console's own).
export async function api(path, { method = "GET", body, headers = {} } = {}) {
  const init = { method, credentials: "same-origin", headers: { "X-Aenv-Console": "1", ...headers } };
  if (body !== undefined) {
    init.body = typeof body === "string" || body instanceof Blob || body instanceof FormData ? body : JSON.stringify(body);
    if (!(body instanceof FormData) && !(body instanceof Blob)) init.headers["Content-Type"] = "application/json";
  }
  const resp = await fetch(path, init);
  if (resp.status === 401 && !path.startsWith("/console/")) { showLogin("Your session ended: log in again."); }
  const text = await resp.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = text; }
  if (!resp.ok) throw new ApiError(resp.status, (data && data.message) || `${resp.status} ${resp.statusText}`);
  return { data, headers: resp.headers };
}

export const get = async (path) => (await api(path)).data;

// The browser libraries a page needs, loaded when it first needs them (the sandbox list needs none, so its
// first paint waits for no library). Each file once; in order, since a plugin needs its library first.
const loaded = new Map();
function loadFile(name) {
  if (!loaded.has(name)) {
    loaded.set(name, new Promise((resolve, reject) => {
      const node = name.endsWith(".css")
        ? Object.assign(document.createElement("link"), { rel: "stylesheet", href: `/console/vendor/${name}` })
        : Object.assign(document.createElement("script"), { src: `/console/vendor/${name}`, async: false });
      node.onload = resolve;
      node.onerror = () => reject(new Error(`could not load ${name}: is the console installed (scripts/setup.sh)?`));
      document.head.append(node);
    }));
  }
  return loaded.get(name);
}
export async function vendor(...names) {
  for (const n of names) await loadFile(n);
}

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (k === "class") node.className = v;
    else if (k === "dataset") Object.assign(node.dataset, v);
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) if (c !== null && c !== undefined && c !== false) node.append(c instanceof Node ? c : String(c));
  return node;
}

export function toast(message, bad = false) {
  const t = document.getElementById("toast");
  t.textContent = message;
  t.className = bad ? "bad" : "";
  t.style.display = "block";
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => { t.style.display = "none"; }, bad ? 6000 : 2500);
}

// Run an action, report its outcome; returns its result or null on failure.
export async function act(label, fn) {
  try { const out = await fn(); toast(`${label}: done`); return out ?? true; }
  catch (e) { toast(`${label}: ${e.message}`, true); return null; }
}

export function age(iso) {
  if (!iso) return "";
  const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (s < 60) return `${Math.floor(s)}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m`;
  if (s < 86400) return `${Math.floor(s / 3600)}h${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d`;
}

export function left(iso) {
  if (!iso) return "";
  const s = (Date.parse(iso) - Date.now()) / 1000;
  return s <= 0 ? "due" : age(new Date(Date.now() - s * 1000).toISOString());
}

export function bytes(n) {
  if (n === null || n === undefined) return "";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0; let v = Number(n);
  while (v >= 1024 && i < u.length - 1) { v /= 1024; i++; }
  return `${v.toFixed(v >= 10 || i === 0 ? 0 : 1)} ${u[i]}`;
}

export const stateBadge = (s) => el("span", { class: `state ${s}` }, s);
export const meta = (m) => Object.entries(m || {}).map(([k, v]) => `${k}=${v}`).join(" ");

export function table(columns, rows, { empty = "Nothing here." } = {}) {
  if (!rows.length) return el("p", { class: "muted" }, empty);
  return el("table", {}, el("thead", {}, el("tr", {}, columns.map((c) => el("th", {}, c[0])))),
    el("tbody", {}, rows.map((r) => el("tr", {}, columns.map((c) => el("td", { class: c[2] || "" }, c[1](r)))))));
}

// One EventSource for the whole page (lifecycle events of the team's sandboxes), shared by the pages.
export function onLifecycle(handler) {
  if (!ctx.events) {
    ctx.events = { source: new EventSource("/aenv/events"), handlers: new Set() };
    const fire = (e) => { for (const h of ctx.events.handlers) h(e); };
    ctx.events.source.addEventListener("lifecycle", (m) => fire(JSON.parse(m.data)));
    ctx.events.source.addEventListener("resync", () => fire({ event: "resync" }));
    ctx.events.source.addEventListener("open", () => fire({ event: "resync" }));
  }
  ctx.events.handlers.add(handler);
  return () => ctx.events && ctx.events.handlers.delete(handler);
}

function showLogin(message = "") {
  const main = document.getElementById("main");
  const key = el("input", { type: "password", id: "api-key", placeholder: "API key", autocomplete: "current-password" });
  const note = el("p", { class: "muted", id: "login-note" }, message);
  const form = el("form", { class: "login", onsubmit: async (ev) => {
    ev.preventDefault();
    try {
      await api("/console/login", { method: "POST", body: { apiKey: key.value } });
      key.value = "";
      await start();
    } catch (e) { note.textContent = e.message; }
  } }, el("h1", {}, "aenv console"), el("p", {}, "This server asks for an API key. It is kept in an httpOnly session cookie."),
  key, el("button", { class: "primary", type: "submit", id: "login" }, "Log in"), note);
  main.replaceChildren(form);
  document.getElementById("nav").style.visibility = "hidden";
}

async function logout() {
  await api("/console/logout", { method: "POST" });
  if (ctx.events) { ctx.events.source.close(); ctx.events = null; }
  showLogin("Logged out.");
  document.getElementById("who").replaceChildren();
}

const PAGES = {
  sandboxes: "./pages/sandboxes.js", sandbox: "./pages/sandbox.js", checkpoints: "./pages/checkpoints.js",
  templates: "./pages/templates.js", template: "./pages/templates.js", nodes: "./pages/nodes.js",
  runs: "./pages/runs.js", volumes: "./pages/volumes.js", webhooks: "./pages/webhooks.js",
};
let cleanup = null;
let navigation = 0; // which navigation is current: a slower earlier page never replaces a later one

async function route() {
  if (!ctx.session || !ctx.session.loggedIn) return;
  const [name, ...args] = (location.hash.replace(/^#\/?/, "") || "sandboxes").split("/").map(decodeURIComponent);
  const page = PAGES[name] ? name : "sandboxes";
  for (const a of document.querySelectorAll("#nav a")) a.classList.toggle("active", a.dataset.page === page || (page === "sandbox" && a.dataset.page === "sandboxes"));
  if (cleanup) { try { cleanup(); } catch { /* a page's cleanup never blocks the next page */ } cleanup = null; }
  const mine = ++navigation;
  // Each navigation renders into a fresh element put in place at once: what a slower earlier page
  // still writes lands in its own element, no longer in the document.
  const main = el("main", { id: "main" }, el("p", { class: "muted" }, "Loading…"));
  document.getElementById("main").replaceWith(main);
  try {
    const mod = await import(PAGES[page]);
    const done = (await mod.render(main, args, ctx, page)) || null;
    if (mine !== navigation) { if (done) done(); return; }
    cleanup = done;
  } catch (e) {
    if (mine === navigation) main.replaceChildren(el("p", { class: "muted" }, `Could not show this page: ${e.message}`));
  }
}

async function start() {
  ctx.session = await get("/console/session");
  if (!ctx.session.loggedIn) { showLogin(); return; }
  document.getElementById("nav").style.visibility = "visible";
  const who = document.getElementById("who");
  who.replaceChildren(
    ctx.session.open ? el("span", { id: "open-note" }, "open server: no API keys configured") : el("span", {}, `team ${String(ctx.session.team).slice(0, 16)}${ctx.session.admin ? " (admin)" : ""}`),
    ctx.session.open ? "" : el("button", { onclick: logout, id: "logout" }, "Log out"));
  await route();
}

window.addEventListener("hashchange", route);
start();
