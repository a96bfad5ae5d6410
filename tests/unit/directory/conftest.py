"""The directory tests run against a real redis-server (skipped where it is not installed)."""

from collections.abc import Iterator

import pytest
import redis

from aenv.directory.node import connect
from tests.fixtures.redis import redis_server, redis_url  # noqa: F401


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:  # noqa: F811
    c = connect(redis_url)
    yield c
    c.close()
