"""Guest RAM as layers: the pages a VM changed against the frozen RAM file it was restored from.

A sandbox's RAM is a ``share=off`` (MAP_PRIVATE) mapping of a frozen template file: every page it
wrote is a private anonymous page in its QEMU process, every other page still reads from the
file. The kernel tells the two apart in ``/proc/PID/pagemap`` (bit 63 present, bit 61 file or
shared), so a snapshot does not need QEMU to stream all of RAM (a classic migration, ~0.8 s under
TCG): it reads just the private pages through ``/proc/PID/mem`` while the vCPUs are stopped. A
restore writes them back the same way into a fresh process that maps the same file, before QEMU
loads the device state.

A layer file holds those pages::

    b"AENVMEM1" | u32 page size | u32 run count | runs: (u64 first page, u32 pages) ... | page data

Runs are sorted and never overlap. Everything here is plain file and process I/O (root, or the
QEMU process's owner, can read and write its memory), so it is unit-tested on the test process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")
MAGIC = b"AENVMEM1"
_HEAD = struct.Struct("<8sII")
_RUN = struct.Struct("<QI")
_MAX_IO = 64 * 2**20  # bytes per pread/pwrite: bounded buffers for long runs

# pagemap entry, top byte: 0x80 present, 0x40 swapped, 0x20 file page or shared anonymous.
# A private page is present and not file-backed, or swapped out (only anonymous pages swap).
_PRIVATE = bytes(ord("1") if (b & 0x80 and not b & 0x20) or b & 0x40 else ord("0") for b in range(256))
_RUN_RE = re.compile(b"1+")

Run = tuple[int, int]  # (first page, page count)


class LayerError(ValueError):
    """A layer file that is not one, or that does not fit the RAM it is applied to."""


@dataclass(frozen=True)
class Mapping:
    """Where a process maps a file: start address and length in bytes."""

    start: int
    size: int


def find_mapping(pid: int, path: Path) -> Mapping:
    """The process's contiguous mapping of ``path`` from offset 0 (QEMU maps guest RAM once)."""
    target = str(path)
    start = end = None
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or fields[5].rstrip("\n") != target:
                continue
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            offset = int(fields[2], 16)
            if start is None and offset == 0:
                start, end = lo, hi
            elif start is not None and lo == end and offset == end - start:
                end = hi
    if start is None or end is None:
        raise LayerError(f"process {pid} does not map {path}")
    return Mapping(start, end - start)


