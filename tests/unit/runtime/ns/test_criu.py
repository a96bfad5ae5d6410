"""``runtime/ns/criu.py``: detection (with a fake ``subprocess.run``) and the dump/restore command lines."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from aenv.runtime.ns import criu


def fake_run(version_out: str, check_rc: int = 0, check_err: str = "") -> tuple[Any, list[list[str]]]:
    calls: list[list[str]] = []

    def run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        if argv[1] == "--version":
            return subprocess.CompletedProcess(argv, 0, version_out, "")
        return subprocess.CompletedProcess(argv, check_rc, "Looks good.\n" if check_rc == 0 else "", check_err)

    return run, calls


@pytest.mark.parametrize(
    ("text", "want"),
    [("Version: 3.17.1\n", (3, 17, 1)), ("Version: 4.2\nGitID: v4.2-12\n", (4, 2, 0)), ("criu?", None)],
)
def test_parse_version(text: str, want: tuple[int, int, int] | None) -> None:
    assert criu.parse_version(text) == want


def test_absent() -> None:
    st = criu.evaluate(None)
    assert not st.usable and st.reason.startswith("absent")


def test_debian_317_is_too_old_without_running_check() -> None:
    run, calls = fake_run("Version: 3.17.1\n")
    st = criu.evaluate("/usr/sbin/criu", run)
    assert not st.usable and "too old" in st.reason and "3.17.1" in st.reason
    assert [c[1] for c in calls] == ["--version"]


def test_41_fails_check_or_is_refused() -> None:
    run, _ = fake_run("Version: 4.1.1\n")
    assert not criu.evaluate("/opt/criu", run).usable


def test_42_needs_a_passing_check() -> None:
    run, _ = fake_run("Version: 4.2.1\n", check_rc=1,
                      check_err="Error (criu/vdso.c:…): vdso: Unexpected rt vDSO area bounds\n")
    st = criu.evaluate("/opt/criu", run)
    assert not st.usable and "check failed" in st.reason and "vDSO" in st.reason
    run, calls = fake_run("Version: 4.2.1\n")
    st = criu.evaluate("/opt/criu", run)
    assert st.usable and st.version == (4, 2, 1)
    assert st.describe() == "4.2.1 at /opt/criu"
    assert calls[-1] == ["/opt/criu", "check"]


def test_exe_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(criu.ENV_EXE, str(tmp_path / "missing"))
    assert criu.find_exe() is None


def test_dump_argv() -> None:
    argv = criu.dump_argv("/opt/criu", 4242, Path("/s/x/criu"), freezer=Path("/sys/fs/cgroup/freezer/aenv/sb1"))
    assert argv[:5] == ["/opt/criu", "dump", "-t", "4242", "-D"]
    assert "--leave-running" in argv and "--tcp-established" in argv and "--ext-unix-sk" in argv
    assert "--skip-in-flight" in argv  # a connection queued on a listener must not fail the dump
    assert argv[argv.index("--freeze-cgroup") + 1] == "/sys/fs/cgroup/freezer/aenv/sb1"
    ext = [argv[i + 1] for i, a in enumerate(argv) if a == "--external"]
    assert "mnt[/.aenv]:aenv-tools" in ext and "mnt[/.aenv-run]:aenv-run" in ext and "mnt[/dev/null]:dev-null" in ext
    assert "mnt[/proc/sys/kernel/random/boot_id]:aenv-boot-id" in ext
    assert "--leave-running" not in criu.dump_argv("/c", 1, Path("/i"), freezer=None, leave_running=False)


def test_restore_argv_maps_externals_back() -> None:
    argv = criu.restore_argv("/opt/criu", Path("/s/x/criu"), root=Path("/w/ns/rootfs"), pidfile=Path("/w/ns/run/pid"),
                             tools=Path("/cache/tools"), run_dir=Path("/w/ns/run"))
    assert argv[:2] == ["/opt/criu", "restore"] and "--restore-detached" in argv
    assert argv[argv.index("--root") + 1] == "/w/ns/rootfs"
    assert argv[argv.index("--pidfile") + 1] == "/w/ns/run/pid"
    ext = [argv[i + 1] for i, a in enumerate(argv) if a == "--external"]
    assert "mnt[aenv-tools]:/cache/tools" in ext and "mnt[aenv-run]:/w/ns/run" in ext and "mnt[dev-null]:/dev/null" in ext
    with_boot_id = criu.restore_argv("/c", Path("/i"), root=Path("/r"), pidfile=Path("/p"), tools=Path("/t"),
                                     run_dir=Path("/w/ns/run"), boot_id=Path("/w/ns/boot_id"))
    assert "mnt[aenv-boot-id]:/w/ns/boot_id" in with_boot_id
    action = Path(argv[argv.index("--action-script") + 1])  # the host binds read-only again before resume
    conf = Path(f"{action}.conf")  # the compiled form's configuration, where a compiler is around
    body = conf.read_text() if conf.exists() else action.read_text()
    assert body.startswith("lo_up" if conf.exists() else "#!/bin/sh\n") or body.startswith("fix")
    assert "ro_remount.py" in body and "/dev/null:0" in body and "/.aenv:6" in body
    assert action.parent.stat().st_mode & 0o777 == 0o700 and (conf if conf.exists() else action).stat().st_mode & 0o077 == 0


def _fake_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for the interpreter the action script would exec: it records its arguments."""
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/ran\n')
    fake.chmod(0o700)
    monkeypatch.setattr(sys, "executable", str(fake))
    return tmp_path / "ran"


