// The checkpoint tree: template → snapshots → sandboxes (GET /aenv/checkpoints), drawn with Cytoscape and
// the dagre layout. Pick a node to act on it: fork a sandbox, snapshot it, roll a sandbox back to a
// snapshot of its lineage, start a new sandbox from a snapshot. Redrawn as lifecycle events arrive.
import { act, el, get, meta, onLifecycle, stateBadge, vendor } from "../app.js";
import * as A from "./actions.js";

let registered = false;

export async function render(main, [root]) {
  await vendor("cytoscape.js", "dagre.js", "cytoscape-dagre.js");
  if (!registered && window.cytoscapeDagre) { window.cytoscape.use(window.cytoscapeDagre); registered = true; }
  const rootInput = el("input", { id: "tree-root", placeholder: "sandbox or snapshot ID (empty: every tree)", value: root || "", size: 40,
    onchange: (e) => { location.hash = `#/checkpoints/${encodeURIComponent(e.target.value.trim())}`; } });
  const graphHost = el("div", { id: "graph" });
  const side = el("div", { class: "panel", id: "tree-node" }, el("p", { class: "muted" }, "Pick a node of the tree."));
  const counts = el("span", { class: "muted", id: "tree-counts" });
  main.replaceChildren(el("h1", {}, "Checkpoint tree"), el("div", { class: "bar" }, rootInput, counts),
    el("div", { style: "display:grid;grid-template-columns:3fr 1fr;gap:1rem" }, graphHost, side));

  let cy = null;
  let data = null;
  let selected = null;
  async function draw() {
    data = await get(`/aenv/checkpoints${root ? `?root=${encodeURIComponent(root)}` : ""}`);
    const elements = [
      ...data.nodes.map((n) => ({ data: { id: n.id, label: label(n), kind: n.kind, state: n.state || "", internal: n.internal ? "yes" : "no" } })),
      ...data.edges.map((e, i) => ({ data: { id: `e${i}`, source: e.source, target: e.target } })),
    ];
    const sandboxes = data.nodes.filter((n) => n.kind === "sandbox").length;
    counts.textContent = `${data.nodes.length - sandboxes} snapshots and templates, ${sandboxes} sandboxes${data.truncated ? " (cut: too many to draw)" : ""}`;
    graphHost.dataset.sandboxes = String(sandboxes);
    graphHost.dataset.nodes = data.nodes.map((n) => n.id).join(" ");
    if (cy) cy.destroy();
    cy = window.cytoscape({ container: graphHost, elements, style: STYLE, layout: { name: "dagre", rankDir: "LR", nodeSep: 18, rankSep: 60 }, maxZoom: 1.6 });
    cy.on("tap", "node", (ev) => pick(ev.target.id()));
    window.aenvTree = { select: pick, ids: () => data.nodes.map((n) => n.id) }; // for tests and the curious
    if (selected && data.nodes.some((n) => n.id === selected)) pick(selected);
  }

  function pick(id) {
    selected = id;
    const n = data.nodes.find((x) => x.id === id);
    if (!n) return;
    if (cy) { cy.nodes().unselect(); cy.getElementById(id).select(); }
    side.replaceChildren(...details(n), ...actions(n));
  }

  function details(n) {
    if (n.kind === "template") return [el("h2", {}, "Template"), el("p", { class: "mono" }, n.templateID)];
    const rows = n.kind === "sandbox"
      ? [["state", stateBadge(n.state)], ["template", n.templateID], ["metadata", meta(n.metadata)], ["node", n.node || ""]]
      : [["name", n.name || ""], ["mode", n.mode], ["taken of", n.sandboxID || ""], ["at", n.createdAt], ["fork point", n.internal ? "yes" : "no"], ["node", n.node || ""]];
    return [el("h2", {}, n.kind === "sandbox" ? "Sandbox" : "Snapshot"), el("p", { class: "mono" }, n.id),
      el("table", {}, el("tbody", {}, rows.map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", { class: "wrap" }, v)))))];
  }

  function actions(n) {
    if (n.kind === "sandbox") {
      return [el("div", { class: "bar" },
        el("button", { id: "tree-fork", class: "primary", onclick: async () => { const k = A.askCount(); if (k && await act(`fork ×${k}`, () => A.fork(n.id, k))) draw(); } }, "Fork ×N"),
        el("button", { id: "tree-snapshot", onclick: async () => { if (await act("snapshot", () => A.snapshot(n.id))) draw(); } }, "Snapshot"),
        el("a", { href: `#/sandbox/${encodeURIComponent(n.id)}` }, el("button", {}, "Open")))];
    }
    if (n.kind !== "snapshot" || n.internal) return [];
    // Sandboxes whose lineage holds this snapshot may go back to it.
    const below = descendants(n.id).filter((x) => x.kind === "sandbox" && x.state === "running");
    const pickBox = el("select", { id: "tree-rollback-target" }, below.map((x) => el("option", { value: x.id }, x.id)));
    return [el("div", { class: "bar" },
      el("button", { id: "tree-create", onclick: async () => { if (await act("create", () => A.createFrom(n.id))) draw(); } }, "New sandbox from it")),
    below.length ? el("div", { class: "bar" }, "Roll back", pickBox, el("button", { id: "tree-rollback", onclick: async () => {
      if (await act("rollback", () => A.rollback(pickBox.value, n.id))) draw();
    } }, "to this snapshot")) : el("p", { class: "muted" }, "No running sandbox descends from it.")];
  }

  function descendants(id) {
    const out = [];
    const todo = [id];
    while (todo.length) {
      const cur = todo.pop();
      for (const e of data.edges) if (e.source === cur) { const n = data.nodes.find((x) => x.id === e.target); if (n) { out.push(n); todo.push(n.id); } }
    }
    return out;
  }

  let timer = null;
  const stop = onLifecycle(() => { if (!timer) timer = setTimeout(() => { timer = null; draw().catch(() => {}); }, 1000); });
  await draw();
  if (root) pick(root);
  return () => { stop(); clearTimeout(timer); if (cy) cy.destroy(); delete window.aenvTree; };
}

function label(n) {
  if (n.kind === "template") return n.templateID;
  if (n.kind === "sandbox") return `${n.id.slice(0, 10)}… (${n.state})`;
  return n.internal ? "fork point" : (n.name || `${n.id.slice(0, 10)}…`);
}

const STYLE = [
  { selector: "node", style: { label: "data(label)", "font-size": 10, "text-valign": "bottom", "text-margin-y": 4, width: 18, height: 18, "background-color": "#2f5bd3" } },
  { selector: "node[kind = 'template']", style: { shape: "round-rectangle", "background-color": "#6b6b76", width: 26 } },
  { selector: "node[kind = 'sandbox']", style: { shape: "ellipse", "background-color": "#1e8e3e" } },
  { selector: "node[state = 'paused']", style: { "background-color": "#b7791f" } },
  { selector: "node[internal = 'yes']", style: { shape: "diamond", "background-color": "#8e44ad" } },
  { selector: "node:selected", style: { "border-width": 3, "border-color": "#111" } },
  { selector: "edge", style: { width: 1.5, "line-color": "#b9bcc6", "target-arrow-shape": "triangle", "target-arrow-color": "#b9bcc6", "curve-style": "bezier" } },
];
