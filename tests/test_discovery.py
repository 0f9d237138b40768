"""Finding drafters: the Redis registry for real (heartbeats, expiry, a real drafter service joining
and leaving a router's set), and Kubernetes discovery against a fake of the API server at the
client's HTTP boundary (no API server can run here): list, then watch events, 410 Gone, readiness."""

import asyncio
import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import redis.asyncio as aioredis
from conftest import wait_until_async
from kubernetes import client as k8s

from specmesh.cluster.discovery import (
    DrafterSet,
    KubernetesWatcher,
    RedisRegistry,
    follow_registry,
    kubernetes_api,
    slice_addresses,
)
from specmesh.cluster.remote_drafter import RemoteDrafter
from specmesh.cluster.serving import Service, TorchThread, start_server
from specmesh.drafters.ngram import NgramDrafter
from specmesh.errors import InvalidArgument
from specmesh.cluster.drafter_sessions import DrafterSessions
from specmesh.services.drafter.server import DrafterServicer
from specmesh.v1 import drafter_pb2, drafter_pb2_grpc

TOKENIZER_HASH = "test-vocabulary"


# ---- the Redis registry, for real ----


def test_the_registry_lists_live_drafters_and_forgets_silent_ones(redis_server):
    async def main():
        redis = aioredis.Redis.from_url(redis_server.url)
        # one prefix, two times to live: long where the test reads what is there, short where it waits
        # for a silent drafter to expire
        registry = RedisRegistry(redis, prefix="t-registry", ttl_s=60.0)
        short = RedisRegistry(redis, prefix="t-registry", ttl_s=0.3)
        beats = RedisRegistry(redis, prefix="t-registry", ttl_s=1.0)
        try:
            await registry.announce("10.0.0.1:50061", "code", ["code"])
            await registry.announce("10.0.0.2:50061", "math", ["math"])
            both = await registry.addresses()
            await registry.withdraw("10.0.0.1:50061")
            one = await registry.addresses()
            await short.announce("10.0.0.2:50061", "math", ["math"])  # its last beat: nobody renews it
            await wait_until_async(lambda: none_left(registry), what="the silent drafter expired by itself")
            beating = asyncio.create_task(beats.heartbeat("10.0.0.3:50061", "writing"))
            renewals = await count_renewals(redis, beats.key("10.0.0.3:50061"), until=2)
            alive = await registry.addresses()
            beating.cancel()
            await asyncio.gather(beating, return_exceptions=True)
            after = await registry.addresses()  # a clean exit withdraws at once
            return both, one, renewals, alive, after
        finally:
            await redis.aclose()

    both, one, renewals, alive, after = asyncio.run(main())
    assert both == {"10.0.0.1:50061", "10.0.0.2:50061"}
    assert one == {"10.0.0.2:50061"}
    assert renewals >= 2 and alive == {"10.0.0.3:50061"} and after == set()
    with pytest.raises(InvalidArgument, match="ttl"):
        RedisRegistry(None, ttl_s=0)


async def none_left(registry: RedisRegistry) -> bool:
    return await registry.addresses() == set()


async def count_renewals(redis, key: str, until: int) -> int:
    """Watch a key's time to live until it was reset ``until`` times; fail if the key ever expires."""
    renewals, last = 0, None

    async def renewed() -> bool:
        nonlocal renewals, last
        left = await redis.pttl(key)
        if last is not None and left == -2:
            raise AssertionError(f"{key} expired: the heartbeat did not renew it")
        if left > 0:
            renewals += last is not None and left > last
            last = left
        return renewals >= until

    await wait_until_async(renewed, every_s=0.01, what=f"{key} renewed {until} times")
    return renewals


async def _drafter_server(name: str):
    drafter = NgramDrafter()
    drafter.name = name
    sessions = DrafterSessions(drafter, vocab_size=1000, max_sessions=4)
    info = drafter_pb2.DrafterInfo(name=name, kind="ngram", domains=["general"], tokenizer_hash=TOKENIZER_HASH)
    servicer = DrafterServicer(sessions, info, TorchThread("draft"))
    return await start_server(
        [Service("specmesh.v1.Drafter", lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, s))],
        "127.0.0.1:0")


