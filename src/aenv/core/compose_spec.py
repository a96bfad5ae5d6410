"""The Compose projects a compose sandbox runs (pure): parsed, interpolated, checked, written back.

What is refused, and why (each a 400 naming the field): whatever would reach past the sandbox or
around the checks — host bind mounts (the sandbox has no host files to give; use a named volume),
``privileged``, host namespaces (``network_mode``/``pid``/``ipc``/``uts``/``userns_mode``/``cgroup``:
host), ``devices`` and GPU reservations, capabilities outside ``ALLOWED_CAPS``, seccomp/AppArmor
overrides, external networks and volumes and volume driver options (a ``local`` volume's options can
bind a path), files the node does not have (``env_file``, ``secrets``, ``configs``, ``include``,
``extends``), remote build contexts and pulls the sandbox cannot make (``pull_policy: always``),
replicas, and projects over ``ComposeLimits``. A key this module does not know is refused too: an
allowlist, so a Compose release that adds a way out is closed until someone looks at it.

YAML is read with YAML 1.2's core scalars, as Compose reads it (PyYAML's YAML 1.1 would turn
``8080:80`` into a number and ``no`` into false).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from aenv.core.compose_interp import escape, interpolate
from aenv.errors import InvalidRequest
from aenv.images.reference import parse_reference

ENVD_PORT = 49983  # the sandbox's own (runtime/envd_client.py): a service may not publish it
ALLOWED_CAPS = frozenset({
    # Docker's default set
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
    "NET_RAW", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
    # confined to the container's own namespaces, and common in tasks (iptables, gdb, nice)
    "NET_ADMIN", "SYS_PTRACE", "SYS_NICE", "IPC_LOCK",
})
_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")
_PROJECT = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
_FALSE = {"false", "0", "no", "n", "off", ""}
_TOP = {"version", "name", "services", "volumes", "networks"}
_TOP_REFUSED = {
    "secrets": "secrets are files on the client's machine; pass values in environment or composeEnv",
    "configs": "configs are files on the client's machine; put the content in the image or a build context",
    "include": "included files are not sent; put everything in one file",
    "models": "model runners are not available in a sandbox",
}
# Service keys taken as they are: they act inside the service's own container only.
_PLAIN = {
    "command", "entrypoint", "environment", "working_dir", "user", "hostname", "domainname", "container_name",
    "labels", "annotations", "restart", "stop_signal", "stop_grace_period", "tty", "stdin_open", "init",
    "read_only", "shm_size", "mem_limit", "mem_reservation", "memswap_limit", "mem_swappiness", "cpus",
    "cpu_shares", "cpu_quota", "cpu_period", "cpuset", "pids_limit", "ulimits", "extra_hosts", "dns",
    "dns_search", "dns_opt", "cap_drop", "expose", "tmpfs", "oom_score_adj", "oom_kill_disable", "mac_address",
    "group_add", "attach", "profiles", "healthcheck", "image", "storage_opt",
}
_SERVICE_REFUSED = {
    "devices": "devices are host hardware; a sandbox has none to give",
    "device_cgroup_rules": "device rules open host devices",
    "gpus": "GPUs are not available in a sandbox",
    "env_file": "env files are on the client's machine; put the variables in environment or composeEnv",
    "label_file": "label files are on the client's machine",
    "extends": "extends reads other files; inline the service",
    "secrets": "secrets are files on the client's machine; pass values in environment or composeEnv",
    "configs": "configs are files on the client's machine",
    "external_links": "external containers do not exist in a sandbox",
    "cgroup_parent": "the sandbox's cgroups are its own",
    "runtime": "only Docker's default runtime is installed",
    "isolation": "only Docker's default isolation exists on Linux",
    "blkio_config": "block-device limits name host devices",
    "credential_spec": "Windows only",
    "volume_driver": "only the local volume driver exists in a sandbox",
    "use_api_socket": "the Docker socket stays with the sandbox's own daemon",
}
_NAMESPACE_KEYS = ("pid", "ipc", "uts", "userns_mode", "cgroup")
_SYSCTL_PREFIXES = ("net.", "kernel.msg", "kernel.sem", "kernel.shm", "fs.mqueue.")
_LOG_DRIVERS = {"json-file", "local", "none"}
_PULL_POLICIES = {"missing", "never", "if_not_present", "build"}
_PLATFORMS = {"linux/amd64", "linux/x86_64", "amd64"}
_BUILD_KEYS = {"context", "dockerfile", "dockerfile_inline", "args", "target", "labels", "shm_size",
               "extra_hosts", "no_cache", "cache_from", "tags", "network", "pull", "platforms"}
_BUILD_REFUSED = {"ssh": "SSH agents of the client do not reach the sandbox",
                  "secrets": "build secrets are files on the client's machine",
                  "additional_contexts": "only the one uploaded context is available",
                  "privileged": "privileged builds are refused", "entitlements": "build entitlements are refused",
                  "isolation": "only Docker's default isolation exists on Linux", "cache_to": "no cache export"}
_CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}


@dataclass(frozen=True)
class ComposeLimits:
    max_bytes: int = 1 << 20
    max_services: int = 24
    max_ports: int = 128  # published ports of all services together
    max_values: int = 200_000  # YAML values after aliases are expanded


@dataclass(frozen=True)
class PublishedPort:
    service: str
    target: int
    published: int | None  # None: Docker picks one (``docker compose ps`` says which)
    protocol: str = "tcp"


@dataclass(frozen=True)
class BuildSpec:
    dockerfile: str = "Dockerfile"  # inside the uploaded context
    inline: bool = False  # ``dockerfile_inline``: no Dockerfile in the context
    args: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    image: str | None  # the image to fetch (None: built in the sandbox)
    build: BuildSpec | None = None
    ports: tuple[PublishedPort, ...] = ()


@dataclass
class ComposeProject:
    name: str
    document: dict[str, Any]  # interpolated and checked
    services: dict[str, ServiceSpec]

    @property
    def ports(self) -> list[PublishedPort]:
        return [p for s in self.services.values() for p in s.ports]

    def images(self) -> list[str]:
        """The images the node fetches, each once, in the file's order."""
        return list(dict.fromkeys(s.image for s in self.services.values() if s.image))

    def render(self, image_tags: Mapping[str, str], contexts: Mapping[str, str]) -> str:
        """The file the sandbox's Compose reads: images renamed to the tags they were loaded under
        (``image_tags``), build contexts pointed at their directories in the sandbox (``contexts``),
        every ``$`` doubled so that nothing is interpolated twice."""
        doc = dict(self.document)
        services = {}
        for name, svc in doc["services"].items():
            svc = dict(svc)
            image = svc.get("image")
            if isinstance(image, str) and image in image_tags and "build" not in svc:
                svc["image"] = image_tags[image]
            if "build" in svc:
                svc["build"] = {**svc["build"], "context": contexts[name]}
            services[name] = svc
        doc["services"] = services
        return yaml.safe_dump(escape(doc), sort_keys=False, default_flow_style=False)


