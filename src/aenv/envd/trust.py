"""The sandbox's trust in its egress CA (``/init``'s ``aenvEgressCa``): the egress proxy outside
presents certificates signed by it for the domains of the sandbox's header rules.

Written where Debian-style systems look: ``/usr/local/share/ca-certificates/aenv-egress.crt`` (kept
by a later ``update-ca-certificates``) and appended to ``/etc/ssl/certs/ca-certificates.crt`` (what
OpenSSL, curl, Python and Go read), between marker lines so a new CA (a fork child's, a restored
copy's) replaces the old one rather than piling up. Only a certificate: its key is never here.
"""

from __future__ import annotations

import os
from pathlib import Path

CERT_PATH = Path("/usr/local/share/ca-certificates/aenv-egress.crt")
BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
BEGIN, END = "# aenv egress CA: begin\n", "# aenv egress CA: end\n"
# what clients with bundles of their own read (Python requests/certifi, Node): set by the host with it
ENV = {"SSL_CERT_FILE": str(BUNDLE), "REQUESTS_CA_BUNDLE": str(BUNDLE), "NODE_EXTRA_CA_CERTS": str(CERT_PATH)}
MAX_PEM = 16 * 1024


def check(pem: object) -> str:
    if not isinstance(pem, str) or len(pem) > MAX_PEM or "-----BEGIN CERTIFICATE-----" not in pem:
        raise ValueError("aenvEgressCa must be one PEM certificate")
    return pem


def _replace(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.aenv")
    tmp.write_text(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def without_block(bundle: str) -> str:
    start = bundle.find(BEGIN)
    if start < 0:
        return bundle
    end = bundle.find(END, start)
    return bundle[:start] + (bundle[end + len(END):] if end >= 0 else "")


def install(pem: str, cert_path: Path = CERT_PATH, bundle: Path = BUNDLE) -> None:
    """Trust ``pem`` (blocking; idempotent)."""
    pem = pem if pem.endswith("\n") else pem + "\n"
    _replace(cert_path, pem)
    try:
        old = bundle.read_text()
    except FileNotFoundError:
        old = ""
    kept = without_block(old)
    if kept and not kept.endswith("\n"):
        kept += "\n"
    _replace(bundle, kept + BEGIN + pem + END)
