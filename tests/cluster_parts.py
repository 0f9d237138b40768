"""In-process cluster parts for tests: verifiers' engine workers on the real Redis queue, each on a thread and
event loop of its own, and the gRPC services (drafter, router) on loopback ports on the test's event loop."""

import asyncio
import threading
import time
import uuid
from contextlib import asynccontextmanager

from conftest import wait_until_async

from specmesh.cluster.gateway import ModelCard, Gateway, GatewayLimits
from specmesh.cluster.metrics import DrafterMetrics, MetricsEndpoint, RouterMetrics, serve_metrics
from specmesh.cluster.pipeline.engine_client import EngineClient
from specmesh.cluster.pipeline.engine_worker import EngineWorker
from specmesh.cluster.pipeline.messages import QueueKeys
from specmesh.cluster.pipeline.policy_sync import RoutingPublisher
from specmesh.cluster.pipeline.verifier_end import QueueMember
from specmesh.cluster.pipeline.verifier_watch import VerifierWatch
from specmesh.cluster.redis_clients import async_redis
from specmesh.cluster.remote_drafter import RemoteDrafter
from specmesh.cluster.serving import Service, TorchThread, start_server
from specmesh.cluster.pipeline.messages import QueueSigner, new_key
from specmesh.drafters.base import Drafter
from specmesh.drafters.ngram import NgramDrafter
from specmesh.runtime.llama import LlamaRuntime
from specmesh.runtime.loading import tokenizer_fingerprint
from specmesh.runtime.tree_verifier import TreeVerifier
from specmesh.sampling import SamplingParams
from specmesh.cluster.drafter_sessions import DrafterSessions
from specmesh.services.drafter.server import DrafterServicer
from specmesh.services.router.openai_api import HttpServer, openai_app
from specmesh.cluster.gateway import watch_cluster
from specmesh.services.router.server import ROUTER_SERVICE, RouterServicer
from specmesh.speculation.classifier import default_classifier
from specmesh.speculation.drafting import LocalDrafter
from specmesh.speculation.policy import adaptive_policy
from specmesh.speculation.engine import Request, SpeculativeEngine
from specmesh.v1 import drafter_pb2, drafter_pb2_grpc, router_pb2_grpc, verifier_pb2_grpc


