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
  const pending = [];

  const send = (text) => {
    if (pid === null) { pending.push(text); return; }
    client.unary("process.Process/SendInput", { process: { pid }, input: { pty: b64encode(text) } }).catch(() => {});
  };
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
        if (ev.start) { pid = ev.start.pid; host.dataset.pid = String(pid); for (const t of pending.splice(0)) send(t); }
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