def _run_action(action: str, stage: str, pid: int) -> None:
    subprocess.run([action], env={"CRTOOLS_SCRIPT_ACTION": stage, "CRTOOLS_INIT_PID": str(pid)}, check=True)


COMPILED = pytest.param(True, marks=pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: shell form only"),
                        id="compiled")
BOTH_FORMS = pytest.mark.parametrize("compiled", [COMPILED, pytest.param(False, id="shell")])


@BOTH_FORMS
def test_ro_remount_action_only_acts_at_pre_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    compiled: bool) -> None:
    # CRIU runs the script at every stage and waits: a Python start at each would cost ~25 ms apiece
    ran = _fake_python(tmp_path, monkeypatch)
    action = criu.ro_remount_action(("keys",), base=tmp_path, compiled=compiled)
    assert action.endswith(".sh") is not compiled
    for stage in ("pre-restore", "setup-namespaces", "post-setup-namespaces", "post-restore", "network-unlock",
                  "post-resume"):
        _run_action(action, stage, 1 << 30)  # no such pid: it would remount if it looked
    assert not ran.exists()
    _run_action(action, "pre-resume", 1 << 30)  # a mount table it cannot read: remount all, to be sure
    args = ran.read_text().split()
    assert args[:2] == ["-I", "-S"] and args[2].endswith("ro_remount.py") and args[-1] == "/.aenv:6"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root for a mount namespace")
@pytest.mark.parametrize(("options", "remounts"), [("ro", False), ("rw", True)])
@BOTH_FORMS
def test_ro_remount_action_remounts_only_a_writable_bind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         options: str, remounts: bool, compiled: bool) -> None:
    """The binds are born read-only (``read_only_sources``); the script checks the restored tree's
    mount table and starts ``ro_remount.py`` only where one is not."""
    ran = _fake_python(tmp_path, monkeypatch)
    action = criu.ro_remount_action((), base=tmp_path, compiled=compiled)
    # a stand-in for the restored tree: a mount namespace of its own with a host bind at /dev/null
    script = (f"mount --bind -o {options} /dev/null /dev/null && "
              f"CRTOOLS_SCRIPT_ACTION=pre-resume CRTOOLS_INIT_PID=$$ {action}")
    subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], check=True)
    assert ran.exists() is remounts


def test_restore_wrapper_binds_the_sources_read_only(tmp_path: Path) -> None:
    sources = criu.read_only_sources(Path("/cache/tools"), Path("/w/ns/boot_id"), ("keys", "kcore"))
    assert sources.count(("/dev/null", 0)) == 1  # /dev/null and both /proc masks: one bind
    assert ("/w/ns/boot_id", criu.MS_NOSUID | criu.MS_NODEV | criu.MS_NOEXEC) in sources
    assert ("/cache/tools", criu.MS_NOSUID | criu.MS_NODEV) in sources
    argv = criu.in_fresh_netns_argv(["/c", "restore"], read_only=sources)
    assert argv[:5] == ["unshare", "--net", "--mount", "--propagation", "private"]  # binds stay in there
    assert "mount --bind -o ro,nosuid,nodev /cache/tools /cache/tools && " in argv[8]
    assert "mount --bind -o ro,nosuid,nodev,noexec /w/ns/boot_id /w/ns/boot_id && " in argv[8]


