"""The console's pure parts: sessions, the cookie's translation and removal, the checkpoint graph."""

from __future__ import annotations

from typing import Any

from aenv.api.checkpoints import graph
from aenv.api.console.sessions import COOKIE, SessionStore, with_session_key, without_session_cookie


def _scope(method: str, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {"type": "http", "method": method, "path": "/v2/sandboxes", "headers": headers}


def test_sessions_expire_and_close() -> None:
    store = SessionStore(ttl_s=60)
    token = store.open("k1")
    assert store.key(token) == "k1" and store.key("other") is None and store.key(None) is None
    store.close(token)
    assert store.key(token) is None
    short = SessionStore(ttl_s=0)
    assert short.key(short.open("k2")) is None


def test_the_cookie_acts_as_the_key_for_reads_and_for_the_consoles_changes() -> None:
    store = SessionStore()
    cookie = (b"cookie", f"theme=dark; {COOKIE}={store.open('k1')}".encode())
    added = (b"x-api-key", b"k1")
    assert added in with_session_key(_scope("GET", [cookie]), store)["headers"]
    assert added not in with_session_key(_scope("POST", [cookie]), store)["headers"]  # a cross-site form
    assert added in with_session_key(_scope("POST", [cookie, (b"x-aenv-console", b"1")]), store)["headers"]
    own = with_session_key(_scope("GET", [cookie, (b"x-api-key", b"k9")]), store)["headers"]
    assert [v for k, v in own if k == b"x-api-key"] == [b"k9"]
    stale = (b"cookie", f"{COOKIE}=gone".encode())
    assert added not in with_session_key(_scope("GET", [stale]), store)["headers"]


def test_the_sandbox_proxy_forwards_no_session() -> None:
    scope = _scope("GET", [(b"cookie", f"a=1; {COOKIE}=secret; b=2".encode()), (b"host", b"x")])
    out = without_session_cookie(scope)
    assert dict(out["headers"])[b"cookie"] == b"a=1; b=2"
    only = without_session_cookie(_scope("GET", [(b"cookie", f"{COOKIE}=secret".encode())]))
    assert only["headers"] == []
    plain = _scope("GET", [(b"cookie", b"a=1")])
    assert without_session_cookie(plain) is plain


SNAPS = [
    {"id": "s1", "parentID": None, "sandboxID": "a", "templateID": "base", "internal": False},
    {"id": "f1", "parentID": "s1", "sandboxID": "a", "templateID": "base", "internal": True},
    {"id": "x1", "parentID": None, "sandboxID": "z", "templateID": "other", "internal": False},
]
BOXES = [
    {"id": "a", "lineageHead": "f1", "templateID": "base", "state": "running"},
    {"id": "c1", "lineageHead": "f1", "templateID": "base", "state": "running"},
    {"id": "c2", "lineageHead": "f1", "templateID": "base", "state": "paused"},
    {"id": "lone", "lineageHead": None, "templateID": "base", "state": "running"},
]


def test_the_checkpoint_graph() -> None:
    whole = graph(SNAPS, BOXES, None)
    edges = {(e["source"], e["target"]) for e in whole["edges"]}
    assert ("template:base", "s1") in edges and ("s1", "f1") in edges  # a root hangs off its template
    assert {("f1", "a"), ("f1", "c1"), ("f1", "c2")} <= edges  # a fork's group under its fork point
    assert ("template:base", "lone") in edges and ("template:other", "x1") in edges
    tree = graph(SNAPS, BOXES, "c2")  # the tree that holds one child: its siblings, not strangers
    ids = {n["id"] for n in tree["nodes"]}
    assert ids == {"template:base", "s1", "f1", "a", "c1", "c2"}
    assert graph(SNAPS, BOXES, "nobody")["nodes"] == []
    assert not whole["truncated"]
