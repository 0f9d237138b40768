"""How the routers and verifiers find their drafters, and keep finding them as nodes join and leave.

Three sources of drafter addresses (``host:port`` of a drafter service's gRPC port):

- static: the ``--drafters`` flag;
- a Redis registry: each drafter service announces its address under a key that expires unless
  renewed (a heartbeat), so a drafter that dies drops out by itself; routers list the live keys;
- Kubernetes: the EndpointSlices of the Services that carry a label selector (by default
  ``specmesh.io/role=drafter``), listed then watched through the API server, so a pod that becomes
  ready, is replaced or goes away changes the set within a second.

``DrafterSet`` applies each new set of addresses to the service: a new address becomes a connected
``RemoteDrafter``; a vanished one leaves the service at once (no new request uses it) and its channel is
closed once the requests already using it have ended.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

from specmesh.cluster.backoff import unreachable_node
from specmesh.cluster.backoff import REDIS_DOWN
from specmesh.cluster.remote_drafter import RemoteDrafter
from specmesh.cluster.service_settings import DEFAULT_SELECTOR, DrafterClientSettings
from specmesh.cluster.tls import channel_options
from specmesh.errors import InvalidArgument

log = logging.getLogger("specmesh.cluster.discovery")

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class DrafterSet:
    """The router's remote drafters, kept equal to the latest set of discovered addresses."""

    def __init__(self, drafters: list, make: Callable[[str], RemoteDrafter], tokenizer_hash: str,
                 drain_s: float = 60.0, hidden_size: int | None = None, num_layers: int | None = None) -> None:
        """``drafters``: the router's own list (model-free local drafters stay in it untouched);
        ``tokenizer_hash``, ``hidden_size``, ``num_layers``: the target's, which a drafter must match."""
        self.drafters = drafters
        self.make = make
        self.tokenizer_hash = tokenizer_hash
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.drain_s = drain_s
        self._closing: set[asyncio.Task] = set()

    @property
    def addresses(self) -> set[str]:
        return {d.address for d in self.drafters if isinstance(d, RemoteDrafter)}

    async def update(self, addresses: Iterable[str]) -> tuple[list[str], list[str]]:
        """Make the remote drafters exactly ``addresses``; returns (added, removed)."""
        wanted = set(addresses)
        current = self.addresses
        added, removed = sorted(wanted - current), sorted(current - wanted)
        for address in removed:
            drafter = next(d for d in self.drafters if isinstance(d, RemoteDrafter) and d.address == address)
            self.drafters.remove(drafter)
            task = asyncio.create_task(self._close_when_idle(drafter))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
            log.info("drafter %s (%s) left", drafter.name, address)
        for address in added:
            drafter = self.make(address)
            try:
                reachable = await drafter.connect(self.tokenizer_hash, self.hidden_size, self.num_layers)
            except InvalidArgument as exc:  # another vocabulary or hidden size: never use it
                log.warning("%s", exc)
                await drafter.close()
                continue
            self.drafters.append(drafter)  # an unreachable one is kept: it is retried with back-off
            log.info("drafter %s joined at %s%s", drafter.name, address, "" if reachable else " (not reachable yet)")
        return added, removed

    async def _close_when_idle(self, drafter: RemoteDrafter) -> None:
        deadline = time.monotonic() + self.drain_s
        while drafter.active_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        await drafter.close()

    async def close(self) -> None:
        for task in list(self._closing):
            task.cancel()
        await asyncio.gather(*self._closing, return_exceptions=True)


# ---- the Redis registry ----


class RedisRegistry:
    """Drafters announce ``address`` with a time to live; what is not renewed expires by itself."""

    def __init__(self, redis, prefix: str = "specmesh", ttl_s: float = 10.0) -> None:
        if ttl_s <= 0:
            raise InvalidArgument("ttl", f"must be > 0 seconds, got {ttl_s}")
        self.redis = redis
        self.prefix = prefix
        self.ttl_s = ttl_s

    def key(self, address: str) -> str:
        return f"{self.prefix}:drafters:{address}"

    async def announce(self, address: str, name: str, domains: Sequence[str] = ()) -> None:
        card = json.dumps({"address": address, "name": name, "domains": list(domains)})
        await self.redis.set(self.key(address), card, px=int(self.ttl_s * 1000))

    async def withdraw(self, address: str) -> None:
        await self.redis.delete(self.key(address))

    async def addresses(self) -> set[str]:
        found = set()
        async for key in self.redis.scan_iter(match=self.key("*"), count=256):
            found.add((key.decode() if isinstance(key, bytes) else key).split(":drafters:", 1)[1])
        return found

    async def heartbeat(self, address: str, name: str, domains: Sequence[str] = ()) -> None:
        """Announce every third of the time to live until cancelled, then withdraw (a clean exit is
        seen at once, a crash after the time to live)."""
        try:
            while True:
                try:
                    await self.announce(address, name, domains)
                except REDIS_DOWN as exc:
                    log.warning("cannot announce %s in Redis: %s", address, exc)
                await asyncio.sleep(self.ttl_s / 3)
        finally:
            try:
                await asyncio.shield(self.withdraw(address))
            except Exception:  # Redis gone too: the key expires by itself
                pass


async def follow_registry(registry: RedisRegistry, drafters: DrafterSet, every_s: float = 1.0) -> None:
    """Keep ``drafters`` equal to the registry's live addresses (until cancelled)."""
    while True:
        try:
            await drafters.update(await registry.addresses())
        except REDIS_DOWN as exc:  # keep the last known set meanwhile
            log.warning("drafter registry unreachable: %s", exc)
        await asyncio.sleep(every_s)


# ---- Kubernetes ----


