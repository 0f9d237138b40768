"""The router service: the client API in front of the verifier pool, which runs the requests' steps; the
router admits requests, streams their answers and owns the routing policy. The servicer only converts
messages; ``specmesh.cluster.gateway`` does the work."""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from typing import Sequence


from specmesh import __version__
from specmesh.cluster.auth import Access, ApiKeys, KeyLimits, check_exposure
from specmesh.cluster.discovery import reach_drafters
from specmesh.cluster.gateway import ModelCard, Gateway, GatewayLimits, TextStream, watch_cluster
from specmesh.cluster.metrics import RouterMetrics, serve_metrics
from specmesh.cluster.pipeline.engine_client import EngineClient
from specmesh.cluster.pipeline.messages import QueueKeys, QueueSigner
from specmesh.cluster.pipeline.policy_sync import RoutingPublisher
from specmesh.cluster.pipeline.verifier_watch import VerifierWatch
from specmesh.cluster.redis_clients import async_redis
from specmesh.cluster.remote_drafter import RemoteDrafter
from specmesh.cluster.serving import Service, run_service, start_server
from specmesh.cluster.service_settings import RouterSettings
from specmesh.cluster.tls import TlsFiles
from specmesh.cluster.wire import sampling_from_pb, trace_to_pb
from specmesh.drafters.catalog import MODEL_FREE_DRAFTERS
from specmesh.errors import InvalidArgument
from specmesh.runtime.loading import configure_threads, load_target_parts, tokenizer_fingerprint
from specmesh.services.router.convert import SPECULATION, stats_pb, usage_pb
from specmesh.services.router.openai_api import HttpServer, openai_app
from specmesh.speculation.classifier import default_classifier
from specmesh.speculation.expertise import GENERAL, RoutingConfig
from specmesh.speculation.drafting import LocalDrafter
from specmesh.speculation.policy import adaptive_policy
from specmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

log = logging.getLogger("specmesh.router")


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, gateway: Gateway, verifiers: VerifierWatch) -> None:
        self.gateway = gateway
        self.verifiers = verifiers

    def _prompt_ids(self, message) -> list[int]:
        kind = message.WhichOneof("input")
        if kind == "prompt":
            return self.gateway.encode_text(message.prompt)
        if kind == "chat":
            return self.gateway.encode_chat([(m.role, m.content) for m in message.chat.messages])
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
            sampling.max_tokens = self.gateway.limits.default_max_tokens
        budget = message.max_tree_nodes if message.HasField("max_tree_nodes") else None
        if message.speculation not in SPECULATION:
            raise InvalidArgument("speculation", f"unknown value {message.speculation}")
        return self.gateway.make_request(self._prompt_ids(message), sampling_from_pb(sampling), message.request_id,
                                        budget, text=self._text(message), speculation=SPECULATION[message.speculation],
                                        resume_ids=message.resume_ids.ids)

    async def Generate(self, request, context):
        ticket = await self.gateway.prepare(self._ticket, request)
        generation = None
        async for generation, _ in self.gateway.generate(ticket, final_only=True):  # the answer goes whole
            pass
        return router_pb2.GenerateResponse(
            request_id=request.request_id or ticket.request.request_id, text=self.gateway.decode(generation.token_ids),
            token_ids=generation.token_ids, finish_reason=generation.finish_reason or "length",
            usage=usage_pb(generation), stats=stats_pb(generation),
        )

    async def GenerateStream(self, request, context):
        ticket = await self.gateway.prepare(self._ticket, request)
        text = TextStream(self.gateway.decode, ticket.resumed)
        async for generation, step in self.gateway.generate(ticket):
            final = step.finish_reason is not None
            chunk = router_pb2.GenerateChunk(
                request_id=request.request_id or ticket.request.request_id, token_ids=step.token_ids,
                text=text.push(step.token_ids, final),
                finish_reason=step.finish_reason or "",
            )
            if step.timing is not None:
                chunk.step.CopyFrom(trace_to_pb(step.timing))
            if final:
                chunk.usage.CopyFrom(usage_pb(generation))
                chunk.stats.CopyFrom(stats_pb(generation))
            yield chunk

    async def CountTokens(self, request, context):
        ids = await self.gateway.prepare(self._prompt_ids, request)
        return router_pb2.CountTokensResponse(count=len(ids), token_ids=ids)

    def _card(self) -> router_pb2.ModelCard:
        card = self.gateway.card
        return router_pb2.ModelCard(id=card.name, tokenizer_hash=card.tokenizer_hash, max_length=card.max_length,
                                    vocab_size=card.vocab_size)

    async def ListModels(self, request, context):
        return router_pb2.ListModelsResponse(models=[self._card()])

    async def Info(self, request, context):
        limits = self.gateway.limits
        return router_pb2.RouterInfo(
            model=self._card(),
            drafters=[router_pb2.DrafterStatus(address=d.address, name=d.name, domains=d.domains or (GENERAL,),
                                               healthy=d.healthy)
                      for d in self.gateway.drafters],
            active_requests=self.gateway.active, max_concurrent_requests=limits.max_concurrent,
            max_tree_nodes=limits.max_tree_nodes, verifiers=len(self.verifiers.alive), version=__version__,
            routing=[router_pb2.RoutingEstimate(kind=kind, drafter=name, acceptance=value)
                     for kind, row in sorted(self.gateway.policy.expertise.table().items()) for name, value in sorted(row.items())],
            speculation=limits.speculation,
        )


ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