class ServiceStack:
    """A router and one drafter as real gRPC servers on loopback, over engine nodes that call the drafter."""

    def __init__(self, url: str, model, tokenizer, drafter: Drafter, limits: GatewayLimits | None = None,
                 metrics: bool = False, http: bool = False, access=None, tls=None, verifiers: int = 1,
                 **node_args) -> None:
        """``metrics``: each service counts into its own registry, served over HTTP on a free port
        (``metrics_urls``), as the real services do. ``http``: the router's OpenAI API too, at ``http_url``.
        ``node_args``: each engine node's (``EngineNode``)."""
        self.with_metrics = metrics
        self.with_http = http
        self.access = access  # API keys the router's client APIs require (None: none)
        self.tls = tls  # TlsFiles: TLS on the router's ports, mutual TLS between router and drafter
        self.http = None
        self.endpoints: dict[str, MetricsEndpoint] = {}
        self.url, self.verifiers = url, verifiers
        self.model = model
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.node_args = node_args
        # fixed: a tiny model's pass costs about a drafter's round trip, so the adaptive policy would
        # (rightly) stop speculating, and these stacks are here to exercise drafting through the services
        self.limits = limits or GatewayLimits(max_tree_nodes=6, speculation="fixed")

    async def __aenter__(self):
        vocab = self.model.config.vocab_size
        self.sessions = DrafterSessions(self.drafter, vocab, max_sessions=16)
        layers = getattr(self.drafter, "feature_layers", ())
        info = drafter_pb2.DrafterInfo(name=self.drafter.name, kind=self.drafter.kind, domains=["general"],
                                       tokenizer_hash=tokenizer_fingerprint(self.tokenizer), feature_layers=layers,
                                       hidden_size=self.model.config.hidden_size if layers else 0)
        drafter_metrics, router_metrics = DrafterMetrics(), RouterMetrics() if self.with_metrics else None
        self.drafter_thread = TorchThread("draft")  # a test may keep it busy: the drafter stalls
        servicer = DrafterServicer(self.sessions, info, self.drafter_thread, drafter_metrics)
        self.drafter_server = await start_server(
            [Service("specmesh.v1.Drafter", lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, s))],
            "127.0.0.1:0", metrics=drafter_metrics, tls=self.tls, require_client_cert=self.tls is not None,
        )
        self.remote = await self._remote_drafter()
        # each node its own channel to the drafter, on its own loop
        self.pool = EnginePool(self.url, self.model, self.verifiers, drafters=lambda: self._remote_drafter_list(),
                               **self.node_args)
        await self.pool.__aenter__()
        watch = self.pool.watch
        card = ModelCard("tiny", vocab, self.model.config.max_position_embeddings,
                         tokenizer_fingerprint(self.tokenizer), frozenset())
        self.router = Gateway(self.tokenizer, card, [self.remote], self.pool.client, self.limits,
                             classifier=default_classifier(), metrics=router_metrics)
        # the router learns routing from the verifiers' reports, as serve() does
        publisher = RoutingPublisher(self.pool.redis, self.pool.keys, self.pool.client.router_id,
                                     self.router.policy.expertise, self.pool.signer, router_metrics)
        self.pool.client.on_report = publisher.receive
        self.publishing = asyncio.create_task(publisher.run())
        router_servicer = RouterServicer(self.router, watch)
        # (a test may serve it once more, on an address of its own)
        self.router_service = Service("specmesh.v1.Router",
                                      lambda s: router_pb2_grpc.add_RouterServicer_to_server(router_servicer, s))
        self.router_server = await start_server([self.router_service], "127.0.0.1:0", metrics=router_metrics,
                                                access=self.access, tls=self.tls)
        self.address = f"127.0.0.1:{self.router_server.port}"
        if self.with_http:
            app = openai_app(self.router, lambda: len(watch.alive), max_body_bytes=1 << 20, access=self.access)
            self.http = HttpServer(app, "127.0.0.1:0", self.tls)
            await self.http.start()
            self.http_url = self.http.url
        # as the router's serve(): gauges, and the Router service's health from the live verifiers
        self.watcher = asyncio.create_task(watch_cluster(self.router, watch, router_metrics or RouterMetrics(),
                                                         every_s=0.2, server=self.router_server, service=ROUTER_SERVICE))
        if self.with_metrics:
            self.endpoints = {"router": serve_metrics(router_metrics, "127.0.0.1:0"),
                              "drafter": serve_metrics(drafter_metrics, "127.0.0.1:0"),
                              **{f"verifier-{i}": serve_metrics(w.metrics, "127.0.0.1:0")
                                 for i, w in enumerate(self.pool.workers)}}
        return self

    async def _remote_drafter(self) -> RemoteDrafter:
        credentials = self.tls.channel_credentials() if self.tls is not None else None
        remote = RemoteDrafter(f"127.0.0.1:{self.drafter_server.port}", credentials=credentials)
        await remote.connect(tokenizer_fingerprint(self.tokenizer), self.model.config.hidden_size)
        return remote

    async def _remote_drafter_list(self) -> list[RemoteDrafter]:
        return [await self._remote_drafter()]

    async def add_verifier(self, name: str) -> None:
        await self.pool.add_node(name)

    @property
    def drafter_failures(self) -> int:
        """Failed calls to the drafter service by the verifiers' step loops."""
        return sum(d.failures for node in self.pool.nodes for d in node.drafters)

    @property
    def metrics_urls(self) -> dict[str, str]:
        return {name: endpoint.url for name, endpoint in self.endpoints.items()}

    async def __aexit__(self, *exc):
        for task in (self.watcher, self.publishing):
            task.cancel()
        for endpoint in self.endpoints.values():
            endpoint.close()
        if self.http is not None:
            await self.http.stop()
        await self.router_server.server.stop(0)
        await self.drafter_server.server.stop(0)
        await self.remote.close()
        await self.pool.__aexit__(*exc)


class SlowVerifier(TreeVerifier):
    """The real verifier, each pass ``pass_s`` longer: a long prefill or a slow device, as far as timing goes."""

    def __init__(self, runtime, pass_s: float) -> None:
        super().__init__(runtime)
        self.pass_s = pass_s

    def verify(self, jobs, prefill_ms=None, alone_ms=None):
        time.sleep(self.pass_s)
        return super().verify(jobs, prefill_ms, alone_ms)


def plain_greedy(model, prompt_ids, max_tokens: int) -> list[int]:
    """The model's plain greedy decoding in process: what every path through the cluster must give."""
    engine = SpeculativeEngine(LlamaRuntime(model), [], max_tree_nodes=0)
    return engine.generate([Request(tuple(prompt_ids), SamplingParams(max_tokens=max_tokens))])[0].token_ids


@asynccontextmanager
async def passes_held(worker: EngineWorker):
    """No verification pass runs inside (the worker's torch thread waits), as behind a long pass."""
    hold = threading.Event()
    busy = asyncio.ensure_future(worker.torch_thread.run(hold.wait))
    try:
        yield
    finally:
        hold.set()
        await busy


