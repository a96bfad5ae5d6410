// Preloaded into the JS SDK suite's Node processes (NODE_OPTIONS=--require): *.localhost resolves to
// 127.0.0.1 (RFC 6761), standing in for E2B's wildcard DNS record, as scripts/e2b_sdk_localhost.py does
// for the Python suite. glibc resolves only "localhost" itself.
'use strict';
const dns = require('dns');

const isLocal = (host) => typeof host === 'string' && (host === 'localhost' || host.endsWith('.localhost'));
const original = dns.lookup;

dns.lookup = function lookup(hostname, options, callback) {
  if (!isLocal(hostname)) return original.apply(this, arguments);
  if (typeof options === 'function') [callback, options] = [options, {}];
  if (typeof options === 'number') options = { family: options };
  if (options && options.all) return process.nextTick(callback, null, [{ address: '127.0.0.1', family: 4 }]);
  return process.nextTick(callback, null, '127.0.0.1', 4);
};

const promises = dns.promises;
const originalPromise = promises.lookup;
promises.lookup = async function lookup(hostname, options) {
  if (!isLocal(hostname)) return originalPromise.call(this, hostname, options);
  const all = options && typeof options === 'object' && options.all;
  return all ? [{ address: '127.0.0.1', family: 4 }] : { address: '127.0.0.1', family: 4 };
};