class _Loader(yaml.SafeLoader):
    """YAML 1.2 core scalars: only true/false are booleans, no sexagesimal numbers, no timestamps."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if not tag.endswith((":bool", ":int", ":float", ":timestamp"))]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))
_Loader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
                              list("-+0123456789"))
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))


def _int12(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = str(loader.construct_scalar(node))
    if text.startswith("0o"):
        return int(text[2:], 8)
    return int(text, 16) if text.startswith("0x") else int(text)


_Loader.add_constructor("tag:yaml.org,2002:int", _int12)


def load_yaml(text: str, limits: ComposeLimits) -> dict[str, Any]:
    size = len(text.encode())
    if size > limits.max_bytes:
        raise InvalidRequest(f"compose: the file is {size} bytes, the limit is {limits.max_bytes}")
    try:
        doc = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader with YAML 1.2 scalars
    except yaml.YAMLError as exc:
        raise InvalidRequest(f"compose: not valid YAML: {str(exc)[:300]}") from None
    if not isinstance(doc, dict):
        raise InvalidRequest("compose: the file must be a mapping with a 'services' key")
    return doc


def parse_project(text: str, env: Mapping[str, str], limits: ComposeLimits, *,
                  contexts: frozenset[str] = frozenset()) -> ComposeProject:
    """Check a Compose file interpolated with ``env``; ``contexts``: the services a build context was
    uploaded for. Raises ``InvalidRequest`` naming the first field refused."""
    doc = interpolate(load_yaml(text, limits), env, limits.max_values)
    for key in doc:
        if str(key).startswith("x-") or key in _TOP:
            continue
        raise InvalidRequest(f"compose {key}: {_TOP_REFUSED.get(str(key), 'not supported by aenv compose sandboxes')}")
    name = doc.get("name") or "aenv"
    if not isinstance(name, str) or not _PROJECT.match(name):
        raise InvalidRequest("compose name: a project name is lowercase letters, digits, '-' and '_'")
    volumes = _top_section(doc.get("volumes"), "volumes", _VOLUME_KEYS, _volume_key)
    networks = _top_section(doc.get("networks"), "networks", _NETWORK_KEYS, _network_key) | {"default"}
    services = doc.get("services")
    if not isinstance(services, dict) or not services:
        raise InvalidRequest("compose services: at least one service is required")
    if len(services) > limits.max_services:
        raise InvalidRequest(f"compose services: {len(services)} services, the limit is {limits.max_services}")
    specs = {}
    for sname, svc in services.items():
        if not isinstance(sname, str) or not _NAME.match(sname):
            raise InvalidRequest(f"compose services.{sname}: a service name is letters, digits, '.', '-' and '_'")
        if not isinstance(svc, dict):
            raise InvalidRequest(f"compose services.{sname}: must be a mapping")
        specs[sname] = _service(sname, svc, env, volumes, networks, set(services), sname in contexts)
    ports = [p for s in specs.values() for p in s.ports]
    if len(ports) > limits.max_ports:
        raise InvalidRequest(f"compose services: {len(ports)} published ports, the limit is {limits.max_ports}")
    extra = sorted(contexts - {n for n, s in specs.items() if s.build})
    if extra:
        raise InvalidRequest(f"buildContexts.{extra[0]}: no service of that name has a build")
    return ComposeProject(name, doc, specs)


def is_false(value: Any) -> bool:
    """Absent or false as Compose reads a boolean (a string after interpolation, too)."""
    if value is None or value is False or (isinstance(value, int) and not isinstance(value, bool) and value == 0):
        return True
    return isinstance(value, str) and value.strip().lower() in _FALSE


def _top_section(raw: Any, section: str, allowed: set[str], check: Callable[[str, str, Any], None]) -> set[str]:
    """The names declared under ``volumes`` or ``networks``, each one's keys checked by ``check``."""
    if raw is None:
        return set()
    if not isinstance(raw, dict):
        raise InvalidRequest(f"compose {section}: must be a mapping of names")
    for name, spec in raw.items():
        where = f"compose {section}.{name}"
        if spec is not None and not isinstance(spec, dict):
            raise InvalidRequest(f"{where}: must be a mapping")
        for key, value in (spec or {}).items():
            if key == "external" and not is_false(value):
                raise InvalidRequest(f"{where}.external: external {section} do not exist in a sandbox")
            if key not in allowed and not str(key).startswith("x-"):
                raise InvalidRequest(f"{where}.{key}: not supported by aenv compose sandboxes")
            check(where, str(key), value)
    return {str(n) for n in raw}


