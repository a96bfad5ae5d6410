// Talking to a sandbox's envd the way the SDKs do: through the server's sandbox proxy (same origin, the
// E2b-Sandbox-Id header names the sandbox), with the sandbox's envd access token. Connect protocol, JSON.
const USER = "Basic " + btoa("user:");

export function envd(sandbox) {
  const base = { "E2b-Sandbox-Id": sandbox.sandboxID, Authorization: USER, "Connect-Protocol-Version": "1" };
  if (sandbox.envdAccessToken) base["X-Access-Token"] = sandbox.envdAccessToken;

  async function unary(method, message) {
    const resp = await fetch(`/${method}`, { method: "POST", headers: { ...base, "Content-Type": "application/json" }, body: JSON.stringify(message) });
    const data = await resp.json().catch(() => ({}));
    if (!resp.ok) throw new Error(data.message || `${resp.status}`);
    return data;
  }

  // A server stream: one enveloped request in, enveloped messages out until the end-stream envelope.
  async function* stream(method, message, signal) {
    const payload = new TextEncoder().encode(JSON.stringify(message));
    const body = new Uint8Array(5 + payload.length);
    new DataView(body.buffer).setUint32(1, payload.length);
    body.set(payload, 5);
    const resp = await fetch(`/${method}`, { method: "POST", headers: { ...base, "Content-Type": "application/connect+json" }, body, signal });
    if (!resp.ok) throw new Error(`${method}: ${resp.status}`);
    const reader = resp.body.getReader();
    let buf = new Uint8Array(0);
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      const joined = new Uint8Array(buf.length + value.length);
      joined.set(buf); joined.set(value, buf.length); buf = joined;
      while (buf.length >= 5) {
        const flags = buf[0];
        const len = new DataView(buf.buffer, buf.byteOffset + 1, 4).getUint32(0);
        if (buf.length < 5 + len) break;
        const msg = JSON.parse(new TextDecoder().decode(buf.subarray(5, 5 + len)) || "{}");
        buf = buf.slice(5 + len);
        if (flags & 0x02) { if (msg.error) throw new Error(msg.error.message || msg.error.code); return; }
        yield msg;
      }
    }
  }

  return {
    unary, stream,
    listDir: (path) => unary("filesystem.Filesystem/ListDir", { path, depth: 1 }),
    download: async (path) => {
      const resp = await fetch(`/files?path=${encodeURIComponent(path)}&username=user`, { headers: base });
      if (!resp.ok) throw new Error((await resp.json().catch(() => ({}))).message || `${resp.status}`);
      return resp.blob();
    },
    upload: async (path, file) => {
      const form = new FormData();
      form.append("file", file, path);
      const resp = await fetch(`/files?path=${encodeURIComponent(path)}&username=user`, { method: "POST", headers: base, body: form });
      if (!resp.ok) throw new Error((await resp.json().catch(() => ({}))).message || `${resp.status}`);
    },
  };
}

export const b64encode = (text) => btoa(String.fromCharCode(...new TextEncoder().encode(text)));
export function b64decode(data) {
  const raw = atob(data);
  const out = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) out[i] = raw.charCodeAt(i);
  return out;
}
