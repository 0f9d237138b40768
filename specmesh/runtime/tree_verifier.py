"""The verifier: the target model's side of a speculation step, for a batch of requests at once.

A verifier holds one KV session per request it has seen. Each job names the request, the number of
committed tokens before the tree's root (``position``), the root and the drafted tree. When the
verifier's session does not hold exactly those ``position`` tokens — it never saw the request, it
evicted it, it restarted, or another verifier took the request over — it needs the committed tokens
themselves: a job may carry them (``history``), and one that does not gets a *resync* answer, after
which the sender sends them. So a verifier holds nothing the router cannot rebuild, and any verifier
can take over any request at the cost of one prefill.

Sampling randomness is derived per step from the request's seed and position, so a seeded request
gives the same tokens whichever verifier happens to verify each of its steps.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import torch

from specmesh.acceptance import Verdict, verify_greedy, verify_mss
from specmesh.errors import InvalidArgument, RequestFailed
from specmesh.runtime.features import MAX_PROMPT_FEATURES, Features
from specmesh.runtime.llama import TreeBatch, check_feature_layers
from specmesh.runtime.prefill_cost import PrefillCost
from specmesh.runtime.target import TargetRuntime, prefill_sessions, score_with_features
from specmesh.sampling import SamplingParams, target_probabilities
from specmesh.tree import MAX_TREE_NODES, CompiledTree, TokenTree, compile_tree

_MASK64 = (1 << 64) - 1
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifyJob:
    request_id: str
    step: int  # the request's step number: (request_id, step) names the job, results are idempotent
    position: int  # committed tokens before the root: what the session must hold
    root: int  # the last committed token, not yet cached
    tree: TokenTree
    params: SamplingParams
    history: tuple[int, ...] | None = None  # the ``position`` committed tokens, when a resync may be needed
    feature_layers: tuple[int, ...] = ()  # return the target's hidden states after these layers (feature drafters)
    max_prompt_features: int = MAX_PROMPT_FEATURES  # of a prefill's positions, return at most the last this many


@dataclass(frozen=True)
class VerifyResult:
    request_id: str
    step: int
    verdict: Verdict | None  # None: resync — send the job again with its history
    prefilled_tokens: int = 0  # tokens this job had to prefill (0 when the session was reused)
    pass_ms: float = 0.0  # time of the tree pass this job was verified in (prefill excluded)
    batch_rows: int = 0  # rows of that pass: every job's root and tree nodes
    batch_size: int = 0  # jobs in that pass
    batch_trees: int = 0  # jobs in that pass with a tree (the others are plain decoding steps)
    verify_ms: float = 0.0  # the verifier's whole work for that pass: any prefill, then the tree pass
    queue_ms: float = 0.0  # how long the job waited on its verifier before that pass (0 in process)
    refused: str = ""  # why the job was not verified (its KV cache does not fit now); verdict None
    features: Features | None = None  # the job's feature_layers at the root and accepted nodes (after a
    # prefill, the prefilled positions' last ones first), fp16 on the CPU
    prefilling: bool = False  # its history is only partly cached: verify the same job again (verdict None)
    failed: str = ""  # why this request alone failed in the pass (its numbers): it ends with RequestFailed

    @property
    def resync(self) -> bool:
        return self.verdict is None and not self.refused and not self.prefilling and not self.failed


@dataclass
class Prefill:
    """A history being cached over several passes (chunked prefill)."""

    step: int  # of the job whose history it is: another step of the request starts over
    tail: torch.Tensor | None = None  # feature rows of the positions cached so far (the last ones kept)


@dataclass
class VerifierStats:
    batches: int = 0
    jobs: int = 0
    tree_nodes: int = 0
    resyncs: int = 0
    busy_s: float = 0.0  # time spent in the target's forward passes and acceptance
    started: float = field(default_factory=time.monotonic)

    def idle_fraction(self, now: float | None = None) -> float:
        wall = (now or time.monotonic()) - self.started
        return max(0.0, 1.0 - self.busy_s / wall) if wall > 0 else 0.0


def step_generator(params: SamplingParams, position: int, device: torch.device, fallback: torch.Generator) -> torch.Generator:
    """The random stream of one sampled step: from (seed, position) when seeded, else the verifier's own."""
    if params.seed is None:
        return fallback
    x = (params.seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 1) & _MASK64  # splitmix64 finaliser
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    generator = torch.Generator(device=device)
    generator.manual_seed((x ^ (x >> 31)) & ((1 << 63) - 1))
    return generator


