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