def slice_addresses(endpoint_slice, port_name: str = "grpc") -> set[str]:
    """``ip:port`` of every ready endpoint of an EndpointSlice, on the port named ``port_name`` (or its
    only port). Works on the client's model objects."""
    ports = list(endpoint_slice.ports or [])
    port = next((p.port for p in ports if p.name == port_name), ports[0].port if len(ports) == 1 else None)
    if port is None:
        return set()
    found = set()
    for endpoint in endpoint_slice.endpoints or []:
        conditions = endpoint.conditions
        if conditions is not None and conditions.ready is False:  # unknown readiness counts as ready
            continue
        for ip in endpoint.addresses or []:
            found.add(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
    return found


class KubernetesWatcher:
    """Lists then watches the EndpointSlices matching a label selector, calling ``on_change`` with
    the ready addresses whenever they change. Runs in a thread (the client is synchronous)."""

    def __init__(self, api, namespace: str, selector: str = DEFAULT_SELECTOR, port_name: str = "grpc",
                 watch_timeout_s: int = 60) -> None:
        """``api``: a ``kubernetes.client.DiscoveryV1Api``."""
        self.api = api
        self.namespace = namespace
        self.selector = selector
        self.port_name = port_name
        self.watch_timeout_s = watch_timeout_s
        self.stopping = threading.Event()
        self._slices: dict[str, set[str]] = {}

    @property
    def addresses(self) -> set[str]:
        return set().union(*self._slices.values()) if self._slices else set()

    def _list(self) -> str:
        listing = self.api.list_namespaced_endpoint_slice(self.namespace, label_selector=self.selector)
        self._slices = {s.metadata.name: slice_addresses(s, self.port_name) for s in listing.items}
        return listing.metadata.resource_version

    def run(self, on_change: Callable[[set[str]], None]) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        backoff = unreachable_node()
        version = None
        while not self.stopping.is_set():
            try:
                if version is None:
                    version = self._list()
                    on_change(self.addresses)
                stream = watch.Watch()
                for event in stream.stream(self.api.list_namespaced_endpoint_slice, self.namespace,
                                           label_selector=self.selector, resource_version=version,
                                           timeout_seconds=self.watch_timeout_s):
                    if self.stopping.is_set():
                        stream.stop()
                        break
                    kind, item = event["type"], event["object"]
                    if kind == "ERROR":  # e.g. 410 Gone: the version is too old, list again
                        version = None
                        break
                    version = item.metadata.resource_version
                    before = self.addresses
                    if kind == "DELETED":
                        self._slices.pop(item.metadata.name, None)
                    else:
                        self._slices[item.metadata.name] = slice_addresses(item, self.port_name)
                    if self.addresses != before:
                        on_change(self.addresses)
                backoff.reset()
            except ApiException as exc:
                if exc.status == 410:
                    version = None
                    continue
                delay = backoff.next()
                log.warning("Kubernetes API: %s %s; retrying in %.1f s", exc.status, exc.reason, delay)
                self.stopping.wait(delay)
            except Exception as exc:  # the API server restarting, the network: keep the last set, retry
                delay = backoff.next()
                log.warning("watching drafters failed (%s); retrying in %.1f s", exc, delay)
                version = None
                self.stopping.wait(delay)

    def stop(self) -> None:
        self.stopping.set()


def kubernetes_api(host: str | None = None):
    """A DiscoveryV1Api: in a pod from its service account, else from kubeconfig (``host`` overrides
    the server, e.g. a test's)."""
    from kubernetes import client, config

    if host is not None:
        configuration = client.Configuration()
        configuration.host = host
        return client.DiscoveryV1Api(client.ApiClient(configuration))
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.DiscoveryV1Api()


def pod_namespace(default: str = "default") -> str:
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or default
    except OSError:
        return default


async def follow_kubernetes(watcher: KubernetesWatcher, drafters: DrafterSet) -> None:
    """Keep ``drafters`` equal to the watched EndpointSlices' ready addresses (until cancelled)."""
    loop = asyncio.get_running_loop()
    changes: asyncio.Queue[set[str]] = asyncio.Queue()
    thread = threading.Thread(target=watcher.run, args=(lambda a: loop.call_soon_threadsafe(changes.put_nowait, a),),
                              name="k8s-discovery", daemon=True)
    thread.start()
    try:
        while True:
            addresses = await changes.get()
            while not changes.empty():  # only the latest set matters
                addresses = changes.get_nowait()
            await drafters.update(addresses)
    finally:
        watcher.stop()


async def reach_drafters(args: DrafterClientSettings, redis, drafters: list, tokenizer_hash: str, hidden_size: int | None,
                         num_layers: int | None, tls) -> tuple[DrafterSet, asyncio.Task | None]:
    """The drafters a service calls (``args``: its ``DrafterClientSettings``), found as ``--discovery`` says
    and kept up to date by the returned task (None: static), over mutual TLS when ``tls`` has the cluster's CA.
    ``drafters``: the service's list, holding its model-free drafters; the remote ones join it."""
    credentials = tls.channel_credentials() if tls is not None and tls.ca is not None else None
    options = channel_options(args.tls_server_name) if credentials is not None else []
    remote = DrafterSet(drafters, lambda address: RemoteDrafter(address, timeout_s=args.drafter_timeout,
                                                                credentials=credentials, options=options),
                        tokenizer_hash, hidden_size=hidden_size, num_layers=num_layers)
    await remote.update(args.drafter_addresses)
    following = None
    if args.discovery == "redis":
        following = asyncio.create_task(follow_registry(RedisRegistry(redis), remote))
    elif args.discovery == "kubernetes":
        watcher = KubernetesWatcher(kubernetes_api(), args.namespace or pod_namespace(), args.discovery_selector)
        following = asyncio.create_task(follow_kubernetes(watcher, remote))
    return remote, following
