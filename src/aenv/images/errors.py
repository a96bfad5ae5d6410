"""Errors of the image pipeline. Every one carries the image reference it is about.

    ImageError (aenv.errors)
    ├── InvalidReference      the reference string cannot be parsed
    ├── ManifestNotFound      unknown repository, tag or digest
    ├── AuthRequired          the registry wants credentials we do not have (or refused ours)
    ├── RegistryUnavailable   connection errors / 5xx after all retries
    ├── RegistryProtocolError the registry answered something we cannot use (bad JSON, huge manifest,
    │                         no linux/amd64 entry, unknown media type)
    ├── DigestMismatch        a blob or manifest does not hash to its digest; never cached
    ├── UnsafeLayer           a layer tries to escape the rootfs (../, absolute, through a symlink)
    ├── CacheError            the layer cache cannot store something (disk full, budget too small)
    └── BootstrapError        building the default ``base`` rootfs failed (not root, mmdebstrap missing)

Registry and httpx errors are translated into these in exactly one place (``registry._translate``).
"""

from __future__ import annotations

from typing import Any

from aenv.errors import ImageError


class InvalidReference(ImageError):
    def __init__(self, reference: str, why: str) -> None:
        super().__init__(f"invalid image reference '{reference}': {why}", reference=reference)
        self.reference = reference


class _RefError(ImageError):
    """Base for errors about one concrete reference; the message always names it."""

    def __init__(self, message: str, reference: str, **context: Any) -> None:
        super().__init__(message, reference=reference, **context)
        self.reference = reference


class ManifestNotFound(_RefError):
    def __init__(self, reference: str, detail: str = "") -> None:
        msg = f"image '{reference}' not found"
        super().__init__(msg + (f": {detail}" if detail else ""), reference)


class AuthRequired(_RefError):
    def __init__(self, reference: str, detail: str = "") -> None:
        msg = f"registry refused access to '{reference}' (authentication required)"
        super().__init__(msg + (f": {detail}" if detail else ""), reference)


class RegistryUnavailable(_RefError):
    def __init__(self, reference: str, detail: str = "", attempts: int = 1) -> None:
        msg = f"registry for '{reference}' unavailable after {attempts} attempt(s)"
        super().__init__(msg + (f": {detail}" if detail else ""), reference, attempts=attempts)


class RegistryProtocolError(_RefError):
    def __init__(self, reference: str, detail: str) -> None:
        super().__init__(f"unusable registry answer for '{reference}': {detail}", reference)


class DigestMismatch(_RefError):
    def __init__(self, reference: str, expected: str, actual: str) -> None:
        super().__init__(
            f"digest mismatch for '{reference}': expected {expected}, got {actual}",
            reference,
            expected=expected,
            actual=actual,
        )
        self.expected = expected
        self.actual = actual


class UnsafeLayer(_RefError):
    def __init__(self, reference: str, member: str, why: str) -> None:
        super().__init__(f"layer of '{reference}' is unsafe: {member!r} {why}", reference, member=member)
        self.member = member


class CacheError(_RefError):
    def __init__(self, reference: str, detail: str) -> None:
        super().__init__(f"layer cache failed for '{reference}': {detail}", reference)


class BootstrapError(ImageError):
    pass
