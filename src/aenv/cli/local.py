"""The ``aenv`` commands that act on this machine rather than through a server: ``serve`` (the server
itself), ``setup``, ``doctor``, ``bench`` and ``template build``. They may import the server side; the
HTTP commands (``remote.py``) may not."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import typer

from aenv.cli.output import ExitStatus, Printer


def register(app: typer.Typer, template_app: typer.Typer) -> None:
    """Add the local commands to the ``aenv`` app."""
    panel = "This machine"
    app.command(rich_help_panel=panel)(serve)
    app.command(rich_help_panel=panel)(setup)
    app.command(rich_help_panel=panel)(doctor)
    app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, add_help_option=False,
                rich_help_panel=panel)(bench)
    template_app.command("build", rich_help_panel=panel)(template_build)


def serve(
    host: Optional[str] = typer.Option(None, help="bind address (AENV_HOST) [default: 127.0.0.1]"),
    port: Optional[int] = typer.Option(None, help="port (AENV_PORT) [default: 8000]"),
    runtime: Optional[str] = typer.Option(None, help="ns | vm | auto (AENV_RUNTIME) [default: auto]"),
    state_dir: Optional[Path] = typer.Option(None, help="state directory (AENV_STATE_DIR)"),
    pool_size: Optional[int] = typer.Option(None, help="pre-started sandboxes per hot template (AENV_POOL_SIZE)"),
    stop_sandboxes_on_exit: Optional[bool] = typer.Option(
        None, "--stop-sandboxes-on-exit/--keep-sandboxes-on-exit",
        help="on a graceful stop (SIGTERM, Ctrl-C) kill every sandbox too, for throwaway servers in tests, "
             "benchmarks and CI (AENV_STOP_SANDBOXES_ON_EXIT) [default: keep them: a restart adopts them]"),
    log_level: Optional[str] = typer.Option(None, help="debug | info | warning (AENV_LOG_LEVEL)"),
    tls_cert: Optional[Path] = typer.Option(None, help="serve HTTPS with this PEM certificate (AENV_TLS_CERT)"),
    tls_key: Optional[Path] = typer.Option(None, help="its PEM private key (AENV_TLS_KEY)"),
    sandbox_domain: Optional[str] = typer.Option(
        None, help="domain in sandbox responses: get_host(port) = <port>-<id>.<domain> (AENV_SANDBOX_DOMAIN) "
                   "[default: X for clients calling api.X, else localhost:<port>]"),
    cluster_redis: Optional[str] = typer.Option(
        None, help="cluster mode: the directory's Redis, redis://HOST:PORT (AENV_CLUSTER_REDIS)"),
    cluster_node_id: Optional[str] = typer.Option(
        None, help="cluster mode: this node's name (AENV_CLUSTER_NODE_ID) [default: the hostname]"),
    cluster_url: Optional[str] = typer.Option(
        None, help="cluster mode: the URL gateways reach this node at (AENV_CLUSTER_URL) [default: http://HOST:PORT]"),
) -> None:
    """Run the server: E2B control plane and sandbox proxy on one port.

    Every setting can also come from a TOML file (AENV_CONFIG, default <state_dir>/config.toml) or an
    AENV_<NAME> environment variable: state_dir, cache_dir, host, port, runtime, default_timeout,
    max_timeout, api_keys (comma list), max_sandboxes, max_concurrent_starts, pool_size, pids_limit,
    registry_mirrors ("docker.io=http://127.0.0.1:5000"), insecure_registries, layer_cache_bytes,
    snapshot_store (file:///dir or s3://bucket or s3://bucket/prefix; "" = off; default <state_dir>/snapshot-store),
    snapshot_store_endpoint, snapshot_store_region. S3 keys: AENV_S3_ACCESS_KEY_ID and
    AENV_S3_SECRET_ACCESS_KEY (or the standard AWS_* names), from the environment only.
    vm runtime: vm_release_paused_after (s a paused VM stays in RAM, default 60), vm_memory_low_mb (below
    this much available host memory paused VMs go to disk at once, default 512, 0 = off), vm_guest_aslr.
    Sandbox proxy: sandbox_domain, tls_cert + tls_key (HTTPS, served by hypercorn: HTTP/2 by ALPN, else HTTP/1.1), ws_max_message
    (largest WebSocket message relayed, bytes, default 16 MiB).
    Sandbox egress (docs/security.md): private_egress (comma list of DEST[:PORT] or named:DEST[:PORT], localhost:PORT =
    a host service at 10.0.2.2:PORT; empty = no private range, no host), package_mirrors
    ("pip=URL,npm=URL,apt=URL", written into every sandbox at create), sandbox_dns.
    """
    import logging

    import uvicorn

    from aenv.api.app import create_app
    from aenv.config import load_settings

    printer = Printer()
    if runtime is not None and runtime not in ("ns", "vm", "auto"):
        printer.fail(f"unknown runtime '{runtime}'", hint="use --runtime ns, vm or auto", status=ExitStatus.USAGE)
    try:
        settings = load_settings(
            {"host": host, "port": port, "runtime": runtime, "state_dir": state_dir, "pool_size": pool_size, "log_level": log_level,
             "stop_sandboxes_on_exit": stop_sandboxes_on_exit,
             "tls_cert": tls_cert, "tls_key": tls_key, "sandbox_domain": sandbox_domain, "cluster_redis": cluster_redis,
             "cluster_node_id": cluster_node_id, "cluster_url": cluster_url}
        )
    except Exception as exc:  # pydantic ValidationError, TOML errors
        printer.fail("invalid configuration", causes=[str(exc)], status=ExitStatus.USAGE)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr
    )
    if settings.host not in ("127.0.0.1", "localhost", "::1") and not settings.api_keys:
        printer.err.print(
            f"[bold yellow]WARNING:[/] binding to {settings.host} with no API keys: anyone who can reach this port "
            "can run code here. Set AENV_API_KEYS.",
            markup=True,
        )
    for path in (settings.tls_cert, settings.tls_key):
        if path is not None and not path.is_file():
            printer.fail(f"no such file: {path}", hint="--tls-cert and --tls-key name PEM files", status=ExitStatus.USAGE)
    if settings.tls_cert is not None and settings.tls_key is not None:
        from aenv.cli.tls_serve import run_tls

        run_tls(create_app(settings, freeze_startup=True), settings)  # hypercorn: HTTP/2 by ALPN, HTTP/1.1 fallback
        return
    logging.getLogger("uvicorn.error").addFilter(_DenialFilter())
    uvicorn.run(
        create_app(settings, freeze_startup=True),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        access_log=False,
        timeout_keep_alive=75,
        server_header=False,
        ws_max_size=settings.ws_max_message,
    )


class _DenialFilter:
    """uvicorn's websockets-sansio protocol logs "ASGI callable returned without completing handshake." at
    ERROR after every WebSocket refused with an HTTP response (the denial extension: the proxy's 502s and
    the sandbox's own refusals), which the client received correctly (uvicorn PR #3138). The proxy always
    accepts or refuses, so the line says nothing; it is dropped."""

    def filter(self, record: object) -> bool:
        return getattr(record, "msg", None) != "ASGI callable returned without completing handshake."


def setup(
    skip_base: bool = typer.Option(False, help="do not build the base template rootfs"),
    vm: bool = typer.Option(True, help="build the microVM guest (kernel, initramfs, tools image) where QEMU is "
                                       "installed; the first kernel build takes minutes"),
) -> None:
    """Prepare this machine: the tools bundle mounted into sandboxes, the `base` template rootfs and,
    where QEMU is installed, the microVM guest artifacts. Everything is cached; a second run is instant."""
    from aenv.config import load_settings

    printer = Printer()
    settings = load_settings()
    from aenv.runtime.tools import ensure_tools

    t0 = time.monotonic()
    tools = ensure_tools(settings)
    printer.info(f"tools bundle: {tools} ({time.monotonic() - t0:.1f}s)")
    if not skip_base:
        from aenv.images.bootstrap import ensure_base_rootfs

        t0 = time.monotonic()
        rootfs = ensure_base_rootfs(settings)
        printer.info(f"base rootfs: {rootfs} ({time.monotonic() - t0:.1f}s)")
    if vm:
        _setup_vm_guest(printer, settings.cache_dir, tools)


def _setup_vm_guest(printer: Printer, cache_dir: Path, tools: Path) -> None:
    """Kernel, initramfs and tools image for the vm runtime, so a fresh machine's first vm sandbox (and
    the vm tests, which skip without a kernel) need no build."""
    import asyncio

    from aenv.runtime.vm.accel import qemu_binary
    from aenv.runtime.vm.artifacts import ensure
    from aenv.runtime.vm.kernel import SOURCE_TARBALL, KernelBuildError, find_kernel
    from aenv.runtime.vm.kernel import build as build_kernel

    if qemu_binary() is None:
        printer.info("vm guest: skipped (QEMU not installed; the ns runtime needs none of it)")
        return
    if find_kernel(cache_dir) is None:
        if not SOURCE_TARBALL.is_file():
            printer.info(f"vm guest: skipped (no {SOURCE_TARBALL}: apt-get install linux-source-6.1)")
            return
        printer.info("vm guest: building the guest kernel from linux-source-6.1 (a few minutes, once)")
    t0 = time.monotonic()
    try:
        art = asyncio.run(ensure(cache_dir, tools))
    except KernelBuildError as exc:
        printer.fail("building the vm guest kernel failed", causes=[str(exc)],
                     hint="see the build log it names; `aenv setup --no-vm` skips it")
    printer.info(f"vm guest: kernel {art.kernel}, initramfs {art.initrd.name} ({time.monotonic() - t0:.1f}s)")
    if find_kernel(cache_dir, "docker") is None:
        printer.info("vm guest: building the docker kernel flavour for templates with Docker inside "
                     "(a few minutes, once)")
    t0 = time.monotonic()
    try:
        docker = build_kernel(cache_dir, flavour="docker")
    except KernelBuildError as exc:
        printer.fail("building the vm guest's docker kernel failed", causes=[str(exc)],
                     hint="see the build log it names; `aenv setup --no-vm` skips it")
    printer.info(f"vm guest: docker kernel {docker} ({time.monotonic() - t0:.1f}s)")


def doctor(output: str = typer.Option("text", "--output", "-o", help="text | json")) -> None:
    """What this machine can do: runtimes, accelerator, cgroups, CRIU — and why."""
    from aenv.config import load_settings
    from aenv.runtime.doctor import collect

    report = collect(load_settings())
    if output == "json":
        Printer().json(report)
        return
    p = Printer()
    for key, value in report.items():
        p.data(f"{key:>18}: {value}")


def bench(ctx: typer.Context) -> None:
    """Run the benchmark suite (same as `python -m bench`; needs a repo checkout). `aenv bench --help`."""
    root = Path(__file__).resolve().parents[3]
    if (root / "bench" / "__main__.py").is_file() and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        from bench.__main__ import main as bench_main
    except ImportError as exc:
        Printer().fail("the benchmark suite is not importable", causes=[str(exc)],
                       hint="run it from a checkout of the aenv repository: `python -m bench`")
    raise typer.Exit(bench_main(list(ctx.args), prog="aenv bench"))


def template_build(
    name: str = typer.Argument(..., help="what to build: code-interpreter or docker"),
    register: bool = typer.Option(True, help="register the template in this machine's state dir"),
    with_languages: bool = typer.Option(
        True, "--with-languages/--python-only",
        help="code-interpreter: R (IRkernel) and Node.js (javascript, typescript) in the template: Debian packages, ~160 MB"),
) -> None:
    """Build a built-in template on this machine (needs root and the Debian mirror), then register it.

    `code-interpreter` makes `code-interpreter-v1` (the default of `e2b-code-interpreter`; needs PyPI too): a
    Debian rootfs (the base's packages plus R, IRkernel and Node.js) with overlay layers holding ipykernel,
    jupyter_client, matplotlib, numpy, pandas and the TypeScript compiler, and the service on port 49999.
    Languages: python, javascript, typescript, r and bash (python and bash with --python-only).

    `docker` makes `docker`: the base's packages plus Debian's docker.io and iptables, and Compose v2 (the
    `docker compose` plugin, from trixie's docker-compose package); dockerd starts with the sandbox, which
    runs Docker inside (`docker run`, `docker build`, `docker compose up`; see docs/docker.md).

    Layers are cached under <cache_dir>/rootfs/; a running server sees the template at once.
    """
    from aenv.config import load_settings
    from aenv.core.templates import TemplateCatalog
    from aenv.images import docker_template
    from aenv.images.errors import BootstrapError
    from aenv.images.interpreter import TEMPLATE_NAME, ensure_interpreter_layers
    from aenv.store.sqlite import Store, TemplateRow

    printer = Printer()
    kinds = {"code-interpreter": TEMPLATE_NAME, TEMPLATE_NAME: TEMPLATE_NAME,
             "docker": docker_template.TEMPLATE_NAME}
    if name not in kinds:
        printer.fail(f"unknown built-in template '{name}'", hint="available: code-interpreter, docker",
                     status=ExitStatus.USAGE)
    settings = load_settings()
    t0 = time.monotonic()

    def log(line: str) -> None:
        printer.err.print(line, markup=False, highlight=False)

    try:
        if kinds[name] == TEMPLATE_NAME:
            layers = ensure_interpreter_layers(settings, with_languages=with_languages, log=log)
            registrar: Callable[[TemplateCatalog], TemplateRow] = lambda c: c.register_interpreter(layers)  # noqa: E731
        else:
            docker_layers = docker_template.ensure_docker_layers(settings, log=log)
            registrar = lambda c: c.register_docker(docker_layers)  # noqa: E731
    except BootstrapError as exc:
        printer.fail(f"building {kinds[name]} failed", causes=[str(exc)],
                     hint="run as root with the Debian mirror (and, for code-interpreter, PyPI) reachable")
    printer.info(f"layers ready in {time.monotonic() - t0:.1f}s")
    if register:
        settings.state_dir.mkdir(parents=True, exist_ok=True)
        row = registrar(TemplateCatalog(settings, Store(settings.db_path)))
        printer.data(f"template {row.alias} registered ({row.size_bytes / 1e6:.0f} MB of packages)")