def _volume_key(where: str, key: str, value: Any) -> None:
    if key == "driver" and value not in (None, "local"):
        raise InvalidRequest(f"{where}.driver: only the local volume driver exists in a sandbox")
    if key == "driver_opts" and value:
        raise InvalidRequest(f"{where}.driver_opts: volume options can bind paths; use a plain named volume")


def _network_key(where: str, key: str, value: Any) -> None:
    if key == "driver" and value not in (None, "bridge", "default"):
        raise InvalidRequest(f"{where}.driver: only bridge networks are supported")
    if key == "name" and str(value) in ("host", "none", "bridge"):
        raise InvalidRequest(f"{where}.name: '{value}' is one of Docker's own networks")


_VOLUME_KEYS = {"external", "driver", "driver_opts", "name", "labels"}
_NETWORK_KEYS = {"name", "labels", "driver", "driver_opts", "internal", "attachable", "enable_ipv6", "ipam", "external"}


def _service(name: str, svc: dict[str, Any], env: Mapping[str, str], volumes: set[str], networks: set[str],
             services: set[str], has_context: bool) -> ServiceSpec:
    where = f"compose services.{name}"
    for key in svc:
        k = str(key)
        if k in _SERVICE_REFUSED and svc[key] not in (None, [], {}, ""):
            raise InvalidRequest(f"{where}.{k}: {_SERVICE_REFUSED[k]}")
        if k not in _PLAIN and k not in _CHECKS and k not in _SERVICE_REFUSED and not k.startswith("x-"):
            raise InvalidRequest(f"{where}.{k}: not supported by aenv compose sandboxes")
    ctx = _Ctx(name, where, volumes, networks, services)
    for key, check in _CHECKS.items():
        if key in svc and svc[key] is not None:
            check(ctx, svc[key])
    if isinstance(svc.get("environment"), (list, dict)):  # KEY without a value: from composeEnv, as from a shell
        svc["environment"] = _environment(svc["environment"], env)
    image = svc.get("image")
    if image is not None:
        try:
            parse_reference(str(image))
        except Exception as exc:  # noqa: BLE001 - InvalidReference's message names what is wrong
            raise InvalidRequest(f"{where}.image: {exc}") from None
    if isinstance(svc.get("build"), str):
        svc["build"] = {"context": svc["build"]}
    build = _build(svc["build"], f"{where}.build", has_context) if svc.get("build") is not None else None
    if build is None and image is None:
        raise InvalidRequest(f"{where}: needs an image or a build")
    if build is None and has_context:
        raise InvalidRequest(f"buildContexts.{name}: the service has no build")
    return ServiceSpec(name, None if build else str(image), build, tuple(ctx.ports))


