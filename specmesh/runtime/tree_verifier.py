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
from specmesh.runtime.pass_cost import PassCost
from specmesh.runtime.prefill_pace import PrefillPace
from specmesh.runtime.target import PREFILL_CHUNK, TargetRuntime, score_with_features
from specmesh.sampling import SamplingParams, target_probabilities
from specmesh.tree import MAX_TREE_NODES, CompiledTree, TokenTree, chained, compile_tree

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
class TreeVerifierStats:
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
# a burst's prompts are cached in passes of their own (``alone_ms``) while they outnumber the requests
# decoding this many to one: paced beside those few, 64 prompts took 8-31 passes; a prompt beside one
# decoding request is still paced (alone, its neighbour's tokens came 1.7-1.8x slower, not 1.4-1.5x)
PROMPTS_TO_ONE = 3
MAX_PREFILL_ROWS = 2048  # history rows a budgeted pass gives the prefills under way, together (each at most PREFILL_CHUNK)
MAX_SESSIONS = 256  # KV sessions held unless told; past them the least recently used request is re-prefilled


class TreeVerifier:
    """Verifies batches of jobs with one target forward per batch; keeps at most ``max_sessions`` sessions.

    A job whose history must be cached is verified in the same call, unless the call gives a prefill time
    budget (``verify(..., prefill_ms=)``): then a long history is cached a chunk per call, the job coming
    back ``prefilling`` until its tree can be verified, so that other requests' steps go on between."""

    def __init__(self, runtime: TargetRuntime, max_sessions: int = MAX_SESSIONS,
                 max_tree_nodes: int = MAX_TREE_NODES) -> None:
        if max_sessions < 1:
            raise InvalidArgument("max_sessions", f"must be >= 1, got {max_sessions}")
        self.runtime = runtime
        self.max_sessions = max_sessions
        self.max_tree_nodes = max_tree_nodes
        self._sessions: OrderedDict[str, object] = OrderedDict()  # least recently used first
        self._last_used: dict[str, float] = {}
        self._random = torch.Generator(device=runtime.device)
        self._random.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        self.stats = TreeVerifierStats()
        self._warned: set[str] = set()  # each reason features cannot be given is logged once
        self._prefilling: dict[str, Prefill] = {}  # requests whose history is partly cached
        self.decode_cost = PassCost()  # what a pass of verified rows costs by its rows
        self.pace = PrefillPace()  # how many history rows a budgeted pass caches

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
        """History tokens the job's next budgeted pass may cache (0: its session holds them already): a new
        request's first chunk, or a prefill under way's next at most (``prefill_chunks`` cuts it to a budget)."""
        left = self._left(job)
        return min(left, FIRST_CHUNK) if left and not self._under_way(job) else left

    def _left(self, job: VerifyJob) -> int:
        """History tokens the job's session lacks."""
        session = self._sessions.get(job.request_id)
        if job.history is None or session is None:
            return 0
        return job.position - session.length

    def _under_way(self, job: VerifyJob) -> bool:
        """Whether an earlier call cached a chunk of the job's history already."""
        return self.resuming(job) and self._sessions[job.request_id].length > 0

    def prefill_chunks(self, jobs: Sequence[VerifyJob], budget_ms: float | None = None, alone: bool = False) -> list[int]:
        """History tokens each job's next pass caches, at most ``PREFILL_CHUNK`` (the attention scores'
        memory): all that is left, or within ``budget_ms`` of the pass's time (``prefill_pace.py``: ``alone``,
        no rows verified in the pass, chunks sized on the last such pass; beside verified rows, what the pace
        grants: on average the budget, in chunks every few passes). Prefills under way share them shortest
        remainder first (the least mean wait: a short prompt's last chunk does not queue behind a long
        one's); a new request's first chunk is ``FIRST_CHUNK`` tokens whatever the budget. Beside verified
        rows this spends the pace's grant: call it once a pass."""
        if budget_ms is None:
            return [min(self._left(job), PREFILL_CHUNK) for job in jobs]
        chunks = [min(self.next_prefill(job), PREFILL_CHUNK) for job in jobs]
        under_way = [i for i, job in enumerate(jobs) if chunks[i] and self._under_way(job)]
        if alone:
            left, least = self.pace.alone_rows, 1  # at least a token each
        else:
            left, least = self.pace.grant(budget_ms) if under_way else 0, 0
        for i in sorted(under_way, key=lambda i: chunks[i]):
            chunks[i] = min(chunks[i], max(least, left))
            left = max(0, left - chunks[i])
        return chunks

    def verify(self, jobs: Sequence[VerifyJob], prefill_ms: float | None = None,
               alone_ms: float | None = None) -> list[VerifyResult]:
        """One verification pass for every job whose session is (or can be made) current, the histories to
        cache in the same pass (chunked prefill beside decoding: one forward, vLLM's mixed batch).
        ``prefill_ms``: cache at most about this long of the histories a pass (None: all of them this call,
        the longest in passes of their own first); ``alone_ms``: the same where the pass verifies no one
        (default ``prefill_ms``)."""
        if len({j.request_id for j in jobs}) != len(jobs):
            raise InvalidArgument("jobs", "two jobs of one batch belong to the same request")
        for job in jobs:
            self.check(job)
        jobs = [self._without_unavailable_features(job) for job in jobs]
        started = time.perf_counter()
        results: dict[int, VerifyResult] = {}
        ready, prefills = self._sessions_for(jobs, results)
        if prefill_ms is None:  # all of every history this call: what one pass would not hold goes first
            while ahead := [jobs[i] for i in prefills if self._left(jobs[i]) > PREFILL_CHUNK]:
                self._pass([(job, PREFILL_CHUNK, False) for job in ahead])
        under_way = [i for i in prefills if self._under_way(jobs[i])]
        # prompts still caching after this pass outnumber the requests it verifies PROMPTS_TO_ONE to one (none
        # verified, or a burst's arrivals beside its first few): passes of about alone_ms
        staying = sum(1 for i in prefills if i in under_way or self._left(jobs[i]) > FIRST_CHUNK)
        alone = staying >= PROMPTS_TO_ONE * (len(ready) - staying)
        budget_ms = alone_ms if alone and alone_ms is not None else prefill_ms
        chunks = dict(zip(prefills, self.prefill_chunks([jobs[i] for i in prefills], budget_ms, alone)))
        for i in [i for i in prefills if chunks[i] == 0]:  # its chunk waits for a later pass
            results[i] = VerifyResult(jobs[i].request_id, jobs[i].step, None, prefilling=True)
            ready.remove(i)
        entries = [(jobs[i], chunks.get(i, 0), chunks.get(i, 0) == self._left(jobs[i])) for i in ready]
        passed_at = time.perf_counter()
        outcomes = self._pass(entries) if entries else []
        pass_ms = (time.perf_counter() - passed_at) * 1e3
        verified = [i for i, (_, _, verifying) in zip(ready, entries) if verifying]
        decode_rows, chunk_rows = sum(1 + len(jobs[i].tree) for i in verified), sum(chunks.values())
        self._measured(decode_rows, chunk_rows, pass_ms, budget_ms, alone)
        rows, trees = decode_rows + chunk_rows, sum(1 for i in verified if len(jobs[i].tree))
        for i, (verdict, features) in zip(ready, outcomes):
            job = jobs[i]
            if verdict is None:  # more chunks to come
                results[i] = VerifyResult(job.request_id, job.step, None, prefilling=True)
                continue
            if i in prefills:
                self._prefilling.pop(job.request_id, None)
            if isinstance(verdict, str):
                results[i] = VerifyResult(job.request_id, job.step, None, failed=verdict)
                continue
            prefilled = job.position if i in prefills else 0
            results[i] = VerifyResult(job.request_id, job.step, verdict, prefilled, pass_ms, rows, len(verified),
                                      trees, (time.perf_counter() - started) * 1e3, features=features)
        self.stats.batches += 1
        self.stats.jobs += len(jobs)
        self.stats.busy_s += time.perf_counter() - started
        return [results[i] for i in range(len(jobs))]

    def _sessions_for(self, jobs: Sequence[VerifyJob], results: dict[int, VerifyResult]) -> tuple[list[int], list[int]]:
        """Each job's session, current or opened (or resumed) for its history, room made for the pass. Returns
        the jobs this pass can take and those of them whose history must be cached; the others' results (a
        resync: no session and no history; refused: no room) go in ``results``."""
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
        return ready, prefills

    def _measured(self, decode_rows: int, chunk_rows: int, ms: float, budget_ms: float | None, alone: bool) -> None:
        """A pass of ``decode_rows`` verified rows and ``chunk_rows`` history rows took ``ms``: the cost of a
        decode pass by its rows; or, within a budget, what sizes the next chunks (``prefill_pace.py``)."""
        if not chunk_rows:
            self.decode_cost.observe(decode_rows, ms)
        elif budget_ms is None:
            return
        elif alone:
            self.pace.alone(chunk_rows, ms, budget_ms, MAX_PREFILL_ROWS)
        else:  # what the chunks added to a decode pass
            self.pace.spent(chunk_rows, ms - self.decode_cost.ms(decode_rows), budget_ms, MAX_PREFILL_ROWS)

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

    def _pass(self, entries: Sequence[tuple[VerifyJob, int, bool]]) -> list[tuple[Verdict | str | None, Features | None]]:
        """One target forward over every entry: (job, history tokens to cache, whether its tree is verified
        after them). Per entry: its verdict, or why it failed (a string: that request's cache is dropped, the
        others go on), or None (not verified); and its features (the root's and accepted nodes' rows, after
        the prompt's last ``max_prompt_features`` where this pass ends its prefill)."""
        sessions = [self._sessions[job.request_id] for job, _, _ in entries]
        trees = [compile_tree(job.root, job.tree) if verifying else None for job, _, verifying in entries]
        rows = [chained(job.history[s.length : s.length + chunk] if chunk else (), tree)
                for (job, chunk, _), s, tree in zip(entries, sessions, trees)]
        batch = TreeBatch.build(sessions, rows)
        # [verified rows]: each verified tree's rows, after its chunk; None: every row of the pass
        wanted = [torch.arange(start + chunk, end) for (_, chunk, _), tree, start, end
                  in zip(entries, trees, batch.cu_rows, batch.cu_rows[1:]) if tree is not None]
        logits_rows = None if all(chunk == 0 for _, chunk, _ in entries) else (
            torch.cat(wanted) if wanted else torch.empty(0, dtype=torch.long))
        layers = _union([job.feature_layers for job, _, _ in entries])
        if layers:
            scores = score_with_features(self.runtime, batch, layers, logits_rows)
            logits, hidden = scores.logits, scores.features  # [verified rows, vocab], [total_rows, layers, hidden]
        else:
            logits, hidden = self.runtime.forward(batch, logits_rows=logits_rows), None
        outcomes: list[tuple[Verdict | str | None, Features | None]] = []
        offset = 0
        for (job, chunk, _), session, tree, start in zip(entries, sessions, trees, batch.cu_rows):
            prompt = self._prompt_features(job, session, hidden[start : start + chunk], layers) if chunk and layers else None
            if tree is None:
                session.keep_rows(list(range(chunk)))
                outcomes.append((None, None))
                continue
            first, offset = offset, offset + tree.num_rows
            try:
                verdict = self._accept(job, tree, logits[first:offset])
            except Exception as exc:  # one request's fault fails that request, not the pass
                if not isinstance(exc, RequestFailed):
                    log.exception("request %s: its acceptance failed", job.request_id)
                self.close(job.request_id)  # its cache holds the tree's rows
                outcomes.append((f"step {job.step}: {exc}", None))
                continue
            kept = [0] + [node + 1 for node in verdict.accepted_nodes]
            session.keep_rows(list(range(chunk)) + [chunk + row for row in kept])
            self.stats.tree_nodes += len(job.tree)
            features = None
            if job.feature_layers:  # the root's and accepted nodes' rows: positions position.. of the committed
                block = hidden[start + chunk + torch.tensor(kept, device=hidden.device)].half().cpu()
                features = Features(job.position, block, layers).of_layers(job.feature_layers)
                if prompt is not None:
                    features = Features(prompt.start, torch.cat([prompt.values, features.values]), features.layers)
            outcomes.append((verdict, features))
        return outcomes

    def _prompt_features(self, job: VerifyJob, session, hidden: torch.Tensor, layers: tuple[int, ...]) -> Features | None:
        """``hidden``: the pass's states at the history positions it caches for the job ([chunk, layers,
        hidden]). Kept with the earlier chunks' last ones until the history is whole; then its last
        ``max_prompt_features`` positions in the job's layers (None before that, or when it asks for none)."""
        if not job.feature_layers:
            return None
        values = hidden[:, [layers.index(n) for n in job.feature_layers]]  # [positions, job's layers, hidden]
        state = self._prefilling.get(job.request_id)
        if state is not None and state.tail is not None:  # the chunks before this one
            values = torch.cat([state.tail, values])
        values = values[max(0, values.shape[0] - job.max_prompt_features):]
        if session.length + hidden.shape[0] < job.position:
            state.tail = values
            return None
        return Features(job.position - values.shape[0], values.half().cpu(), job.feature_layers)

    def _accept(self, job: VerifyJob, tree: CompiledTree, rows: torch.Tensor) -> Verdict:
        """The acceptance rule over one job's rows ([num_rows, vocab] logits)."""
        if job.params.greedy:
            return verify_greedy(tree, rows)
        generator = step_generator(job.params, job.position, self.runtime.device, self._random)
        return verify_mss(tree, target_probabilities(rows, job.params), generator)


def _union(layer_sets: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """Every layer any job asks for, in ascending order (one pass captures them all)."""
    return tuple(sorted({n for layers in layer_sets for n in layers}))
