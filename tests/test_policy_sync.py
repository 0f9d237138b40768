"""The routing policy shared between routers and verifiers (specmesh/cluster/pipeline/policy_sync.py): the
table's round trip through a snapshot, the routers' one lineage on a real Redis, and the whole loop with an
engine worker — its reports reach the router, whose snapshot it applies; a forged one it refuses."""

import asyncio
import math
import random
import uuid

import pytest
from cluster_parts import EnginePool, plain_greedy
from conftest import wait_until_async

from specmesh.cancellation import cancel_all
from specmesh.cluster.metrics import RouterMetrics, VerifierMetrics
from specmesh.cluster.pipeline.engine_client import EngineClient
from specmesh.cluster.pipeline.messages import ROUTING, QueueKeys, QueueSigner, new_key
from specmesh.cluster.pipeline.policy_sync import (
    RoutingFollower,
    RoutingPublisher,
    report_to_pb,
    snapshot_to_pb,
)
from specmesh.cluster.redis_clients import async_redis
from specmesh.sampling import SamplingParams
from specmesh.speculation.expertise import Expertise, LevelCounts, LevelRecord, RoutingConfig, Tally, team_key
from specmesh.speculation.policy import adaptive_policy
from specmesh.speculation.requests import Request
from specmesh.v1 import verifier_pb2

DOMAINS = {"coder": ("coding",), "writer": ("writing",), "small": ("general",), "ngram": ()}
KINDS = ("coding", "writing", "general")
PROMPT = (5, 6, 7, 5, 6, 7, 5)


def feed(router: Expertise, seed: int, steps: int = 300) -> None:
    """Steps of requests of every kind, as the adaptive policy observes them: each drafter's tree and the
    team's fused tree against the committed tokens."""
    rng = random.Random(seed)
    routes = [router.open(kind) for kind in KINDS]
    for _ in range(steps):
        route = rng.choice(routes)
        names = rng.sample(sorted(DOMAINS), 2)
        for name in names:
            attempts = rng.randint(0, 4)
            router.observe(route, name, rng.randint(0, attempts), attempts)
        attempts = rng.randint(1, 4)
        router.observe_team(route, names, rng.randint(0, attempts), attempts)


def signed(signer: QueueSigner, snapshot: verifier_pb2.RoutingSnapshot) -> tuple[bytes, bytes]:
    payload = snapshot.SerializeToString()
    return payload, signer.tag(ROUTING, payload)


def reads_alike(verifier: Expertise, router: Expertise) -> None:
    """Routing and fusion as each reads them: the same drafters, trust and team estimates for every kind."""
    assert verifier.table() == router.table() != {}
    for kind in KINDS:
        mine, theirs = verifier.open(kind), router.open(kind)
        names = sorted(DOMAINS)
        assert verifier.select(mine, names) == router.select(theirs, names)
        assert verifier.weights(mine, names) == router.weights(theirs, names)
        assert verifier.team_levels(mine, ["coder", "ngram"], 6) == router.team_levels(theirs, ["coder", "ngram"], 6)


def test_counts_taken_in_at_once_are_the_walks_one_by_one():
    """``LevelRecord.add_counts``: one walk is ``add``'s; n alike walks are n ``add``s (their decay too)."""
    one, counted = LevelRecord(), LevelRecord()
    one.add(2, 3, 0.9)
    counts = LevelCounts()
    counts.add(2, 3)
    counted.add_counts(counts, 0.9)
    assert one == counted
    walked, batched, many = LevelRecord(), LevelRecord(), LevelCounts()
    for _ in range(40):
        walked.add(1, 3, 0.95)
        many.add(1, 3)
    batched.add_counts(many, 0.95)
    for a, b in zip(walked.levels, batched.levels):
        assert math.isclose(a.hits, b.hits) and math.isclose(a.attempts, b.attempts)