@dataclass
class _Ctx:
    name: str
    where: str
    volumes: set[str]
    networks: set[str]
    services: set[str]
    ports: list[PublishedPort] = field(default_factory=list)


def _privileged(ctx: _Ctx, value: Any) -> None:
    if not is_false(value):
        raise InvalidRequest(f"{ctx.where}.privileged: privileged containers are refused")


def _network_mode(ctx: _Ctx, value: Any) -> None:
    mode = str(value)
    if mode in ("bridge", "none", "default"):
        return
    if mode.startswith("service:") and mode[8:] in ctx.services:
        return
    raise InvalidRequest(f"{ctx.where}.network_mode: '{mode}' is refused (bridge, none or service:NAME)")


def _namespace(key: str) -> Any:
    def check(ctx: _Ctx, value: Any) -> None:
        mode = str(value)
        if mode == "host" or mode.startswith("container:") or key == "userns_mode":
            raise InvalidRequest(f"{ctx.where}.{key}: '{mode}' is refused (the host's namespaces stay closed)")
        if mode.startswith("service:") and mode[8:] not in ctx.services:
            raise InvalidRequest(f"{ctx.where}.{key}: no service '{mode[8:]}'")
    return check


def _cap_add(ctx: _Ctx, value: Any) -> None:
    for cap in _strings(value, f"{ctx.where}.cap_add"):
        plain = cap.upper().removeprefix("CAP_")
        if plain not in ALLOWED_CAPS:
            raise InvalidRequest(f"{ctx.where}.cap_add: {cap} is refused (allowed: {', '.join(sorted(ALLOWED_CAPS))})")


def _security_opt(ctx: _Ctx, value: Any) -> None:
    for opt in _strings(value, f"{ctx.where}.security_opt"):
        if opt.replace("=", ":") not in ("no-new-privileges", "no-new-privileges:true"):
            raise InvalidRequest(f"{ctx.where}.security_opt: '{opt}' is refused (only no-new-privileges)")


def _sysctls(ctx: _Ctx, value: Any) -> None:
    names = value.keys() if isinstance(value, dict) else [str(v).split("=", 1)[0] for v in _strings(value, "")]
    for n in names:
        if not str(n).startswith(_SYSCTL_PREFIXES):
            raise InvalidRequest(f"{ctx.where}.sysctls: {n} is not a namespaced sysctl")


def _logging(ctx: _Ctx, value: Any) -> None:
    driver = value.get("driver") if isinstance(value, dict) else None
    if driver is not None and driver not in _LOG_DRIVERS:
        raise InvalidRequest(f"{ctx.where}.logging.driver: '{driver}' is refused ({', '.join(sorted(_LOG_DRIVERS))})")


def _platform(ctx: _Ctx, value: Any) -> None:
    if str(value) not in _PLATFORMS:
        raise InvalidRequest(f"{ctx.where}.platform: only linux/amd64 images run here")


def _pull_policy(ctx: _Ctx, value: Any) -> None:
    if str(value) not in _PULL_POLICIES:
        raise InvalidRequest(f"{ctx.where}.pull_policy: '{value}' is refused: the sandbox pulls nothing, "
                             "images come through the node's registry client")


def _scale(ctx: _Ctx, value: Any) -> None:
    if str(value) not in ("0", "1"):
        raise InvalidRequest(f"{ctx.where}.scale: one container per service")