def private_runs(pid: int, mapping: Mapping) -> list[Run]:
    """Runs of pages the process wrote (private copies) in ``mapping``, from its pagemap."""
    pages = mapping.size // PAGE
    fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
    try:
        raw = os.pread(fd, pages * 8, mapping.start // PAGE * 8)
    finally:
        os.close(fd)
    if len(raw) != pages * 8:
        raise LayerError(f"pagemap of {pid}: short read ({len(raw)} of {pages * 8} bytes)")
    flags = raw[7::8].translate(_PRIVATE)  # little endian: byte 7 of each entry holds bits 56-63
    return [(m.start(), m.end() - m.start()) for m in _RUN_RE.finditer(flags)]


def _chunks(runs: Iterable[Run]) -> Iterator[Run]:
    step = _MAX_IO // PAGE
    for first, count in runs:
        for off in range(0, count, step):
            yield first + off, min(step, count - off)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_IOV_MAX = 1024


def _vm_io(pid: int, mapping: Mapping, runs: list[Run], buf: bytearray | memoryview, write: bool) -> None:
    """``process_vm_readv``/``writev``: up to 1024 runs per system call, straight between the
    process's pages and ``buf`` (a guest's changed pages come in thousands of short runs, and
    one ``pread`` of ``/proc/PID/mem`` each cost ~10x more)."""
    call = _libc.process_vm_writev if write else _libc.process_vm_readv
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    local_base = ctypes.addressof(ctypes.c_char.from_buffer(view)) if len(view) else 0
    runs = list(_chunks(runs))
    pos = 0
    for i in range(0, len(runs), _IOV_MAX):
        batch = runs[i : i + _IOV_MAX]
        total = sum(c for _, c in batch) * PAGE
        local = _IoVec(local_base + pos, total)
        remote = (_IoVec * len(batch))(*(_IoVec(mapping.start + f * PAGE, c * PAGE) for f, c in batch))
        done = call(pid, ctypes.byref(local), 1, remote, len(batch), 0)
        if done != total:
            err = ctypes.get_errno()
            what = "write" if write else "read"
            raise LayerError(
                f"memory of {pid}: {what} {done} of {total} bytes ({os.strerror(err) if err else 'short'})"
            )
        pos += total


def read_pages(pid: int, mapping: Mapping, runs: list[Run]) -> bytearray:
    """The bytes of ``runs`` in ``mapping``, concatenated (stop the vCPUs first)."""
    buf = bytearray(pages_of(runs) * PAGE)
    _vm_io(pid, mapping, runs, buf, write=False)
    return buf


def write_pages(pid: int, mapping: Mapping, runs: list[Run], data: bytes | bytearray | memoryview) -> None:
    """Write ``data`` (as from :func:`read_pages`) into ``runs`` of the process's mapping: each
    written page becomes a private copy, the file under it stays as it is."""
    view = memoryview(data)
    if sum(c for _, c in runs) * PAGE != len(view):
        raise LayerError("page data does not match the runs")
    if runs and (runs[-1][0] + runs[-1][1]) * PAGE > mapping.size:
        raise LayerError(f"layer reaches page {runs[-1][0] + runs[-1][1]}, RAM has {mapping.size // PAGE}")
    _vm_io(pid, mapping, runs, view if not view.readonly else bytearray(view), write=True)


def read_private(pid: int, mapping: Mapping) -> tuple[list[Run], bytearray]:
    """Every page the process wrote in ``mapping``: its runs and their bytes (vCPUs stopped)."""
    runs = private_runs(pid, mapping)
    return runs, read_pages(pid, mapping, runs)


def apply(pid: int, mapping: Mapping, layers: list[Path]) -> None:
    """Write layer files into the process's mapping, oldest first (later layers win)."""
    for path in layers:
        write_pages(pid, mapping, *load(path))


def save(path: Path, runs: list[Run], data: bytes | bytearray) -> int:
    """Write a layer file atomically; returns its size."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as f:
        f.write(_HEAD.pack(MAGIC, PAGE, len(runs)))
        f.write(b"".join(_RUN.pack(first, count) for first, count in runs))
        f.write(data)
        size = f.tell()
    os.rename(tmp, path)
    return size


def load(path: Path) -> tuple[list[Run], memoryview]:
    """Runs and page data of a layer file (validated; the data is writable, no copy to write it on)."""
    with path.open("rb") as f:
        raw = bytearray(os.fstat(f.fileno()).st_size)
        f.readinto(raw)
    if len(raw) < _HEAD.size:
        raise LayerError(f"{path}: not a RAM layer (too short)")
    magic, page, nruns = _HEAD.unpack_from(raw)
    if magic != MAGIC:
        raise LayerError(f"{path}: not a RAM layer")
    if page != PAGE:
        raise LayerError(f"{path}: page size {page}, this host has {PAGE}")
    body = _HEAD.size + nruns * _RUN.size
    runs = [_RUN.unpack_from(raw, _HEAD.size + i * _RUN.size) for i in range(nruns)]
    end = -1
    for first, count in runs:
        if count <= 0 or first <= end:
            raise LayerError(f"{path}: runs out of order or empty")
        end = first + count - 1
    if len(raw) - body != sum(c for _, c in runs) * PAGE:
        raise LayerError(
            f"{path}: page data is {len(raw) - body} bytes, runs need {sum(c for _, c in runs) * PAGE}"
        )
    return runs, memoryview(raw)[body:]


def pages_of(runs: list[Run]) -> int:
    return sum(c for _, c in runs)


# ---- layers on layers ---------------------------------------------------------------------------
# A snapshot of a VM that was itself restored from a snapshot stores only what changed against that
# parent: its private pages whose bytes differ from the parent's layers (applied in order over the
# base RAM), plus pages the parent had changed that now read as the base again. Restoring applies
# the chain oldest first. Past a chosen depth a snapshot writes all its private pages instead (the
# chain is compacted into one layer): restores then read fewer files.


def page_map(layers: list[tuple[list[Run], bytes | bytearray | memoryview]]) -> dict[int, memoryview]:
    """Page index -> its bytes after applying ``layers`` in order (later layers win). No copies."""
    pages: dict[int, memoryview] = {}
    for runs, data in layers:
        view = memoryview(data)
        pos = 0
        for first, count in runs:
            for page in range(first, first + count):
                pages[page] = view[pos : pos + PAGE]
                pos += PAGE
    return pages


def runs_of(pages: list[int]) -> list[Run]:
    """Sorted page indexes as runs."""
    runs: list[Run] = []
    for page in pages:
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
    return runs


def delta(
    runs: list[Run], data: bytes | bytearray, parent: dict[int, memoryview], base: Path
) -> tuple[list[Run], bytearray]:
    """The layer that turns ``parent`` (a :func:`page_map` over the base RAM file ``base``) into
    the RAM whose private pages are ``runs``/``data``: pages whose bytes differ from the parent's,
    and the parent's pages that are no longer private (they read as ``base`` again)."""
    current = page_map([(runs, data)])
    changed = [p for p, view in current.items() if parent.get(p) != view]
    reverted = [p for p in parent if p not in current]
    out = bytearray()
    with base.open("rb") as f:
        for page in sorted(changed + reverted):
            view = current.get(page)
            out += view if view is not None else os.pread(f.fileno(), PAGE, page * PAGE)
    return runs_of(sorted(changed + reverted)), out
