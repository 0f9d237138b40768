"""The verifier's membership of its pool: registration and heartbeats. The heartbeat key tells the routers
(``verifier_watch.py``) and the other verifiers (``engine_worker.py``, which adopt a dead one's requests)
that it is alive; its value is the verifier's pass curve.

The pipeline as a whole (keys, delivery guarantees) is described in ``specmesh.cluster.pipeline``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import redis.asyncio as aioredis

from specmesh.cluster.backoff import REDIS_DOWN
from specmesh.cluster.pipeline.messages import QueueKeys, QueueSigner, encode_pass_curve
from specmesh.cluster.service_settings import VerifierSettings
from specmesh.cluster.settings import default_of
from specmesh.runtime.calibration import PassCurve

log = logging.getLogger("specmesh.cluster.pipeline")


class QueueMember:
    """A verifier's end of the queue: its membership, its heartbeat, and the Redis client, keys and signer
    its engine worker uses."""

    def __init__(
        self, redis: aioredis.Redis, keys: QueueKeys, verifier_id: str,
        heartbeat_ttl_s: float = default_of(VerifierSettings, "heartbeat_ttl"), signer: QueueSigner | None = None, pass_curve: PassCurve | None = None,
    ) -> None:
        """``signer``: take only entries with a valid tag, and tag what it posts; ``pass_curve``: the runtime's
        measured passes, told to the routers with each heartbeat."""
        self.redis = redis
        self.keys = keys
        self.verifier_id = verifier_id
        self.signer = signer or QueueSigner()
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.beat = encode_pass_curve(pass_curve) if pass_curve is not None else b"1"

    async def register(self) -> None:
        """Join the pool: a member, alive."""
        await self.heartbeat()

    async def heartbeat(self, renew_only: bool = False) -> bool:
        """I am alive (and a member: Redis may have restarted empty since registering). ``renew_only``: only
        if the alive key is still there; False when it was not (it expired: the others may have taken over
        what this verifier held, and it must not come back to life holding it)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.sadd(self.keys.members, self.verifier_id)
        pipe.set(self.keys.alive(self.verifier_id), self.beat, px=int(self.heartbeat_ttl_s * 1000), xx=renew_only)
        return bool((await pipe.execute())[1])

    async def keep_beating(self, until: asyncio.Event, on_lapse: Callable[[], None] | None = None,
                           renew_only: bool = False) -> None:
        """The heartbeat, on its own task (a pass of any length is not a death), every third of the TTL until
        ``until`` is set, so that the others then adopt what this verifier held. ``on_lapse``: called when
        a beat came later than the TTL (stopped, SIGSTOP, or starved): the others presumed it dead meanwhile;
        ``renew_only``: also when the alive key had expired, which is then left to the worker to set again
        (``heartbeat``) once it let go of what it held."""
        last = time.monotonic()
        while not until.is_set():
            now = time.monotonic()
            if now - last > self.heartbeat_ttl_s and on_lapse is not None:
                on_lapse()
            last = now
            try:
                if not await self.heartbeat(renew_only) and on_lapse is not None:
                    on_lapse()
            except REDIS_DOWN:
                pass  # the worker's loop reconnects; the key expires meanwhile
            except Exception:
                log.exception("heartbeat failed")
            try:
                await asyncio.wait_for(until.wait(), self.heartbeat_ttl_s / 3)
            except asyncio.TimeoutError:
                pass

    async def unregister(self) -> None:
        """Stop being routed to and counted alive; what it still holds is adopted by the others."""
        await self.redis.delete(self.keys.alive(self.verifier_id))