def test_a_verifier_that_applies_the_routers_snapshot_routes_and_weighs_as_the_router():
    signer = QueueSigner(new_key())
    router = Expertise(DOMAINS, RoutingConfig(max_drafters=2, explore=0.0), free=("ngram",))
    feed(router, seed=1)
    verifier = Expertise(DOMAINS, free=("ngram",))
    follower = RoutingFollower(verifier, signer)
    feed(verifier, seed=2)  # its own learning before any snapshot, reported: the router has it (or not)
    follower.report(flush=True)
    assert verifier.table() != router.table()
    assert follower.apply(*signed(signer, snapshot_to_pb(router, 7, "r")), known=set(DOMAINS))
    assert (verifier.config.max_drafters, verifier.config.explore, follower.version) == (2, 0.0, 7)
    assert verifier.shared() == router.shared()
    reads_alike(verifier, router)
    # what it observes after the snapshot, not reported yet, stays through the next one
    feed(verifier, seed=3, steps=20)
    unreported = Tally()
    unreported.merge(verifier.tally)
    assert follower.apply(*signed(signer, snapshot_to_pb(router, 8, "r")), known=set(DOMAINS))
    router.learn(unreported)
    reads_alike(verifier, router)
    # an older version, or the records of drafters it does not have, are not applied
    assert not follower.apply(*signed(signer, snapshot_to_pb(Expertise(DOMAINS), 5, "r")), known=set(DOMAINS))
    partial = Expertise(DOMAINS, free=("ngram",))
    RoutingFollower(partial, signer).apply(*signed(signer, snapshot_to_pb(router, 9, "r")), known={"coder", "ngram"})
    drafters, teams = partial.shared()
    assert {name for _, name in drafters} == {"coder", "ngram"}
    assert {key for _, key in teams} <= {team_key(["coder", "ngram"])}


def test_forged_unreadable_and_unsound_snapshots_are_refused_and_counted_once():
    signer = QueueSigner(new_key())
    router = Expertise(DOMAINS)
    feed(router, seed=1)
    verifier = Expertise(DOMAINS)
    metrics = VerifierMetrics()
    follower = RoutingFollower(verifier, signer, metrics)
    good, _ = signed(signer, snapshot_to_pb(router, 7, "r"))
    nan = snapshot_to_pb(router, 8, "r")
    nan.records[0].hits[0] = math.nan
    unsound = [signed(signer, nan), signed(signer, verifier_pb2.RoutingSnapshot(version=9, max_drafters=0)),
               (b"\xff not a snapshot", signer.tag(ROUTING, b"\xff not a snapshot"))]
    for fields in [(good, signer.tag(ROUTING, b"something else")), (good, None), *unsound]:
        for _ in range(3):  # the key read again and again (once a second): counted once
            assert not follower.apply(*fields, set(DOMAINS))
    refused = lambda reason: metrics.registry.get_sample_value("specmesh_routing_snapshots_refused_total",  # noqa: E731
                                                               {"reason": reason})
    assert (refused("forged"), refused("unreadable")) == (2, 3)
    assert verifier.shared() == ({}, {}) and follower.version == 0
    assert metrics.registry.get_sample_value("specmesh_routing_snapshot_applied_version") == 0


def observed(seed: int) -> Tally:
    """What a verifier's steps observed: its tally."""
    observer = Expertise(DOMAINS)
    observer.tally = Tally()
    feed(observer, seed, steps=50)
    return observer.tally


def test_routers_publish_one_lineage_that_holds_every_report_once(redis_server):
    """Two routers, each learning from its own reports: each publishes what the key held plus its own; a
    publisher that lost the race adopts the winner's and tries again; a key that Redis lost is written anew."""
    async def main():
        redis, keys, signer = async_redis(redis_server.url), QueueKeys(pool=uuid.uuid4().hex[:8]), QueueSigner(new_key())
        metrics = RouterMetrics()
        a = RoutingPublisher(redis, keys, "router-a", Expertise(DOMAINS), signer, metrics)
        b = RoutingPublisher(redis, keys, "router-b", Expertise(DOMAINS), signer)
        both = Expertise(DOMAINS)  # what one router given every report would hold
        try:
            a.receive(report_to_pb(observed(1)))
            b.receive(report_to_pb(observed(2)))
            for seed in (1, 2):
                both.learn(observed(seed))
            read_before = await redis.hget(keys.routing, "version")  # b reads, then a publishes first
            assert await a.sync()
            assert not await b._publish(read_before or b"") and b.expertise.tally  # lost the race: kept its counts
            assert await b.sync() and b.version > a.version
            assert not await b.sync()  # nothing new: nothing published
            assert await a.sync() is False and a.version == b.version  # adopted b's
            assert a.expertise.shared() == b.expertise.shared()
            for mine, theirs in zip(a.expertise.shared(), both.shared()):
                assert mine.keys() == theirs.keys()
                for key in mine:
                    for x, y in zip(mine[key].levels, theirs[key].levels):
                        assert math.isclose(x.hits, y.hits) and math.isclose(x.attempts, y.attempts)
            a.receive(verifier_pb2.RoutingReport(records=[verifier_pb2.RoutingRecord(
                kind="coding", name="coder", hits=[2], attempts=[1])]))  # more hits than attempts: refused
            assert metrics.registry.get_sample_value("specmesh_routing_reports_total") == 1
            last = b.version
            await redis.delete(keys.routing)  # Redis restarted empty
            assert await a.sync() and a.version > last
            assert metrics.registry.get_sample_value("specmesh_routing_snapshot_published_version") == a.version
        finally:
            await redis.aclose()

    asyncio.run(main())


