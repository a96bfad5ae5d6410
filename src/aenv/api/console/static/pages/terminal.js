// A terminal in the sandbox: a PTY started through envd (process.Process/Start with a pty), keystrokes
// sent with SendInput, the size kept with Update; drawn by xterm.js.
import { b64decode, b64encode } from "./envd.js";

export function openTerminal(host, client) {
  const term = new window.Terminal({ convertEol: false, cursorBlink: true, fontSize: 13 });
  const fit = new window.FitAddon.FitAddon();
  term.loadAddon(fit);
  term.open(host);
  fit.fit();
  const abort = new AbortController();
  let pid = null;
  // Keystrokes go one request at a time, in order (parallel requests may overtake each other on the way
  // through a gateway); what is typed while one is in flight goes in the next.
  let typed = "";
  let sending = false;
  const pump = async () => {
    if (sending || pid === null || !typed) return;
    sending = true;
    const chunk = typed;
    typed = "";
    try { await client.unary("process.Process/SendInput", { process: { pid }, input: { pty: b64encode(chunk) } }); } catch { /* the stream's end says why */ }
    sending = false;
    pump();
  };
  const send = (text) => { typed += text; pump(); };
  term.onData(send);
  const resize = () => {
    fit.fit();
    if (pid !== null) client.unary("process.Process/Update", { process: { pid }, pty: { size: { cols: term.cols, rows: term.rows } } }).catch(() => {});
  };
  window.addEventListener("resize", resize);

  (async () => {
    try {
      const start = { process: { cmd: "/bin/bash", args: ["-i", "-l"], envs: { TERM: "xterm-256color" } }, pty: { size: { cols: term.cols, rows: term.rows } } };
      for await (const msg of client.stream("process.Process/Start", start, abort.signal)) {
        const ev = msg.event || {};
        if (ev.start) { pid = ev.start.pid; host.dataset.pid = String(pid); pump(); }
        if (ev.data && ev.data.pty) term.write(b64decode(ev.data.pty));
        if (ev.end) { term.write("\r\n[process ended]\r\n"); host.dataset.ended = "1"; }
      }
    } catch (e) {
      if (!abort.signal.aborted) term.write(`\r\n[terminal: ${e.message}]\r\n`);
    }
  })();

  return {
    term,
    close() {
      abort.abort();
      window.removeEventListener("resize", resize);
      if (pid !== null) client.unary("process.Process/SendSignal", { process: { pid }, signal: "SIGNAL_SIGKILL" }).catch(() => {});
      term.dispose();
    },
  };
}
