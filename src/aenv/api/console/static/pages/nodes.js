// Nodes: on a gateway, each node behind it as the gateway last saw it (GET /nodes, /nodes/<id>), refreshed
// every few seconds; on a single node, that node's own /aenv/info.
import { age, el, get, stateBadge, table } from "../app.js";

const REFRESH_MS = 5000;
const when = (t) => (t === null || t === undefined ? null : new Date(t * 1000).toISOString()); // unix seconds → ISO
const counts = (m) => Object.entries(m || {}).map(([k, n]) => `${n} ${k}`).join(", ") || "none";

export async function render(main, args, ctx) {
  if (ctx.session.role !== "gateway") return renderNode(main);
  const host = el("div", { id: "nodes" });
  const detail = el("div", { id: "node-detail" });
  main.replaceChildren(el("h1", {}, "Nodes"), host, detail);
  async function load() {
    const nodes = await get("/nodes");
    host.replaceChildren(el("div", { class: "cards" },
      ["up", "down", "dead"].map((s) => el("div", { class: "card" }, el("b", { id: `nodes-${s}` }, nodes.filter((n) => n.state === s).length), s))),
    table([
      ["node", (n) => el("a", { href: `#/nodes/${encodeURIComponent(n.nodeID)}`, "data-node": n.nodeID }, n.nodeID)],
      ["state", (n) => stateBadge(n.state)], ["since", (n) => `${age(when(n.since))} ago`], ["why down", (n) => n.reason || "", "wrap"],
      ["incarnation", (n) => (n.incarnation ?? "")], ["sandboxes", (n) => counts(n.sandboxes)],
      ["starting", (n) => String(n.starting)], ["in flight", (n) => String(n.inflight)], ["load", (n) => Number(n.load).toFixed(2)],
      ["version", (n) => n.version || ""], ["runtime", (n) => n.runtime || ""], ["warm", (n) => counts(n.warm), "wrap"],
      ["reported", (n) => (n.reportedAt ? `${age(when(n.reportedAt))} ago` : "never")],
    ], nodes, { empty: "No nodes behind this gateway." }));
    if (args[0]) detail.replaceChildren(await nodeDetail(args[0]));
  }
  await load();
  const timer = setInterval(() => load().catch(() => {}), REFRESH_MS);
  return () => clearInterval(timer);
}

async function nodeDetail(id) {
  let n;
  try { n = await get(`/nodes/${encodeURIComponent(id)}`); } catch (e) { return el("p", { class: "muted" }, e.message); }
  const down = n.state !== "up";
  const rows = [["URL", n.url], ["state", stateBadge(n.state)], ["since", `${when(n.since)} (${age(when(n.since))} ago)`],
    ["why", n.reason || ""], ["incarnation", n.incarnation ?? ""], ["machine", n.machine ? JSON.stringify(n.machine) : ""],
    ["runtime", n.runtime || ""], ["version", n.version || ""], ["last report", n.reportedAt ? when(n.reportedAt) : "never"],
    [down ? "held at its last report" : "sandboxes", counts(n.sandboxes)], ["warm templates", counts(n.warm)]];
  return el("div", { class: "panel", id: `node-${n.nodeID}` }, el("h2", {}, `Node ${n.nodeID}`), kv(rows),
    n.state === "dead" ? el("p", { class: "bad", id: "node-lost" },
      `Declared dead ${age(when(n.since))} ago. The sandboxes it held at its last report (${counts(n.sandboxes)}) ended with it, `
      + "except paused ones whose pause was published to the shared snapshot store: a resume brings those back on a live node.") : "",
    n.lost ? el("div", { id: "node-lost-list" }, el("h2", {}, `Lost with it: ${n.lost.count} sandboxes`),
      el("p", { class: "mono wrap" }, n.lost.sandboxes.join(" ")),
      n.lost.count > n.lost.sandboxes.length ? el("p", { class: "muted" }, `the latest ${n.lost.sandboxes.length} shown`) : "") : "");
}

function kv(rows) {
  return el("table", { class: "kv" }, el("tbody", {}, rows.map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", { class: "wrap" }, v)))));
}

async function renderNode(main) {
  const i = await get("/aenv/info");
  const flat = (o) => Object.entries(o || {}).map(([k, v]) => [k, typeof v === "object" && v !== null ? JSON.stringify(v) : String(v)]);
  const known = new Set(["version", "sandboxes", "starting", "waiting", "runtime", "capabilities", "ksm", "network", "cluster", "teams"]);
  main.replaceChildren(el("h1", {}, "This node"),
    el("div", { class: "cards", id: "node-info" },
      el("div", { class: "card" }, el("b", { id: "node-version" }, i.version), "version"),
      el("div", { class: "card" }, el("b", {}, i.runtime), "runtime"),
      ...Object.entries(i.sandboxes || {}).map(([k, n]) => el("div", { class: "card" }, el("b", {}, n), k)),
      el("div", { class: "card" }, el("b", {}, i.starting ?? 0), "starting"), el("div", { class: "card" }, el("b", {}, i.waiting ?? 0), "waiting")),
    el("div", { class: "grid2" },
      el("div", { class: "panel" }, el("h2", {}, "Capabilities"), kv(flat(i.capabilities))),
      el("div", {}, el("div", { class: "panel" }, el("h2", {}, "Network"), kv(flat(i.network))),
        el("div", { class: "panel" }, el("h2", {}, "KSM"), kv(flat(i.ksm))),
        el("div", { class: "panel" }, el("h2", {}, "Cluster"), i.cluster ? kv(flat(i.cluster)) : el("p", { class: "muted" }, "Not in a cluster.")),
        el("div", { class: "panel" }, el("h2", {}, "Placement"), kv(flat(Object.fromEntries(Object.entries(i).filter(([k]) => !known.has(k)))))))),
    i.teams ? el("div", {}, el("h2", {}, "Teams here"), table([["team", (r) => r[0]], ["holds", (r) => counts(r[1])]], Object.entries(i.teams))) : "");
}