def _deploy(ctx: _Ctx, value: Any) -> None:
    if not isinstance(value, dict):
        raise InvalidRequest(f"{ctx.where}.deploy: must be a mapping")
    if str(value.get("replicas", 1)) not in ("0", "1"):
        raise InvalidRequest(f"{ctx.where}.deploy.replicas: one container per service")
    if value.get("mode", "replicated") != "replicated":
        raise InvalidRequest(f"{ctx.where}.deploy.mode: only replicated")
    reservations = (value.get("resources") or {}).get("reservations") or {}
    if isinstance(reservations, dict) and reservations.get("devices"):
        raise InvalidRequest(f"{ctx.where}.deploy.resources.reservations.devices: devices (GPUs) are not available")


def _depends_on(ctx: _Ctx, value: Any) -> None:
    items = value.items() if isinstance(value, dict) else ((v, None) for v in _strings(value, ""))
    for dep, spec in items:
        if dep not in ctx.services:
            raise InvalidRequest(f"{ctx.where}.depends_on: no service '{dep}'")
        if isinstance(spec, dict) and spec.get("condition", "service_started") not in _CONDITIONS:
            raise InvalidRequest(f"{ctx.where}.depends_on.{dep}.condition: one of {', '.join(sorted(_CONDITIONS))}")


def _links(ctx: _Ctx, value: Any) -> None:
    for link in _strings(value, f"{ctx.where}.links"):
        if link.split(":", 1)[0] not in ctx.services:
            raise InvalidRequest(f"{ctx.where}.links: no service '{link.split(':', 1)[0]}'")


def _volumes_from(ctx: _Ctx, value: Any) -> None:
    for item in _strings(value, f"{ctx.where}.volumes_from"):
        if item.startswith("container:") or item.split(":", 1)[0] not in ctx.services:
            raise InvalidRequest(f"{ctx.where}.volumes_from: '{item}' is not a service of this project")


def _networks(ctx: _Ctx, value: Any) -> None:
    names = value.keys() if isinstance(value, dict) else _strings(value, f"{ctx.where}.networks")
    for n in names:
        if n not in ctx.networks:
            raise InvalidRequest(f"{ctx.where}.networks: '{n}' is not declared under networks")


def _each(ctx: _Ctx, key: str, value: Any) -> Iterator[tuple[str, Any]]:
    """(where, item) of a list-valued service key."""
    if not isinstance(value, list):
        raise InvalidRequest(f"{ctx.where}.{key}: must be a list")
    for i, item in enumerate(value):
        yield f"{ctx.where}.{key}[{i}]", item


def _volumes(ctx: _Ctx, value: Any) -> None:
    for where, item in _each(ctx, "volumes", value):
        if isinstance(item, dict):
            kind = item.get("type", "volume")
            if kind not in ("volume", "tmpfs"):
                raise InvalidRequest(f"{where}.type: {kind} mounts are refused (the sandbox has no host files to "
                                     "bind); use a named volume")
            if item.get("bind"):
                raise InvalidRequest(f"{where}.bind: bind options are refused")
            source = item.get("source")
        else:
            parts = str(item).split(":")
            source = parts[0] if len(parts) > 1 else None
            if source is not None and (source.startswith((".", "/", "~")) or "/" in source or "\\" in source):
                raise InvalidRequest(f"{where}: host bind mounts ('{item}') are refused: the sandbox has no host "
                                     "files; use a named volume or a build context")
        if source and source not in ctx.volumes:
            raise InvalidRequest(f"{where}: volume '{source}' is not declared under volumes")


def _ports(ctx: _Ctx, value: Any) -> None:
    for where, item in _each(ctx, "ports", value):
        if isinstance(item, dict):
            protocol = str(item.get("protocol") or "tcp")
            pairs = _port_pairs(item.get("published"), item.get("target"), where)
        else:
            text, _, protocol = str(item).partition("/")
            protocol = protocol or "tcp"
            if text.startswith("["):  # [::1]:8080:80
                text = text.partition("]:")[2]
            parts = text.split(":")
            if len(parts) > 3:
                raise InvalidRequest(f"{where}: '{item}' is not [HOST:]PUBLISHED:TARGET")
            pairs = _port_pairs(parts[-2] if len(parts) > 1 else None, parts[-1], where)
        if protocol not in ("tcp", "udp"):
            raise InvalidRequest(f"{where}: protocol '{protocol}' (tcp or udp)")
        for published, target in pairs:
            if published == ENVD_PORT:
                raise InvalidRequest(f"{where}: port {ENVD_PORT} is the sandbox's envd")
            ctx.ports.append(PublishedPort(ctx.name, target, published, protocol))


