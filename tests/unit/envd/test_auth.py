"""URL signatures for /files (spec §3.2), checked against the SDK's own signer."""

from __future__ import annotations

import pytest

from aenv.envd.auth import SignatureError, compute_signature, validate_files_request


def test_matches_sdk_signature() -> None:
    signature = pytest.importorskip("e2b.sandbox.signature")
    sdk = signature.get_signature("/home/user/a.txt", "read", None, "tok")
    assert sdk["signature"] == compute_signature("/home/user/a.txt", "read", "", "tok")
    sdk_exp = signature.get_signature("/p", "write", "root", "tok", 100)
    exp = sdk_exp["expiration"]
    assert sdk_exp["signature"] == compute_signature("/p", "write", "root", "tok", exp)


def test_validation_rules() -> None:
    good = compute_signature("/p", "read", "", "tok")
    validate_files_request(None, None, "/p", "read", None, None, None)  # no token ⇒ open
    validate_files_request("tok", "tok", "/p", "read", None, None, None)  # header wins
    validate_files_request("tok", None, "/p", "read", None, good, None)
    with pytest.raises(SignatureError):
        validate_files_request("tok", "wrong", "/p", "read", None, good, None)  # bad header is not rescued
    with pytest.raises(SignatureError):
        validate_files_request("tok", None, "/p", "read", None, None, None)
    with pytest.raises(SignatureError):
        validate_files_request("tok", None, "/p", "write", None, good, None)
    with pytest.raises(SignatureError):
        validate_files_request("tok", None, "/p", "read", "root", good, None)


def test_expiration() -> None:
    sig = compute_signature("/p", "read", "", "tok", 1000)
    validate_files_request("tok", None, "/p", "read", None, sig, "1000", now=999)
    with pytest.raises(SignatureError, match="expired"):
        validate_files_request("tok", None, "/p", "read", None, sig, "1000", now=1001)
    with pytest.raises(SignatureError):
        validate_files_request("tok", None, "/p", "read", None, sig, None, now=999)  # expiry is signed
