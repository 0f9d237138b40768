"""The drafter service: one drafter (an expert, a model-free lookup, a small LM) behind per-request
sessions. Drafting runs on one worker thread, off the event loop, since drafters are not thread-safe
and their model passes should not stall the server."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Sequence

import grpc

from specmesh.cluster.discovery import RedisRegistry
from specmesh.cluster.drafter_sessions import DEFAULT_SESSION_TOKENS, MAX_PROPOSE_ITEMS, DrafterSessions
from specmesh.cluster.metrics import DrafterMetrics, serve_metrics
from specmesh.cluster.redis_clients import async_redis
from specmesh.cluster.serving import Service, TorchThread, run_service, start_server, status_for
from specmesh.cluster.service_settings import DrafterSettings
from specmesh.cluster.tls import TlsFiles
from specmesh.cluster.wire import features_from_pb, tree_to_pb
from specmesh.drafters.catalog import load_drafter
from specmesh.errors import InvalidArgument
from specmesh.runtime.loading import configure_threads, load_target_parts, tokenizer_fingerprint
from specmesh.tree import TokenTree
from specmesh.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger("specmesh.drafter")


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, sessions: DrafterSessions, info: drafter_pb2.DrafterInfo, torch_thread: TorchThread,
                 metrics: DrafterMetrics | None = None) -> None:
        self.sessions = sessions
        self.info = info
        self._run = torch_thread.run
        self.metrics = metrics or DrafterMetrics()

    async def OpenSession(self, request, context):
        await self._run(self.sessions.open, request.request_id, tuple(request.prompt_ids))
        self.metrics.sessions.labels(self.info.name).set(len(self.sessions))
        await self._trim()  # it may have ended the least recently used
        return drafter_pb2.OpenSessionResponse()

    async def _trim(self) -> None:
        if self.sessions.trim_due(time.monotonic()):  # on the drafting thread: it frees what that thread holds
            await self._run(self.sessions.trim, time.monotonic())

    async def Propose(self, request, context):
        [proposal] = await self._propose([request])
        if proposal.error is not None:
            raise proposal.error  # the interceptor maps it to its status
        return proposal.answer()

    async def ProposeMany(self, request, context):
        return await self._propose_many(request)

    async def ProposeStream(self, request_iterator, context):
        async for request in request_iterator:  # answered in order, one at a time
            yield await self._propose_many(request)

    async def _propose_many(self, request: drafter_pb2.ProposeManyRequest) -> drafter_pb2.ProposeManyResponse:
        if len(request.items) > MAX_PROPOSE_ITEMS:
            raise InvalidArgument("items", f"{len(request.items)} proposals in one call; at most {MAX_PROPOSE_ITEMS}")
        self.metrics.propose_batch_items.labels(self.info.name).observe(len(request.items))
        proposals = await self._propose(request.items)
        return drafter_pb2.ProposeManyResponse(results=[p.result() for p in proposals])

    async def _propose(self, items: Sequence[drafter_pb2.ProposeRequest]) -> list[Proposal]:
        """Every item drafted on the drafting thread, one hop for them all."""
        proposals = await self._run(propose_each, self.sessions, items)
        self.metrics.sessions.labels(self.info.name).set(len(self.sessions))  # growing, it may have ended others
        await self._trim()
        for proposal in proposals:
            if proposal.error is None:
                self.metrics.proposals.labels(self.info.name).inc()
                self.metrics.proposed_nodes.labels(self.info.name).inc(len(proposal.tree))
                self.metrics.propose_seconds.labels(self.info.name).observe(proposal.seconds)
        return proposals

    async def CloseSession(self, request, context):
        await self._run(self.sessions.close, request.request_id, tuple(request.committed))
        self.metrics.sessions.labels(self.info.name).set(len(self.sessions))
        await self._trim()
        return drafter_pb2.CloseSessionResponse()

    async def end_idle(self, idle_s: float, every_s: float = 5.0) -> None:
        """Now and then, end the sessions unused for ``idle_s`` (their routers are most likely gone)."""
        while True:
            await asyncio.sleep(every_s)
            if await self._run(self.sessions.end_idle, idle_s):
                self.metrics.sessions.labels(self.info.name).set(len(self.sessions))
                await self._trim()

    async def Info(self, request, context):
        info = drafter_pb2.DrafterInfo()
        info.CopyFrom(self.info)
        info.active_sessions = len(self.sessions)
        return info


@dataclass
class Proposal:
    """One item's answer: its tree and the time it took, or the error that is its answer alone."""

    tree: TokenTree
    seconds: float
    error: Exception | None = None

    def answer(self) -> drafter_pb2.ProposeResponse:
        return drafter_pb2.ProposeResponse(tree=tree_to_pb(self.tree), draft_ms=self.seconds * 1e3)

    def result(self) -> drafter_pb2.ProposeResult:
        if self.error is None:
            return drafter_pb2.ProposeResult(answer=self.answer())
        code, message = status_for(self.error)
        if code == grpc.StatusCode.INTERNAL:  # a bug, as the interceptor logs a failed call's
            log.error("a proposal failed", exc_info=self.error)
        return drafter_pb2.ProposeResult(code=code.value[0], message=message)


