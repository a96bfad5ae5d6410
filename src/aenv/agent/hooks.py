"""Post-restore / post-fork hooks run inside the sandbox.

After a VM snapshot restore or a fork, every copy shares the same RNG state and clock. The host
supplies fresh random bytes; mixing them into ``/dev/urandom`` (a plain write, no privilege needed)
makes the copies diverge. Crediting entropy or stepping the clock needs more privilege and is left
to the VM runtime for now.
"""

from __future__ import annotations

import os
import random


def reseed_rng(seed: bytes) -> None:
    """Mix host-supplied bytes into the kernel pool and reseed Python's own RNG."""
    if seed:
        try:
            fd = os.open("/dev/urandom", os.O_WRONLY)
            try:
                os.write(fd, seed)
            finally:
                os.close(fd)
        except OSError:
            pass
    random.seed(seed + os.urandom(16))


def post_restore(seed: bytes) -> None:
    """Entry point the runtime triggers after restore/fork (stub: RNG only)."""
    reseed_rng(seed)
