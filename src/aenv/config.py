"""Server configuration: one TOML file plus ``AENV_*`` environment overrides.

Precedence (last wins): built-in defaults < TOML file (``AENV_CONFIG`` or ``<state_dir>/config.toml``) <
``AENV_<FIELD>`` environment variables < explicit CLI flags. ``aenv serve --help`` lists the fields.
"""

from __future__ import annotations

import contextlib
import json
import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from aenv.teams import Quota, TeamDirectory, TeamSpec


def _is_root() -> bool:
    return os.geteuid() == 0


def default_state_dir() -> Path:
    """Where sandboxes, the database and templates live (``/var/lib/aenv`` as root)."""
    if _is_root():
        return Path("/var/lib/aenv")
    return Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local/share")) / "aenv"


def default_cache_dir() -> Path:
    """Where rebuildable artefacts live: tools bundle, base rootfs, kernels, image layers."""
    if _is_root():
        return Path("/var/cache/aenv")
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "aenv"


class Settings(BaseModel):
    """Every knob of the server. Unknown keys are rejected so typos surface at start-up."""

    model_config = ConfigDict(extra="forbid")

    state_dir: Path = Field(default_factory=default_state_dir, description="state: DB, sandboxes, templates")
    cache_dir: Path = Field(default_factory=default_cache_dir, description="rebuildable artefacts")
    host: str = Field("127.0.0.1", description="bind address; anything else without api_keys is loudly warned")
    port: int = Field(8000, ge=0, le=65535)
    runtime: Literal["ns", "vm", "auto"] = Field(
        "auto", description="sandbox runtime: ns, vm, or auto (vm where the host has hardware KVM, else ns)"
    )
    default_timeout: int = Field(300, gt=0, description="sandbox TTL in seconds when the client gives none")
    max_timeout: int = Field(86400, gt=0, description="largest TTL a client may ask for, seconds")
    api_keys: list[str] = Field(default_factory=list, description="accepted X-API-KEY values; empty = no auth")
    max_sandboxes: int = Field(1000, gt=0, description="admission limit on live sandboxes")
    max_concurrent_starts: int = Field(32, gt=0, description="creates starting at once; more wait in the admission queue")
    admission_queue: int = Field(1024, ge=0, description="creates that may wait for a start slot; past it 429 (reason capacity)")
    admission_wait: float = Field(
        30.0, gt=0, description="seconds a create waits for a start slot before 429 (reason capacity); below the SDKs' 60 s request timeout"
    )
    team_concurrent_starts: int | None = Field(
        default=None, gt=0, description="with several teams, the starts one team may have at once (the other "
        "slots stay free for the other teams); unset = 2 per CPU (a start is CPU-bound: more at once only adds latency)"
    )
    team_burst_yield: bool = Field(
        True, description="with several teams, a team's burst of starts runs at the lowest CPU weight while another "
        "team has a create in flight (ns), so that create is served at about its usual latency"
    )
    admission_group_key: str = Field(
        "run", description="metadata key whose value, with the API key, makes a fair-share group of the admission queue"
    )
    key_quotas: dict[str, int] = Field(
        default_factory=dict, description="live + starting sandboxes per API key (key or sha256:<hex> = N); past it 429 (reason quota)"
    )
    default_key_quota: int | None = Field(None, gt=0, description="that quota for keys not in key_quotas; unset = none")
    teams: dict[str, TeamSpec] = Field(
        default_factory=dict, description='teams of keys with their quotas, e.g. {"research": {"keys": ["sha256:<hex>"], '
        '"max_sandboxes": 200}}; a key of api_keys in no team is a team of its own'
    )
    admin_keys: list[str] = Field(default_factory=list, description="keys that see and act on every team's objects")
    team_quota: Quota = Field(default_factory=lambda: Quota(), description="limits of every team that sets none of its own")
    webhook_urls: list[str] = Field(
        default_factory=list, description="lifecycle webhook receivers (created, paused, resumed, forked, killed)"
    )
    webhook_secret: str | None = Field(None, description="HMAC-SHA256 key of the webhooks' X-Aenv-Signature")
    webhook_attempts: int = Field(8, gt=0, description="deliveries tried this often (backoff 1 s, 2 s, 4 s, ...)")
    webhook_backoff: float = Field(1.0, gt=0, description="first retry delay of a webhook delivery, seconds")
    pool_size: int = Field(2, ge=0, description="pre-started sandboxes kept ready per hot template")
    ksm: Literal["auto", "on", "off"] = Field(
        "auto", description="kernel same-page merging of sandboxes' identical memory (host ksmd): auto = only "
        "while the server has at most one API key (a merged page is a timing side channel between tenants), "
        "on = always, off = never (the host's ksmd is left alone)"
    )
    ksm_max_cpu: int = Field(10, ge=1, le=100, description="when merging: the most ksmd may use, % of one CPU (the kernel's scan-time advisor)")
    ksm_idle_s: float = Field(
        5.0, ge=0, description="when merging (ns): a sandbox's processes become mergeable once envd has served no "
        "request for this long after the hand-out; pooled and busy sandboxes are never merged (a merged page "
        "written again costs a copy-on-write fault: ~3 ms on a create and its first command, 2 cores). 0 = "
        "from the start"
    )
    ksm_merge_below: float = Field(
        1.0, gt=0, le=1, description="when merging: ksmd scans only while MemAvailable is below this share of "
        "MemTotal and is paused (merged pages kept) once it is 0.1 above; 1 = always. Merging costs a create "
        "and its first command ~3 ms on 2 cores (copy-on-write of merged pages, ksmd's CPU): e.g. 0.5 pays "
        "that only once memory is short"
    )
    ksm_rest: bool = Field(
        True, description="when merging: ksmd rests (run = 0, merged pages kept) once three full scans after the last "
        "sandbox start (and its ksm_idle_s) merged under 1 % more pages (four at most), and scans again on the next start or "
        "once MemAvailable has fallen 5 % of MemTotal since: while there is nothing new to merge, a scanning "
        "ksmd costs CPU and the commands' latency tail (commands.run in 400 merged sandboxes, 4 at once, 2 "
        "cores: p99 90 ms with ksmd scanning, 33 ms with it stopped)"
    )
    stop_sandboxes_on_exit: bool = Field(
        False, description="a graceful stop (SIGTERM, Ctrl-C) also kills every sandbox, paused ones included: for "
        "throwaway servers (tests, benchmarks, CI). Off by default: sandboxes outlive a server so that a restart "
        "or an upgrade adopts them"
    )
    reaper_interval: float = Field(1.0, gt=0, description="seconds between TTL sweeps")
    gone_retention: float = Field(
        7 * 86400.0, gt=0, description="seconds a killed or expired sandbox's ID keeps answering why it ended"
    )
    default_cpu_count: int = Field(2, gt=0)
    default_memory_mb: int = Field(512, gt=0)
    default_disk_mb: int = Field(2048, gt=0)
    ns_disk_quota: bool = Field(
        True, description="ns: enforce each sandbox's disk size (a btrfs volume on the sandboxes dir, one subvolume + quota per sandbox)"
    )
    volume_size_mb: int = Field(
        10240, gt=0, description="E2B volumes: each volume's size limit (its quota subvolume's qgroup limit on the sandboxes volume, both runtimes)"
    )
    max_volumes: int = Field(100, gt=0, description="E2B volumes per team")
    ns_volume_mb: int = Field(0, ge=0, description="ns: size of that sparse volume image; 0 = min(64 GiB, half the free space)")
    ns_criu: Path | None = Field(
        None, description="ns: the CRIU (>= 4.2) for process snapshots; unset = AENV_CRIU, else <cache_dir>/criu/current/criu (scripts/build-criu.sh), else criu on PATH"
    )
    ns_userns_uid: int = Field(
        1_200_000_000, ge=0,
        description="ns: run sandboxes in a user namespace whose uids/gids 0-65535 are host uids from this one (one range for all sandboxes of a server with one team; with two or more teams each team gets a 65536-uid range of its own above it, kept in the store; files on disk keep their owners; the default lies far above the ranges useradd hands out in /etc/subuid); 0 = none. Left at the default, a host that cannot (no user namespaces, a state or cache dir on a filesystem without idmapped mounts) runs sandboxes without one and says why; set explicitly, that refuses to start"
    )
    ns_nested_containers: bool = Field(
        True,
        description="ns: let templates that run Docker inside (nested_containers, e.g. `docker`) start on this node. Such a sandbox's root holds every capability of a user namespace of its own (dockerd needs them to mount, make namespaces and set up its bridges), which widens the kernel surface it reaches (mounts of overlayfs, tmpfs, proc, sysfs and cgroups; netfilter and bridges in its own network namespace). Its egress filter stays out of its reach, in the network namespace of a router in front of it. False: such templates are refused (400) and run only on the vm runtime",
    )
    ns_fork_lazy_pages: bool = Field(
        False, description="ns: restore fork children and sandboxes made from full snapshots with CRIU lazy pages (userfaultfd: a `criu lazy-pages` daemon per child serves the dump's pages on first touch, then copies the rest); off: every page is read into place before the child runs (measured in bench/lazy_restore_probe.py)"
    )
    ns_release_paused_after: float = Field(
        300.0, ge=0, description="ns: seconds a sandbox stays paused (frozen) before its processes are saved to disk with CRIU and end; resume restores them (0 = at once; needs CRIU, else it stays frozen)"
    )
    pids_limit: int = Field(4096, gt=0, description="max processes per sandbox")
    max_metadata_bytes: int = Field(16384, gt=0, description="largest metadata map accepted at create")
    metrics_public: bool = Field(True, description="serve /metrics without an API key")
    registry_mirrors: dict[str, str] = Field(default_factory=dict, description='e.g. {"docker.io": "http://127.0.0.1:5000"}')
    insecure_registries: list[str] = Field(default_factory=list)
    layer_cache_bytes: int = Field(20 * 1024**3, gt=0, description="byte budget of the image layer cache")
    lazy_images: bool = Field(
        False, description="start images on demand where a lazy artifact exists (FUSE reader aenv-lazyd; needs /dev/fuse and root); otherwise, and when off, images are pulled whole. Default: off on a single machine, on in cluster mode (cluster_redis set)"
    )
    lazy_cache_bytes: int = Field(10 * 1024**3, gt=0, description="byte budget of the lazy images' chunk cache (one for all images; pinned ones apart)")
    lazy_store: str | None = Field(
        None,
        description="store for lazy artifacts a registry will not take: a directory (a path or file:///dir) or an "
        "object store s3://bucket[/prefix] (endpoint, region and keys as for an s3 snapshot_store: "
        "snapshot_store_endpoint, snapshot_store_region, AENV_S3_* / AWS_* in the environment); unset = <state_dir>/lazy-store, "
        "or in cluster mode the snapshot_store when one is set (the nodes share it: an image is converted once per cluster)",
    )
    lazy_publish: bool = Field(True, description="with lazy_images: convert an image pulled whole and publish its lazy artifact (registry, else store)")
    log_level: str = Field("info")
    vm_release_paused_after: float = Field(
        60.0, ge=0, description="vm: seconds a sandbox stays paused in RAM before it is saved to disk and QEMU ends (0 = at once)"
    )
    vm_memory_low_mb: float = Field(
        512.0, ge=0, description="vm: when the host's MemAvailable falls below this many MB, paused VMs are saved to disk at once, longest-paused first, instead of after vm_release_paused_after (0 = off)"
    )
    vm_guest_aslr: bool = Field(
        False, description="vm under TCG: keep address-space randomisation in the guest (every new process then costs ~4x more: TCG retranslates its code)"
    )
    snapshot_store: str | None = Field(
        None,
        description="where snapshots are published: file:///dir or s3://bucket[/prefix]; unset = "
        "file://<state_dir>/snapshot-store, empty string = no publishing. S3 keys come only from the "
        "environment (AENV_S3_ACCESS_KEY_ID / AENV_S3_SECRET_ACCESS_KEY, else AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)",
    )
    snapshot_store_endpoint: str | None = Field(
        None, description="S3 endpoint URL for an s3:// snapshot store (e.g. http://127.0.0.1:8333); unset = AWS"
    )
    snapshot_store_region: str | None = Field(None, description="S3 region (default: AWS_REGION or us-east-1)")
    template_recheck_s: float = Field(
        5.0, ge=0,
        description="built templates shared through the store: a create of one this node holds asks the store "
        "at most this often (seconds, per template) whether a newer build replaced it (a rebuild runs on one "
        "node); 0 = at every create",
    )
    sandbox_domain: str | None = Field(
        None,
        description="the domain in create/connect/detail responses: the SDK's sbx.get_host(port) is "
        "<port>-<id>.<domain>, which the proxy routes by Host (include a non-default port: "
        "'sbx.example.com:8443'); unset = the X of a client that called api.X (only E2B_DOMAIN set), "
        "else localhost:<the port the client used>",
    )
    tls_cert: Path | None = Field(None, description="serve HTTPS with this PEM certificate (chain); needs tls_key")
    tls_key: Path | None = Field(None, description="the PEM private key of tls_cert")
    sandbox_dns: str | None = Field(
        None, description="IPv4 address of the DNS server sandboxes with internet use (their queries to "
        "10.0.2.3 are redirected to it, and the egress proxy resolves domain rules with it); unset = the "
        "host's resolver, through slirp4netns"
    )
    egress_extra_ca: Path | None = Field(
        None, description="a PEM bundle of CAs the egress proxy trusts, besides the system's, when it "
        "verifies the servers of a sandbox's network.rules domains (a private or test CA); unset = the "
        "system's only"
    )
    private_egress: list[str] = Field(
        default_factory=list, description="private destinations sandboxes may reach (docs/security.md): "
        "[named:]DEST[:PORT] with DEST an IPv4 address, CIDR or host name (resolved by the host at start), "
        "or localhost:PORT for a service on this host, reached from sandboxes at 10.0.2.2:PORT; named: = "
        "only sandboxes whose allowOut names it, else every sandbox. Empty: none (every private range and "
        "the host refused)"
    )
    egress_bandwidth_mbit: float = Field(
        0, ge=0, description="what each sandbox with internet may send, Mbit/s (10^6 bit/s; tc in its network "
        "namespace, docs/security.md: Network rate limits); a create's bandwidth.egressMbit overrides it. 0 = unlimited "
        "(max_bandwidth_mbit when that is set)"
    )
    ingress_bandwidth_mbit: float = Field(
        0, ge=0, description="what each sandbox with internet may receive from outside, Mbit/s; a create's "
        "bandwidth.ingressMbit overrides it. 0 = unlimited (max_bandwidth_mbit when that is set)"
    )
    max_bandwidth_mbit: float = Field(
        0, ge=0, description="the most a create's bandwidth.egressMbit or ingressMbit may ask for, Mbit/s; "
        "0 = no maximum (a create may also ask for 0, unlimited)"
    )
    package_mirrors: dict[str, str] = Field(
        default_factory=dict, description="the operator's package mirrors, written into every sandbox at "
        "create: pip = an index URL (PIP_INDEX_URL), npm = a registry URL (NPM_CONFIG_REGISTRY), apt = a "
        "Debian mirror URL (/etc/apt/sources.list), docker = a Docker Hub mirror (dockerd's registry-mirrors, in "
        "sandboxes with Docker inside); reachable from sandboxes through private_egress"
    )
    compose_max_bytes: int = Field(1 << 20, gt=0, description="compose sandboxes: the largest Compose file accepted, bytes")
    compose_max_services: int = Field(24, gt=0, description="compose sandboxes: the most services one project may have")
    compose_max_context_bytes: int = Field(
        64 << 20, gt=0, description="compose sandboxes: the build contexts of one request together, bytes (as uploaded, and unpacked)"
    )
    compose_startup_timeout: float = Field(
        300.0, gt=0, description="compose sandboxes: seconds from the request to every service up (image fetch, create, "
        "docker load, compose up --wait) unless the request's startupTimeout says otherwise"
    )
    ws_max_message: int = Field(
        16 * 1024 * 1024, gt=0, description="largest WebSocket message relayed into or out of a sandbox, bytes"
    )
    cluster_redis: str | None = Field(
        None, description="cluster mode: the cluster directory's Redis (redis://HOST:PORT or unix:///path): "
        "each sandbox is bound there, fenced by this node's incarnation; unset = a single machine"
    )
    cluster_node_id: str | None = Field(None, description="cluster mode: this node's name in the directory [default: the hostname]")
    cluster_url: str | None = Field(
        None, description="cluster mode: the URL gateways reach this node at [default: http://<host>:<port>]"
    )

    @field_validator("state_dir", "cache_dir", mode="after")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        return v.expanduser().absolute()

    @field_validator("lazy_store", mode="after")
    @classmethod
    def _lazy_store_url(cls, v: str | None) -> str | None:
        if v is None or not v.strip():
            return None
        v = v.strip()
        if "://" in v and not v.startswith(("file://", "s3://")):
            raise ValueError("lazy_store is a path, file:///dir or s3://bucket[/prefix]")
        if v.startswith("s3://") and (not v[5:].strip("/").partition("/")[0] or "@" in v):
            raise ValueError("lazy_store s3://bucket[/prefix]: keys go in the environment, not the URL")
        return v

    @field_validator("package_mirrors", mode="after")
    @classmethod
    def _mirror_kinds(cls, v: dict[str, str]) -> dict[str, str]:
        for kind, url in v.items():
            if kind not in MIRROR_KINDS:
                raise ValueError(f"package_mirrors: {kind!r} is not one of {', '.join(MIRROR_KINDS)}")
            if not url.startswith(("http://", "https://")) or any(c.isspace() for c in url):
                raise ValueError(f"package_mirrors: {kind} = {url!r} is not an http(s) URL")
        return v

    @model_validator(mode="after")
    def _tls_pair(self) -> Settings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: set both or neither")
        if self.egress_extra_ca is not None and not self.egress_extra_ca.is_file():
            raise ValueError(f"egress_extra_ca: {self.egress_extra_ca} is not a file")
        return self

    @model_validator(mode="after")
    def _cluster_lazy(self) -> Settings:
        """Cluster mode: lazy images on and their artifacts in the store the nodes share, unless set."""
        if not self.cluster_redis:
            return self
        if "lazy_images" not in self.model_fields_set:
            self.lazy_images = True
        if "lazy_store" not in self.model_fields_set and self.snapshot_store and self.snapshot_store.strip():
            self.lazy_store = self.snapshot_store.strip()
        return self

    @model_validator(mode="after")
    def _teams_consistent(self) -> Settings:
        self.team_directory()  # a key given to two teams, a bad team name: refused at start-up
        return self

    def team_directory(self) -> TeamDirectory:
        """Keys → teams and each team's quota (``aenv/teams.py``)."""
        defaults = self.team_quota
        if self.default_key_quota is not None and defaults.max_sandboxes is None:
            defaults = defaults.model_copy(update={"max_sandboxes": self.default_key_quota})
        return TeamDirectory(self.api_keys, self.teams, self.admin_keys, defaults, self.key_quotas)

    @model_validator(mode="after")
    def _bandwidth_under_max(self) -> Settings:
        top = self.max_bandwidth_mbit
        for name in ("egress_bandwidth_mbit", "ingress_bandwidth_mbit"):
            if top and getattr(self, name) > top:
                raise ValueError(f"{name} ({getattr(self, name)}) is above max_bandwidth_mbit ({top})")
        return self

    def default_bandwidth(self) -> tuple[float | None, float | None]:
        """(egress, ingress) Mbit/s of a sandbox whose create did not say; None: unlimited."""
        return (self.egress_bandwidth_mbit or self.max_bandwidth_mbit or None,
                self.ingress_bandwidth_mbit or self.max_bandwidth_mbit or None)

    # Derived paths, kept here so every module agrees on the layout.
    @property
    def db_path(self) -> Path:
        return self.state_dir / "aenv.db"

    @property
    def sandboxes_dir(self) -> Path:
        return self.state_dir / "sandboxes"

    @property
    def volumes_dir(self) -> Path:
        """E2B volumes, one directory each: on the sandboxes volume, so their bytes count where the
        sandboxes' do (ns: each a quota subvolume). A dot name: reconciliation never takes it for a sandbox."""
        return self.sandboxes_dir / VOLUMES_NAME

    @property
    def templates_dir(self) -> Path:
        return self.state_dir / "templates"

    @property
    def snapshots_dir(self) -> Path:
        return self.state_dir / "snapshots"

    @property
    def service_ports(self) -> tuple[int, ...]:
        """aenv's own ports, which ``private_egress`` never opens: the API's and, in a cluster, the
        directory's (Redis) and this node's URL's."""
        from urllib.parse import urlsplit

        ports = {self.port}
        for url in (self.cluster_redis, self.cluster_url):
            if url and url.startswith(("redis://", "rediss://", "http://", "https://")):
                with contextlib.suppress(ValueError):
                    parts = urlsplit(url)
                    ports.add(parts.port or {"redis": 6379, "rediss": 6379, "http": 80, "https": 443}[parts.scheme])
        return tuple(sorted(ports))

    @property
    def snapshot_store_url(self) -> str | None:
        """The snapshot repository's URL, or None when publishing is off (``snapshot_store = ""``)."""
        if self.snapshot_store is None:
            return f"file://{self.state_dir / 'snapshot-store'}"
        return self.snapshot_store.strip() or None


