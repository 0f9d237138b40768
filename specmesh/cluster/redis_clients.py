"""The services' Redis clients, made in one place: timeouts, and a command on a dead connection tried again
on a new one.

When Redis restarts, every pooled connection is dead and fails its next command ("Connection closed by
server"). redis-py tries such a command again only when its connection was given a retry policy, and a
client built by ``from_url`` gets none from the constructor's default: after a restart, 55 of 60 concurrent
commands failed. Two more tries per command reconnect a stale connection; a Redis that is down still fails
within the connect timeout, and the callers' own back-off (``specmesh.cluster.backoff``) takes over.
Timeouts are not retried: a command that timed out on a live server may have run (an XADD would post twice).
"""

from __future__ import annotations

from redis import Redis as BlockingRedis
from redis.asyncio import Redis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry

SOCKET_TIMEOUT_S = 5.0  # a reply slower than this: the server is gone (blocking reads block for at most 1 s)
CONNECT_TIMEOUT_S = 2.0
RETRIES = 2  # after the first try: a stale connection needs one, a restart racing the command a second
BACKOFF = dict(base=0.01, cap=0.2)  # seconds


def async_redis(url: str) -> Redis:
    """The asyncio client of every service."""
    return Redis.from_url(url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=CONNECT_TIMEOUT_S,
                          retry=AsyncRetry(ExponentialWithJitterBackoff(**BACKOFF), RETRIES,
                                           supported_errors=(RedisConnectionError,)))


def blocking_redis(url: str) -> BlockingRedis:
    """The blocking client a verifier posts results with from its pass's thread."""
    return BlockingRedis.from_url(url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                  retry=Retry(ExponentialWithJitterBackoff(**BACKOFF), RETRIES,
                                              supported_errors=(RedisConnectionError,)))
