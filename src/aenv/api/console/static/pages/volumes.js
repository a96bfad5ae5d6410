// Volumes (GET /volumes) and a read-only browser of one volume's files through the volume content API,
// which takes the volume's own token (GET /volumes/<id> gives it), not the API key.
import { act, api, bytes, el, get, table, toast } from "../app.js";

export async function render(main) {
  const list = el("div", { id: "volumes" });
  const browser = el("div", { id: "volume-browser" });
  main.replaceChildren(el("h1", {}, "Volumes"), list, browser);
  async function load() {
    const vols = await get("/volumes");
    list.replaceChildren(table([
      ["name", (v) => el("b", { "data-volume": v.volumeID }, v.name)], ["ID", (v) => el("span", { class: "mono" }, v.volumeID)],
      ["", (v) => el("span", {}, el("button", { "data-browse": v.volumeID, onclick: () => open(v) }, "Browse"), " ",
        el("button", { class: "danger", "data-delete": v.volumeID, onclick: async () => {
          if (!window.confirm(`Delete volume ${v.name} and its files?`)) return;
          if (await act("delete volume", () => api(`/volumes/${encodeURIComponent(v.volumeID)}`, { method: "DELETE" }))) { browser.replaceChildren(); load(); }
        } }, "Delete"))],
    ], vols, { empty: "No volumes." }));
  }
  async function open(v) {
    try {
      const { token } = await get(`/volumes/${encodeURIComponent(v.volumeID)}`);
      browse(browser, v, token, "/");
    } catch (e) { toast(`volume ${v.name}: ${e.message}`, true); }
  }
  await load();
  return null;
}

function content(v, token, what, path) {
  return api(`/volumecontent/${encodeURIComponent(v.volumeID)}/${what}?path=${encodeURIComponent(path)}`, { headers: { Authorization: `Bearer ${token}` } });
}

async function browse(host, v, token, path) {
  let entries;
  try { entries = (await content(v, token, "dir", path)).data; } catch (e) { host.replaceChildren(el("p", { class: "muted" }, `${path}: ${e.message}`)); return; }
  entries = (Array.isArray(entries) ? entries : entries.entries || []).sort((a, b) => (a.type === b.type ? a.name.localeCompare(b.name) : a.type === "directory" ? -1 : 1));
  const parent = path.replace(/\/[^/]+\/?$/, "") || "/";
  const view = el("pre", { class: "log", id: "volume-file", style: "display:none" });
  host.replaceChildren(el("h2", {}, `Files of ${v.name}`),
    el("div", { class: "bar" }, el("b", { class: "mono", id: "volume-cwd" }, path), path !== "/" ? el("button", { id: "volume-up", onclick: () => browse(host, v, token, parent) }, "Up") : ""),
    table([
      ["name", (e) => (e.type === "directory"
        ? el("a", { href: "javascript:void 0", "data-entry": e.name, onclick: () => browse(host, v, token, e.path) }, `${e.name}/`)
        : el("span", { "data-entry": e.name }, e.name))],
      ["size", (e) => (e.type === "directory" ? "" : bytes(e.size))], ["modified", (e) => (e.mtime || "").slice(0, 19).replace("T", " ")],
      ["mode", (e) => (e.mode !== undefined ? e.mode.toString(8) : "")],
      ["", (e) => (e.type === "file" ? el("button", { "data-read": e.name, onclick: async () => {
        try {
          const resp = await fetch(`/volumecontent/${encodeURIComponent(v.volumeID)}/file?path=${encodeURIComponent(e.path)}`, { headers: { Authorization: `Bearer ${token}` } });
          if (!resp.ok) throw new Error(`${resp.status} ${resp.statusText}`);
          view.textContent = await (await resp.blob()).slice(0, 256 * 1024).text();
          view.style.display = "block";
        } catch (err) { toast(`read ${e.path}: ${err.message}`, true); }
      } }, "Read") : "")],
    ], entries, { empty: "This folder is empty." }), view);
}