class EngineNode:
    """A verifier's engine worker on a thread and event loop of its own, as in a
    process of its own: it can stand still (``stall``, a SIGSTOP as far as the others can tell) while the
    rest of the test goes on. Tiny model, an n-gram drafter in process."""

    def __init__(self, url: str, keys: QueueKeys, signer: QueueSigner, model, name: str,
                 heartbeat_ttl_s: float = 1.0, verifier=TreeVerifier, drafters=None, inline: bool = False,
                 draft_ahead: str = "auto") -> None:
        """``verifier``: makes the node's verifier from its runtime (a slow one, say); ``drafters``: an async
        function making the node's drafters on its loop (default: an n-gram drafter in process); ``inline``:
        its torch work on its event loop's thread, as a CPU verifier's; ``draft_ahead``: as the service's."""
        self.url, self.keys, self.signer, self.model, self.name = url, keys, signer, model, name
        self.inline = inline
        self.draft_ahead = draft_ahead
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.make_verifier = verifier
        self.make_drafters = drafters
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=f"node-{name}", daemon=True)
        self.worker: EngineWorker | None = None
        self.running = None

    def start(self) -> "EngineNode":
        self.thread.start()
        self.worker = self.call(self._build())
        self.running = asyncio.run_coroutine_threadsafe(self.worker.run(), self.loop)
        return self

    async def _build(self) -> EngineWorker:
        queue = QueueMember(async_redis(self.url), self.keys, self.name, heartbeat_ttl_s=self.heartbeat_ttl_s,
                              signer=self.signer)
        drafters = await self.make_drafters() if self.make_drafters else [LocalDrafter(NgramDrafter())]
        self.drafters = drafters
        return EngineWorker(self.make_verifier(LlamaRuntime(self.model)), queue, TorchThread(self.name, self.inline),
                            adaptive_policy({}), drafters, frozenset(), draft_ahead=self.draft_ahead)

    def call(self, coroutine, timeout_s: float = 60.0):
        """Run ``coroutine`` on the node's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def stall(self, seconds: float) -> None:
        """The node's loop stands still for ``seconds`` (its heartbeat, reads and posts with it)."""
        self.loop.call_soon_threadsafe(time.sleep, seconds)

    def serve_control(self, info, **server_args):
        """The verifier's control API (Info, Drain) for this node, served on its loop; returns the server."""
        from specmesh.services.verifier.server import VerifierServicer

        async def start():
            servicer = VerifierServicer(self.worker, info)
            return await start_server([Service("specmesh.v1.Verifier", lambda s: verifier_pb2_grpc.add_VerifierServicer_to_server(
                servicer, s))], "127.0.0.1:0", **server_args)

        return self.call(start())

    def holds(self, request_id: str) -> bool:
        return request_id in self.worker._held

    @property
    def sessions(self) -> int:
        return self.worker.verifier.num_sessions

    def stop(self) -> None:
        """Stop as a process killed would: no drain; its admissions stay pending for whoever adopts them."""
        if self.running is not None:
            self.loop.call_soon_threadsafe(self.worker.stopped.set)
            self.running.result(60)
            self.call(self.worker.queue.redis.aclose())
            for drafter in self.drafters:
                if hasattr(drafter, "close"):
                    self.call(drafter.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class EnginePool:
    """Engine nodes over a real Redis, and a router's ``EngineClient`` on the test's event loop."""

    def __init__(self, url: str, model, workers: int = 1, timeout_s: float = 30.0, node_url: str | None = None,
                 **node_args) -> None:
        """``url``: the router's Redis URL; ``node_url``: the verifiers' (another user's), else the same;
        ``node_args``: every node's (``EngineNode``). ``watch``: the router's view of which verifiers are alive."""
        self.keys = QueueKeys(pool=uuid.uuid4().hex[:8])
        self.signer = QueueSigner(new_key())
        self.redis = async_redis(url)
        self.client = EngineClient(self.redis, self.keys, f"router-{self.keys.pool}", timeout_s=timeout_s,
                                   signer=self.signer)
        self.watch = VerifierWatch(self.redis, self.keys, liveness_every_s=0.1)
        self.url, self.model, self.node_args = node_url or url, model, node_args
        self.nodes = [EngineNode(self.url, self.keys, self.signer, model, f"v{i}", **node_args)
                      for i in range(workers)]

    @property
    def workers(self) -> list[EngineWorker]:
        return [node.worker for node in self.nodes]

    async def add_node(self, name: str, **node_args) -> EngineNode:
        node = EngineNode(self.url, self.keys, self.signer, self.model, name, **{**self.node_args, **node_args})
        self.nodes.append(node)
        return await asyncio.to_thread(node.start)

    async def __aenter__(self):
        for node in self.nodes:
            await asyncio.to_thread(node.start)
        await self.client.start()
        await self.watch.start()
        await wait_until_async(lambda: len(self.watch.alive) >= len(self.nodes), what="the router sees every node")
        return self

    async def __aexit__(self, *exc):
        await self.watch.stop()
        await self.client.stop()
        for node in self.nodes:
            if node.thread.is_alive():
                await asyncio.to_thread(node.stop)
        await self.redis.aclose()

    async def answer(self, request: Request, budget: int = 6, on_delta=None) -> list[int]:
        """The request's whole answer through the nodes (fixed budget); ``on_delta`` sees each delta."""
        tokens: list[int] = []
        async for delta in self.client.generate(request, budget, fixed_budget=True):
            tokens += delta.tokens
            if on_delta is not None:
                on_delta(delta)
        return tokens
