"""The router service: the client API over the speculation loop, with remote drafters and the
Redis-backed verifier pool. The servicer only converts messages; ``specmesh.cluster.gateway`` does the work."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import uuid
from typing import Sequence

import redis.asyncio as aioredis

from specmesh import __version__
from specmesh.cluster.auth import Access, ApiKeys, KeyLimits, check_exposure
from specmesh.cluster.discovery import (
    DEFAULT_SELECTOR,
    DISCOVERY_MODES,
    DrafterSet,
    KubernetesWatcher,
    RedisRegistry,
    follow_kubernetes,
    follow_registry,
    kubernetes_api,
    pod_namespace,
)
from specmesh.cluster.gateway import Generation, ModelCard, Router, RouterLimits, TextStream
from specmesh.cluster.metrics import RouterMetrics, serve_metrics
from specmesh.cluster.queue import QueueKeys, QueueVerifierClient
from specmesh.cluster.remote_drafter import RemoteDrafter
from specmesh.cluster.serving import Server, Service, env_default, run_service, start_server
from specmesh.cluster.signing import QueueSigner
from specmesh.cluster.tls import TlsFiles, add_tls_flags, channel_options
from specmesh.cluster.wire import sampling_from_pb
from specmesh.drafters.catalog import MODEL_FREE_DRAFTERS
from specmesh.errors import InvalidArgument, Unavailable
from specmesh.runtime.loading import EMBEDDED_DEFAULT, configure_threads, load_target_parts, tokenizer_fingerprint
from specmesh.services.router.openai_api import DEFAULT_MAX_BODY_BYTES, HttpServer, openai_app
from specmesh.speculation.classifier import default_classifier
from specmesh.speculation.expertise import GENERAL, RoutingConfig
from specmesh.speculation.loop import LocalDrafter
from specmesh.speculation.policy import (
    DEFAULT_TREE_NODES,
    SPECULATION_MARGIN,
    SPECULATION_MODES,
    StepOutcome,
    adaptive_policy,
)
from specmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

log = logging.getLogger("specmesh.router")


def _usage(generation: Generation) -> router_pb2.Usage:
    return router_pb2.Usage(prompt_tokens=generation.prompt_tokens, completion_tokens=len(generation.token_ids))


def _stats(generation: Generation) -> router_pb2.SpeculationStats:
    s = generation.stats
    return router_pb2.SpeculationStats(
        target_steps=s.target_steps, drafted_nodes=s.drafted_nodes, accepted_tokens=s.accepted_tokens,
        mean_accepted_length=s.mean_accepted_length, resyncs=s.resyncs, first_token_ms=s.first_token_s * 1e3,
        total_ms=s.total_s * 1e3, drafters=generation.drafters, drafted_ahead=s.drafted_ahead,
        draft_ms=s.draft_s * 1e3, verify_ms=s.verify_s * 1e3, verifier_ms=s.verifier_s * 1e3, request_kind=s.request_kind, drafter_steps=s.drafter_steps,
    )


def _trace(outcome: StepOutcome) -> router_pb2.StepTrace:
    return router_pb2.StepTrace(budget=outcome.plan.budget, tree_nodes=len(outcome.fused), draft_ms=outcome.draft_ms,
                                pass_ms=outcome.pass_ms, step_ms=outcome.step_ms, batch_size=outcome.batch_size)


SPECULATION = {router_pb2.SPECULATION_UNSPECIFIED: None, router_pb2.SPECULATION_ADAPTIVE: "adaptive",
               router_pb2.SPECULATION_FIXED: "fixed", router_pb2.SPECULATION_OFF: "off"}


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, router: Router, verifier_client: QueueVerifierClient) -> None:
        self.router = router
        self.verifier_client = verifier_client

    def _prompt_ids(self, message) -> list[int]:
        kind = message.WhichOneof("input")
        if kind == "prompt":
            return self.router.encode_text(message.prompt)
        if kind == "chat":
            return self.router.encode_chat([(m.role, m.content) for m in message.chat.messages])
        if kind == "prompt_ids":
            return list(message.prompt_ids.ids)
        raise InvalidArgument("input", "give one of prompt, chat or prompt_ids")

    @staticmethod
    def _text(message) -> str:
        """The user's own words, what the request is classified by (empty for token ids)."""
        kind = message.WhichOneof("input")
        if kind == "prompt":
            return message.prompt
        if kind == "chat":
            return next((m.content for m in reversed(message.chat.messages) if m.role == "user"), "")
        return ""

    def _ticket(self, message: router_pb2.GenerateRequest):
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(message.sampling)
        if sampling.max_tokens == 0:
            sampling.max_tokens = self.router.limits.default_max_tokens
        budget = message.max_tree_nodes if message.HasField("max_tree_nodes") else None
        if message.speculation not in SPECULATION:
            raise InvalidArgument("speculation", f"unknown value {message.speculation}")
        return self.router.make_request(self._prompt_ids(message), sampling_from_pb(sampling), message.request_id,
                                        budget, text=self._text(message), speculation=SPECULATION[message.speculation])

    async def Generate(self, request, context):
        ticket = await self.router.prepare(self._ticket, request)
        generation = None
        async for generation, _ in self.router.generate(ticket):
            pass
        return router_pb2.GenerateResponse(
            request_id=request.request_id or ticket.request.request_id, text=self.router.decode(generation.token_ids),
            token_ids=generation.token_ids, finish_reason=generation.finish_reason or "length",
            usage=_usage(generation), stats=_stats(generation),
        )

    async def GenerateStream(self, request, context):
        ticket = await self.router.prepare(self._ticket, request)
        text = TextStream(self.router)
        async for generation, step in self.router.generate(ticket):
            final = step.finish_reason is not None
            chunk = router_pb2.GenerateChunk(
                request_id=request.request_id or ticket.request.request_id, token_ids=step.token_ids,
                text=text.push(step.token_ids, final),
                finish_reason=step.finish_reason or "",
            )
            if step.outcome is not None:
                chunk.step.CopyFrom(_trace(step.outcome))
            if final:
                chunk.usage.CopyFrom(_usage(generation))
                chunk.stats.CopyFrom(_stats(generation))
            yield chunk

    async def CountTokens(self, request, context):
        ids = await self.router.prepare(self._prompt_ids, request)
        return router_pb2.CountTokensResponse(count=len(ids), token_ids=ids)

    def _card(self) -> router_pb2.ModelCard:
        card = self.router.card
        return router_pb2.ModelCard(id=card.name, tokenizer_hash=card.tokenizer_hash, max_length=card.max_length,
                                    vocab_size=card.vocab_size)

    async def ListModels(self, request, context):
        return router_pb2.ListModelsResponse(models=[self._card()])

    async def Info(self, request, context):
        limits = self.router.limits
        return router_pb2.RouterInfo(
            model=self._card(),
            drafters=[router_pb2.DrafterStatus(address=getattr(d, "address", IN_ROUTER), name=d.name,
                                               domains=getattr(d, "domains", (GENERAL,)), healthy=getattr(d, "healthy", True))
                      for d in self.router.drafters],
            active_requests=self.router.active, max_concurrent_requests=limits.max_concurrent_requests,
            max_tree_nodes=limits.max_tree_nodes, verifiers=len(self.verifier_client.alive), version=__version__,
            routing=[router_pb2.RoutingEstimate(kind=kind, drafter=name, acceptance=value)
                     for kind, row in sorted(self.router.policy.router.table().items()) for name, value in sorted(row.items())],
            speculation=limits.speculation,
        )


