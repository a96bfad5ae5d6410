// Runs and leases: each run's counters (GET /aenv/runs, the aenv_run_* metrics as JSON), its live sandboxes
// by state (the summary's byRun), and the team's heartbeat leases (GET /aenv/leases). Refreshed every few seconds.
import { age, el, get, left, stateBadge, table } from "../app.js";

const REFRESH_MS = 5000;
const EVENTS = ["created", "forked", "paused", "resumed", "killed"];
const when = (t) => (t === null || t === undefined ? null : new Date(t * 1000).toISOString()); // unix seconds → ISO
const sum = (m) => Object.values(m || {}).reduce((a, b) => a + b, 0);

export async function render(main) {
  const runsHost = el("div", { id: "runs" });
  const leasesHost = el("div", { id: "leases" });
  const showEnded = el("input", { type: "checkbox", id: "show-ended", onchange: () => load() });
  main.replaceChildren(el("h1", {}, "Runs"), runsHost,
    el("h2", {}, "Leases"), el("div", { class: "bar" }, el("label", {}, showEnded, " show ended leases")), leasesHost);

  async function load() {
    const [counters, summary, leases] = await Promise.all([get("/aenv/runs"), get("/aenv/sandboxes/summary"), get("/aenv/leases")]);
    const key = counters.runKey || summary.runKey || "run";
    const names = [...new Set([...Object.keys(counters.runs || {}), ...Object.keys(summary.byRun || {})])].sort();
    const rows = names.map((run) => ({ run, c: (counters.runs || {})[run] || { events: {}, refused: {} }, live: (summary.byRun || {})[run] || {} }));
    runsHost.replaceChildren(
      el("p", { class: "muted" }, `A run is the sandboxes whose metadata has ${key}=<run> (aenv.rl tags each rollout's). Counters count since this server started.`),
      table([
        ["run", (r) => el("b", { "data-run": r.run }, r.run)],
        ["live", (r) => el("span", { "data-live": r.run }, Object.entries(r.live).map(([s, n]) => `${n} ${s}`).join(", ") || "0")],
        ...EVENTS.map((e) => [e, (r) => String(r.c.events[e] || 0)]),
        ["refused", (r) => Object.entries(r.c.refused).map(([why, n]) => `${n} ${why}`).join(", ") || "0"],
        ["", (r) => (sum(r.live) ? el("a", { href: `#/sandboxes/${encodeURIComponent(`${key}=${r.run}`)}`, "data-run-link": r.run,
          title: `the sandbox list filtered by ${key}=${r.run}` }, "its sandboxes") : "")],
      ], rows, { empty: `No runs yet: sandboxes with ${key} metadata show here.` }));
    const shown = showEnded.checked ? leases : leases.filter((l) => l.state === "live");
    leasesHost.replaceChildren(table([
      ["lease", (l) => el("span", { class: "mono", "data-lease": l.leaseID }, l.leaseID)], ["name", (l) => l.name || ""],
      ["state", (l) => stateBadge(l.state)], ["sandboxes", (l) => String(l.sandboxes)], ["TTL", (l) => `${l.ttl}s`],
      ["last heartbeat", (l) => `${age(when(l.expiresAt - l.ttl))} ago`],
      ["expires", (l) => (l.state === "live" ? `in ${left(when(l.expiresAt))}` : `ended ${age(when(l.endedAt))} ago${l.endReason ? ` (${l.endReason})` : ""}`)],
      ["created", (l) => `${age(when(l.createdAt))} ago`],
    ], shown, { empty: showEnded.checked ? "No leases." : "No live leases." }));
  }
  await load();
  const timer = setInterval(() => load().catch(() => {}), REFRESH_MS);
  return () => clearInterval(timer);
}
