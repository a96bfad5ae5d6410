"""The ns sandbox's seccomp filter: Docker's default profile, in meaning, as a classic-BPF program we build.

Why our own BPF and not libseccomp: the launcher runs as a script under the host Python in isolated
mode (``-I -S``: no site-packages) and the zygote under the tools bundle's Python, so neither can import
a binding; a filter this small is ~100 instructions of ``struct sock_filter`` and needs only the stdlib.

What it does (``docs/ARCHITECTURE.md`` and ``docs/security.md`` list what stays reachable):

* any architecture but x86_64, and the x32 ABI (syscall numbers with bit 30), get ``ENOSYS``: a filter
  keyed on x86_64 numbers must not be walked around through ``int 0x80`` or x32;
* syscalls newer than the last one reviewed here (``LAST_REVIEWED``) get ``ENOSYS``, as an allowlist
  would: a syscall a future kernel adds is not reachable until someone looks at it;
* the syscalls Docker's profile refuses to a container without the matching capability get ``EPERM``:
  module loading, kexec, mounting (old and new mount API), ``pivot_root``, namespaces (``unshare``,
  ``setns``, ``clone`` with a ``CLONE_NEW*`` flag; ``clone3`` is ``ENOSYS`` so libc falls back to
  ``clone``, whose flags a filter can read), keyrings, ``bpf``, ``perf_event_open``, file handles
  (``name_to_handle_at``, ``open_by_handle_at``), clocks, ``reboot``, swap, quotas, ``acct``, ``iopl``/
  ``ioperm``, ``syslog``, ``userfaultfd``, NUMA policy, ``fanotify_init``, ``vhangup``, obsolete ones;
* ``personality`` only with the values Docker allows (Linux, 32-bit, UNAME26, query); ``socket`` not for
  ``AF_VSOCK``.

Everything else is allowed, including ``ptrace``, ``process_vm_*`` and ``kcmp`` (Docker allows them on
kernels >= 4.8: the PID namespace already limits them to the sandbox's own processes) and ``io_uring``
(ns sandboxes need it for CRIU's "cannot be dumped" path to be testable and for libuv; Docker >= 25
refuses it — a known difference). The sandbox's capability bounding set is dropped first
(``launch.drop_capabilities``), so the filter is the second wall, not the only one.
"""

from __future__ import annotations

import ctypes
import errno
import struct

PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
LAST_REVIEWED = 469  # file_setattr (Linux 6.17)

SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000

# classic BPF opcodes
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGT_K = 0x25  # BPF_JMP | BPF_JGT | BPF_K
_JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K

# offsets into struct seccomp_data
_NR = 0
_ARCH = 4
_ARG0_LO = 16

