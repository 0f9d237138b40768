"""API keys on the router's client APIs: no valid key is 401 / UNAUTHENTICATED on every HTTP route and
RPC (health checks stay open for probes); keys are kept hashed, rotate without a restart, and each has
its own concurrency and rate limits (429 / RESOURCE_EXHAUSTED). Without keys the router refuses to
listen beyond loopback."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import httpx
import pytest
from cluster_parts import ServiceStack
from conftest import wait_until_async
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from openai import AsyncOpenAI, AuthenticationError

from specmesh.client import AsyncClient
from specmesh.cluster import auth
from specmesh.cluster.auth import Access, ApiKeys, Caller, KeyLimits, check_exposure, digest
from specmesh.drafters.ngram import NgramDrafter
from specmesh.errors import InvalidArgument, ResourceExhausted, Unauthenticated

KEY, OTHER = "sk-test-0123456789abcdef", "sk-other-0123456789abcdef"


def test_keys_are_checked_hashed_and_rotate_without_a_restart(tmp_path, monkeypatch):
    monkeypatch.setattr(auth, "RELOAD_EVERY_S", 0.0)
    file = tmp_path / "keys"
    file.write_text(f"# the team's keys\n{KEY} alice\nsha256:{digest(OTHER)} bob\n")
    keys = ApiKeys("sk-env-0123456789abcdef", file)
    assert keys.authenticate(f"Bearer {KEY}") == Caller("alice")
    assert keys.authenticate(f"bearer {OTHER}") == Caller("bob")  # stored as a digest only
    assert keys.authenticate("Bearer sk-env-0123456789abcdef").name.startswith("key-")
    assert KEY not in repr(vars(keys))  # only digests are kept
    for bad in (None, "", KEY, "Basic abc", "Bearer ", "Bearer sk-wrong-0123456789abcdef"):
        with pytest.raises(Unauthenticated):
            keys.authenticate(bad)
    file.write_text(f"{OTHER} bob\n")  # rotation: alice's key is revoked
    with pytest.raises(Unauthenticated):
        keys.authenticate(f"Bearer {KEY}")
    assert keys.authenticate(f"Bearer {OTHER}") == Caller("bob")
    file.write_text("not-a-key\n")  # a broken rewrite keeps the last good keys
    assert keys.authenticate(f"Bearer {OTHER}") == Caller("bob")
    with pytest.raises(InvalidArgument, match="16 characters"):
        ApiKeys("short")
    with pytest.raises(InvalidArgument, match="64 hex"):
        ApiKeys("sha256:abc")


def test_each_key_has_its_own_concurrency_and_rate_limits():
    limits = KeyLimits(max_concurrent=2, per_minute=3)
    alice, bob = Caller("alice"), Caller("bob")
    first, second = limits.admit(alice), limits.admit(alice)
    with pytest.raises(ResourceExhausted, match="in flight"):
        limits.admit(alice)
    limits.admit(bob).release()  # another key is not limited by alice's calls
    first.release()
    first.release()  # idempotent
    assert limits.active("alice") == 1
    third = limits.admit(alice)  # the refused call above spent none of the minute's three
    third.release()
    with pytest.raises(ResourceExhausted, match="3 calls a minute"):
        limits.admit(alice)
    second.release()


def test_without_keys_only_loopback(tmp_path):
    open_access = Access(ApiKeys(), KeyLimits())
    check_exposure(open_access, ["127.0.0.1:50051", "localhost:8000", "[::1]:1", ""])
    with pytest.raises(InvalidArgument, match="loopback only"):
        check_exposure(open_access, ["127.0.0.1:50051", "0.0.0.0:8000"])
    check_exposure(Access(ApiKeys(KEY), KeyLimits()), ["0.0.0.0:50051"])
    # the router refuses before it loads anything
    result = subprocess.run([sys.executable, "-m", "specmesh.services.router", "--listen", "0.0.0.0:0",
                             "--http-listen", ""], capture_output=True, text=True, timeout=120,
                            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert result.returncode == 2 and "loopback only" in result.stdout + result.stderr


def test_every_route_and_rpc_needs_a_valid_key(redis_server, model, tokenizer):
    access = Access(ApiKeys(KEY), KeyLimits(max_concurrent=1))

    async def main():
        async with ServiceStack(redis_server.url, model, tokenizer, NgramDrafter(), http=True, access=access) as stack:
            base = stack.http_url.removesuffix("/v1")
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            routes = [("GET", "/v1/models", None), ("GET", "/v1/models/tiny", None),
                      ("POST", "/v1/chat/completions", body),
                      ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 3})]
            async with httpx.AsyncClient(base_url=base, timeout=30) as http:
                refused = {}
                for method, path, json in routes:
                    for header in ({}, {"authorization": f"Bearer {OTHER}"}):
                        answer = await http.request(method, path, json=json, headers=header)
                        refused[path, bool(header)] = (answer.status_code, answer.json()["error"]["code"],
                                                       answer.headers.get("www-authenticate"))
                allowed = [(await http.request(m, p, json=j, headers={"authorization": f"Bearer {KEY}"})).status_code
                           for m, p, j in routes]
                # the key is checked before the body is read: an anonymous 10 MB body is a 401, not a 413
                unread = (await http.post("/v1/completions", content=b"x" * (10 << 20))).status_code
                # a request refused for its fields gives its key's slot back (the limit here is 1)
                keyed = {"authorization": f"Bearer {KEY}"}
                bad = [(await http.post("/v1/chat/completions", json={**body, "stop": [""]}, headers=keyed)).status_code
                       for _ in range(3)]
                after_bad = (await http.post("/v1/chat/completions", json=body, headers=keyed)).status_code
                health = (await http.get("/health")).status_code
                schema_refused = (await http.get("/openapi.json")).status_code  # it names the model and version
                schema = (await http.get("/openapi.json", headers=keyed)).json()
            rpcs = {}
            async with AsyncClient(stack.address, api_key="") as anonymous:
                for name, call in [("Generate", anonymous.generate("hi", max_tokens=2)),
                                   ("CountTokens", anonymous.count_tokens("hi")), ("Info", anonymous.info()),
                                   ("ListModels", anonymous.list_models())]:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call
                    rpcs[name] = err.value.code()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in anonymous.stream("hi", max_tokens=2):
                        pass
                rpcs["GenerateStream"] = err.value.code()
            async with grpc.aio.insecure_channel(stack.address) as channel:
                probe = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                services = reflection_pb2.ServerReflectionRequest(list_services="")
                with pytest.raises(grpc.aio.AioRpcError) as err:  # reflection streams requests: checked too
                    async for _ in reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                            iter([services])):
                        pass
                rpcs["ServerReflectionInfo"] = err.value.code()
                listed = [answer async for answer in reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                    iter([services]), metadata=(("authorization", f"Bearer {KEY}"),))]
            async with AsyncClient(stack.address, api_key=KEY) as client:
                granted = await client.generate("hi", max_tokens=3)
                # one call in flight per key: a second concurrent one is refused
                first = client.stream("hi", max_tokens=200)
                await first.__anext__()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.generate("hi", max_tokens=2)
                over_limit = err.value.code(), err.value.details()
                busy = await http_status(stack, body)  # the same key over HTTP: the same limit
                await first.aclose()
                await wait_until_async(lambda: access.limits.active(access.keys.authenticate(f"Bearer {KEY}").name) == 0,
                                       what="the cancelled stream gave its key's slot back")
                async with AsyncOpenAI(base_url=stack.http_url, api_key=OTHER, max_retries=0) as openai:
                    with pytest.raises(AuthenticationError):
                        await openai.models.list()
                async with AsyncOpenAI(base_url=stack.http_url, api_key=KEY, max_retries=0) as openai:
                    answer = await openai.chat.completions.create(model="tiny", messages=body["messages"], max_tokens=3)
            return refused, allowed, health, (schema, schema_refused), rpcs, probe, granted, over_limit, busy, answer, (unread, bad, after_bad, listed)

    refused, allowed, health, (schema, schema_refused), rpcs, probe, granted, over_limit, busy, answer, more = asyncio.run(main())
    unread, bad, after_bad, listed = more
    assert set(refused.values()) == {(401, "invalid_api_key", "Bearer")}, refused
    assert allowed == [200, 200, 200, 200] and health == 200
    assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer" and schema_refused == 401
    assert set(rpcs.values()) == {grpc.StatusCode.UNAUTHENTICATED}, rpcs
    assert probe.status == health_pb2.HealthCheckResponse.SERVING
    assert len(granted.token_ids) == 3
    assert over_limit[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "in flight" in over_limit[1]
    assert busy == 429
    assert answer.usage.completion_tokens == 3
    assert unread == 401 and bad == [400, 400, 400] and after_bad == 200
    assert "specmesh.v1.Router" in {s.name for s in listed[0].list_services_response.service}


async def http_status(stack, body) -> int:
    async with httpx.AsyncClient(timeout=30) as http:
        answer = await http.post(f"{stack.http_url}/chat/completions", json=body,
                                 headers={"authorization": f"Bearer {KEY}"})
    return answer.status_code
