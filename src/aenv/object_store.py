"""Object stores (obstore) from a URL: ``file:///dir``, ``memory:///``, ``s3://bucket[/prefix]``.

A shared word: the snapshot repository and the lazy images' store both keep objects in one, with the
same endpoint, region and credential sources (keys only from the environment, never from the
config file, a URL or a file aenv writes)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any


def make_store(url: str, **options: Any) -> Any:
    """An obstore store from ``file:///dir``, ``memory:///`` or ``s3://bucket[/prefix]``.

    S3 options: ``endpoint``, ``access_key_id``, ``secret_access_key``, ``session_token``, ``region``.
    Requests are retried a few times within ``retry_timeout`` seconds (default 30), not obstore's
    3 minutes: a create that looks a snapshot up must fail in reasonable time when the store is down."""
    from obstore.store import LocalStore, MemoryStore, S3Store

    if url.startswith("file://"):
        root = Path(url[len("file://") :])
        root.mkdir(parents=True, exist_ok=True)
        return LocalStore(str(root))
    if url.startswith("memory://"):
        return MemoryStore()
    if url.startswith("s3://"):
        bucket, _, prefix = url[len("s3://") :].strip("/").partition("/")
        if not bucket or "@" in bucket:
            raise ValueError("an s3 store is s3://bucket[/prefix] (keys go in the environment, not the URL)")
        endpoint = options.get("endpoint")
        client_options: Any = {"connect_timeout": timedelta(seconds=5)}
        if str(endpoint or "").startswith("http://"):
            client_options["allow_http"] = True
        extra = {  # only what is set: obstore refuses None and reads AWS_* itself for what is missing
            k: options[k] for k in ("endpoint", "access_key_id", "secret_access_key", "session_token") if options.get(k)
        }
        return S3Store(
            bucket,
            prefix=prefix or None,
            region=options.get("region") or "us-east-1",
            virtual_hosted_style_request=False,
            client_options=client_options,
            retry_config={
                "max_retries": 3,
                "retry_timeout": timedelta(seconds=float(options.get("retry_timeout", 30))),
                "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=5), "base": 2},
            },
            **extra,
        )
    raise ValueError(f"unsupported store URL {url!r} (use file://, memory:// or s3://)")


def s3_credentials(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """S3 keys from the environment only (never from the config file, never logged):
    ``AENV_S3_ACCESS_KEY_ID`` / ``AENV_S3_SECRET_ACCESS_KEY`` / ``AENV_S3_SESSION_TOKEN``, else the
    standard ``AWS_*`` names. Empty when neither is set (obstore then tries its own sources)."""
    env = os.environ if environ is None else environ
    for prefix in ("AENV_S3_", "AWS_"):
        key, secret = env.get(f"{prefix}ACCESS_KEY_ID"), env.get(f"{prefix}SECRET_ACCESS_KEY")
        if key and secret:
            out = {"access_key_id": key, "secret_access_key": secret}
            if env.get(f"{prefix}SESSION_TOKEN"):
                out["session_token"] = env[f"{prefix}SESSION_TOKEN"]
            return out
    return {}


def s3_location(endpoint: str | None, region: str | None, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Endpoint and region of an s3:// store: the configured ones, else ``AWS_ENDPOINT_URL_S3`` /
    ``AWS_ENDPOINT_URL`` and ``AWS_REGION`` / ``AWS_DEFAULT_REGION``. Not secret: fit for a file."""
    env = os.environ if environ is None else environ
    return {
        "endpoint": endpoint or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL"),
        "region": region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"),
    }


def store_from_url(
    url: str, endpoint: str | None = None, region: str | None = None, environ: Mapping[str, str] | None = None,
    **options: Any,
) -> Any:
    """``make_store`` with, for s3://, the endpoint/region above and the environment's keys."""
    if url.startswith("s3://"):
        options = {**s3_location(endpoint, region, environ), **s3_credentials(environ), **options}
    return make_store(url, **options)


def describe_store(url: str) -> str:
    """The store URL fit for a log line (no query, no user info)."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.split('?', 1)[0].rpartition('@')[2]}"
