"""The ksm policy (who may share pages) and the host side of it (ksmd within a CPU budget, counters),
on a stand-in of /sys/kernel/mm/ksm; and the marks it puts on each runtime's processes' command lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.runtime import ksm
from aenv.runtime.ns.procimage import image_key
from aenv.runtime.vm.cmdline import build_argv
from aenv.runtime.vm.config import VmConfig

KEY_A, KEY_B = "e2b_" + "a" * 40, "e2b_" + "b" * 40


@pytest.mark.parametrize(
    ("mode", "keys", "merge"),
    [("auto", [], True), ("auto", [KEY_A], True), ("auto", [KEY_A, KEY_A], True), ("auto", [KEY_A, KEY_B], False),
     ("on", [KEY_A, KEY_B], True), ("off", [], False), ("off", [KEY_A], False)],
)
def test_policy(tmp_path: Path, mode: str, keys: list[str], merge: bool) -> None:
    decision = ksm.decide(Settings(state_dir=tmp_path, ksm=mode, api_keys=keys))  # type: ignore[arg-type]
    assert decision.merge is merge
    assert decision.reason.startswith(f"ksm = {mode}")
    if mode == "auto" and not merge:
        assert "side channel" in decision.reason and "2 teams" in decision.reason


@pytest.mark.parametrize(
    ("teams", "admin", "merge"),
    [({"a": [KEY_A, KEY_B]}, [], True),  # two keys of one team: one tenant
     ({"a": [KEY_A]}, ["k-admin"], False),  # the admin team is a tenant of its own
     ({"a": [KEY_A], "b": [KEY_B]}, [], False)],
)
def test_auto_counts_teams_not_keys(tmp_path: Path, teams: dict[str, list[str]], admin: list[str], merge: bool) -> None:
    settings = Settings(state_dir=tmp_path, teams={n: {"keys": k} for n, k in teams.items()},  # type: ignore[misc]
                        admin_keys=admin)
    decision = ksm.decide(settings)
    assert decision.merge is merge, decision.reason
    if not merge:
        assert "none across teams" in decision.reason


def _sysfs(tmp_path: Path, **values: int | str) -> Path:
    base = {"run": 0, "advisor_mode": "[none] scan-time", "advisor_max_cpu": 70, "pages_shared": 0,
            "pages_sharing": 0, "general_profit": 0, "full_scans": 0}  # fmt: skip
    root = tmp_path / "ksm"
    root.mkdir()
    for name, value in {**base, **values}.items():
        (root / name).write_text(f"{value}\n")
    return root


def test_start_runs_ksmd_with_the_advisor_bounding_its_cpu(tmp_path: Path) -> None:
    sysfs = _sysfs(tmp_path)
    assert "started" in ksm.start_ksmd(15, sysfs)
    assert (sysfs / "run").read_text() == "1"
    assert (sysfs / "advisor_mode").read_text() == "scan-time"
    assert (sysfs / "advisor_max_cpu").read_text() == "15"
    assert "already running" in ksm.start_ksmd(15, sysfs)


def test_no_ksm_or_no_write_access_is_said_not_raised(tmp_path: Path) -> None:
    assert ksm.start_ksmd(10, tmp_path / "absent").startswith("unavailable: the kernel has no KSM")
    sysfs = _sysfs(tmp_path)
    (sysfs / "run").unlink()
    (sysfs / "run").mkdir()  # a write to it fails as one to a read-only sysfs would
    (sysfs / "advisor_mode").unlink()
    assert ksm.start_ksmd(10, sysfs).startswith("unavailable: cannot set up ksmd")


def test_a_server_that_does_not_merge_leaves_ksmd_alone(tmp_path: Path) -> None:
    sysfs = _sysfs(tmp_path)
    k = ksm.Ksm(Settings(state_dir=tmp_path, ksm="off"), sysfs)
    k.start()
    assert (sysfs / "run").read_text().strip() == "0"
    assert k.stats()["merge"] is False and "ksmd" not in k.stats()


def test_stats_and_metrics(tmp_path: Path) -> None:
    sysfs = _sysfs(tmp_path, run=1, pages_shared=10, pages_sharing=250, general_profit=900000, full_scans=3)
    k = ksm.Ksm(Settings(state_dir=tmp_path), sysfs)
    out = k.stats()
    page = out["mergedBytes"] // 250
    assert (out["merge"], out["running"], out["sharedBytes"], out["mergedBytes"]) == (True, True, 10 * page, 250 * page)
    assert (out["profitBytes"], out["fullScans"]) == (900000, 3)
    lines = k.prometheus()
    assert "aenv_ksm_merge 1" in lines and f"aenv_ksm_merged_bytes {250 * page}" in lines
    assert "aenv_ksm_profit_bytes 900000" in lines


def test_an_ns_process_image_is_never_shared_between_the_two_policies(tmp_path: Path) -> None:
    """Its mappings are dumped marked mergeable or not: a server of the other policy must not restore it."""
    from aenv.runtime.base import SandboxImage

    tpl = SandboxImage(template_id="t", rootfs=tmp_path)
    assert image_key(tpl, True, tmp_path, "criu", True) != image_key(tpl, True, tmp_path, "criu", False)
    assert image_key(tpl, True, tmp_path, "criu") == image_key(tpl, True, tmp_path, "criu", False)  # as before
    # an idle wait changes what is dumped marked (the agent may be, envd is not)
    assert image_key(tpl, True, tmp_path, "criu", True, 5.0) != image_key(tpl, True, tmp_path, "criu", True)


def test_the_ns_agent_is_started_mergeable_only_when_asked(tmp_path: Path) -> None:
    from aenv.agent.main import envd_args, parse_args
    from aenv.runtime.base import SandboxImage
    from aenv.runtime.ns.sandbox import LaunchOptions, agent_argv

    tpl = SandboxImage(template_id="t", rootfs=tmp_path)
    common = {"template": tpl, "tools": tmp_path, "allow_internet": False, "default_limits": (1, 256, 64)}
    argv = agent_argv(LaunchOptions(**common, mergeable=True, merge_idle_s=2.5))  # type: ignore[arg-type]
    assert argv[argv.index("--mergeable") + 1 :][:2] == ["--merge-idle", "2.5"]
    assert "--mergeable" not in agent_argv(LaunchOptions(**common))  # type: ignore[arg-type]
    args = parse_args(["--channel", "unix-listen:/.aenv-run/mux.sock", "--mergeable", "--merge-idle", "2.5"])
    assert args.mergeable and envd_args(args)[-3:] == ["--mergeable", "--merge-idle", "2.5"]
    assert "--mergeable" not in envd_args(parse_args(["--channel", "unix-listen:/.aenv-run/mux.sock"]))


def test_vm_guest_ram_is_unmarked_only_where_the_policy_says(tmp_path: Path) -> None:
    cfg = VmConfig(name="x", kernel=tmp_path / "k", qmp_socket=tmp_path / "q", channel_socket=tmp_path / "c",
                   mem_path=tmp_path / "m")  # fmt: skip
    machine = build_argv(cfg)[build_argv(cfg).index("-M") + 1]
    assert "mem-merge" not in machine  # QEMU's default (on): the argv of every VM before the policy
    off = build_argv(VmConfig(**{**cfg.__dict__, "mem_merge": False}))
    assert "mem-merge=off" in off[off.index("-M") + 1]


def test_merge_below_scans_only_while_memory_is_short(tmp_path: Path) -> None:
    """``ksm_merge_below`` < 1: ksmd starts once MemAvailable is below the share, is paused (merged pages
    kept: run = 0, never 2) once it is HYSTERESIS above again, and is left as it is in between."""
    sysfs = _sysfs(tmp_path)
    k = ksm.Ksm(Settings(state_dir=tmp_path, ksm="on", ksm_merge_below=0.5), sysfs)
    k.adjust(0.8)
    assert (sysfs / "run").read_text().strip() == "0" and not k.scanning
    k.adjust(0.4)
    assert (sysfs / "run").read_text() == "1" and k.scanning
    k.adjust(0.55)  # within the hysteresis: still scanning
    assert (sysfs / "run").read_text() == "1" and k.scanning
    k.adjust(0.65)
    assert (sysfs / "run").read_text() == "0" and not k.scanning and "paused" in (k.ksmd or "")
    assert k.stats()["mergeBelow"] == 0.5


def test_the_default_scans_always_and_never_pauses(tmp_path: Path) -> None:
    sysfs = _sysfs(tmp_path)
    k = ksm.Ksm(Settings(state_dir=tmp_path, ksm="on"), sysfs)
    k.start()
    k.adjust(0.99)
    assert (sysfs / "run").read_text() == "1" and k.scanning


def test_memory_share_reads_meminfo(tmp_path: Path) -> None:
    (tmp_path / "meminfo").write_text("MemTotal:       1000 kB\nMemFree:  10 kB\nMemAvailable:    250 kB\n")
    assert ksm.memory_share(tmp_path / "meminfo") == 0.25
    assert ksm.memory_share(tmp_path / "none") is None


# ---- ksm_rest: ksmd rests once merging settled, scans again on a start -------------------------------
def _meminfo(tmp_path: Path, available_kb: int, total_kb: int = 1_000_000) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal: {total_kb} kB\nMemFree: 1 kB\nMemAvailable: {available_kb} kB\n")
    return path


def _counters(sysfs: Path, scans: int, sharing: int) -> None:
    (sysfs / "full_scans").write_text(f"{scans}\n")
    (sysfs / "pages_sharing").write_text(f"{sharing}\n")


def _resting_server(tmp_path: Path, **settings: object) -> tuple[ksm.Ksm, Path]:
    """A server merging one sandbox "a" (idle wait 5 s) whose ksmd has just rested, at t = 118."""
    sysfs = _sysfs(tmp_path)
    k = ksm.Ksm(Settings(state_dir=tmp_path, ksm="on", ksm_idle_s=5, **settings), sysfs,  # type: ignore[arg-type]
                _meminfo(tmp_path, 800_000))
    k.start()
    k.adjust(running=["a"], now=100.0)
    for now, scans, sharing in ((103, 9, 0), (108, 10, 1000), (111, 11, 5000), (114, 12, 5005), (118, 13, 5010)):
        _counters(sysfs, scans, sharing)
        k.adjust(running=["a"], now=now)
    return k, sysfs


def test_ksmd_rests_once_three_scans_after_the_last_start_merged_almost_nothing(tmp_path: Path) -> None:
    sysfs = _sysfs(tmp_path)
    k = ksm.Ksm(Settings(state_dir=tmp_path, ksm="on", ksm_idle_s=5), sysfs, _meminfo(tmp_path, 800_000))
    k.start()
    k.adjust(running=["a"], now=100.0)
    # before "a" can be marked (5 s + the margin) nothing counts, however still the counters
    for now, scans in ((101, 1), (103, 2), (106, 3)):
        _counters(sysfs, scans, 0)
        k.adjust(running=["a"], now=now)
        assert (sysfs / "run").read_text() == "1" and not k.resting
    _counters(sysfs, 10, 1000)
    k.adjust(running=["a"], now=108.0)  # the first count after: three full scans from here
    _counters(sysfs, 11, 1000)
    k.adjust(running=["a"], now=113.0)  # one scan (under way at the marks: it passed them by)
    _counters(sysfs, 12, 1005)
    k.adjust(running=["a"], now=118.0)  # two, +0.5 %: pages noted, too early to say it settled
    assert (sysfs / "run").read_text() == "1" and not k.resting
    _counters(sysfs, 13, 5000)
    k.adjust(running=["a"], now=123.0)  # three, and it merged what the new ones share: still merging
    assert (sysfs / "run").read_text() == "1" and not k.resting
    _counters(sysfs, 14, 5040)  # the fourth, +0.8 %
    k.adjust(running=["a"], now=128.0)
    assert (sysfs / "run").read_text() == "0" and k.resting and not k.scanning
    assert "resting" in (k.ksmd or "") and k.stats()["rests"] == 1 and k.stats()["resting"] is True
    assert "aenv_ksm_resting 1" in k.prometheus()
    _counters(sysfs, 12, 5040)
    k.adjust(running=["a"], now=200.0)  # the same sandbox, memory as it was: it rests on
    assert (sysfs / "run").read_text() == "0" and k.resting


def test_a_scan_that_still_merges_keeps_ksmd_scanning_up_to_four(tmp_path: Path) -> None:
    sysfs = _sysfs(tmp_path)
    k = ksm.Ksm(Settings(state_dir=tmp_path, ksm="on", ksm_idle_s=0), sysfs, _meminfo(tmp_path, 800_000))
    k.start()
    k.adjust(running=["a"], now=100.0)
    for i in range(4):  # every scan 2 % more: the first count, then three scans
        _counters(sysfs, i, int(1000 * 1.02**i))
        k.adjust(running=["a"], now=105.0 + 5 * i)
        assert (sysfs / "run").read_text() == "1" and not k.resting
    _counters(sysfs, 4, int(1000 * 1.02**4))  # the fourth: churn that never settles is not worth a scanning ksmd
    k.adjust(running=["a"], now=125.0)
    assert (sysfs / "run").read_text() == "0" and k.resting and "4 full scans" in (k.ksmd or "")


@pytest.mark.parametrize("running", [["a", "b"], ["b"]])
def test_a_sandbox_start_wakes_a_resting_ksmd_and_settling_counts_again(tmp_path: Path, running: list[str]) -> None:
    k, sysfs = _resting_server(tmp_path)
    assert k.resting
    k.adjust(running=running, now=120.0)  # a create or a fork child: an ID not running before
    assert (sysfs / "run").read_text() == "1" and k.scanning and not k.resting
    _counters(sysfs, 13, 5040)
    k.adjust(running=running, now=125.0)  # before "b" can be marked: no rest
    _counters(sysfs, 20, 5040)
    k.adjust(running=running, now=130.0)
    assert not k.resting  # three more scans are needed after b's wait
    for now, scans in ((135, 21), (140, 22)):
        _counters(sysfs, scans, 5040)
        k.adjust(running=running, now=now)
    assert not k.resting
    for now, scans in ((145, 23),):
        _counters(sysfs, scans, 5040)
        k.adjust(running=running, now=now)
    assert k.resting and k.stats()["rests"] == 2


def test_a_resumed_sandbox_counts_as_a_start(tmp_path: Path) -> None:
    k, sysfs = _resting_server(tmp_path)
    k.adjust(running=[], now=120.0)  # "a" paused: nothing new
    assert k.resting
    k.adjust(running=["a"], now=125.0)  # resumed: its processes restored, new pages
    assert (sysfs / "run").read_text() == "1" and not k.resting


def test_memory_that_creeps_down_while_resting_wakes_ksmd(tmp_path: Path) -> None:
    k, sysfs = _resting_server(tmp_path)
    _meminfo(tmp_path, 760_000)  # 4 % of MemTotal less (first commands' copy-on-write): rests on
    k.adjust(running=["a"], now=120.0)
    assert k.resting
    _meminfo(tmp_path, 740_000)  # 6 % less: sandboxes idle only now, pages commands wrote
    k.adjust(running=["a"], now=125.0)
    assert (sysfs / "run").read_text() == "1" and k.scanning and not k.resting


def test_another_server_that_rested_ksmd_does_not_stop_ours(tmp_path: Path) -> None:
    sysfs = _sysfs(tmp_path)
    k = ksm.Ksm(Settings(state_dir=tmp_path, ksm="on", ksm_idle_s=5), sysfs, _meminfo(tmp_path, 800_000))
    k.start()
    k.adjust(running=["a"], now=100.0)
    (sysfs / "run").write_text("0\n")  # the host's other aenv server: its own sandboxes settled
    k.adjust(running=["a"], now=105.0)
    assert (sysfs / "run").read_text() == "1" and k.scanning


def test_without_ksm_rest_ksmd_scans_on(tmp_path: Path) -> None:
    sysfs = _sysfs(tmp_path)
    k = ksm.Ksm(Settings(state_dir=tmp_path, ksm="on", ksm_idle_s=0, ksm_rest=False), sysfs,
                _meminfo(tmp_path, 800_000))
    k.start()
    for i in range(10):
        _counters(sysfs, i, 1000)
        k.adjust(running=["a"], now=100.0 + 5 * i)
    assert (sysfs / "run").read_text() == "1" and k.stats()["rest"] is False and k.stats()["rests"] == 0


def test_a_start_while_memory_is_plentiful_leaves_a_merge_below_ksmd_paused(tmp_path: Path) -> None:
    k, sysfs = _resting_server(tmp_path, ksm_merge_below=0.5)  # MemAvailable 80 %: ksmd is only ever paused
    assert (sysfs / "run").read_text().strip() == "0" and not k.scanning
    k.adjust(0.8, running=["a", "b"], now=120.0)
    assert (sysfs / "run").read_text().strip() == "0" and not k.scanning
    k.adjust(0.4, running=["a", "b"], now=125.0)  # memory short: scans
    assert (sysfs / "run").read_text() == "1" and k.scanning


def test_a_server_that_started_ksmd_stops_it_again_when_it_closes(tmp_path: Path) -> None:
    sysfs = _sysfs(tmp_path)
    k = ksm.Ksm(Settings(state_dir=tmp_path, ksm="on"), sysfs)
    k.start()
    assert (sysfs / "run").read_text().strip() == "1"
    k.close()
    assert (sysfs / "run").read_text().strip() == "0"


@pytest.mark.parametrize("mode", ["on", "off"])
def test_a_ksmd_that_ran_before_the_server_runs_on_after_it(tmp_path: Path, mode: str) -> None:
    sysfs = _sysfs(tmp_path)
    (sysfs / "run").write_text("1")
    k = ksm.Ksm(Settings(state_dir=tmp_path, ksm=mode), sysfs)  # type: ignore[arg-type]
    k.start()
    k.close()
    assert (sysfs / "run").read_text().strip() == "1"
