"""The routing policy between routers and verifiers: learnt by the routers from what the verifiers observe,
applied by the verifiers, where the drafts meet.

The verifiers run every request's steps, so they see how each drafter's tree, and each team's fused tree,
fared level by level; the routers own the routing policy. What goes round is the per-kind table of
``expertise.Expertise``: decayed per-level hits and attempts per (request kind, drafter) and per (kind,
team), from which routing (which drafters a step asks) and the fusion's trust weights are read.

1. **Report.** A verifier's ``Expertise`` keeps a ``Tally`` of the per-level counts its steps observed.
   At most every ``REPORT_EVERY_S``, and in the step that ends a request (so an idle verifier owes
   nothing), the counts ride on one router's ``StepOutputs`` message of that step (``RoutingReport``): no
   Redis command of their own.
2. **Learn and publish.** A router adds each report to its own table at once (``RoutingPublisher.receive``)
   and, every ``SNAPSHOT_EVERY_S`` when its table changed, publishes it with its routing settings
   (``--max-drafters``, ``--explore``) as a signed ``RoutingSnapshot`` on the pool's routing key
   (``specmesh:P:routing``, a hash: version, snapshot, tag).
3. **Apply.** A verifier reads the key about every ``SNAPSHOT_EVERY_S`` (one HMGET a second, not on its
   admissions round trip: there a Redis user made before the key existed would fail the whole read) and
   applies a snapshot that is validly signed, sound and newer than the one it has: its table becomes the
   snapshot's (the records of the drafters it has), plus its counts not reported yet, and it routes by
   the snapshot's settings. Until a first snapshot it routes by its own learning. Each request's own
   records stay where its steps run. A forged or unreadable snapshot is refused and counted, once however
   often it is read.

Several routers, and restarts: the snapshots form one lineage. A router adopts the newest snapshot it
reads (its table becomes the snapshot's plus the counts reported to it since it last published), and
publishes only if the key still holds what it read (compare-and-set, one script); else it adopts the newer
one on its next round and tries again. A verifier reports each count to one router, so each count enters
the lineage once, whichever router took it. A version is the publication's unix time in ms, or one more
than the last where that is more. Each publication carries its router's routing settings, so the routers
of a pool should agree on them (a router started with new ones brings them with its first publication).

A report lost with its message (Redis down, a verifier fenced) costs half a second's learning, never a
token: the policy chooses which drafters draft and how much each is trusted; verification is unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Callable

from google.protobuf.message import DecodeError
from redis.exceptions import NoPermissionError

from specmesh.cancellation import raise_if_cancelled
from specmesh.cluster.backoff import REDIS_DOWN
from specmesh.cluster.metrics import RouterMetrics, VerifierMetrics
from specmesh.cluster.pipeline.messages import ROUTING, QueueKeys, QueueSigner
from specmesh.speculation.expertise import Expertise, LevelCounts, LevelRecord, HitRecord, RoutingConfig, Tally
from specmesh.tree import MAX_TREE_NODES
from specmesh.v1 import verifier_pb2

log = logging.getLogger(__name__)

REPORT_EVERY_S = 0.5  # a verifier's counts, at most this often (and when a request ends)
SNAPSHOT_EVERY_S = 1.0  # a router's publication round, and a verifier's read of the key
MAX_RECORDS = 4096  # (kind, drafter or team) records in a report or a snapshot
MAX_NAME = 256  # characters of a kind, a drafter's name or a team's key
MAX_COUNT = 1e12

# Compare-and-set: the snapshot is written only if the key's version is still the one the router read
# ('' none). KEYS: the routing key. ARGV: the version read, the new version, the snapshot, its tag.
PUBLISH = """
local current = redis.call('HGET', KEYS[1], 'version') or ''
if current ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'version', ARGV[2], 'snapshot', ARGV[3], 'tag', ARGV[4])
return 1
"""


def report_to_pb(tally: Tally) -> verifier_pb2.RoutingReport:
    return verifier_pb2.RoutingReport(records=[
        verifier_pb2.RoutingRecord(kind=kind, name=name, team=team, hits=counts.hits, attempts=counts.attempts)
        for team, entries in ((False, tally.drafters), (True, tally.teams)) for (kind, name), counts in entries.items()])


def snapshot_to_pb(expertise: Expertise, version: int, router_id: str) -> verifier_pb2.RoutingSnapshot:
    drafters, teams = expertise.shared()
    records = [verifier_pb2.RoutingRecord(kind=kind, name=name, team=team, hits=[r.hits for r in record.levels],
                                          attempts=[r.attempts for r in record.levels])
               for team, table in ((False, drafters), (True, teams)) for (kind, name), record in table.items()]
    return verifier_pb2.RoutingSnapshot(version=version, router_id=router_id, records=records,
                                        max_drafters=expertise.config.max_drafters, explore=expertise.config.explore)


def _checked(records) -> list[verifier_pb2.RoutingRecord]:
    """``records`` if every one is sound, else ValueError: a signed message is still not trusted to be."""
    if len(records) > MAX_RECORDS:
        raise ValueError(f"{len(records)} records; at most {MAX_RECORDS}")
    for record in records:
        if not (0 < len(record.kind) <= MAX_NAME and 0 < len(record.name) <= MAX_NAME):
            raise ValueError("a record's kind or name is empty or too long")
        if len(record.hits) != len(record.attempts) or len(record.attempts) > MAX_TREE_NODES:
            raise ValueError(f"record {record.kind}/{record.name} has {len(record.hits)} hits for "
                             f"{len(record.attempts)} levels (at most {MAX_TREE_NODES})")
        for hits, attempts in zip(record.hits, record.attempts):
            if not 0.0 <= hits <= attempts * (1 + 1e-9) <= MAX_COUNT:  # NaN fails every comparison
                raise ValueError(f"record {record.kind}/{record.name}: {hits} hits of {attempts} attempts")
    return list(records)


def tally_from_pb(report: verifier_pb2.RoutingReport) -> Tally:
    tally = Tally()
    for record in _checked(report.records):
        entries = tally.teams if record.team else tally.drafters
        entries.setdefault((record.kind, record.name), LevelCounts()).merge(
            LevelCounts(list(record.hits), list(record.attempts)))
    return tally


def table_from_pb(snapshot: verifier_pb2.RoutingSnapshot, known: set[str] | None = None):
    """The snapshot's (kind, drafter) and (kind, team) records; with ``known``, only those whose drafters
    (every member of a team) are among these names."""
    drafters: dict[tuple[str, str], LevelRecord] = {}
    teams: dict[tuple[str, str], LevelRecord] = {}
    for record in _checked(snapshot.records):
        names = record.name.split("+") if record.team else [record.name]
        if known is not None and not all(name in known for name in names):
            continue
        levels = [HitRecord(hits, attempts) for hits, attempts in zip(record.hits, record.attempts)]
        (teams if record.team else drafters)[(record.kind, record.name)] = LevelRecord(levels)
    return drafters, teams


class Refused(ValueError):
    """A snapshot not to trust, and why."""

    def __init__(self, reason: str, why: str) -> None:
        super().__init__(f"{reason}: {why}")
        self.reason = reason  # forged or unreadable


def read_snapshot(signer: QueueSigner, payload: bytes, tag: bytes | None, known: set[str] | None = None):
    """The snapshot in the routing key's fields, with its table (``table_from_pb``); ``Refused`` where it
    is not one to trust."""
    if not signer.valid(ROUTING, payload, tag):
        raise Refused("forged", "no valid queue tag")
    try:
        snapshot = verifier_pb2.RoutingSnapshot.FromString(payload)
        config = RoutingConfig(max_drafters=snapshot.max_drafters, explore=snapshot.explore)  # checks them
        return snapshot, config, table_from_pb(snapshot, known)
    except (DecodeError, ValueError) as exc:
        raise Refused("unreadable", str(exc)) from None


class RoutingFollower:
    """A verifier's side: its steps' counts reported, the routers' snapshots applied (see the module doc)."""

    def __init__(self, expertise: Expertise, signer: QueueSigner, metrics: VerifierMetrics | None = None,
                 report_every_s: float = REPORT_EVERY_S, read_every_s: float = SNAPSHOT_EVERY_S) -> None:
        self.expertise = expertise
        if expertise.tally is None:
            expertise.tally = Tally()
        self.signer = signer
        self.metrics = metrics
        self.report_every_s, self.read_every_s = report_every_s, read_every_s
        self.version = 0  # of the snapshot applied (0: none)
        self._next_report = self._next_read = 0.0
        self._last: tuple | None = None  # the key's fields last read: the same again is not looked at (nor counted)
        self.readable = True  # its Redis user may read the routing key

    def report(self, flush: bool = False) -> verifier_pb2.RoutingReport | None:
        """The counts observed since the last report, when one is due (``flush``: now; a request ended)."""
        now = time.monotonic()
        if not self.expertise.tally or not (flush or now >= self._next_report):
            return None
        self._next_report = now + self.report_every_s
        return report_to_pb(self.expertise.tally.take())

    async def poll(self, redis, key: str, known: Callable[[], set[str]]) -> bool:
        """Read the routing key ``key`` if due (at most every ``read_every_s``) and apply what it holds (True:
        applied); ``known``: the drafters this verifier has. A Redis user without the right to read the key
        (made before it existed) is told once, and this verifier routes by its own learning."""
        now = time.monotonic()
        if not self.readable or now < self._next_read:
            return False
        self._next_read = now + self.read_every_s
        try:
            payload, tag = await redis.hmget(key, "snapshot", "tag")
        except NoPermissionError:
            log.warning("this verifier's Redis user may not read %s: it routes by its own learning alone "
                        "(specmesh redis-acl writes users that may)", key)
            self.readable = False
            return False
        return self.apply(payload, tag, known())

    def apply(self, payload: bytes | None, tag: bytes | None, known: set[str]) -> bool:
        """Apply the key's snapshot if it is sound and newer than the one applied (True); ``known``: the
        drafters whose records it takes. No snapshot yet, or the same bytes as last time: nothing."""
        if payload is None or (payload, tag) == self._last:
            return False
        self._last = (payload, tag)
        try:
            snapshot, config, (drafters, teams) = read_snapshot(self.signer, payload, tag, known)
        except Refused as exc:
            log.warning("a routing snapshot refused (%s)", exc)
            if self.metrics is not None:
                self.metrics.routing_refused.labels(exc.reason).inc()
            return False
        if snapshot.version <= self.version:
            return False
        self.expertise.config = replace(self.expertise.config, max_drafters=config.max_drafters, explore=config.explore)
        self.expertise.adopt(drafters, teams)
        self.version = snapshot.version
        if self.metrics is not None:
            self.metrics.routing_applied.set(snapshot.version)
        return True