IN_ROUTER = "in-router"


def local_drafter_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODEL_FREE_DRAFTERS]
    if unknown:
        raise InvalidArgument("local_drafters", f"{', '.join(unknown)} cannot run in the router; model-free drafters: "
                                                f"{', '.join(MODEL_FREE_DRAFTERS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specmesh-router", description="Serve the client API of a specmesh cluster.")
    parser.add_argument("--model", default=env_default("model", EMBEDDED_DEFAULT),
                        help="the target (its tokenizer and config are read; no weights) [SPECMESH_MODEL]")
    parser.add_argument("--redis-url", default=env_default("redis_url", "redis://127.0.0.1:6379/0"), help="[SPECMESH_REDIS_URL]")
    parser.add_argument("--pool", default=env_default("pool", "default"), help="verifier pool [SPECMESH_POOL]")
    parser.add_argument("--drafters", default=env_default("drafters", ""),
                        help="comma-separated drafter addresses host:port [SPECMESH_DRAFTERS]")
    parser.add_argument("--discovery", choices=DISCOVERY_MODES, default=env_default("discovery", "static"),
                        help="how drafters are found: static (--drafters), redis (drafters announce themselves in "
                             "the registry) or kubernetes (EndpointSlices of labelled Services) [SPECMESH_DISCOVERY]")
    parser.add_argument("--discovery-selector", default=env_default("discovery_selector", DEFAULT_SELECTOR),
                        help=f"kubernetes: label selector of the drafter Services (default {DEFAULT_SELECTOR}) "
                             "[SPECMESH_DISCOVERY_SELECTOR]")
    parser.add_argument("--namespace", default=env_default("namespace"),
                        help="kubernetes: namespace of the drafter Services (default: the router pod's) [SPECMESH_NAMESPACE]")
    parser.add_argument("--local-drafters", default=env_default("local_drafters", ""),
                        help="model-free drafters to run inside the router, comma-separated: ngram (prompt "
                             "lookup), history; they need only the tokens the router holds, so no network hop "
                             "[SPECMESH_LOCAL_DRAFTERS]")
    parser.add_argument("--listen", default=env_default("listen", "127.0.0.1:50051"), help="host:port [SPECMESH_LISTEN]")
    parser.add_argument("--http-listen", default=env_default("http_listen", "127.0.0.1:8000"),
                        help="host:port of the OpenAI-compatible HTTP API (/v1/chat/completions, ...); empty: off "
                             "[SPECMESH_HTTP_LISTEN]")
    parser.add_argument("--http-max-body", type=int, default=int(env_default("http_max_body", str(DEFAULT_MAX_BODY_BYTES))),
                        help="largest HTTP request body in bytes (larger: 413) [SPECMESH_HTTP_MAX_BODY]")
    parser.add_argument("--api-keys-file", default=env_default("api_keys_file"),
                        help="API keys, one a line (or sha256:<hex>), each optionally followed by a name; read again "
                             "when it changes. With SPECMESH_API_KEYS (comma-separated) the keys callers must send as "
                             "'authorization: Bearer <key>'. No key: loopback only, no authentication "
                             "[SPECMESH_API_KEYS_FILE]")
    parser.add_argument("--key-max-concurrent", type=int, default=int(env_default("key_max_concurrent", "0")),
                        help="calls in flight per API key (default 0: only --max-concurrent) [SPECMESH_KEY_MAX_CONCURRENT]")
    parser.add_argument("--key-requests-per-minute", type=int,
                        default=int(env_default("key_requests_per_minute", "0")),
                        help="calls a minute per API key (default 0: no limit) [SPECMESH_KEY_REQUESTS_PER_MINUTE]")
    parser.add_argument("--queue-key-file", default=env_default("queue_key_file"),
                        help="the key shared with the verifiers: jobs are tagged with it, only results tagged with "
                             "it are taken (else $SPECMESH_QUEUE_KEY; neither: untagged) [SPECMESH_QUEUE_KEY_FILE]")
    parser.add_argument("--metrics-address", default=env_default("metrics_address", "127.0.0.1:9400"),
                        help="serve Prometheus metrics at http://ADDRESS/metrics ('' = off) [SPECMESH_METRICS_ADDRESS]")
    parser.add_argument("--max-concurrent", type=int, default=int(env_default("max_concurrent", "64")))
    parser.add_argument("--max-queue-backlog", type=int, default=int(env_default("max_queue_backlog", "256")))
    parser.add_argument("--max-tree-nodes", type=int, default=int(env_default("max_tree_nodes", str(DEFAULT_TREE_NODES))))
    parser.add_argument("--default-max-tokens", type=int, default=int(env_default("default_max_tokens", "256")))
    parser.add_argument("--draft-ahead", choices=("on", "off"), default=env_default("draft_ahead", "on"),
                        help="draft the next tree while the current one is verified (default on)")
    parser.add_argument("--speculation", choices=SPECULATION_MODES, default=env_default("speculation", "adaptive"),
                        help="for requests that do not choose: adaptive (routed drafters, budget by goodput), fixed "
                             "(routed drafters, the whole budget) or off [SPECMESH_SPECULATION]")
    parser.add_argument("--speculation-margin", type=float,
                        default=float(env_default("speculation_margin", str(SPECULATION_MARGIN))),
                        help="adaptive: in a shared pass, the least predicted goodput gain a tree must promise, in "
                             "shares of one request's part of the batch's goodput (default "
                             f"{SPECULATION_MARGIN}) [SPECMESH_SPECULATION_MARGIN]")
    parser.add_argument("--max-drafters", type=int, default=int(env_default("max_drafters", "1")),
                        help="model drafters asked per step, the best for the request, besides the model-free ones "
                             "(default 1) [SPECMESH_MAX_DRAFTERS]")
    parser.add_argument("--explore", type=float, default=float(env_default("explore", "0.1")),
                        help="chance per step of also asking a drafter outside the best (default 0.1) [SPECMESH_EXPLORE]")
    parser.add_argument("--job-timeout", type=float, default=float(env_default("job_timeout", "30")),
                        help="seconds a verification step may take before the request fails UNAVAILABLE (a long "
                             "prefill counts from its verifier's last progress report)")
    parser.add_argument("--drafter-timeout", type=float, default=float(env_default("drafter_timeout", "2")),
                        help="deadline of each drafter call, seconds")
    add_tls_flags(parser, env_default)  # TLS on both client APIs; with --tls-ca, mutual TLS to the drafters
    parser.add_argument("--log-level", default=env_default("log_level", "INFO"))
    return parser


ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