@pytest.mark.parametrize(("points", "one_remount"), [({"/", "/dev"}, True), ({"/", "/dev", "/dev/null"}, False),
                                                     ({"/"}, False)])
def test_device_nodes_take_one_remount_of_dev_where_they_can(monkeypatch: pytest.MonkeyPatch, points: set[str],
                                                              one_remount: bool) -> None:
    """One mount(8) run instead of six, unless /dev is no mount or a node is a mount of its own."""
    monkeypatch.setattr(criu, "_mount_points", lambda: points)
    script = criu.in_fresh_netns_argv(["/c"], read_only=criu.read_only_sources(Path("/t"), None, ()))[8]
    assert ("mount -o remount,bind,ro /dev && " in script) is one_remount
    assert ("mount --bind -o ro /dev/null /dev/null && " in script) is not one_remount
    assert "mount --bind -o ro,nosuid,nodev /t /t && " in script


def test_ro_remount_does_nothing_but_at_pre_resume(monkeypatch: pytest.MonkeyPatch) -> None:
    from aenv.runtime.ns import ro_remount

    monkeypatch.setenv("CRTOOLS_SCRIPT_ACTION", "post-restore")
    assert ro_remount.main(["/dev/null:0"]) == 0  # no setns, no mount: not its stage


def test_in_cgroups_argv_joins_then_execs(tmp_path: Path) -> None:
    files = [str(tmp_path / "a.procs"), str(tmp_path / "b.procs")]
    argv = criu.in_cgroups_argv(files, ["/bin/sh", "-c", 'echo "restored $$"'])
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    pid = out.split()[1]
    assert out == f"restored {pid}\n"  # exec kept the pid that joined the cgroups
    assert [Path(f).read_text().strip() for f in files] == [pid, pid]


def test_mount_overlay_argv() -> None:
    argv = criu.mount_overlay_argv(["/s/a/upper", "/rootfs"], Path("/w/upper"), Path("/w/work"), Path("/w/rootfs"))
    assert argv == ["mount", "-t", "overlay", "overlay", "-o",
                    "lowerdir=/s/a/upper:/rootfs,upperdir=/w/upper,workdir=/w/work", "/w/rootfs"]