def test_a_drafter_that_announces_itself_joins_the_router_and_leaves_when_it_stops(redis_server):
    async def main():
        redis = aioredis.Redis.from_url(redis_server.url)
        registry = RedisRegistry(redis, prefix="t-join", ttl_s=1.0)
        server = await _drafter_server("lookup")
        address = f"127.0.0.1:{server.port}"
        drafters: list = []
        remote = DrafterSet(drafters, lambda a: RemoteDrafter(a, timeout_s=1.0), TOKENIZER_HASH, drain_s=1.0)
        following = asyncio.create_task(follow_registry(registry, remote, every_s=0.1))
        try:
            beating = asyncio.create_task(registry.heartbeat(address, "lookup"))
            await wait_until_async(lambda: drafters, what="the drafter joined")
            joined = [(d.name, d.address, d.kind) for d in drafters]
            # it drafts for a request like any static drafter
            drafter = drafters[0]
            await drafter.start("r1", [1, 2, 3, 1, 2])
            tree = await drafter.propose("r1", 4)
            await drafter.end("r1")
            beating.cancel()  # the drafter shuts down: withdrawn from the registry
            await asyncio.gather(beating, return_exceptions=True)
            await wait_until_async(lambda: not drafters, what="the drafter left")
            return joined, list(tree.tokens)
        finally:
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
            await remote.close()
            await server.server.stop(0)
            await redis.aclose()

    joined, tree = asyncio.run(main())
    assert joined[0][0] == "lookup" and joined[0][2] == "ngram"
    assert tree[:1] == [3]  # prompt lookup: after ...1, 2 came 3


def test_a_drafter_with_another_vocabulary_is_never_used():
    async def main():
        server = await _drafter_server("stranger")
        drafters: list = []
        remote = DrafterSet(drafters, lambda a: RemoteDrafter(a, timeout_s=1.0), "another-vocabulary")
        try:
            added, _ = await remote.update([f"127.0.0.1:{server.port}"])
            return added, drafters
        finally:
            await server.server.stop(0)

    added, drafters = asyncio.run(main())
    assert added and drafters == []


# ---- Kubernetes, against a fake API server ----


def _slice(name: str, version: int, endpoints: list[tuple[str, bool | None]], port_name: str = "grpc") -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "serving", "resourceVersion": str(version),
                     "labels": {"specmesh.io/role": "drafter", "kubernetes.io/service-name": name.rsplit("-", 1)[0]}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [ip], **({"conditions": {"ready": ready}} if ready is not None else {})}
                      for ip, ready in endpoints],
        "ports": [{"name": port_name, "port": 50061, "protocol": "TCP"}, {"name": "metrics", "port": 9400, "protocol": "TCP"}],
    }