async def watch_cluster(router: Router, verifier: QueueVerifierClient, metrics: RouterMetrics, every_s: float = 1.0,
                        server: Server | None = None) -> None:
    """Keep the cluster gauges current: queue depth, live verifiers, reachable drafters. With ``server``,
    the health of the Router service says whether any verifier is live (the server's own, "", stays
    SERVING: requests wait for a verifier within their deadline, so the router itself is not unready)."""
    shown: set[tuple[str, str]] = set()
    while True:
        try:
            metrics.queue_depth.set(await verifier.backlog())
        except Unavailable:
            pass  # Redis is down: the depth is unknown, the last value stays
        metrics.verifiers_alive.set(len(verifier.alive))
        if server is not None and not server.stopping.is_set() and verifier.looked.is_set():
            await server.set_serving(bool(verifier.alive), [ROUTER_SERVICE])
        now = {(d.name, getattr(d, "address", IN_ROUTER)): getattr(d, "healthy", True) for d in router.drafters}
        for labels, healthy in now.items():
            metrics.drafter_up.labels(*labels).set(1 if healthy else 0)
        for labels in shown - set(now):  # a drafter that left (discovery) is not "down": its series goes
            metrics.drafter_up.remove(*labels)
        shown = set(now)
        await asyncio.sleep(every_s)


