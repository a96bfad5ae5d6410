"""Compose files of compose sandboxes: what is accepted, what is refused (each a 400 naming the field),
interpolation done once, and the file written back for the sandbox's Compose."""

from __future__ import annotations

import pytest
import yaml

from aenv.core.compose_interp import interpolate, substitute
from aenv.core.compose_spec import ComposeLimits, PublishedPort, is_false, load_yaml, parse_project
from aenv.errors import InvalidRequest

LIMITS = ComposeLimits()

APP = """
name: shop
services:
  web:
    image: 127.0.0.1:5000/aenv/web:1
    command: ["httpd", "-f", "-p", "80"]
    environment:
      BACKEND: http://api:8080
      GREETING: ${GREETING:-hello}
    ports:
      - 8080:80
      - target: 81
        published: "8081"
    depends_on:
      api:
        condition: service_healthy
    networks: [front, default]
  api:
    build:
      context: ./api
      args: [VERSION=2]
    healthcheck:
      test: ["CMD-SHELL", "wget -q -O- http://localhost:8080/ || exit 1"]
      interval: 1s
      retries: 30
    volumes:
      - data:/var/lib/api
      - type: tmpfs
        target: /tmp
      - /scratch
    restart: no
    cap_add: [NET_ADMIN, CAP_SYS_PTRACE]
    security_opt: [no-new-privileges:true]
    x-note: anything
  cache:
    image: redis@sha256:{digest}
    profiles: [extra]
volumes:
  data: {}
networks:
  front:
    driver: bridge
x-shared: {a: 1}
""".replace("{digest}", "a" * 64)


def parse(text: str, env: dict[str, str] | None = None, contexts: frozenset[str] = frozenset(), **limits: int):
    return parse_project(text, env or {}, ComposeLimits(**limits) if limits else LIMITS, contexts=contexts)


def test_a_project_with_every_supported_part_is_accepted() -> None:
    p = parse(APP, contexts=frozenset({"api"}))
    assert p.name == "shop"
    assert list(p.services) == ["web", "api", "cache"]
    assert p.images() == ["127.0.0.1:5000/aenv/web:1", "redis@sha256:" + "a" * 64]  # the build fetches nothing
    assert p.services["api"].build is not None and p.services["api"].build.args == {"VERSION": "2"}
    assert p.ports == [PublishedPort("web", 80, 8080), PublishedPort("web", 81, 8081)]
    api = p.document["services"]["api"]
    assert api["restart"] == "no"  # YAML 1.2: `no` is a string, as Compose reads it
    assert p.document["services"]["web"]["environment"]["GREETING"] == "hello"


def test_yaml_is_read_with_yaml_1_2_scalars() -> None:
    doc = load_yaml("a: 8080:80\nb: yes\nc: 0755\nd: 0o17\ne: 2024-01-02\nf: true\ng: 1.5\nh: null\n", LIMITS)
    assert doc == {"a": "8080:80", "b": "yes", "c": 755, "d": 15, "e": "2024-01-02", "f": True, "g": 1.5, "h": None}


def test_interpolation_forms() -> None:
    env = {"A": "1", "E": ""}
    cases = {
        "$A ${A}": "1 1", "$$A": "$A", "${E:-d}": "d", "${E-d}": "", "${U-d}": "d", "${A:+alt}": "alt",
        "${E:+alt}": "", "${E+alt}": "alt", "${U:-${A}x}": "1x", "${U}": "", "x$": None,
    }
    for text, want in cases.items():
        if want is None:
            with pytest.raises(InvalidRequest, match="invalid interpolation"):
                substitute(text, env)
        else:
            assert substitute(text, env) == want, text
    with pytest.raises(InvalidRequest, match="need it"):
        substitute("${U:?need it}", env)
    assert interpolate({"k$A": ["$A"]}, env) == {"k$A": ["1"]}  # keys are not interpolated