FIRST_CHUNK = 64  # tokens of a budgeted prefill's first pass, whatever the budget


class TreeVerifier:
    """Verifies batches of jobs with one target forward per batch; keeps at most ``max_sessions`` sessions.

    A job whose history must be cached is verified in the same call, unless the call gives a prefill time
    budget (``verify(..., prefill_ms=)``): then a long history is cached a chunk per call, the job coming
    back ``prefilling`` until its tree can be verified, so that other requests' steps go on between."""

    def __init__(self, runtime: TargetRuntime, max_sessions: int = 256, max_tree_nodes: int = MAX_TREE_NODES) -> None:
        if max_sessions < 1:
            raise InvalidArgument("max_sessions", f"must be >= 1, got {max_sessions}")
        self.runtime = runtime
        self.max_sessions = max_sessions
        self.max_tree_nodes = max_tree_nodes
        self._sessions: OrderedDict[str, object] = OrderedDict()  # least recently used first
        self._last_used: dict[str, float] = {}
        self._random = torch.Generator(device=runtime.device)
        self._random.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        self.stats = VerifierStats()
        self._warned: set[str] = set()  # each reason features cannot be given is logged once
        self._prefilling: dict[str, Prefill] = {}  # requests whose history is partly cached
        self.prefill_cost = PrefillCost()  # what a prefill call costs: its chunks are sized on it

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    @property
    def session_ids(self) -> set[str]:
        """The requests whose KV cache it holds."""
        return set(self._sessions)

    @property
    def cache_bytes(self) -> int:
        """Memory held by every session's KV cache (read from any thread: a pass may open or close one)."""
        return sum(session.nbytes for session in list(self._sessions.values()))

    def check(self, job: VerifyJob) -> None:
        """Refuse a job that no model could verify (the router validates requests before this)."""
        vocab = self.runtime.vocab_size
        if len(job.tree) > self.max_tree_nodes:
            raise InvalidArgument("tree", f"has {len(job.tree)} nodes; this verifier takes at most {self.max_tree_nodes}")
        tokens = (job.root, *job.tree.tokens, *(job.history or ()))
        if any(not 0 <= t < vocab for t in tokens):
            raise InvalidArgument("tree", f"holds token ids outside the vocabulary (0..{vocab - 1})")
        if job.history is not None and len(job.history) != job.position:
            raise InvalidArgument("history", f"has {len(job.history)} tokens but position is {job.position}")
        if job.max_prompt_features < 0:
            raise InvalidArgument("max_prompt_features", f"must be >= 0, got {job.max_prompt_features}")
        if job.position + 1 + len(job.tree) > self.runtime.max_length:
            raise InvalidArgument("position", f"{job.position} + tree exceeds the model's context of {self.runtime.max_length}")

    def features_unavailable(self, layers: Sequence[int]) -> str | None:
        """Why this verifier cannot return these hidden states (None when it can): a job asking for them is
        verified without (its feature drafters draft nothing), never refused."""
        if not hasattr(self.runtime, "score"):
            return f"{type(self.runtime).__name__} returns no hidden states"
        try:
            check_feature_layers(layers, self.runtime.config.num_hidden_layers)
        except InvalidArgument as exc:
            return str(exc)
        return None

    def resuming(self, job: VerifyJob) -> bool:
        """Whether the job continues a prefill an earlier call began."""
        state, session = self._prefilling.get(job.request_id), self._sessions.get(job.request_id)
        return state is not None and state.step == job.step and session is not None and session.length < job.position

    def next_prefill(self, job: VerifyJob) -> int:
        """History tokens the job's next budgeted call may cache (0: its session holds them already): a new
        request's first chunk, or a prefill under way's next at most (``prefill_chunks`` cuts it to a budget)."""
        session = self._sessions.get(job.request_id)
        if job.history is None or (session is not None and session.length == job.position):
            return 0
        if not self._under_way(job):
            return min(job.position, FIRST_CHUNK)
        return job.position - session.length

    def _under_way(self, job: VerifyJob) -> bool:
        """Whether an earlier call cached a chunk of the job's history already."""
        return self.resuming(job) and self._sessions[job.request_id].length > 0

    def prefill_chunks(self, jobs: Sequence[VerifyJob], budget_ms: float | None = None) -> list[int]:
        """History tokens each job's next call caches, within ``budget_ms`` (a budget can drop from one pass to
        the next: the prefill had the verifier to itself, now shares it). Prefills under way share the tokens
        the measured prefill cost fits in the budget, shortest remainder first (the least mean wait: a short
        prompt's last chunk does not queue behind a long one's), at least a token each; a new request's first
        chunk is ``FIRST_CHUNK`` tokens whatever the budget."""
        chunks = [self.next_prefill(job) for job in jobs]
        if budget_ms is None:
            return chunks
        left = self.prefill_cost.tokens_within(budget_ms)
        under_way = [i for i, job in enumerate(jobs) if chunks[i] and self._under_way(job)]
        for i in sorted(under_way, key=lambda i: chunks[i]):
            chunks[i] = min(chunks[i], max(1, left))
            left = max(0, left - chunks[i])
        return chunks

    def verify(self, jobs: Sequence[VerifyJob], prefill_ms: float | None = None) -> list[VerifyResult]:
        """One verification pass for every job whose session is (or can be made) current. ``prefill_ms``:
        cache at most about this long of the histories this call (None: all of them)."""
        if len({j.request_id for j in jobs}) != len(jobs):
            raise InvalidArgument("jobs", "two jobs of one batch belong to the same request")
        for job in jobs:
            self.check(job)
        jobs = [self._without_unavailable_features(job) for job in jobs]
        started = time.perf_counter()
        results: dict[int, VerifyResult] = {}
        ready: list[int] = []
        prefills: list[int] = []
        for i, job in enumerate(jobs):
            session = self._sessions.get(job.request_id)
            current = session is not None and session.length == job.position
            if current or job.history is not None:
                if not current and not self.resuming(job):
                    self.close(job.request_id)
                    self._open(job.request_id)
                    self._prefilling[job.request_id] = Prefill(job.step)
                self._sessions.move_to_end(job.request_id)
                self._last_used[job.request_id] = time.monotonic()
                if not current:
                    prefills.append(i)
                ready.append(i)
            else:
                self.stats.resyncs += 1
                results[i] = VerifyResult(job.request_id, job.step, None)
        refused = self._make_room([jobs[i] for i in ready])
        for i in [i for i in ready if jobs[i].request_id in refused]:
            results[i] = VerifyResult(jobs[i].request_id, jobs[i].step, None, refused=refused[jobs[i].request_id])
            ready.remove(i)
            if i in prefills:
                prefills.remove(i)
        prompt_features = self._prefill([jobs[i] for i in prefills], prefill_ms)
        for i in prefills:
            job = jobs[i]
            if self._sessions[job.request_id].length < job.position:  # more chunks to come
                ready.remove(i)
                results[i] = VerifyResult(job.request_id, job.step, None, prefilling=True)
            else:
                self._prefilling.pop(job.request_id, None)
        prefill_ms = (time.perf_counter() - started) * 1e3
        if ready:
            passed_at = time.perf_counter()
            verdicts, step_features = self._verify_trees([jobs[i] for i in ready])
            pass_ms = (time.perf_counter() - passed_at) * 1e3
            rows = sum(1 + len(jobs[i].tree) for i in ready)
            trees = sum(1 for i in ready if len(jobs[i].tree))
            for i, verdict, features in zip(ready, verdicts, step_features):
                if isinstance(verdict, str):
                    results[i] = VerifyResult(jobs[i].request_id, jobs[i].step, None, failed=verdict)
                    continue
                prefilled = jobs[i].position if i in prefills else 0
                if features is not None and jobs[i].request_id in prompt_features:
                    before = prompt_features[jobs[i].request_id]
                    features = Features(before.start, torch.cat([before.values, features.values]), features.layers)
                results[i] = VerifyResult(jobs[i].request_id, jobs[i].step, verdict, prefilled, pass_ms, rows, len(ready),
                                          trees, prefill_ms + pass_ms, features=features)
        self.stats.batches += 1
        self.stats.jobs += len(jobs)
        self.stats.busy_s += time.perf_counter() - started
        return [results[i] for i in range(len(jobs))]

    def _without_unavailable_features(self, job: VerifyJob) -> VerifyJob:
        if not job.feature_layers:
            return job
        why = self.features_unavailable(job.feature_layers)
        if why is None:
            return job
        if why not in self._warned:
            self._warned.add(why)
            log.warning("jobs ask for hidden states this verifier cannot give (%s): verified without them", why)
        return dataclasses.replace(job, feature_layers=())

    def abandon(self, job: VerifyJob) -> None:
        """The job will not be verified (its router gave up): free the history cached for it so far."""
        if self.resuming(job):
            self.close(job.request_id)

    def close(self, request_id: str) -> None:
        session = self._sessions.pop(request_id, None)
        self._last_used.pop(request_id, None)
        self._prefilling.pop(request_id, None)
        if session is not None:
            session.free()

    def evict_idle(self, max_idle_s: float) -> int:
        """Free sessions unused for ``max_idle_s`` (their router went away); returns how many."""
        cutoff = time.monotonic() - max_idle_s
        idle = [rid for rid, used in self._last_used.items() if used < cutoff]
        for request_id in idle:
            self.close(request_id)
        return len(idle)

    def close_all(self) -> None:
        for request_id in list(self._sessions):
            self.close(request_id)

    def _open(self, request_id: str) -> None:
        while len(self._sessions) >= self.max_sessions:  # the least recently used request pays a resync
            self.close(next(iter(self._sessions)))
        self._sessions[request_id] = self.runtime.new_session()
        self._last_used[request_id] = time.monotonic()

    def _make_room(self, jobs: Sequence[VerifyJob]) -> dict[str, str]:
        """On a runtime with a KV budget: free the least recently used other sessions until it holds the
        bytes this pass needs (each evicted request pays a resync later); if it still cannot, refuse the
        jobs that need the most until the rest fit. Returns the refused ones: request id -> why. Nothing
        is over-committed."""
        pool = getattr(self.runtime, "pool", None)  # a KVPool (CUDA) or KVBudget (CPU); None: no limit
        if pool is None:
            return {}
        needed = {job.request_id: pool.extra_bytes(self._sessions[job.request_id], job.position + 1 + len(job.tree))
                  for job in jobs}
        others = [rid for rid in self._sessions if rid not in needed]  # least recently used first, prefills
        for request_id in sorted(others, key=lambda rid: rid in self._prefilling):  # under way last (sorted is stable)
            if pool.free_bytes >= sum(needed.values()):
                return {}
            self.close(request_id)
        refused = {}
        for request_id in sorted(needed, key=needed.get, reverse=True):
            if pool.free_bytes >= sum(needed.values()):
                break
            refused[request_id] = (f"KV cache full: the job needs {needed.pop(request_id) / 2**20:.1f} MiB more; "
                                   f"the cache holds {pool.capacity_bytes / 2**30:.2f} GiB in all")
            self.close(request_id)
        return refused

    def _prefill(self, jobs: Sequence[VerifyJob], budget_ms: float | None) -> dict[str, Features]:
        """Cache each job's history (all of it, or with ``budget_ms`` each one's next chunk), in chunks so
        attention memory stays bounded. Returns, for the jobs whose history is now cached and that ask for
        features, the hidden states of their last ``max_prompt_features`` positions."""
        if not jobs:
            return {}
        sessions = [self._sessions[j.request_id] for j in jobs]
        before = [s.length for s in sessions]
        ends = [j.position if budget_ms is None else s.length + chunk
                for j, s, chunk in zip(jobs, sessions, self.prefill_chunks(jobs, budget_ms))]
        layers = _union([j.feature_layers for j in jobs])
        started = time.perf_counter()
        hidden = prefill_sessions(self.runtime, sessions, [j.history[:end] for j, end in zip(jobs, ends)], layers)
        self.prefill_cost.observe(sum(e - b for e, b in zip(ends, before)), (time.perf_counter() - started) * 1e3)
        tails = {}
        for job, values in zip(jobs, hidden):
            if not job.feature_layers or values is None:
                continue
            values = values[:, [layers.index(n) for n in job.feature_layers]]  # [positions, job's layers, hidden]
            state = self._prefilling.get(job.request_id)
            if state is not None and state.tail is not None:  # the chunks before this one
                values = torch.cat([state.tail, values])
            values = values[max(0, values.shape[0] - job.max_prompt_features):]
            if self._sessions[job.request_id].length < job.position:
                state.tail = values
                continue
            tails[job.request_id] = Features(job.position - values.shape[0], values.half().cpu(), job.feature_layers)
        return tails

    def _verify_trees(self, jobs: Sequence[VerifyJob]) -> tuple[list[Verdict | str], list[Features | None]]:
        """Each job's verdict, or why it failed (a string: that request's cache is dropped, the others go
        on), and its features."""
        sessions = [self._sessions[j.request_id] for j in jobs]
        trees: list[CompiledTree] = [compile_tree(j.root, j.tree) for j in jobs]
        batch = TreeBatch.build(sessions, trees)
        layers = _union([j.feature_layers for j in jobs])
        if layers:
            scores = score_with_features(self.runtime, batch, layers)
            logits, hidden = scores.logits, scores.features  # [total_rows, vocab], [total_rows, layers, hidden]
        else:
            logits, hidden = self.runtime.forward(batch), None
        verdicts, features = [], []
        offset = 0
        for job, session, tree in zip(jobs, sessions, trees):
            start, offset = offset, offset + tree.num_rows
            rows = logits[start:offset]
            try:
                verdict = self._accept(job, tree, rows)
            except Exception as exc:  # one request's fault fails that request, not the pass
                if not isinstance(exc, RequestFailed):
                    log.exception("request %s: its acceptance failed", job.request_id)
                self.close(job.request_id)  # its cache holds the tree's rows
                verdicts.append(f"step {job.step}: {exc}")
                features.append(None)
                continue
            kept = [0] + [node + 1 for node in verdict.accepted_nodes]
            session.keep_rows(kept)
            if job.feature_layers:  # the root's and accepted nodes' rows: positions position.. of the committed
                block = hidden[start + torch.tensor(kept, device=hidden.device)].half().cpu()
                features.append(Features(job.position, block, layers).of_layers(job.feature_layers))
            else:
                features.append(None)
            self.stats.tree_nodes += len(job.tree)
            verdicts.append(verdict)
        return verdicts, features

    def _accept(self, job: VerifyJob, tree: CompiledTree, rows: torch.Tensor) -> Verdict:
        """The acceptance rule over one job's rows ([num_rows, vocab] logits)."""
        if job.params.greedy:
            return verify_greedy(tree, rows)
        generator = step_generator(job.params, job.position, self.runtime.device, self._random)
        return verify_mss(tree, target_probabilities(rows, job.params), generator)


def _union(layer_sets: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """Every layer any job asks for, in ascending order (one pass captures them all)."""
    return tuple(sorted({n for layers in layer_sets for n in layers}))
