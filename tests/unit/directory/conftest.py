"""The directory tests run against a real redis-server (skipped where it is not installed)."""

from tests.fixtures.redis import redis_server, redis_url  # noqa: F401
