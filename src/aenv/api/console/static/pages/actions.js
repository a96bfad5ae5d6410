// Actions on one sandbox, shared by the sandbox table and the sandbox page. Each returns a promise.
import { api } from "../app.js";

const id = encodeURIComponent;
export const kill = (sid) => api(`/sandboxes/${id(sid)}`, { method: "DELETE" });
export const pause = (sid) => api(`/sandboxes/${id(sid)}/pause`, { method: "POST" });
export const resume = (sid) => api(`/sandboxes/${id(sid)}/connect`, { method: "POST", body: { timeout: 300 } });
export const setTimeoutS = (sid, seconds) => api(`/sandboxes/${id(sid)}/timeout`, { method: "POST", body: { timeout: seconds } });
export const fork = (sid, count) => api(`/sandboxes/${id(sid)}/fork`, { method: "POST", body: { count } });
export const snapshot = (sid, name) => api(`/sandboxes/${id(sid)}/snapshots`, { method: "POST", body: name ? { name } : {} });
export const rollback = (sid, snapshotID) => api(`/sandboxes/${id(sid)}/rollback`, { method: "POST", body: { snapshotID } });
export const createFrom = (templateID) => api("/v2/sandboxes", { method: "POST", body: { templateID, timeout: 300 } });
export const killRun = (metadata) => api(`/aenv/sandboxes?metadata=${id(metadata)}`, { method: "DELETE" });

export function askCount(what = "Fork how many children?", initial = "4") {
  const raw = window.prompt(what, initial);
  const n = Number.parseInt(raw || "", 10);
  return Number.isFinite(n) && n > 0 ? n : null;
}