async def serve(args: argparse.Namespace) -> None:
    configure_threads(1)
    policy = adaptive_policy({}, routing=RoutingConfig(max_drafters=args.max_drafters, explore=args.explore),
                             margin=args.speculation_margin)  # first: a bad flag fails before anything starts
    tls = TlsFiles.from_flags(args.tls_cert, args.tls_key, args.tls_ca)
    access = Access(ApiKeys.from_environment(args.api_keys_file),
                    KeyLimits(args.key_max_concurrent, args.key_requests_per_minute))
    check_exposure(access, [args.listen, args.http_listen])  # before anything starts
    target = load_target_parts(args.model)
    card = ModelCard(
        target.name, target.vocab_size, target.max_length, tokenizer_fingerprint(target.tokenizer),
        frozenset(target.eos_token_ids),
    )
    redis = aioredis.Redis.from_url(args.redis_url, socket_timeout=5, socket_connect_timeout=2)
    metrics = RouterMetrics()
    verifier = QueueVerifierClient(redis, QueueKeys(args.pool), f"router-{os.getpid()}-{uuid.uuid4().hex[:6]}",
                                   job_timeout_s=args.job_timeout, signer=QueueSigner.from_environment(args.queue_key_file),
                                   on_forged=metrics.forged_results.inc, on_resend=metrics.resent_jobs.inc,
                                   on_pass_curve=policy.calibrate)
    await verifier.start()
    local = [LocalDrafter(MODEL_FREE_DRAFTERS[name]()) for name in local_drafter_names(args.local_drafters)]
    drafters: list = [*local]
    credentials = tls.channel_credentials() if tls is not None and tls.ca is not None else None  # mTLS to drafters
    options = channel_options(args.tls_server_name) if credentials is not None else []
    remote = DrafterSet(drafters, lambda address: RemoteDrafter(address, timeout_s=args.drafter_timeout,
                                                                credentials=credentials, options=options),
                        card.tokenizer_hash,
                        hidden_size=target.hidden_size or None, num_layers=target.num_layers or None)
    await remote.update(a.strip() for a in args.drafters.split(",") if a.strip())
    discovery = None
    if args.discovery == "redis":
        discovery = asyncio.create_task(follow_registry(RedisRegistry(redis), remote))
    elif args.discovery == "kubernetes":
        watcher = KubernetesWatcher(kubernetes_api(), args.namespace or pod_namespace(), args.discovery_selector)
        discovery = asyncio.create_task(follow_kubernetes(watcher, remote))
    limits = RouterLimits(args.max_concurrent, args.max_queue_backlog, args.default_max_tokens, args.max_tree_nodes,
                          draft_ahead=args.draft_ahead == "on", speculation=args.speculation)
    endpoint = serve_metrics(metrics, args.metrics_address)
    router = Router(target.tokenizer, card, drafters, verifier, limits, policy, default_classifier(), metrics)
    servicer = RouterServicer(router, verifier)
    server = await start_server(
        [Service(ROUTER_SERVICE, lambda s: router_pb2_grpc.add_RouterServicer_to_server(servicer, s))],
        args.listen, metrics=metrics, access=access if access.keys.enabled else None, tls=tls,
    )
    http = None
    if args.http_listen:
        http = HttpServer(openai_app(router, lambda: len(verifier.alive), args.http_max_body,
                                     access if access.keys.enabled else None), args.http_listen, tls)
        await http.start()
    gauges = asyncio.create_task(watch_cluster(router, verifier, metrics, server=server))
    log.info("router on port %d: drafters %s (discovery %s), pool %s", server.port,
             ", ".join(d.name for d in drafters) or "none yet", args.discovery, args.pool)
    metrics_note = f", metrics at {endpoint.url}" if endpoint else ""
    http_note = f", OpenAI API at {http.url}" if http else ""
    auth_note = (f"{len(access.keys)} API key(s) required" if access.keys.enabled
                 else "no API keys: loopback only, no authentication")
    print(f"specmesh-router ready on port {server.port}{http_note}{metrics_note} ({auth_note})", flush=True)
    await server.wait(grace_s=30)
    if http is not None:
        await http.stop()
    gauges.cancel()
    if discovery is not None:
        discovery.cancel()
    if endpoint:
        endpoint.close()
    await verifier.stop()
    await remote.close()
    await asyncio.gather(*(d.close() for d in drafters if isinstance(d, RemoteDrafter)))
    await redis.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("specmesh-router", build_parser(), serve, argv)
