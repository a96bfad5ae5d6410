// aenv's JavaScript / TypeScript kernel: one Node process per context, state kept between runs.
//
// Why not a Jupyter kernel: the npm ones (ijavascript, tslab) need ZeroMQ's native addon, whose
// prebuilt binaries come from GitHub releases (not reachable here), and E2B's own is a GitHub fork.
// Node's REPL evaluator already does what a notebook cell needs: top-level await, the value of the
// last expression, declarations that persist. This file drives it; the service (kernels.JsContext)
// talks to it over two pipes, one JSON object per line (events: the fd named by $AENV_EVENTS_FD):
//   stdin  <- {"code": str, "language": "javascript" | "typescript", "env": {..}, "temp": {..}}
//   events -> {"type": "ready"} once, then per run: {"type": "stdout" | "stderr", "text"},
//             {"type": "result", "text"}, {"type": "error", "name", "value", "traceback"}, {"type": "done"}
// Static `import ... from 'm'` lines become dynamic imports (the REPL evaluates scripts, not modules);
// TypeScript is transpiled with the `typescript` package when the template has it.
'use strict';

const fs = require('fs');
const path = require('path');
const readline = require('readline');
const repl = require('repl');
const util = require('util');
const { PassThrough } = require('stream');

const EVENTS = Number(process.env.AENV_EVENTS_FD || 3);
const RUN_END = '\u0000aenv-run-end\u0000\n';
delete process.env.AENV_EVENTS_FD; // not the user's
const TYPESCRIPT = process.env.AENV_TYPESCRIPT || '/usr/local/lib/aenv-node/node_modules/typescript';

function send(event) {
  fs.writeSync(EVENTS, JSON.stringify(event) + '\n');
}

for (const [name, stream] of [['stdout', process.stdout], ['stderr', process.stderr]]) {
  stream.write = (chunk, encoding, callback) => {
    const text = typeof chunk === 'string' ? chunk : Buffer.from(chunk).toString('utf8');
    send({ type: name, text });
    const done = typeof encoding === 'function' ? encoding : callback;
    if (done) done();
    return true;
  };
}

const server = repl.start({
  input: new PassThrough(),
  output: new PassThrough(),
  terminal: false,
  useGlobal: true,
  prompt: '',
});
delete server.context.module; // a notebook has no CommonJS module of its own
server.context.require = require('module').createRequire(path.join(process.cwd(), 'cell.js'));

function importsToDynamic(code) {
  const spec = "(['\"][^'\"]+['\"])";
  return code
    .replace(new RegExp(`^([ \\t]*)import\\s+\\*\\s+as\\s+([\\w$]+)\\s+from\\s+${spec};?`, 'gm'),
      '$1const $2 = await import($3);')
    .replace(new RegExp(`^([ \\t]*)import\\s+([\\w$]+)\\s*,\\s*\\{([^}]*)\\}\\s*from\\s+${spec};?`, 'gm'),
      (_, indent, def, names, from) => `${indent}const { default: ${def}, ${renamed(names)} } = await import(${from});`)
    .replace(new RegExp(`^([ \\t]*)import\\s+\\{([^}]*)\\}\\s*from\\s+${spec};?`, 'gm'),
      (_, indent, names, from) => `${indent}const { ${renamed(names)} } = await import(${from});`)
    .replace(new RegExp(`^([ \\t]*)import\\s+([\\w$]+)\\s+from\\s+${spec};?`, 'gm'),
      '$1const $2 = (await import($3)).default;')
    .replace(new RegExp(`^([ \\t]*)import\\s+${spec};?`, 'gm'), '$1await import($2);');
}

function renamed(names) {
  return names.split(',').map((n) => n.trim()).filter(Boolean)
    .map((n) => n.replace(/^([\w$]+)\s+as\s+([\w$]+)$/, '$1: $2')).join(', ');
}

let ts = null;
function transpile(code) {
  if (ts === null) ts = require(TYPESCRIPT);
  const out = ts.transpileModule(code, {
    compilerOptions: { target: ts.ScriptTarget.ES2022, module: ts.ModuleKind.ESNext, sourceMap: false },
    reportDiagnostics: false,
  }).outputText;
  return out.replace(/^export \{\};\s*$/m, '');
}

// The REPL runs its evaluator in a domain and hands an uncaught error (thrown, or an awaited rejection)
// to the domain, not to the callback: both end the run.
let pending = null;
server._domain.on('error', (err) => {
  if (pending) pending.reject(err);
});

function evaluate(code) {
  return new Promise((resolve, reject) => {
    pending = { reject };
    server.eval(code, server.context, 'cell', (err, value) => (err ? reject(err) : resolve(value)));
  }).finally(() => { pending = null; });
}

function setEnv(values) {
  for (const [k, v] of Object.entries(values || {})) process.env[k] = v;
}

function cellStack(stack) {  // the user's frames, not the REPL's and this file's under them
  const lines = String(stack || '').split('\n');
  const end = lines.findIndex((l, i) => i > 0 && /\((node:|.*js_kernel\.js)|at (node:|.*js_kernel\.js)/.test(l));
  return (end > 0 ? lines.slice(0, end) : lines).join('\n');
}

function shown(value) {
  return typeof value === 'string' ? value : util.inspect(value, { depth: 4, colors: false });
}

async function run(request) {
  const saved = {};
  for (const k of Object.keys(request.temp || {})) saved[k] = process.env[k];
  setEnv(request.env);
  setEnv(request.temp);
  try {
    let code = request.code;
    if (request.language === 'typescript') code = transpile(code);
    const value = await evaluate(importsToDynamic(code));
    if (value !== undefined) send({ type: 'result', text: shown(value) });
  } catch (err) {
    const e = err instanceof Error ? err : new Error(String(err));
    const recoverable = e.constructor && e.constructor.name === 'Recoverable';
    send({
      type: 'error',
      name: recoverable ? 'SyntaxError' : (e.name || 'Error'),
      value: recoverable ? 'Unexpected end of input' : (e.message || String(err)),
      traceback: (recoverable ? '' : cellStack(e.stack)) || String(err),
    });
  } finally {
    for (const [k, v] of Object.entries(saved)) {
      if (v === undefined) delete process.env[k];
      else process.env[k] = v;
    }
    // what a child wrote to the inherited stdout/stderr reached them before this (pipe_kernels.RUN_END)
    fs.writeSync(1, RUN_END);
    fs.writeSync(2, RUN_END);
    send({ type: 'done' });
  }
}

const requests = readline.createInterface({ input: process.stdin }); // a pipe handle: a blocking read would hold up exit
let queue = Promise.resolve();
requests.on('line', (line) => {
  if (!line.trim()) return;
  const request = JSON.parse(line);
  queue = queue.then(() => run(request));
});
requests.on('close', () => process.exit(0));
send({ type: 'ready' });
