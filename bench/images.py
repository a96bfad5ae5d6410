"""Image pipeline benchmark: ``python -m bench.images [--json out.json]``.

Starts a private docker-registry on 127.0.0.1, pushes the test fixture images with aenv's own client,
then measures cold pull, warm pull (template present), pull with all layers cached (template rebuilt),
and the download/disk bytes saved when a second image shares the first one's layers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tests.fixtures.plugin import _push_all
from tests.fixtures.push import bench
from tests.fixtures.registry import start_registry


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.images", description=__doc__)
    ap.add_argument("--json", type=Path, help="write results as JSON here")
    args = ap.parse_args(argv)
    reg = start_registry(Path(tempfile.mkdtemp(prefix="aenv-bench-registry-")))
    try:
        asyncio.run(_push_all(reg))
        results = asyncio.run(bench(reg))
    finally:
        reg.stop()
    table = Table(title="aenv image pipeline (local registry)")
    for col in ("image", "cold pull s", "warm pull ms", "layers cached s", "download MB", "unpacked MB"):
        table.add_column(col)
    for name, r in results.items():
        if "cold_s" in r:  # type: ignore[operator]
            table.add_row(
                name, f"{r['cold_s']:.2f}", f"{r['warm_s'] * 1000:.1f}", f"{r['layers_cached_s']:.3f}",  # type: ignore[index]
                f"{r['download_bytes'] / 1e6:.1f}", f"{r['unpacked_bytes'] / 1e6:.1f}",  # type: ignore[index]
            )
    Console().print(table)
    for name, r in results.items():
        if "pull_s" in r:  # type: ignore[operator]
            Console().print(
                f"{name}: {r['pull_s']:.3f} s, {r['layers_reused']} layers reused, "  # type: ignore[index]
                f"download saved {r['download_bytes_saved'] / 1e6:.1f} MB, disk saved {r['disk_bytes_saved'] / 1e6:.1f} MB"  # type: ignore[index]
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