def propose_each(sessions: DrafterSessions, items: Sequence[drafter_pb2.ProposeRequest]) -> list[Proposal]:
    """Each item as its own Propose would be drafted, in order (on the drafting thread): an item that fails
    (an unknown session, invalid tokens or features) fails alone."""
    proposals = []
    for item in items:
        started = time.perf_counter()
        try:
            features = features_from_pb(item.features) if item.HasField("features") else None
            committed = tuple(item.committed)
            if item.opens:  # its first proposal: the session starts from the committed tokens
                sessions.open(item.request_id, committed)
                committed = ()
            tree = sessions.propose(item.request_id, committed, item.budget, tuple(item.assumed), features)
        except Exception as exc:
            proposals.append(Proposal(TokenTree(), time.perf_counter() - started, exc))
        else:
            proposals.append(Proposal(tree, time.perf_counter() - started))
    return proposals


def load(args: DrafterSettings):
    configure_threads(args.threads)
    target = load_target_parts(args.model)
    return target, load_drafter(args.drafter, target, args.device, args.dtype)


async def serve(args: DrafterSettings) -> None:
    tls = TlsFiles.from_flags(args.tls_cert, args.tls_key, args.tls_ca)  # first: a bad flag fails before loading
    if tls is not None and tls.ca is None:
        log.warning("TLS without --tls-ca: any caller is answered; give the cluster's CA to require its certificates")
    torch_thread = TorchThread("draft")
    target, drafter = await torch_thread.run(load, args)
    domains = args.domain_names or list(drafter.domains or ("general",))
    info = drafter_pb2.DrafterInfo(
        name=drafter.name, kind=drafter.kind, domains=domains, target=target.name,
        tokenizer_hash=tokenizer_fingerprint(target.tokenizer), max_sessions=args.max_sessions,
        feature_layers=drafter.feature_layers, hidden_size=target.hidden_size if drafter.feature_layers else 0,
        opens_in_propose=True, proposes_in_stream=True,
    )
    metrics = DrafterMetrics()
    endpoint = serve_metrics(metrics, args.metrics_address)
    sessions = DrafterSessions(drafter, target.vocab_size, args.max_sessions, target.max_length or DEFAULT_SESSION_TOKENS,
                               args.max_held_tokens)
    servicer = DrafterServicer(sessions, info, torch_thread, metrics)
    server = await start_server(
        [Service(drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name,
                 lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, s))],
        args.listen, metrics=metrics, tls=tls, require_client_cert=tls is not None and tls.ca is not None,
    )
    log.info("drafter %s (%s, domains %s) serving on port %d", drafter.name, info.kind, ",".join(domains), server.port)
    announcing = redis = None
    if args.announce:
        redis = async_redis(args.redis_url)
        announcing = asyncio.create_task(RedisRegistry(redis).heartbeat(args.announce, drafter.name, domains))
    metrics_note = f", metrics at {endpoint.url}" if endpoint else ""
    print(f"specmesh-drafter ready on port {server.port}{metrics_note}", flush=True)
    sweeping = asyncio.create_task(servicer.end_idle(args.session_idle_s))
    await server.wait()
    sweeping.cancel()
    if announcing is not None:  # withdrawn: routers stop sending new requests at once
        announcing.cancel()
        await asyncio.gather(announcing, return_exceptions=True)
        await redis.aclose()
    if endpoint:
        endpoint.close()


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("specmesh-drafter", "Serve one drafter over gRPC.", DrafterSettings, serve, argv)