def _port_range(raw: Any, where: str) -> list[int]:
    text = str(raw).strip()
    lo, _, hi = text.partition("-")
    try:
        first, last = int(lo), int(hi or lo)
    except ValueError:
        raise InvalidRequest(f"{where}: '{raw}' is not a port or a range") from None
    if not (1 <= first <= last <= 65535) or last - first > 127:
        raise InvalidRequest(f"{where}: '{raw}' is not a port (1-65535) or a range of at most 128")
    return list(range(first, last + 1))


def _port_pairs(published: Any, target: Any, where: str) -> list[tuple[int | None, int]]:
    if target is None:
        raise InvalidRequest(f"{where}: a target port is required")
    targets = _port_range(target, where)
    if published in (None, ""):
        return [(None, t) for t in targets]
    pubs = _port_range(published, where)
    if len(targets) == 1 and len(pubs) > 1:
        return [(None, targets[0])]  # Docker picks one of the range
    if len(pubs) != len(targets):
        raise InvalidRequest(f"{where}: published and target ranges differ in length")
    return list(zip(pubs, targets, strict=True))


def _build(spec: Any, where: str, has_context: bool) -> BuildSpec:
    if not isinstance(spec, dict):
        raise InvalidRequest(f"{where}: must be a context path or a mapping")
    for key, value in spec.items():
        if key in _BUILD_REFUSED and value:
            raise InvalidRequest(f"{where}.{key}: {_BUILD_REFUSED[key]}")
        if key not in _BUILD_KEYS and key not in _BUILD_REFUSED and not str(key).startswith("x-"):
            raise InvalidRequest(f"{where}.{key}: not supported by aenv compose sandboxes")
    context = str(spec.get("context") or ".")
    if "://" in context or context.startswith(("git@", "github.com/")):
        raise InvalidRequest(f"{where}.context: remote build contexts are not fetched; upload the context")
    if str(spec.get("network") or "default") not in ("default", "bridge", "none"):
        raise InvalidRequest(f"{where}.network: '{spec['network']}' is refused (default, bridge or none)")
    if not is_false(spec.get("pull")):
        raise InvalidRequest(f"{where}.pull: the sandbox pulls nothing; base images come through the node")
    for platform in _strings(spec.get("platforms") or [], f"{where}.platforms"):
        if platform not in _PLATFORMS:
            raise InvalidRequest(f"{where}.platforms: only linux/amd64")
    inline = spec.get("dockerfile_inline") is not None
    dockerfile = str(spec.get("dockerfile") or "Dockerfile")
    if dockerfile.startswith("/") or ".." in dockerfile.split("/"):
        raise InvalidRequest(f"{where}.dockerfile: a path inside the build context")
    if not has_context and not inline:
        raise InvalidRequest(f"{where}: needs its build context uploaded (buildContexts.<service>) or dockerfile_inline")
    args = spec.get("args") or {}
    if isinstance(args, list):
        args = {str(a).partition("=")[0]: str(a).partition("=")[2] for a in args}
    return BuildSpec(dockerfile, inline, {str(k): str(v) for k, v in args.items() if v is not None})


def _environment(items: list[Any] | dict[Any, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """A service's environment as a mapping; a variable named without a value takes composeEnv's (Compose
    takes the shell's, which the node does not have), or is left out when composeEnv has none."""
    pairs = items.items() if isinstance(items, dict) else (
        (k, v if sep else None) for k, sep, v in (str(i).partition("=") for i in items))
    out: dict[str, Any] = {}
    for key, value in pairs:
        if value is not None:
            out[str(key)] = value
        elif str(key) in env:
            out[str(key)] = env[str(key)]
    return out


def _strings(value: Any, where: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise InvalidRequest(f"{where}: must be a list")
    return [str(v) for v in value]


_CHECKS = {
    "privileged": _privileged, "network_mode": _network_mode, "cap_add": _cap_add, "security_opt": _security_opt,
    "sysctls": _sysctls, "logging": _logging, "platform": _platform, "pull_policy": _pull_policy,
    "scale": _scale, "deploy": _deploy, "depends_on": _depends_on, "links": _links,
    "volumes_from": _volumes_from, "networks": _networks, "volumes": _volumes, "ports": _ports,
    "build": lambda ctx, value: None,  # checked by _build, which knows whether a context came
    **{key: _namespace(key) for key in _NAMESPACE_KEYS},
}