# x86_64 numbers of the syscalls refused with EPERM (see the module docstring for the groups)
DENIED: dict[str, int] = {
    "syslog": 103, "uselib": 134, "ustat": 136, "sysfs": 139, "vhangup": 153, "pivot_root": 155,
    "_sysctl": 156, "acct": 163, "settimeofday": 164, "mount": 165, "umount2": 166, "swapon": 167,
    "swapoff": 168, "reboot": 169, "iopl": 172, "ioperm": 173, "create_module": 174, "init_module": 175,
    "delete_module": 176, "get_kernel_syms": 177, "query_module": 178, "quotactl": 179, "nfsservctl": 180,
    "getpmsg": 181, "putpmsg": 182, "afs_syscall": 183, "tuxcall": 184, "security": 185,
    "lookup_dcookie": 212, "clock_settime": 227, "vserver": 236, "mbind": 237, "set_mempolicy": 238,
    "get_mempolicy": 239, "kexec_load": 246, "add_key": 248, "request_key": 249, "keyctl": 250,
    "migrate_pages": 256, "unshare": 272, "move_pages": 279, "perf_event_open": 298, "fanotify_init": 300,
    "name_to_handle_at": 303, "open_by_handle_at": 304, "clock_adjtime": 305, "setns": 308,
    "finit_module": 313, "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323, "open_tree": 428,
    "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
    "quotactl_fd": 443, "set_mempolicy_home_node": 450, "open_tree_attr": 467,
}
# What a nested sandbox (Docker inside, ``launch._contain_and_report``) may call besides: dockerd and
# runc mount, pivot, make and join namespaces and a session keyring. Its user namespace bounds them.
NESTED_ALLOWED = frozenset({
    "mount", "umount2", "pivot_root", "unshare", "setns", "keyctl", "add_key", "request_key", "open_tree",
    "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "open_tree_attr"})
CLONE = 56
CLONE3 = 435
PERSONALITY = 135
SOCKET = 41
AF_VSOCK = 40
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME (0x80: clone3 only)
CLONE_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
PERSONALITY_ALLOWED = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)


def _stmt(code: int, k: int) -> tuple[int, int, int, int]:
    return (code, 0, 0, k)


def _jump(code: int, k: int, jt: int, jf: int) -> tuple[int, int, int, int]:
    return (code, jt, jf, k)


def _errno(value: int) -> tuple[int, int, int, int]:
    return _stmt(_RET_K, SECCOMP_RET_ERRNO | value)


def _first_arg_test(nr: int, code: int, k: int, err: int) -> list[tuple[int, int, int, int]]:
    """Syscall ``nr`` returns ``err`` when its first argument matches (``code``, ``k``), else is
    allowed; any other syscall falls through to what follows (the accumulator still holds its nr)."""
    return [
        _jump(_JEQ_K, nr, 0, 4),
        _stmt(_LD_W_ABS, _ARG0_LO),
        _jump(code, k, 0, 1),
        _errno(err),
        _stmt(_RET_K, SECCOMP_RET_ALLOW),
    ]


def program(nested: bool = False) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions. Every test is a pair "jump over the next
    instruction unless it matches; return", so no jump is longer than the 255 BPF allows. ``nested``:
    the syscalls of ``NESTED_ALLOWED`` and ``clone`` with namespace flags are allowed too."""
    allow = _stmt(_RET_K, SECCOMP_RET_ALLOW)
    prog = [
        _stmt(_LD_W_ABS, _ARCH),
        _jump(_JEQ_K, AUDIT_ARCH_X86_64, 1, 0),
        _errno(errno.ENOSYS),
        _stmt(_LD_W_ABS, _NR),
        _jump(_JGT_K, LAST_REVIEWED, 0, 1),  # also catches x32 (bit 30 set)
        _errno(errno.ENOSYS),
    ]
    denied = {nr for name, nr in DENIED.items() if not (nested and name in NESTED_ALLOWED)}
    for nr in sorted(denied):
        prog += [_jump(_JEQ_K, nr, 0, 1), _errno(errno.EPERM)]
    prog += [_jump(_JEQ_K, CLONE3, 0, 1), _errno(errno.ENOSYS)]
    if not nested:  # clone: the flags are its first argument on x86_64; any namespace flag is refused
        prog += _first_arg_test(CLONE, _JSET_K, CLONE_NAMESPACES, errno.EPERM)
    # personality: only the values Docker allows
    n = len(PERSONALITY_ALLOWED)
    prog += [_jump(_JEQ_K, PERSONALITY, 0, n + 3), _stmt(_LD_W_ABS, _ARG0_LO)]
    for i, value in enumerate(PERSONALITY_ALLOWED):
        prog.append(_jump(_JEQ_K, value, n - i, 0))
    prog += [_errno(errno.EPERM), allow]
    # socket: no AF_VSOCK (a host channel the sandbox has no business opening)
    return [*prog, *_first_arg_test(SOCKET, _JEQ_K, AF_VSOCK, errno.EAFNOSUPPORT), allow]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _prctl(libc: ctypes.CDLL, what: str, option: int, *args: object) -> None:
    padded = (*args, 0, 0, 0, 0)[:4]
    if libc.prctl(option, *padded) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({what}): {errno.errorcode.get(err, err)}")


def install(no_new_privs: bool = False, nested: bool = False) -> None:
    """Load the filter into this (single-threaded) process; its children and everything it execs
    inherit it, and it cannot be undone. Without ``no_new_privs`` the kernel lets only a process
    holding CAP_SYS_ADMIN load a filter, so the launcher loads it before it trims its own capabilities:
    setuid programs then still work (``sudo``, as E2B's sandboxes offer it to ``user``) and run
    filtered like everything else. ``no_new_privs`` (opt-in) also stops setuid and file capabilities."""
    libc = ctypes.CDLL(None, use_errno=True)
    if no_new_privs:
        _prctl(libc, "PR_SET_NO_NEW_PRIVS", PR_SET_NO_NEW_PRIVS, 1)
    prog = program(nested)
    blob = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *ins) for ins in prog))
    fprog = _SockFprog(len(prog), ctypes.cast(blob, ctypes.c_void_p))
    _prctl(libc, "PR_SET_SECCOMP", PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog))