def test_what_is_checked_is_what_runs_interpolated_values_are_checked() -> None:
    text = "services:\n  a:\n    image: busybox\n    privileged: ${P}\n"
    parse(text, {"P": "false"})
    with pytest.raises(InvalidRequest, match=r"services\.a\.privileged"):
        parse(text, {"P": "true"})
    with pytest.raises(InvalidRequest, match=r"services\.a\.network_mode"):
        parse("services:\n  a:\n    image: busybox\n    network_mode: ${M}\n", {"M": "host"})


def test_render_renames_images_points_builds_at_their_context_and_escapes_dollars() -> None:
    p = parse(APP + "", {"GREETING": "cost $5"}, contexts=frozenset({"api"}))
    digest_ref = "redis@sha256:" + "a" * 64
    text = p.render({digest_ref: "docker.io/library/redis:aenv-aaaa"}, {"api": "/var/lib/aenv-compose/build/api"})
    out = yaml.safe_load(text)
    assert out["services"]["cache"]["image"] == "docker.io/library/redis:aenv-aaaa"
    assert out["services"]["api"]["build"]["context"] == "/var/lib/aenv-compose/build/api"
    assert out["services"]["web"]["environment"]["GREETING"] == "cost $$5"  # Compose reads it as "cost $5"
    again = interpolate(load_yaml(text, LIMITS), {})
    assert again["services"]["web"]["environment"]["GREETING"] == "cost $5"
    assert again["services"]["web"]["ports"][0] == "8080:80"


def test_environment_names_without_values_come_from_compose_env_only() -> None:
    p = parse("services:\n  a:\n    image: busybox\n    environment: [A, B, C=3]\n", {"A": "1"})
    assert p.document["services"]["a"]["environment"] == {"A": "1", "C": "3"}


def svc(body: str) -> str:
    lines = "\n".join("    " + line for line in body.strip().splitlines())
    return f"services:\n  a:\n    image: busybox\n{lines}\n  b:\n    image: busybox\nvolumes:\n  data:\n"