class RoutingPublisher:
    """A router's side: the verifiers' reports learnt, the table published (see the module doc)."""

    def __init__(self, redis, keys: QueueKeys, router_id: str, expertise: Expertise, signer: QueueSigner,
                 metrics: RouterMetrics | None = None, every_s: float = SNAPSHOT_EVERY_S) -> None:
        self.redis = redis
        self.key = keys.routing
        self.router_id = router_id
        self.expertise = expertise
        if expertise.tally is None:
            expertise.tally = Tally()
        self.signer = signer
        self.metrics = metrics
        self.every_s = every_s
        self.version = 0  # of the snapshot its table was last (adopted or published; 0: none)
        self._script = redis.register_script(PUBLISH)

    def receive(self, report: verifier_pb2.RoutingReport) -> None:
        """A verifier's report (from an outputs message whose tag was checked): learnt now, published at the
        next round."""
        try:
            counts = tally_from_pb(report)
        except ValueError as exc:
            log.warning("a routing report refused: %s", exc)
            return
        self.expertise.learn(counts)
        if self.metrics is not None:
            self.metrics.routing_reports.inc()

    async def run(self) -> None:
        while True:
            try:
                await self.sync()
            except NoPermissionError:
                log.warning("this router's Redis user may not write %s: the verifiers route by their own learning "
                            "(specmesh redis-acl writes users that may)", self.key)
                return
            except REDIS_DOWN as exc:
                log.debug("routing snapshot round skipped: Redis unreachable (%s)", exc)
            except Exception:
                log.exception("the routing snapshot round failed; carrying on")
            raise_if_cancelled()  # redis-py may have swallowed it: a stopped publisher publishes no more rounds
            await asyncio.sleep(self.every_s)

    async def sync(self) -> bool:
        """One round: adopt a newer snapshot, then publish this router's table where the key lacks it.
        True: published."""
        stored, payload, tag = await self.redis.hmget(self.key, "version", "snapshot", "tag")
        snapshot = None
        if payload is not None:
            try:
                snapshot, _, table = read_snapshot(self.signer, payload, tag)
            except Refused as exc:  # overwritten below
                log.warning("the routing key holds a snapshot refused (%s)", exc)
        if snapshot is not None and snapshot.version > self.version:
            self.expertise.adopt(*table)
            self.version = snapshot.version
        if snapshot is not None and snapshot.version == self.version and not self.expertise.tally:
            return False  # the key holds this router's table (and nothing was reported since)
        return await self._publish(stored or b"")

    async def _publish(self, read_version: bytes) -> bool:
        version = max(self.version + 1, int(time.time() * 1e3))
        taken = self.expertise.tally.take()  # in this snapshot; reports arriving meanwhile stay in the tally
        payload = snapshot_to_pb(self.expertise, version, self.router_id).SerializeToString()
        published = False
        try:
            published = bool(await self._script(keys=[self.key], args=[read_version, version, payload,
                                                                        self.signer.tag(ROUTING, payload)]))
        finally:
            if not published:  # another router was first (or Redis is down): still to publish
                self.expertise.tally.merge(taken)
        if published:
            self.version = version
            if self.metrics is not None:
                self.metrics.routing_published.set(version)
        return published
