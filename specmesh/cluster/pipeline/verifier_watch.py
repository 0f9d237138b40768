"""The router's view of its verifier pool: which verifiers are alive (their heartbeat keys) and the pass
curves their heartbeats carry, read every ``liveness_every_s``.

The router reports the live verifiers in ``Info``, its gauges and the Router service's health, and feeds
their pass curves to its policy's cost model. Keys: ``pipeline/__init__.py``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import redis.asyncio as aioredis

from specmesh.cluster.backoff import REDIS_DOWN
from specmesh.cluster.pipeline.messages import QueueKeys, decode_pass_curve
from specmesh.runtime.calibration import PassCurve

log = logging.getLogger("specmesh.cluster.pipeline")


class VerifierWatch:
    def __init__(self, redis: aioredis.Redis, keys: QueueKeys, liveness_every_s: float = 0.5,
                 on_pass_curve: Callable[[list[PassCurve]], None] | None = None) -> None:
        """``on_pass_curve`` hears the live verifiers' measured pass curves whenever they change."""
        self.redis = redis
        self.keys = keys
        self.liveness_every_s = liveness_every_s
        self.on_pass_curve = on_pass_curve
        self.alive: set[str] = set()
        self.pass_curves: dict[str, PassCurve] = {}  # live verifier -> its pass curve
        self.looked = asyncio.Event()  # ``alive`` has been read from Redis at least once
        self._task: asyncio.Task | None = None
        self._stopping = asyncio.Event()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        self._stopping.set()
        if self._task is not None:
            await self._task

    async def _watch(self) -> None:
        while not self._stopping.is_set():
            try:
                members = [m.decode() for m in await self.redis.smembers(self.keys.members)]
                beats = await asyncio.gather(*(self.redis.get(self.keys.alive(m)) for m in members))
                self.alive = {m for m, beat in zip(members, beats) if beat is not None}
                self._learn_curves({m: decode_pass_curve(b) for m, b in zip(members, beats) if b is not None})
                self.looked.set()
            except REDIS_DOWN:
                self.alive = set()
            try:
                await asyncio.wait_for(self._stopping.wait(), self.liveness_every_s)
            except asyncio.TimeoutError:
                pass

    def _learn_curves(self, curves: dict[str, PassCurve | None]) -> None:
        curves = {m: c for m, c in curves.items() if c is not None}
        if curves != self.pass_curves:
            self.pass_curves = curves
            if self.on_pass_curve is not None and curves:
                self.on_pass_curve([curves[m] for m in sorted(curves)])