REFUSED = [
    (svc("volumes: ['./src:/src']"), r"services\.a\.volumes\[0\]: host bind mounts"),
    (svc("volumes: ['/etc:/host-etc:ro']"), r"services\.a\.volumes\[0\]: host bind mounts"),
    (svc("volumes: ['~/x:/x']"), r"services\.a\.volumes\[0\]"),
    (svc("volumes: [{type: bind, source: /, target: /host}]"), r"services\.a\.volumes\[0\]\.type: bind"),
    (svc("volumes: ['nope:/x']"), r"volume 'nope' is not declared"),
    (svc("privileged: true"), r"services\.a\.privileged"),
    (svc("network_mode: host"), r"services\.a\.network_mode"),
    (svc("network_mode: 'container:abc'"), r"services\.a\.network_mode"),
    (svc("pid: host"), r"services\.a\.pid"),
    (svc("ipc: host"), r"services\.a\.ipc"),
    (svc("uts: host"), r"services\.a\.uts"),
    (svc("userns_mode: host"), r"services\.a\.userns_mode"),
    (svc("cgroup: host"), r"services\.a\.cgroup"),
    (svc("devices: ['/dev/kvm:/dev/kvm']"), r"services\.a\.devices"),
    (svc("cap_add: [SYS_ADMIN]"), r"services\.a\.cap_add: SYS_ADMIN"),
    (svc("cap_add: [ALL]"), r"services\.a\.cap_add: ALL"),
    (svc("security_opt: ['seccomp:unconfined']"), r"services\.a\.security_opt"),
    (svc("sysctls: {kernel.panic: 1}"), r"services\.a\.sysctls"),
    (svc("env_file: .env"), r"services\.a\.env_file"),
    (svc("extends: {file: other.yaml, service: x}"), r"services\.a\.extends"),
    (svc("runtime: nvidia"), r"services\.a\.runtime"),
    (svc("pull_policy: always"), r"services\.a\.pull_policy"),
    (svc("deploy: {replicas: 3}"), r"services\.a\.deploy\.replicas"),
    (svc("deploy: {resources: {reservations: {devices: [{capabilities: [gpu]}]}}}"), r"reservations\.devices"),
    (svc("logging: {driver: syslog}"), r"services\.a\.logging\.driver"),
    (svc("platform: linux/arm64"), r"services\.a\.platform"),
    (svc("ports: ['49983:80']"), r"services\.a\.ports\[0\]: port 49983"),
    (svc("ports: ['70000:80']"), r"services\.a\.ports\[0\]"),
    (svc("depends_on: [nobody]"), r"services\.a\.depends_on: no service 'nobody'"),
    (svc("depends_on: {b: {condition: service_magic}}"), r"depends_on\.b\.condition"),
    (svc("volumes_from: ['container:x']"), r"services\.a\.volumes_from"),
    (svc("networks: [elsewhere]"), r"services\.a\.networks"),
    (svc("frobnicate: 1"), r"services\.a\.frobnicate: not supported"),
    (svc("build: {context: 'https://github.com/x/y.git'}"), r"services\.a\.build\.context: remote"),
    (svc("build: ."), r"services\.a\.build: needs its build context"),
    (svc("build: {dockerfile_inline: 'FROM busybox', network: host}"), r"services\.a\.build\.network"),
    (svc("build: {dockerfile_inline: 'FROM busybox', ssh: [default]}"), r"services\.a\.build\.ssh"),
    ("services:\n  a:\n    command: x\n", r"services\.a: needs an image or a build"),
    ("services:\n  a:\n    image: 'Not A Ref'\n", r"services\.a\.image"),
    ("services:\n  a:\n    image: busybox\nnetworks:\n  n:\n    external: true\n", r"networks\.n\.external"),
    ("services:\n  a:\n    image: busybox\nnetworks:\n  n:\n    name: host\n", r"networks\.n\.name"),
    ("services:\n  a:\n    image: busybox\nnetworks:\n  n:\n    driver: macvlan\n", r"networks\.n\.driver"),
    ("services:\n  a:\n    image: busybox\nvolumes:\n  v:\n    external: true\n", r"volumes\.v\.external"),
    ("services:\n  a:\n    image: busybox\nvolumes:\n  v:\n    driver_opts: {type: none, o: bind, device: /}\n",
     r"volumes\.v\.driver_opts"),
    ("services:\n  a:\n    image: busybox\nsecrets:\n  s:\n    file: ./s\n", r"compose secrets"),
    ("services:\n  a:\n    image: busybox\ninclude: [other.yaml]\n", r"compose include"),
    ("services: {}\n", r"compose services: at least one"),
    ("- a\n", r"must be a mapping"),
    ("services: [\n", r"not valid YAML"),
    ("name: Not_Valid\nservices:\n  a:\n    image: busybox\n", r"compose name"),
]


@pytest.mark.parametrize(("text", "match"), REFUSED)
def test_refusals_name_the_field(text: str, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        parse(text)


def test_bounds_on_size_services_ports_and_expansion() -> None:
    with pytest.raises(InvalidRequest, match="bytes, the limit is 100"):
        parse("services:\n" + "#" * 200, max_bytes=100)
    many = "services:\n" + "".join(f"  s{i}:\n    image: busybox\n" for i in range(5))
    with pytest.raises(InvalidRequest, match="5 services, the limit is 4"):
        parse(many, max_services=4)
    with pytest.raises(InvalidRequest, match="published ports, the limit is 3"):
        parse(svc("ports: ['8000-8009:8000-8009']"), max_ports=3)
    laughs = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
        for p, c in zip("abcdefg", "bcdefgh", strict=False)) + "services: {s: {image: busybox}}\n"
    with pytest.raises(InvalidRequest, match="too many values"):
        parse(laughs)


def test_contexts_must_belong_to_services_with_a_build() -> None:
    with pytest.raises(InvalidRequest, match=r"buildContexts\.a: the service has no build"):
        parse("services:\n  a:\n    image: busybox\n", contexts=frozenset({"a"}))
    with pytest.raises(InvalidRequest, match=r"buildContexts\.zz"):
        parse("services:\n  a:\n    image: busybox\n", contexts=frozenset({"zz"}))


def test_booleans_as_compose_reads_them() -> None:
    assert all(is_false(v) for v in (None, False, 0, "false", "FALSE", "0", "no", "off", ""))
    assert not any(is_false(v) for v in (True, 1, "true", "yes", "1", "on", "anything"))
