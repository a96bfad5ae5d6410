"""A sandbox's egress CA: the egress proxy terminates the sandbox's TLS to its rule domains (E2B's
``network.rules``) with a certificate for the name it asked for, signed by a CA made for that sandbox
alone. The sandbox trusts the CA's certificate (envd installs it, ``envd/trust.py``); its key stays
in the server (memory, and the store's ``egress_cas`` table so a restart keeps it).

A CA per sandbox, not one per server: a sandbox that read its CA's key out of somewhere could only
impersonate hosts to itself. EC P-256 keys (a CA is made at a sandbox's create: ~1 ms, where RSA 2048
takes ~50 ms), the extensions OpenSSL 3 and Python's ``VERIFY_X509_STRICT`` require.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import ssl
import tempfile
import threading
from dataclasses import dataclass, field

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ALPN = ["http/1.1"]  # the proxy speaks HTTP/1.1 only: a client offering h2 gets http/1.1
_LEAF_DAYS = 30
_CA_YEARS = 10
_MAX_LEAVES = 256


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "aenv"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common[:64])])  # fmt: skip


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())  # fmt: skip


def new_ca(label: str) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) of a new CA named after ``label`` (the sandbox ID)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    name = _name(f"aenv egress CA {label}")
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1)).not_valid_after(now + dt.timedelta(days=365 * _CA_YEARS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


@dataclass
class EgressCa:
    """A loaded CA and the leaves it has issued (by host name), each as a ready server context."""

    cert_pem: bytes
    key_pem: bytes
    _contexts: dict[str, ssl.SSLContext] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self._cert = x509.load_pem_x509_certificate(self.cert_pem)
        key = serialization.load_pem_private_key(self.key_pem, None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError("an egress CA key is an EC key")
        self._key = key
        self._leaf_key = ec.generate_private_key(ec.SECP256R1())  # one per CA: its leaves share it

    def leaf_pem(self, host: str) -> bytes:
        """A certificate for ``host`` (a DNS name or an IP literal) signed by this CA, then the key."""
        now = dt.datetime.now(dt.UTC)
        try:
            san: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            san = x509.DNSName(host)
        issuer_ski = self._cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        cert = (
            x509.CertificateBuilder().subject_name(_name(host)).issuer_name(self._cert.subject)
            .public_key(self._leaf_key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=_LEAF_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName([san]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(issuer_ski), critical=False)
            .sign(self._key, hashes.SHA256())
        )  # fmt: skip
        return cert.public_bytes(serialization.Encoding.PEM) + _pem_key(self._leaf_key)

    def server_context(self, host: str) -> ssl.SSLContext:
        """The TLS server context that presents ``host``'s leaf (made once per name; blocking: run it
        off the event loop the first time)."""
        with self._lock:
            ctx = self._contexts.get(host)
            if ctx is None:
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                ctx.minimum_version = ssl.TLSVersion.TLSv1_2
                ctx.set_alpn_protocols(ALPN)
                _load_chain(ctx, self.leaf_pem(host))
                if len(self._contexts) >= _MAX_LEAVES:
                    self._contexts.pop(next(iter(self._contexts)))
                self._contexts[host] = ctx
            return ctx


def _load_chain(ctx: ssl.SSLContext, pem: bytes) -> None:
    """``ssl`` loads a certificate and key from a file only: a private temporary one, gone at once."""
    fd, path = tempfile.mkstemp(prefix="aenv-leaf-", suffix=".pem")
    try:
        os.write(fd, pem)
        os.close(fd)
        ctx.load_cert_chain(path)
    finally:
        os.unlink(path)


def upstream_context(extra_ca: str | None) -> ssl.SSLContext:
    """What the proxy verifies the real servers with: the system's CAs and, if the operator named one,
    an extra bundle (``egress_extra_ca``: a private CA, a test's). Hostname checked; HTTP/1.1 offered."""
    ctx = ssl.create_default_context()
    if extra_ca:
        ctx.load_verify_locations(cafile=extra_ca)
    ctx.set_alpn_protocols(ALPN)
    return ctx