@pytest.fixture
def routed_pool(redis_server, tiny_model):
    """An engine node, and a router's side of the routing policy: its policy (its settings: 2 drafters,
    never exploring), the publisher, and an EngineClient that hands the publisher the reports."""

    class Routed:
        async def __aenter__(self):
            self.pool = await EnginePool(redis_server.url, tiny_model).__aenter__()
            self.policy = adaptive_policy({}, routing=RoutingConfig(max_drafters=2, explore=0.0))
            self.metrics = RouterMetrics()
            self.publisher = RoutingPublisher(self.pool.redis, self.pool.keys, "router-sync", self.policy.expertise,
                                              self.pool.signer, self.metrics, every_s=0.2)
            self.client = EngineClient(self.pool.redis, self.pool.keys, "router-sync", signer=self.pool.signer,
                                       on_report=self.publisher.receive)
            await self.client.start()
            self.publishing = asyncio.create_task(self.publisher.run())
            return self

        async def __aexit__(self, *exc):
            self.publishing.cancel()
            await self.client.stop()
            await self.pool.__aexit__(*exc)

        async def answer(self, request: Request) -> list[int]:
            tokens = []
            async for delta in self.client.generate(request, 6, fixed_budget=True):
                tokens += delta.tokens
            return tokens

        def published(self) -> float:
            return self.metrics.registry.get_sample_value("specmesh_routing_snapshot_published_version")

        def applied(self) -> float:
            return self.pool.workers[0].metrics.registry.get_sample_value("specmesh_routing_snapshot_applied_version")

    return Routed()


def test_a_verifiers_reports_reach_the_router_whose_snapshot_it_applies(routed_pool, tiny_model):
    """Steps on the verifier, counts to the router, the router's table published, and the verifier routing
    by it (its applied version the router's published one, the same table); answers stay plain greedy."""
    async def main():
        async with routed_pool as routed:
            worker = routed.pool.workers[0]
            router = routed.policy.expertise
            assert router.table() == {}
            answers = [await asyncio.wait_for(routed.answer(Request(PROMPT, SamplingParams(max_tokens=40),
                                                                    f"synced-{i}", kind="coding")), 60)
                       for i in range(2)]

            def caught_up() -> bool:
                return (not router.tally and not worker.policy.expertise.tally
                        and routed.applied() == routed.published() == routed.publisher.version > 0)

            await wait_until_async(caught_up, timeout_s=20, what="the verifier applies the router's last snapshot")
            reports = routed.metrics.registry.get_sample_value("specmesh_routing_reports_total")
            assert worker.policy.expertise.shared() == router.shared()
            return answers, reports, worker

    answers, reports, worker = asyncio.run(main())
    assert answers == [plain_greedy(tiny_model, PROMPT, 40)] * 2
    assert reports >= 1
    router = worker.policy.expertise
    assert "coding" in router.table()
    assert (router.config.max_drafters, router.config.explore) == (2, 0.0)  # the router's settings


def test_a_forged_snapshot_is_refused_and_counted_and_the_routers_next_one_applied(routed_pool, redis_server):
    async def main():
        async with routed_pool as routed:
            worker = routed.pool.workers[0]
            await wait_until_async(lambda: routed.applied() == routed.published() > 0, timeout_s=20,
                                   what="the router's first snapshot applied")
            # stopped for good before the forgery: a round after it would publish over it unread
            await asyncio.wait_for(cancel_all(routed.publishing), timeout=5)
            first = routed.applied()
            forger = Expertise(DOMAINS, RoutingConfig(max_drafters=5))
            feed(forger, seed=4)
            payload = snapshot_to_pb(forger, int(first) + 10**9, "forger").SerializeToString()
            await routed.pool.redis.hset(routed.pool.keys.routing, mapping={
                "version": str(int(first) + 10**9), "snapshot": payload, "tag": b"\x00" * 32})
            refused = lambda: worker.metrics.registry.get_sample_value(  # noqa: E731
                "specmesh_routing_snapshots_refused_total", {"reason": "forged"})
            await wait_until_async(lambda: refused() == 1, timeout_s=10, what="the forged snapshot refused")
            assert routed.applied() == first and worker.policy.expertise.config.max_drafters == 2
            assert worker.policy.expertise.shared() == ({}, {})
            routed.publisher.expertise.learn(observed(5))  # the router learns: it publishes over the forgery
            assert await routed.publisher.sync()
            await wait_until_async(lambda: routed.applied() == routed.publisher.version, timeout_s=10,
                                   what="the router's snapshot applied after the forged one")
            return refused()

    assert asyncio.run(main()) == 1