def test_exe_search_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """AENV_CRIU alone when set; else the ns_criu setting; else the set-up's build in the cache, then PATH."""
    from aenv.config import Settings

    built = tmp_path / "cache" / "criu" / "current" / "criu"
    built.parent.mkdir(parents=True)
    built.write_text("#!/bin/sh\n")
    built.chmod(0o755)
    monkeypatch.delenv(criu.ENV_EXE, raising=False)
    settings = Settings(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache")
    assert criu.find_exe(settings) == str(built)
    assert criu.candidates(settings)[0] == str(built)
    other = Settings(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache", ns_criu=tmp_path / "mine")
    assert criu.candidates(other) == [str(tmp_path / "mine")] and criu.find_exe(other) is None
    monkeypatch.setenv(criu.ENV_EXE, str(built))
    assert criu.candidates(other) == [str(built)]


def test_network_namespace_is_external() -> None:
    """Dumped as external by inode, joined at restore from the fd the fresh-netns wrapper opens."""
    argv = criu.dump_argv("/c", 7, Path("/i"), freezer=None, net_inode=4026532999, masked=("keys",))
    ext = [argv[i + 1] for i, a in enumerate(argv) if a == "--external"]
    assert "net[4026532999]:aenv-net" in ext and "mnt[/proc/keys]:proc-keys" in ext
    restore = criu.restore_argv("/c", Path("/i"), root=Path("/r"), pidfile=Path("/p"), tools=Path("/t"),
                                run_dir=Path("/run"), masked=("keys",))
    assert restore[restore.index("--inherit-fd") + 1] == f"fd[{criu.NET_FD}]:aenv-net"
    ext = [restore[i + 1] for i, a in enumerate(restore) if a == "--external"]
    assert "mnt[proc-keys]:/dev/null" in ext
    wrapped = criu.in_fresh_netns_argv(["/c", "restore"])
    assert wrapped[:3] == ["unshare", "--net", "--"] and wrapped[-2:] == ["/c", "restore"]
    assert f"{criu.NET_FD}</proc/self/ns/net" in wrapped[5] and "lo up" in wrapped[5]


def test_dump_runs_in_the_trees_network_namespace() -> None:
    """No network namespace to dump (CRIU's own), and no external one to name."""
    assert criu.in_netns_of_argv(41, ["/c", "dump"]) == ["nsenter", "--net=/proc/41/ns/net", "--", "/c", "dump"]
    assert not any(a.startswith("net[") for a in criu.dump_argv("/c", 41, Path("/i"), freezer=None))


def test_user_namespace_dumps_an_empty_network_and_keeps_dev_external() -> None:
    """A sandbox in a user namespace (checkpoint.dump of such a tree): no network external, its
    namespace dumped empty (sockets only) and restored empty, /dev by key both ways."""
    argv = criu.dump_argv("/c", 7, Path("/i"), freezer=None, net_inode=None, masked=(), dev_external=True,
                          empty_net=True)
    ext = [argv[i + 1] for i, a in enumerate(argv) if a == "--external"]
    assert "mnt[/dev]:aenv-dev" in ext and not any(e.startswith("net[") for e in ext)
    assert _pairs_of(argv, "--empty-ns") == ["net"]
    restore = criu.restore_argv("/c", Path("/i"), root=Path("/r"), pidfile=Path("/p"), tools=Path("/t"),
                                run_dir=Path("/run"), masked=(), net_external=False, dev=Path("/stage/dev"),
                                empty_net=True)
    ext = [restore[i + 1] for i, a in enumerate(restore) if a == "--external"]
    assert "mnt[aenv-dev]:/stage/dev" in ext and "--inherit-fd" not in restore
    assert _pairs_of(restore, "--empty-ns") == ["net"]


def test_a_dump_keeps_its_network_unless_asked() -> None:
    """The plain path's network namespace is external (never dumped): no --empty-ns there."""
    assert "--empty-ns" not in criu.dump_argv("/c", 7, Path("/i"), freezer=None, net_inode=4026532999, masked=())


def _pairs_of(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_masked_here_only_names_what_exists() -> None:
    assert all(Path(f"/proc/{n}").exists() for n in criu.masked_here())


def test_kdat_cache_wrappers_bind_a_tmpfs_dir_over_run(tmp_path: Path) -> None:
    """CRIU keeps its kernel probe only on a tmpfs /run: the wrappers give it one in a private mount
    namespace (one directory per executable); without a directory they run CRIU as is."""
    d = criu.kdat_dir("/opt/criu", base=tmp_path)
    assert d.parent == tmp_path and d != criu.kdat_dir("/other/criu", base=tmp_path)
    assert criu.in_kdat_cache_argv(None, ["/c", "dump"]) == ["/c", "dump"]
    wrapped = criu.in_kdat_cache_argv(d, ["/c", "dump"])
    assert wrapped[:4] == ["unshare", "--mount", "--propagation", "private"] and wrapped[-2:] == ["/c", "dump"]
    assert f'mount --bind "{d}" /run' in wrapped[7]
    net = criu.in_fresh_netns_argv(["/c", "restore"], kdat=d)
    assert net[:5] == ["unshare", "--net", "--mount", "--propagation", "private"]
    assert f'mount --bind "{d}" /run' in net[8] and "lo up" in net[8]


def test_no_network_lock() -> None:
    """The namespace is external on both sides: CRIU's iptables lock (two iptables-restore runs) is skipped."""
    for argv in (criu.dump_argv("/c", 1, Path("/i"), freezer=None),
                 criu.restore_argv("/c", Path("/i"), root=Path("/r"), pidfile=Path("/p"), tools=Path("/t"),
                                   run_dir=Path("/run"))):
        assert argv[argv.index("--network-lock") + 1] == "skip"


def test_an_empty_network_namespace_gets_its_loopback_from_the_action_script(tmp_path: Path) -> None:
    """``--empty-ns net`` leaves the restored namespace bare: the script brings lo up at
    setup-namespaces (before sockets bound to 127.0.0.1 are restored) and does nothing else then."""
    import subprocess

    plain = Path(criu.ro_remount_action((), base=tmp_path, compiled=False)).read_text()
    lo = Path(criu.ro_remount_action((), base=tmp_path, lo_up=True, compiled=False)).read_text()
    assert criu.SETUP_NAMESPACES not in plain and lo.splitlines()[1].startswith(f'[ "$CRTOOLS_SCRIPT_ACTION" = {criu.SETUP_NAMESPACES} ]')
    script = tmp_path / "probe.sh"
    script.write_text(lo.replace("exec nsenter", "echo nsenter"))
    env = {"PATH": "/usr/bin:/bin", "CRTOOLS_INIT_PID": "77"}
    out = subprocess.run(["sh", str(script)], env={**env, "CRTOOLS_SCRIPT_ACTION": criu.SETUP_NAMESPACES},
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("nsenter -t 77 -n sh -c ") and "ip link set lo up" in out
    out = subprocess.run(["sh", str(script)], env={**env, "CRTOOLS_SCRIPT_ACTION": "post-restore"},
                         capture_output=True, text=True, check=True).stdout
    assert out == ""




@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: unshare --net")
@BOTH_FORMS
def test_a_restore_may_bind_and_connect_sockets_before_the_tree_has_a_network(tmp_path: Path, compiled: bool) -> None:
    """A socket dumped bound to the tap's address, or connecting to a peer outside, is bound and
    connected again before the restored tree has a tap: its network namespace allows binding to absent
    addresses while CRIU runs (the fresh one's wrapper; the action script's ``LO_UP`` in a
    user-namespaced one) and, where the dump holds such a connection, routes through loopback; neither
    once CRIU has ended (``end_restore_network``). The host's own settings are never touched."""
    from aenv.runtime.ns import checkpoint, sockets

    host_nonlocal, host_routes = Path(criu.NONLOCAL_BIND).read_text(), Path("/proc/net/route").read_text()
    wrapped = criu.in_fresh_netns_argv(["sh", "-c", f"cat {criu.NONLOCAL_BIND}; ip route"], stand_in_route=True)
    out = subprocess.run(wrapped, capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "1" and out[1].startswith("default dev lo")
    plain = criu.in_fresh_netns_argv(["ip", "route"])
    assert subprocess.run(plain, capture_output=True, text=True, check=True).stdout == ""
    images = tmp_path / "images"
    images.mkdir()
    (images / criu.OUTSIDE_TCP_MARK).touch()
    action = criu.ro_remount_action((), base=tmp_path, lo_up=True, compiled=compiled)
    tree = subprocess.Popen(["unshare", "--net", "sleep", "30"])
    try:
        for _ in range(100):  # until sleep runs in its namespace
            if os.readlink(f"/proc/{tree.pid}/ns/net") != os.readlink("/proc/self/ns/net"):
                break
            time.sleep(0.01)
        env = {"PATH": os.environ["PATH"], "CRTOOLS_INIT_PID": str(tree.pid), "CRTOOLS_IMAGE_DIR": str(images),
               "CRTOOLS_SCRIPT_ACTION": criu.SETUP_NAMESPACES}
        subprocess.run(["sh", "-c", action], env=env, check=True)  # as CRIU runs it

        def inside(*argv: str) -> str:
            return subprocess.run(["nsenter", "-t", str(tree.pid), "-n", *argv], capture_output=True, text=True,
                                  check=True).stdout.strip()

        assert inside("cat", criu.NONLOCAL_BIND) == "1" and inside("ip", "route").startswith("default dev lo")
        assert criu.STAND_IN_ADDR.split("/")[0] in inside("ip", "-4", "addr", "show", "dev", "lo")
        assert not sockets.has_outside_tcp(sockets.tree_pids(tree.pid))
        connecting = ("import socket, time; s = socket.socket(); s.setblocking(False); s.connect_ex(('203.0.113.9', 80)); "
                      "l = socket.create_server(('127.0.0.1', 0)); c = socket.create_connection(l.getsockname()); "
                      "print('ok', flush=True); time.sleep(30)")
        with subprocess.Popen(["nsenter", "-t", str(tree.pid), "-n", sys.executable, "-c", connecting],
                              stdout=subprocess.PIPE, text=True) as knocker:
            assert knocker.stdout is not None and knocker.stdout.readline().strip() == "ok"
            assert sockets.has_outside_tcp([knocker.pid])  # the loopback pair alone would not be
            knocker.kill()
        checkpoint.end_restore_network(tree.pid)
        assert inside("cat", criu.NONLOCAL_BIND) == "0" and inside("ip", "route") == ""
        assert criu.STAND_IN_ADDR.split("/")[0] not in inside("ip", "-4", "addr", "show", "dev", "lo")
        checkpoint.end_restore_network(tree.pid)  # nothing left to undo: no error
        (images / criu.OUTSIDE_TCP_MARK).unlink()
        subprocess.run(["sh", "-c", action], env=env, check=True)  # as CRIU runs it
        assert inside("ip", "route") == ""
    finally:
        tree.kill()
        tree.wait()
    assert Path(criu.NONLOCAL_BIND).read_text() == host_nonlocal and Path("/proc/net/route").read_text() == host_routes
