"""envd's trust in the sandbox's egress CA (``/init``'s ``aenvEgressCa``): the certificate file, the
bundle block replaced (not piled up) by a later CA, the bundle's own certificates kept, bad input refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.envd import trust
from aenv.runtime.egress_ca import new_ca


def test_install_replaces_its_own_block_and_keeps_the_rest(tmp_path: Path) -> None:
    cert, bundle = tmp_path / "local/aenv-egress.crt", tmp_path / "certs/ca-certificates.crt"
    bundle.parent.mkdir()
    bundle.write_text("-----BEGIN CERTIFICATE-----\nSYSTEM\n-----END CERTIFICATE-----")
    first, second = new_ca("a")[0].decode(), new_ca("b")[0].decode()
    trust.install(trust.check(first), cert, bundle)
    trust.install(trust.check(second), cert, bundle)
    text = bundle.read_text()
    assert "SYSTEM" in text and second in text and first not in text and text.count(trust.BEGIN) == 1
    assert cert.read_text() == second
    with pytest.raises(ValueError):
        trust.check("not a certificate")
