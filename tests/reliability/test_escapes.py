"""Escape attempts from inside a sandbox, as root, through the real E2B SDK against a real server.

Each test runs one attempt of ``escape_probe.py`` (uploaded into the sandbox, run by its python3) and
asserts the specific way it fails: a syscall the seccomp filter or the dropped capabilities refuse is
``EPERM`` (``ENOSYS`` where Docker's profile says so), a host-global /proc knob is a read-only mount
(``EROFS``), a host process does not exist in the sandbox's PID namespace (``ESRCH``), and no address
the sandbox can name reaches a listener of the host or of another sandbox.

Where the runtime is ``vm`` the syscall attempts are skipped: root in the guest may mount or load
modules there, the guest kernel is the boundary; the network attempts run on both runtimes.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import CommandExitException, Sandbox

from aenv.testing.server import Server
from tests.fixtures.nethost import HostListener, host_addrs

PROBE = (Path(__file__).parent / "escape_probe.py").read_text()
PROBE_PATH = "/tmp/escape_probe.py"
ENVD_PORT = 49983
SLIRP_HOST = "10.0.2.2"
SLIRP_DNS = "10.0.2.3"


def _prepare(s: Sandbox) -> Sandbox:
    s.files.write(PROBE_PATH, PROBE)
    return s


@pytest.fixture(scope="module")
def sbx(conn: dict[str, str]) -> Iterator[Sandbox]:
    s = _prepare(Sandbox.create("base", timeout=600, **conn))
    yield s
    s.kill()


def attempt(s: Sandbox, *args: str) -> dict[str, object]:
    cmd = "python3 " + " ".join([PROBE_PATH, *args])
    try:
        out = s.commands.run(cmd, user="root", timeout=60).stdout
    except CommandExitException as exc:
        pytest.fail(f"probe {args} crashed: {exc.stdout} {exc.stderr}")
    result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return result


@pytest.fixture
def ns_only(runtime_name: str) -> None:
    if runtime_name != "ns":
        pytest.skip("vm: root in the guest owns the guest kernel; the boundary is the VM")


def refused(result: dict[str, object], *errnos: str) -> None:
    assert not result["ok"], f"the attempt worked: {result}"
    assert result["errno"] in errnos, result


def test_proc_1_root_does_not_lead_to_the_host(sbx: Sandbox, tmp_path: Path) -> None:
    secret = secrets.token_hex(16)
    marker = tmp_path / f"escape-{secrets.token_hex(4)}"
    marker.write_text(secret)
    for prefix in ("/proc/1/root", "/proc/self/root", "/proc/2/root"):
        result = attempt(sbx, "read", f"{prefix}{marker}")
        assert secret not in str(result.get("detail", ""))
        refused(result, "ENOENT", "EACCES")


@pytest.mark.usefixtures("ns_only")
def test_open_by_handle_at_of_a_host_inode(sbx: Sandbox) -> None:
    # /.aenv is a bind mount of a host directory: a handle to its filesystem's root inode would be
    # the host's / (the "shocker" escape)
    refused(attempt(sbx, "open_by_handle", "/.aenv"), "EPERM")


@pytest.mark.usefixtures("ns_only")
def test_mount_is_refused(sbx: Sandbox) -> None:
    refused(attempt(sbx, "mount"), "EPERM")


@pytest.mark.usefixtures("ns_only")
@pytest.mark.parametrize("how", ["unshare_user_mount", "unshare_mount", "clone_newuser"])
def test_new_namespaces_to_regain_capabilities(sbx: Sandbox, how: str) -> None:
    refused(attempt(sbx, how), "EPERM")


@pytest.mark.usefixtures("ns_only")
def test_unshare_command_cannot_mount(sbx: Sandbox) -> None:
    out = sbx.commands.run("unshare -Urm sh -c 'mount -t tmpfs none /mnt && echo MOUNTED' 2>&1 || true",
                           user="root").stdout
    assert "MOUNTED" not in out and "Operation not permitted" in out, out


@pytest.mark.usefixtures("ns_only")
@pytest.mark.parametrize("probe", ["load_module", "keyctl", "bpf", "perf_event_open"])
def test_kernel_interfaces_are_refused(sbx: Sandbox, probe: str) -> None:
    refused(attempt(sbx, probe), "EPERM")


@pytest.mark.usefixtures("ns_only")
@pytest.mark.parametrize("path", ["/proc/sysrq-trigger", "/proc/sys/kernel/core_pattern",
                                  "/proc/sys/kernel/modprobe"])
def test_host_global_proc_knobs_are_read_only(sbx: Sandbox, path: str) -> None:
    if not Path(path).exists():
        pytest.skip(f"this host's kernel has no {path}")
    before = Path(path).read_text() if path != "/proc/sysrq-trigger" else ""
    result = attempt(sbx, "write", path)
    if path != "/proc/sysrq-trigger" and Path(path).read_text() != before:
        Path(path).write_text(before)  # undo before failing
        pytest.fail(f"sandbox root changed the host's {path}")
    refused(result, "EROFS", "EACCES", "EPERM")


@pytest.mark.usefixtures("ns_only")
def test_ptrace_of_a_host_process(sbx: Sandbox) -> None:
    result = attempt(sbx, "ptrace", str(os.getpid()))
    assert not result["visible"], "a host process is visible in the sandbox's /proc"
    refused(result, "ESRCH", "EPERM")


def _targets(s: Sandbox, port: int) -> list[str]:
    seen = attempt(s, "gateway")
    names = {*host_addrs(), SLIRP_HOST, SLIRP_DNS, "127.0.0.1", *seen["gateways"], *seen["dns"]}  # type: ignore[misc]
    return sorted(f"{a}:{port}" for a in names)


@pytest.fixture(scope="module")
def online(conn: dict[str, str]) -> Iterator[Sandbox]:
    s = _prepare(Sandbox.create("base", timeout=600, allow_internet_access=True, **conn))
    yield s
    s.kill()


@pytest.fixture(scope="module")
def neighbour(conn: dict[str, str]) -> Iterator[Sandbox]:
    s = _prepare(Sandbox.create("base", timeout=600, allow_internet_access=True, **conn))
    yield s
    s.kill()


def test_host_unreachable_through_every_address(online: Sandbox, shared_server: Server) -> None:
    listener = HostListener(host_addrs())
    try:
        for port in (listener.port, int(shared_server.url.rsplit(":", 1)[1])):
            for target in _targets(online, port):
                if target.startswith("127.0.0.1:") and port != listener.port:
                    continue  # the sandbox's own loopback: nothing of the host's
                result = attempt(online, "connect", target)
                assert not result["ok"], f"{target} answered from inside the sandbox: {result}"
        assert listener.accepted == 0, "a sandbox connection reached the host listener"
    finally:
        listener.close()


def test_another_sandbox_and_its_envd_unreachable(online: Sandbox, neighbour: Sandbox) -> None:
    port = 47000 + secrets.randbelow(1000)
    neighbour.commands.run(
        f"python3 -c \"import socket; s=socket.socket(); s.bind(('0.0.0.0', {port})); s.listen(); "
        f"open('/tmp/listening','w').close(); c,a=s.accept(); open('/tmp/reached','w').write(str(a))\"",
        background=True, user="root", timeout=0).disconnect()
    for _ in range(100):
        if neighbour.files.exists("/tmp/listening"):
            break
        time.sleep(0.1)
    theirs = {str(a) for a in attempt(neighbour, "gateway")["self"]}  # type: ignore[attr-defined]
    mine = {str(a) for a in attempt(online, "gateway")["self"]}  # type: ignore[attr-defined]
    for p in (port, ENVD_PORT):
        for target in sorted({*_targets(online, p), *(f"{a}:{p}" for a in theirs)}):
            addr = target.rsplit(":", 1)[0]
            if p == ENVD_PORT and (addr == "127.0.0.1" or addr in mine):
                continue  # its own envd listens there (ns sandboxes all have slirp's 10.0.2.100)
            result = attempt(online, "connect", target)
            assert not result["ok"], f"{target} answered: {result}"
    assert not neighbour.files.exists("/tmp/reached"), "the other sandbox's listener was reached"


@pytest.mark.usefixtures("ns_only")
def test_root_in_a_default_sandbox_is_an_unprivileged_host_uid(sbx: Sandbox) -> None:
    """A server with default settings runs ns sandboxes in its user namespace: uid 0 inside (and a
    sudo'd process) is a non-zero host uid, and the map cannot be rewritten from inside."""
    for cmd in ("cat /proc/self/uid_map /proc/self/gid_map", "sudo cat /proc/self/uid_map"):
        maps = [line.split() for line in sbx.commands.run(cmd, user="root").stdout.splitlines()]
        assert maps and all(inside == "0" and int(outside) > 0 and count == "65536"
                            for inside, outside, count in maps), maps
    out = sbx.commands.run("echo '0 0 1' > /proc/self/uid_map 2>/dev/null; cat /proc/1/uid_map", user="root").stdout
    assert out.split()[:3] == maps[0], out  # still the non-zero base


@pytest.mark.usefixtures("ns_only")
def test_every_process_runs_filtered_and_sudo_stays_inside_the_filter(sbx: Sandbox) -> None:
    """Every process, a sudo'd one included, runs under the filter; sudo raises ``user`` to the
    sandbox's root as on E2B (no ``no_new_privs``), and that root still cannot mount or unshare."""
    out = sbx.commands.run("grep -hE '^Seccomp:' /proc/[0-9]*/status | sort | uniq -c", user="root").stdout
    assert {" ".join(line.split()[1:]) for line in out.splitlines()} == {"Seccomp: 2"}, out
    assert sbx.commands.run("sudo id -u").stdout.strip() == "0"
    assert sbx.commands.run("sudo grep -E '^Seccomp:' /proc/self/status").stdout.split() == ["Seccomp:", "2"]
    for attempt in ("sudo mount -t tmpfs none /mnt", "sudo unshare -m true"):
        with pytest.raises(CommandExitException):
            sbx.commands.run(attempt)
