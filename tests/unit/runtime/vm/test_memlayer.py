"""RAM layers against real processes: the test process's own private mapping, and a child's."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aenv.runtime.vm import memlayer
from aenv.runtime.vm.memlayer import PAGE, LayerError

PAGES = 64


def _base(tmp_path: Path) -> Path:
    path = tmp_path / "base.mem"
    path.write_bytes(b"".join(bytes([i % 251 + 1]) * PAGE for i in range(PAGES)))
    return path


def test_private_pages_are_exactly_the_written_ones(tmp_path: Path) -> None:
    base = _base(tmp_path)
    with base.open("rb") as f:
        m = mmap.mmap(f.fileno(), PAGES * PAGE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        _ = m[5 * PAGE]  # read only: stays a file page
        for page in (3, 4, 5, 9, 63):
            m[page * PAGE : page * PAGE + 3] = b"new"
        where = memlayer.find_mapping(os.getpid(), base)
        assert where.size == PAGES * PAGE
        runs = memlayer.private_runs(os.getpid(), where)
        assert runs == [(3, 3), (9, 1), (63, 1)]
        data = memlayer.read_pages(os.getpid(), where, runs)
        assert len(data) == 5 * PAGE and data[:3] == b"new" and data[3:PAGE] == bytes([4]) * (PAGE - 3)
        assert base.read_bytes()[3 * PAGE : 3 * PAGE + 3] == bytes([4]) * 3  # the file never changed
    finally:
        m.close()


CHILD = r"""
import mmap, sys
f = open(sys.argv[1], "rb")
m = mmap.mmap(f.fileno(), int(sys.argv[2]), flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
print("ready", flush=True)
sys.stdin.readline()
page = int(sys.argv[3])
sys.stdout.write(",".join(str(m[i * page]) for i in range(len(m) // page)) + "\n")
sys.stdout.flush()
"""


def test_layer_round_trip_into_another_process(tmp_path: Path) -> None:
    base = _base(tmp_path)
    runs = [(0, 2), (10, 1), (40, 3)]
    data = b"".join(bytes([200 + i]) * PAGE for i in range(memlayer.pages_of(runs)))
    layer = tmp_path / "mem.layer"
    size = memlayer.save(layer, runs, data)
    assert size == layer.stat().st_size
    got_runs, got_data = memlayer.load(layer)
    assert got_runs == runs and bytes(got_data) == data

    with subprocess.Popen(
        [sys.executable, "-c", CHILD, str(base), str(PAGES * PAGE), str(PAGE)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) as child:  # fmt: skip
        try:
            assert child.stdout is not None and child.stdin is not None
            assert child.stdout.readline().strip() == "ready"
            where = memlayer.find_mapping(child.pid, base)
            memlayer.write_pages(child.pid, where, *memlayer.load(layer))
            assert memlayer.private_runs(child.pid, where) == runs
            child.stdin.write("\n")
            child.stdin.flush()
            firsts = [int(x) for x in child.stdout.readline().split(",")]
        finally:
            child.kill()
    expected = [i % 251 + 1 for i in range(PAGES)]
    for n, page in enumerate(p for first, count in runs for p in range(first, first + count)):
        expected[page] = 200 + n
    assert firsts == expected
    assert base.read_bytes()[:1] == b"\x01"


def test_bad_layers_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.layer"
    bad.write_bytes(b"nope")
    with pytest.raises(LayerError, match="too short"):
        memlayer.load(bad)
    bad.write_bytes(b"X" * 64)
    with pytest.raises(LayerError, match="not a RAM layer"):
        memlayer.load(bad)
    memlayer.save(bad, [(5, 1), (2, 1)], b"\0" * 2 * PAGE)
    with pytest.raises(LayerError, match="out of order"):
        memlayer.load(bad)
    memlayer.save(bad, [(1, 2)], b"\0" * PAGE)
    with pytest.raises(LayerError, match="runs need"):
        memlayer.load(bad)
    with pytest.raises(LayerError, match="does not map"):
        memlayer.find_mapping(os.getpid(), tmp_path / "absent")
    with pytest.raises(LayerError, match="does not match"):
        memlayer.write_pages(os.getpid(), memlayer.Mapping(0, PAGE), [(0, 2)], b"\0" * PAGE)
    with pytest.raises(LayerError, match="RAM has"):
        memlayer.write_pages(os.getpid(), memlayer.Mapping(0, PAGE), [(1, 1)], b"\0" * PAGE)


def test_thousands_of_runs_cross_the_per_call_batch(tmp_path: Path) -> None:
    """A guest's changed pages come scattered: more runs than one process_vm_readv takes."""
    n = 2 * 1500
    path = tmp_path / "big.mem"
    path.write_bytes(b"\0" * n * PAGE)
    with path.open("rb") as f:
        m = mmap.mmap(f.fileno(), n * PAGE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        for page in range(0, n, 2):
            m[page * PAGE : page * PAGE + 4] = page.to_bytes(4, "little")
        where = memlayer.find_mapping(os.getpid(), path)
        runs = memlayer.private_runs(os.getpid(), where)
        assert len(runs) == 1500 and all(count == 1 for _, count in runs)
        data = memlayer.read_pages(os.getpid(), where, runs)
        assert [int.from_bytes(data[i * PAGE : i * PAGE + 4], "little") for i in range(1500)] == list(
            range(0, n, 2)
        )
        memlayer.write_pages(os.getpid(), where, runs, bytes(PAGE) * 1500)  # writes batch the same way
        assert m[2 * PAGE : 2 * PAGE + 4] == b"\0\0\0\0"
    finally:
        m.close()


def test_delta_against_a_parent_chain(tmp_path: Path) -> None:
    """Child pages identical to the parent's are left out; changed and new ones are kept; a page
    the parent had changed and the child no longer has reads as the base again."""
    base = _base(tmp_path)  # page i holds byte i % 251 + 1

    def pages(*items: tuple[int, int]) -> tuple[list[tuple[int, int]], bytes]:
        return memlayer.runs_of([p for p, _ in items]), b"".join(bytes([v]) * PAGE for _, v in items)

    grand = pages((1, 100), (2, 101), (7, 102))
    parent_own = pages((2, 110), (3, 111))  # over grand: page 2 changed, page 3 new
    chain = memlayer.page_map([grand, parent_own])
    assert sorted(chain) == [1, 2, 3, 7] and chain[2].tobytes() == bytes([110]) * PAGE
    child = pages((1, 100), (2, 110), (3, 150), (9, 160))  # 1, 2 as in the chain; 7 back to base
    runs, data = memlayer.delta(*child, chain, base)
    assert runs == [(3, 1), (7, 1), (9, 1)]
    assert data[:PAGE] == bytes([150]) * PAGE
    assert data[PAGE : 2 * PAGE] == bytes([7 % 251 + 1]) * PAGE  # the base page
    assert data[2 * PAGE :] == bytes([160]) * PAGE
    # applying chain + delta gives exactly the child's pages (and base elsewhere)
    result = memlayer.page_map([grand, parent_own, (runs, data)])
    for page, value in ((1, 100), (2, 110), (3, 150), (9, 160)):
        assert result[page].tobytes() == bytes([value]) * PAGE
    assert memlayer.runs_of([]) == [] and memlayer.runs_of([4, 5, 6, 9]) == [(4, 3), (9, 1)]