class FakeApiServer:
    """Answers the two calls the watcher makes: list and watch of EndpointSlices in a namespace.
    ``watches`` is a list of event lists: the n-th watch call streams the n-th list (then ends);
    an event list that is the int 410 answers the watch with 410 Gone."""

    def __init__(self, listing: list[dict], watches: list, relist: list[dict] | None = None) -> None:
        self.listing, self.watches, self.relist = listing, list(watches), relist
        self.calls: list[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                url = urllib.parse.urlsplit(self.path)
                query = dict(urllib.parse.parse_qsl(url.query))
                fake.calls.append({"path": url.path, **query})
                assert url.path == "/apis/discovery.k8s.io/v1/namespaces/serving/endpointslices", url.path
                assert query.get("labelSelector") == "specmesh.io/role=drafter"
                if query.get("watch") in ("true", "True", "1"):
                    events = fake.watches.pop(0) if fake.watches else []
                    if events == 410:
                        return self._json(410, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                                "reason": "Expired", "code": 410, "message": "too old resource version"})
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()
                    for kind, obj in events:
                        self.wfile.write((json.dumps({"type": kind, "object": obj}) + "\n").encode())
                        self.wfile.flush()
                    if not events:
                        time.sleep(0.2)  # an idle watch that times out
                    return
                items = fake.listing if fake.relist is None or len([c for c in fake.calls if "watch" not in c]) == 1 \
                    else fake.relist
                version = max([int(i["metadata"]["resourceVersion"]) for i in items] + [1])
                self._json(200, {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                                 "metadata": {"resourceVersion": str(version)}, "items": items})

            def _json(self, status: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _watch(fake: FakeApiServer, expected_changes: int) -> list[set[str]]:
    watcher = KubernetesWatcher(kubernetes_api(host=fake.url), "serving", watch_timeout_s=1)
    changes: list[set[str]] = []

    def on_change(addresses):
        changes.append(addresses)
        if len(changes) >= expected_changes:
            watcher.stop()

    thread = threading.Thread(target=watcher.run, args=(on_change,), daemon=True)
    thread.start()
    thread.join(20)
    watcher.stop()
    thread.join(5)
    return changes


def test_kubernetes_discovery_follows_ready_endpoints_as_pods_come_and_go():
    code = _slice("drafter-code-abc", 10, [("10.1.0.4", True), ("10.1.0.5", False)])
    fake = FakeApiServer([code], watches=[
        [("MODIFIED", _slice("drafter-code-abc", 11, [("10.1.0.4", True), ("10.1.0.5", True)]))],  # a pod got ready
        [("ADDED", _slice("drafter-math-xyz", 12, [("10.1.0.9", None)]))],  # readiness unknown: counted ready
        [("MODIFIED", _slice("drafter-math-xyz", 13, [("10.1.0.9", None)])),  # no change: no call
         ("DELETED", _slice("drafter-code-abc", 14, []))],
    ])
    try:
        changes = _watch(fake, expected_changes=4)
    finally:
        fake.close()
    assert changes == [
        {"10.1.0.4:50061"},
        {"10.1.0.4:50061", "10.1.0.5:50061"},
        {"10.1.0.4:50061", "10.1.0.5:50061", "10.1.0.9:50061"},
        {"10.1.0.9:50061"},
    ]
    watches = [c for c in fake.calls if "watch" in c]
    assert watches[0]["resourceVersion"] == "10" and watches[1]["resourceVersion"] == "11"  # resumes where it was


def test_kubernetes_discovery_lists_again_after_410_gone():
    fake = FakeApiServer([_slice("drafter-code-abc", 5, [("10.1.0.4", True)])], watches=[410],
                         relist=[_slice("drafter-code-abc", 40, [("10.1.0.7", True)])])
    try:
        changes = _watch(fake, expected_changes=2)
    finally:
        fake.close()
    assert changes == [{"10.1.0.4:50061"}, {"10.1.0.7:50061"}]
    assert len([c for c in fake.calls if "watch" not in c]) == 2


def test_slice_addresses_reads_the_grpc_port_and_skips_unready_endpoints():
    def model(endpoints, ports):
        return k8s.V1EndpointSlice(
            address_type="IPv4",
            endpoints=[k8s.V1Endpoint(addresses=[ip], conditions=k8s.V1EndpointConditions(ready=ready)) for ip, ready in endpoints],
            ports=[k8s.DiscoveryV1EndpointPort(name=name, port=port) for name, port in ports])

    grpc_and_metrics = [("grpc", 50061), ("metrics", 9400)]
    both = model([("10.0.0.1", True), ("10.0.0.2", False), ("fd00::3", True)], grpc_and_metrics)
    assert slice_addresses(both) == {"10.0.0.1:50061", "[fd00::3]:50061"}
    assert slice_addresses(model([("10.0.0.1", None)], [("", 7000)])) == {"10.0.0.1:7000"}  # its only port
    # two ports and none named grpc: which one is the drafter's cannot be known
    assert slice_addresses(model([("10.0.0.1", True)], [("rpc", 1), ("metrics", 2)])) == set()
