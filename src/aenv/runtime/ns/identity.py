"""What makes each ns sandbox its own beyond its ID and envd token: its hostname (this module), its
boot id (``Paths.new_boot_id``: every start and every process restore writes a fresh one), and
its randomness (below).

**Hostname.** Every sandbox's UTS namespace is named after its sandbox ID. Pooled sandboxes are
launched before their ID exists (under the placeholder ``aenv``), and a process restore (fork child,
create from a full snapshot, rollback, resume from disk) brings back the UTS namespace CRIU dumped,
named after the parent. So the host sets the name once the ID is known: at hand-out, after an exec
start and after every restore, from one long-lived thread that joins the sandbox's UTS namespace with
``setns`` and calls ``sethostname`` (the server's other threads never change namespace). envd cannot
do it: a sandbox's root has no CAP_SYS_ADMIN. E2B's own
sandboxes are all called ``e2b.local``; aenv names them apart so that a fork child's logs, prompts and
``socket.gethostname()`` tell children apart. The name is not added to the sandbox's ``/etc/hosts``
(the image's file is left as it is).

**Randomness.** The kernel CRNG is per host, not per namespace: ``/dev/urandom``, ``getrandom(2)``
and ``os.urandom`` give every sandbox, and every fork child restored from one snapshot, independent
bytes from the first read after the restore. What a process drew *before* the snapshot is part of its
memory and is restored as it was: a Python ``random`` seeded before the fork (``random.seed()`` or
the module's import-time seeding) produces the same sequence in every child, as do OpenSSL's and
NumPy's user-space generators. Such a program must reseed after the fork (e.g. when it sees its boot
id or hostname change). The vm runtime is the same for user-space state; there the guest kernel's
CRNG *is* part of the snapshot (the VM's memory), so the host sends 64 fresh random bytes in the first
frame of every new session after a restore, fork or resume, which the guest agent writes to
``/dev/urandom``, credits (``RNDADDENTROPY``) and reseeds with before the first stream
(``vm/sandbox.host_facts``): kernel reads differ per child there too, user-space generators do not.
"""

from __future__ import annotations

import ctypes
import os
import re

from aenv.runtime.nsthread import NamespaceWorker

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,62}")
_UTS = NamespaceWorker("uts")  # every create of a pooled sandbox names it: no thread start per name


def set_hostname(pid: int, name: str) -> None:
    """Name the UTS namespace of ``pid`` (a sandbox's init) ``name``. Blocking, tens of µs: a hand-off
    to the one thread that enters UTS namespaces."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"not a hostname: {name!r}")
    def name_it(libc: ctypes.CDLL) -> None:
        raw = name.encode()
        if libc.sethostname(raw, len(raw)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"sethostname {name}: {os.strerror(err)}")

    _UTS.run(pid, name_it)