VOLUMES_NAME = ".volumes"  # under the sandboxes dir (``Settings.volumes_dir``)
MIRROR_KINDS = ("pip", "npm", "apt", "docker")  # ``package_mirrors``' keys

_LIST_FIELDS = {"api_keys", "admin_keys", "insecure_registries", "webhook_urls", "private_egress"}
_DICT_FIELDS = {"registry_mirrors", "key_quotas", "package_mirrors"}
_JSON_FIELDS = {"teams", "team_quota"}


def _env_overrides(environ: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in Settings.model_fields:
        raw = environ.get(f"AENV_{name.upper()}")
        if raw is None:
            continue
        if name in _JSON_FIELDS:
            out[name] = json.loads(raw)  # AENV_TEAMS='{"research": {"keys": [...]}}'
        elif name in _LIST_FIELDS:
            out[name] = [p.strip() for p in raw.split(",") if p.strip()]
        elif name in _DICT_FIELDS:
            # "docker.io=http://127.0.0.1:5000,ghcr.io=http://..."
            pairs = [p.split("=", 1) for p in raw.split(",") if "=" in p]
            out[name] = {k.strip(): v.strip() for k, v in pairs}
        else:
            out[name] = raw
    return out


def load_settings(overrides: dict[str, Any] | None = None, environ: dict[str, str] | None = None) -> Settings:
    """Build Settings from file + environment + explicit overrides (CLI flags)."""
    env = dict(os.environ if environ is None else environ)
    data: dict[str, Any] = {}
    env_data = _env_overrides(env)
    state_dir = Path(env_data.get("state_dir") or (overrides or {}).get("state_dir") or default_state_dir())
    config_file = Path(env["AENV_CONFIG"]) if env.get("AENV_CONFIG") else state_dir / "config.toml"
    if config_file.is_file():
        with config_file.open("rb") as fh:
            data.update(tomllib.load(fh))
    data.update(env_data)
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return Settings(**data)
