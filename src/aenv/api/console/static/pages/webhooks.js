// Lifecycle webhooks: the receivers (the server's setting) and the delivery log. Both are operators' routes:
// a team key gets a 403, shown as a note rather than an error.
import { age, el, get, stateBadge, table } from "../app.js";

const REFRESH_MS = 5000;
const when = (t) => (t === null || t === undefined ? null : new Date(t * 1000).toISOString()); // unix seconds → ISO
let stateFilter = "";

export async function render(main) {
  let hooks;
  try { hooks = await get("/aenv/webhooks"); } catch (e) {
    if (e.status !== 403) throw e;
    main.replaceChildren(el("h1", {}, "Webhooks"), el("p", { class: "muted", id: "webhooks-forbidden" },
      "Webhooks are the server's setting and their deliveries carry every team's events, so only an operator's key ",
      "(one of admin_keys) can see them. ", el("span", { class: "mono" }, e.message)));
    return null;
  }
  const deliveries = el("div", { id: "deliveries" });
  const filter = el("select", { id: "delivery-state", onchange: (e) => { stateFilter = e.target.value; load(); } },
    [["", "all"], ["pending", "pending"], ["delivered", "delivered"], ["failed", "failed"]].map(([v, t]) => el("option", { value: v, selected: stateFilter === v }, t)));
  main.replaceChildren(el("h1", {}, "Webhooks"),
    el("div", { class: "panel", id: "receivers" },
      el("h2", {}, "Receivers"),
      hooks.urls.length ? el("ul", {}, hooks.urls.map((u) => el("li", { class: "mono", "data-receiver": u }, u)))
        : el("p", { class: "muted" }, "No receivers: set webhook_urls (AENV_WEBHOOK_URLS) to have lifecycle events posted."),
      el("p", { class: "muted" }, `Events: ${(hooks.events || []).join(", ")}. Up to ${hooks.attempts} attempts each. `,
        hooks.signed ? "Bodies are signed (X-Aenv-Signature)." : "Bodies are not signed (no webhook secret set)."),
      (hooks.nodesDown || []).length ? el("p", { class: "bad" }, `Nodes not answering: ${hooks.nodesDown.join(", ")}`) : ""),
    el("h2", {}, "Deliveries"), el("div", { class: "bar" }, "state:", filter, el("button", { onclick: () => load() }, "Refresh")), deliveries);

  async function load() {
    const q = new URLSearchParams({ limit: "200" });
    if (stateFilter) q.set("state", stateFilter);
    const rows = await get(`/aenv/webhooks/deliveries?${q}`);
    deliveries.replaceChildren(table([
      ["event", (d) => el("b", { "data-delivery": d.id }, d.event)], ["receiver", (d) => el("span", { class: "mono" }, d.url), "wrap"],
      ["sandbox", (d) => (d.sandboxID ? el("a", { href: `#/sandbox/${encodeURIComponent(d.sandboxID)}`, class: "mono" }, d.sandboxID) : "")],
      ["state", (d) => stateBadge(d.state)], ["attempts", (d) => String(d.attempts)], ["last status", (d) => (d.lastStatus ?? "")],
      ["last error", (d) => d.lastError || "", "wrap"], ["created", (d) => `${age(when(d.createdAt))} ago`],
      ["next try", (d) => (d.state === "pending" && d.nextAttemptAt ? `in ${Math.max(0, Math.round(d.nextAttemptAt - Date.now() / 1000))}s` : "")],
      ...(rows.some((d) => d.node) ? [["node", (d) => d.node || ""]] : []),
    ], rows, { empty: "No deliveries yet." }));
  }
  await load();
  const timer = setInterval(() => load().catch(() => {}), REFRESH_MS);
  return () => clearInterval(timer);
}
