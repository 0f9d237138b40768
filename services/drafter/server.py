"""The drafter service: one drafter (an expert, a model-free lookup, a small LM) behind per-request
sessions. Drafting runs on one worker thread, off the event loop, since drafters are not thread-safe
and their model passes should not stall the server."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import time
from collections import OrderedDict
from typing import Sequence

import redis.asyncio as aioredis

from specmesh.cluster.discovery import RedisRegistry
from specmesh.cluster.metrics import DrafterMetrics, serve_metrics
from specmesh.cluster.serving import Service, TorchThread, env_default, run_service, start_server
from specmesh.cluster.tls import TlsFiles, add_tls_flags
from specmesh.cluster.wire import features_from_pb, tree_to_pb
from specmesh.drafters.base import Drafter
from specmesh.drafters.catalog import load_drafter
from specmesh.errors import InvalidArgument, NotFound
from specmesh.runtime.features import Features
from specmesh.runtime.loading import EMBEDDED_DEFAULT, configure_threads, load_target_parts, tokenizer_fingerprint
from specmesh.tree import MAX_TREE_NODES
from specmesh.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger("specmesh.drafter")
DEFAULT_SESSION_TOKENS = 1 << 15  # without a target's context to go by
DEFAULT_TOTAL_TOKENS = 1 << 20  # all sessions together (prompt lookup's index: ~0.8 KB a token)
TRIM_EVERY_S = 5.0  # how often freed memory may be handed back to the system


def trim_heap() -> None:
    """Give the C heap's free memory back to the system (glibc keeps freed small blocks otherwise)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class DrafterSessions:
    """The drafter's sessions, bounded three ways: no session grows past ``max_session_tokens`` (the
    target's context: no request is longer); past ``max_sessions`` sessions, or ``max_total_tokens``
    tokens in all, the least recently used are ended (their routers re-open them on NOT_FOUND). Memory
    freed by ended sessions goes back to the system (``trim``)."""

    def __init__(self, drafter: Drafter, vocab_size: int, max_sessions: int,
                 max_session_tokens: int = DEFAULT_SESSION_TOKENS, max_total_tokens: int = DEFAULT_TOTAL_TOKENS) -> None:
        self.drafter = drafter
        self.vocab_size = vocab_size
        self.max_sessions = max_sessions
        self.max_session_tokens = max_session_tokens
        self.max_total_tokens = max(max_total_tokens, max_session_tokens)
        self._sessions: OrderedDict[str, int] = OrderedDict()  # request -> tokens held, least recently used first
        self.total_tokens = 0
        self._ended = 0  # sessions ended since the heap was last trimmed
        self._trimmed_at = 0.0

    def __len__(self) -> int:
        return len(self._sessions)

    def _check_tokens(self, field: str, tokens: Sequence[int], held: int = 0) -> None:
        if held + len(tokens) > self.max_session_tokens:
            raise InvalidArgument(field, f"would make the session {held + len(tokens)} tokens long; at most "
                                         f"{self.max_session_tokens} (the target's context)")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgument(field, f"token ids {bad[:5]} are outside the vocabulary (0..{self.vocab_size - 1})")

    def _hold(self, request_id: str, tokens: int) -> None:
        """The session now holds ``tokens`` more; end the least recently used others past the bounds."""
        self._sessions[request_id] = self._sessions.get(request_id, 0) + tokens
        self._sessions.move_to_end(request_id)
        self.total_tokens += tokens
        while len(self._sessions) > 1 and (len(self._sessions) > self.max_sessions
                                           or self.total_tokens > self.max_total_tokens):
            self._end(next(iter(self._sessions)))

    def _end(self, request_id: str) -> None:
        self.total_tokens -= self._sessions.pop(request_id)
        self._ended += 1
        self.drafter.end(request_id)

    def open(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        if not request_id:
            raise InvalidArgument("request_id", "is empty")
        if not prompt_ids:
            raise InvalidArgument("prompt_ids", "is empty; a session starts from at least one token")
        self._check_tokens("prompt_ids", prompt_ids)
        if request_id in self._sessions:
            self._end(request_id)
        self.drafter.start(request_id, list(prompt_ids))
        self._hold(request_id, len(prompt_ids))

    def propose(self, request_id: str, committed: Sequence[int], budget: int, assumed: Sequence[int] = (),
                features: Features | None = None):
        if not 0 <= budget <= MAX_TREE_NODES:
            raise InvalidArgument("budget", f"must be in 0..{MAX_TREE_NODES}, got {budget}")
        if request_id not in self._sessions:
            raise NotFound(f"no drafting session for request {request_id!r}; open one first")
        self._check_tokens("committed", committed, self._sessions[request_id])
        self._check_tokens("assumed", assumed)  # guessed tokens, not held
        if committed:
            self.drafter.commit(request_id, list(committed))
        self._hold(request_id, len(committed))
        if features is not None:
            if not hasattr(self.drafter, "add_features"):
                raise InvalidArgument("features", f"drafter {self.drafter.name!r} reads no features; send none")
            self.drafter.add_features(request_id, features)
        return self.drafter.propose(request_id, budget, list(assumed))

    def close(self, request_id: str, committed: Sequence[int]) -> None:
        if request_id not in self._sessions:
            return
        try:
            self._check_tokens("committed", committed, self._sessions[request_id])
            if committed:
                self.drafter.commit(request_id, list(committed))
        finally:
            self._end(request_id)

    def trim_due(self, now: float) -> bool:
        """Sessions ended, and the last trim is ``TRIM_EVERY_S`` ago."""
        return bool(self._ended) and now - self._trimmed_at >= TRIM_EVERY_S

    def trim(self, now: float) -> bool:
        """Hand freed memory back to the system when it is due."""
        if not self.trim_due(now):
            return False
        trim_heap()
        self._ended, self._trimmed_at = 0, now
        return True


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
        started = time.perf_counter()
        features = features_from_pb(request.features) if request.HasField("features") else None
        tree = await self._run(self.sessions.propose, request.request_id, tuple(request.committed), request.budget,
                               tuple(request.assumed), features)
        seconds = time.perf_counter() - started
        self.metrics.sessions.labels(self.info.name).set(len(self.sessions))  # growing, it may have ended others
        await self._trim()
        self.metrics.proposals.labels(self.info.name).inc()
        self.metrics.proposed_nodes.labels(self.info.name).inc(len(tree))
        self.metrics.propose_seconds.labels(self.info.name).observe(seconds)
        return drafter_pb2.ProposeResponse(tree=tree_to_pb(tree), draft_ms=seconds * 1e3)

    async def CloseSession(self, request, context):
        await self._run(self.sessions.close, request.request_id, tuple(request.committed))
        self.metrics.sessions.labels(self.info.name).set(len(self.sessions))
        await self._trim()
        return drafter_pb2.CloseSessionResponse()

    async def Info(self, request, context):
        info = drafter_pb2.DrafterInfo()
        info.CopyFrom(self.info)
        info.active_sessions = len(self.sessions)
        return info



def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specmesh-drafter", description="Serve one drafter over gRPC.")
    parser.add_argument("--drafter", default=env_default("drafter", "ngram"),
                        help="ngram, history, a shipped expert (code, math, writing, knowledge, chat), a drafter directory "
                             "or a small HF model sharing the target's tokenizer [SPECMESH_DRAFTER]")
    parser.add_argument("--target", default=env_default("target", EMBEDDED_DEFAULT),
                        help="the target model drafted for (its tokenizer and embeddings are read) [SPECMESH_TARGET]")
    parser.add_argument("--domains", default=env_default("domains"),
                        help="comma-separated domains this drafter is good at (default: the expert's own, else general)")
    parser.add_argument("--listen", default=env_default("listen", "127.0.0.1:50061"), help="host:port [SPECMESH_LISTEN]")
    parser.add_argument("--metrics-address", default=env_default("metrics_address", "127.0.0.1:9402"),
                        help="serve Prometheus metrics at http://ADDRESS/metrics ('' = off) [SPECMESH_METRICS_ADDRESS]")
    parser.add_argument("--announce", default=env_default("announce"),
                        help="host:port at which routers reach this drafter: announced in the Redis registry (with "
                             "--redis-url) for routers started with --discovery redis [SPECMESH_ANNOUNCE]")
    parser.add_argument("--redis-url", default=env_default("redis_url", "redis://127.0.0.1:6379/0"),
                        help="the registry for --announce [SPECMESH_REDIS_URL]")
    parser.add_argument("--threads", type=int, default=int(env_default("threads", "1")), help="torch threads")
    parser.add_argument("--max-sessions", type=int, default=int(env_default("max_sessions", "1024")))
    parser.add_argument("--max-tokens", type=int, default=int(env_default("max_tokens", str(DEFAULT_TOTAL_TOKENS))),
                        help="tokens all sessions may hold together; past it the least recently used end (each "
                             "session holds at most the target's context) [SPECMESH_MAX_TOKENS]")
    parser.add_argument("--device", default=env_default("device"),
                        help="where the drafter runs: cpu, cuda, cuda:N or auto (default: an expert on the CPU, "
                             "a model on CUDA when present) [SPECMESH_DEVICE]")
    parser.add_argument("--dtype", default=env_default("dtype"))
    add_tls_flags(parser, env_default)  # with --tls-ca: mutual TLS, only the cluster's router may call
    parser.add_argument("--log-level", default=env_default("log_level", "INFO"))
    return parser


def load(args: argparse.Namespace):
    configure_threads(args.threads)
    target = load_target_parts(args.target)
    return target, load_drafter(args.drafter, target, args.device, args.dtype)


async def serve(args: argparse.Namespace) -> None:
    tls = TlsFiles.from_flags(args.tls_cert, args.tls_key, args.tls_ca)  # first: a bad flag fails before loading
    if tls is not None and tls.ca is None:
        log.warning("TLS without --tls-ca: any caller is answered; give the cluster's CA to require its certificates")
    torch_thread = TorchThread("draft")
    target, drafter = await torch_thread.run(load, args)
    domains = [d for d in (args.domains or getattr(drafter, "domain", "") or "general").split(",") if d]
    info = drafter_pb2.DrafterInfo(
        name=drafter.name, kind=getattr(drafter, "kind", "model"), domains=domains, target=target.name,
        tokenizer_hash=tokenizer_fingerprint(target.tokenizer), max_sessions=args.max_sessions,
        feature_layers=getattr(drafter, "feature_layers", ()),
        hidden_size=target.hidden_size if getattr(drafter, "feature_layers", ()) else 0,
    )
    metrics = DrafterMetrics()
    endpoint = serve_metrics(metrics, args.metrics_address)
    sessions = DrafterSessions(drafter, target.vocab_size, args.max_sessions, target.max_length or DEFAULT_SESSION_TOKENS,
                               args.max_tokens)
    servicer = DrafterServicer(sessions, info, torch_thread, metrics)
    server = await start_server(
        [Service(drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name,
                 lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, s))],
        args.listen, metrics=metrics, tls=tls, require_client_cert=tls is not None and tls.ca is not None,
    )
    log.info("drafter %s (%s, domains %s) serving on port %d", drafter.name, info.kind, ",".join(domains), server.port)
    announcing = redis = None
    if args.announce:
        redis = aioredis.Redis.from_url(args.redis_url, socket_timeout=5, socket_connect_timeout=2)
        announcing = asyncio.create_task(RedisRegistry(redis).heartbeat(args.announce, drafter.name, domains))
    metrics_note = f", metrics at {endpoint.url}" if endpoint else ""
    print(f"specmesh-drafter ready on port {server.port}{metrics_note}", flush=True)
    await server.wait()
    if announcing is not None:  # withdrawn: routers stop sending new requests at once
        announcing.cancel()
        await asyncio.gather(announcing, return_exceptions=True)
        await redis.aclose()
    if endpoint:
        endpoint.close()


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("specmesh-drafter", build_parser(), serve, argv)
