"""Exponential back-off, the one policy every retry in the cluster follows.

A part that lost a dependency (Redis, a drafter, the Kubernetes API) waits ``next()`` seconds before
trying again, each wait ``multiplier`` times the last up to ``max_s``, and calls ``reset()`` once a
call went through. Two presets name the cluster's two kinds of waits: reconnecting to Redis, which
the request path waits on (short, capped at a second), and giving up on a drafter or an API server
for a while (longer, capped at ten seconds). (The SDK's gRPC retries are grpc's own service-config
policy, ``specmesh/client.py``.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from specmesh.errors import Unavailable

REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)  # Redis unreachable, for now


def queue_unreachable(exc: BaseException) -> Unavailable:
    """The client's error for a Redis call that failed; where Redis is and why goes to the log only."""
    logging.getLogger("specmesh.cluster.pipeline").warning("the pipeline queue (Redis) is unreachable: %s", exc)
    return Unavailable("the pipeline queue is unreachable; retry later")


@dataclass
class Backoff:
    initial_s: float = 0.05
    max_s: float = 1.0
    multiplier: float = 2.0
    _delay_s: float = field(default=-1.0, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError(f"back-off needs 0 < initial_s <= max_s, got {self.initial_s} and {self.max_s}")
        if self.multiplier < 1:
            raise ValueError(f"back-off multiplier must be >= 1, got {self.multiplier}")
        self.reset()

    @property
    def delay_s(self) -> float:
        """The wait that ``next()`` will return."""
        return self._delay_s

    def next(self) -> float:
        """The wait before the next try; the one after it is longer (up to ``max_s``)."""
        delay = self._delay_s
        self._delay_s = min(delay * self.multiplier, self.max_s)
        return delay

    def reset(self) -> None:
        """A call went through: the next failure waits ``initial_s`` again."""
        self._delay_s = self.initial_s


def redis_reconnect() -> Backoff:
    """Reconnecting to the pipeline queue's Redis: 0.05 s, doubling, at most 1 s."""
    return Backoff(initial_s=0.05, max_s=1.0)


def unreachable_node(max_s: float = 10.0) -> Backoff:
    """Leaving a drafter or an API server alone before trying it again: 0.5 s, doubling, at most ``max_s``."""
    return Backoff(initial_s=min(0.5, max_s), max_s=max_s)