async def serve(args: RouterSettings) -> None:
    configure_threads(1)
    policy = adaptive_policy({}, routing=RoutingConfig(max_drafters=args.max_drafters, explore=args.explore),
                             margin=args.speculation_margin)  # first: a bad flag fails before anything starts
    tls = TlsFiles.from_flags(args.tls_cert, args.tls_key, args.tls_ca)
    access = _access(args)
    target = load_target_parts(args.model)
    card = ModelCard(target.name, target.vocab_size, target.max_length, tokenizer_fingerprint(target.tokenizer),
                     frozenset(target.eos_token_ids))
    redis = async_redis(args.redis_url)
    metrics = RouterMetrics()
    router_id = f"router-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    signer = QueueSigner.from_environment(args.queue_key_file)
    keys = QueueKeys(args.pool)
    verifiers = VerifierWatch(redis, keys, on_pass_curve=policy.calibrate)
    await verifiers.start()
    # the verifiers run the requests' steps, routed by this router's policy, learnt from what they report
    publisher = RoutingPublisher(redis, keys, router_id, policy.expertise, signer, metrics)
    engine = EngineClient(redis, keys, router_id, timeout_s=args.job_timeout, signer=signer,
                          on_forged=metrics.forged_results.inc, on_report=publisher.receive)
    await engine.start()
    publishing = asyncio.create_task(publisher.run())
    local = [LocalDrafter(MODEL_FREE_DRAFTERS[name]()) for name in args.local_drafter_names]
    drafters: list = [*local]
    remote, discovery = await reach_drafters(args, redis, drafters, card.tokenizer_hash, target.hidden_size or None,
                                             target.num_layers or None, tls)
    limits = GatewayLimits(max_concurrent=args.max_concurrent, max_queue_backlog=args.max_queue_backlog,
                           default_max_tokens=args.default_max_tokens, max_tree_nodes=args.max_tree_nodes,
                           speculation=args.speculation)
    endpoint = serve_metrics(metrics, args.metrics_address)
    gateway = Gateway(target.tokenizer, card, drafters, engine, limits, policy, default_classifier(), metrics)
    servicer = RouterServicer(gateway, verifiers)
    server = await start_server(
        [Service(ROUTER_SERVICE, lambda s: router_pb2_grpc.add_RouterServicer_to_server(servicer, s))],
        args.listen, metrics=metrics, access=access if access.keys.enabled else None, tls=tls,
    )
    http = None
    if args.http_listen:
        http = HttpServer(openai_app(gateway, lambda: len(verifiers.alive), args.http_max_body,
                                     access if access.keys.enabled else None), args.http_listen, tls)
        await http.start()
    gauges = asyncio.create_task(watch_cluster(gateway, verifiers, metrics, server=server, service=ROUTER_SERVICE))
    log.info("router on port %d: drafters %s (discovery %s), pool %s", server.port,
             ", ".join(d.name for d in drafters) or "none yet", args.discovery, args.pool)
    _say_ready(server.port, http, endpoint, access)
    await server.wait(grace_s=30)
    if http is not None:
        await http.stop()
    gauges.cancel()
    publishing.cancel()
    if discovery is not None:
        discovery.cancel()
    if endpoint:
        endpoint.close()
    await verifiers.stop()
    await engine.stop()
    await remote.close()
    await asyncio.gather(*(d.close() for d in drafters if isinstance(d, RemoteDrafter)))
    await redis.aclose()


def _access(args: RouterSettings) -> Access:
    """The callers' keys and limits, refused before anything starts if keyless ports face a network."""
    access = Access(ApiKeys.from_environment(args.api_keys_file),
                    KeyLimits(args.key_max_concurrent, args.key_requests_per_minute))
    check_exposure(access, [args.listen, args.http_listen])
    return access


def _say_ready(port: int, http: HttpServer | None, endpoint, access: Access) -> None:
    """The line a launcher waits for: where the router serves, and whether keys are required."""
    metrics_note = f", metrics at {endpoint.url}" if endpoint else ""
    http_note = f", OpenAI API at {http.url}" if http else ""
    auth_note = (f"{len(access.keys)} API key(s) required" if access.keys.enabled
                 else "no API keys: loopback only, no authentication")
    print(f"specmesh-router ready on port {port}{http_note}{metrics_note} ({auth_note})", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("specmesh-router", "Serve the client API of a specmesh cluster.", RouterSettings, serve,
                       argv)
