"""Drafters as the speculation steps call them, and one step's drafting for one request: ask the
planned drafters, each guarded, and fuse their trees.

A drafter runs in this process (``LocalDrafter``) or as a service (``cluster/remote_drafter.py``); both
answer the asynchronous ``AsyncDrafter`` interface. A drafter's failure costs that step's proposal, never
the request: it is logged with its exception and counted (``SpeculationStats.drafter_failures``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from specmesh.drafters.base import Drafter
from specmesh.fusion import fuse_trees
from specmesh.runtime.features import Features
from specmesh.speculation.draft_deadline import DraftDeadlines
from specmesh.speculation.policy import StepPlan
from specmesh.speculation.requests import SpeculationStats
from specmesh.tree import TokenTree

log = logging.getLogger(__name__)

IN_PROCESS = "in-process"  # the address of a drafter that runs in the caller's process
LOOPBACK_HOSTS = ("localhost", "::1")


class AsyncDrafter(Protocol):
    """A drafter as the loop calls it: in this process (``LocalDrafter``) or a service (``RemoteDrafter``).
    A feature drafter reads the target's hidden states of ``feature_layers``: the loop asks the verifier
    for them and hands each step's block over after the commit (``add_features``)."""

    name: str
    kind: str  # as ``Drafter.kind``
    domains: tuple[str, ...]  # the request kinds it is an expert in (empty: none in particular)
    feature_layers: tuple[int, ...]
    address: str  # where it runs (``IN_PROCESS``, or its service's host:port)

    @property
    def healthy(self) -> bool:
        """Whether it may be asked now (a service in back-off after failing is not)."""

    async def start(self, request_id: str, prompt_ids: Sequence[int]) -> None: ...

    async def propose(self, request_id: str, budget: int, assumed: Sequence[int] = ()) -> TokenTree: ...

    async def commit(self, request_id: str, new_token_ids: Sequence[int]) -> None: ...

    async def add_features(self, request_id: str, features: Features) -> None: ...

    async def end(self, request_id: str) -> None: ...


def runs_apart(address: str) -> bool:
    """Whether a drafter at ``address`` (host:port) runs on another machine than its caller: not in process,
    not on a loopback address or a Unix socket."""
    if address == IN_PROCESS or address.startswith("unix:"):
        return False
    host = address.rsplit(":", 1)[0].strip("[]") if ":" in address else address
    return not (host in LOOPBACK_HOSTS or host.startswith("127."))


def one_per_name(drafters: Sequence[AsyncDrafter]) -> list[AsyncDrafter]:
    """One drafter per name, a healthy one where there is (a replica with the same name adds nothing to
    routing)."""
    unique: dict[str, AsyncDrafter] = {}
    for drafter in drafters:
        if drafter.name not in unique or not unique[drafter.name].healthy:
            unique[drafter.name] = drafter
    return list(unique.values())


class LocalDrafter:
    """An in-process drafter behind the asynchronous interface (runs inline: deterministic, no threads).

    It keeps each request's committed tokens, so after one of its drafter's calls raised (and left the
    drafter's session in an unknown state) the next proposal re-opens the session with the whole context,
    as a remote drafter's session is re-opened after a restart. Exceptions still reach the loop, which
    logs and counts them and drafts without this drafter for that step.
    """

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.name = drafter.name
        self.kind = drafter.kind
        self.domains = tuple(drafter.domains)
        self.feature_layers = tuple(drafter.feature_layers)
        self.address = IN_PROCESS
        self.healthy = True
        self._context: dict[str, list[int]] = {}  # request -> every committed token
        self._stale: set[str] = set()  # requests whose session a failed call may have left inconsistent

    async def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self._context[request_id] = list(prompt_ids)
        self._call(request_id, self.drafter.start, request_id, prompt_ids)

    async def propose(self, request_id: str, budget: int, assumed: Sequence[int] = ()) -> TokenTree:
        if request_id in self._stale:
            self._call(request_id, self.drafter.end, request_id)
            self._call(request_id, self.drafter.start, request_id, self._context[request_id])
            self._stale.discard(request_id)
        return self._call(request_id, self.drafter.propose, request_id, budget, assumed)

    async def commit(self, request_id: str, new_token_ids: Sequence[int]) -> None:
        self._context[request_id].extend(new_token_ids)
        self._call(request_id, self.drafter.commit, request_id, new_token_ids)

    async def add_features(self, request_id: str, features: Features) -> None:
        self._call(request_id, self.drafter.add_features, request_id, features)

    async def end(self, request_id: str) -> None:
        self._context.pop(request_id, None)
        self._stale.discard(request_id)
        self.drafter.end(request_id)

    def _call(self, request_id: str, method, *args):
        try:
            return method(*args)
        except Exception:
            self._stale.add(request_id)
            raise


@dataclass(frozen=True)
class Draft:
    """One step's drafting: the plan, each asked drafter's own tree, and their fusion."""

    plan: StepPlan
    trees: tuple[TokenTree, ...]  # aligned with plan.drafters
    fused: TokenTree
    drafter_ms: tuple[float, ...] = ()  # each drafter's time (aligned with plan.drafters)
    fuse_ms: float = 0.0  # merging their trees into one
    late: dict[str, asyncio.Future] = field(default_factory=dict)  # proposals still on their way, by drafter

    def below(self, token: int) -> Draft | None:
        """What this draft says after ``token`` (a draft made ahead, once the verdict confirmed its path)."""
        fused = self.fused.below(token)
        if fused is None:
            return None
        return Draft(self.plan, tuple(t.below(token) or TokenTree() for t in self.trees), fused)


async def guarded(drafter: AsyncDrafter, call: str, request_id: str, stats: SpeculationStats, *args):
    """Await the drafter's ``call`` for the request; if it raises, log it with its traceback, count it, and
    return None. The call is made here, not by the caller: one cancelled before this ran makes none."""
    try:
        return await getattr(drafter, call)(request_id, *args)
    except Exception:
        stats.drafter_failures += 1
        log.warning("drafter %s failed in %s for request %s; the request goes on without its draft",
                    drafter.name, call, request_id, exc_info=True)
        return None


NO_DRAFT = Draft(StepPlan(), (), TokenTree())  # a plain step's


def drafts(plan: StepPlan, max_depth: int) -> bool:
    """Whether a step with this plan asks any drafter: a step commits at most depth + 1 tokens, so guesses
    deeper than the answer has room for are waste."""
    return plan.budget > 0 and max_depth > 0 and bool(plan.drafters)


async def draft_step(
    drafters: dict[str, AsyncDrafter], plan: StepPlan, request_id: str, stats: SpeculationStats, max_depth: int,
    assumed: Sequence[int] = (), wait_s: float | None = None, deadlines: DraftDeadlines | None = None,
) -> Draft:
    """Ask the planned drafters (assuming ``assumed`` past the committed tokens) and fuse what they give by
    ``wait_s`` (None: every answer). A proposal still on its way then is left to arrive (``Draft.late``),
    not cancelled: a call cut short leaves a drafter's session in doubt, to be opened again whole. Each
    answer's time, a late one's too, goes to ``deadlines``."""
    if not drafts(plan, max_depth):
        return NO_DRAFT
    started = time.perf_counter()
    answer_ms: dict[str, float] = {}

    def arrived(name: str) -> Callable[[asyncio.Future], None]:
        def record(task: asyncio.Future) -> None:
            answer_ms[name] = (time.perf_counter() - started) * 1e3
            if deadlines is not None and not task.cancelled() and task.result() is not None:
                deadlines.answered(name, answer_ms[name])  # a failed call's time says nothing of its pace
        return record

    asked: dict[str, asyncio.Future] = {}
    for name in plan.drafters:
        asked[name] = asyncio.ensure_future(guarded(drafters[name], "propose", request_id, stats, plan.budget, assumed))
        asked[name].add_done_callback(arrived(name))
    try:
        _, late = await asyncio.wait(asked.values(), timeout=wait_s)
    except asyncio.CancelledError:  # the step itself was cancelled: nothing it asked outlives it
        for task in asked.values():
            task.cancel()
        raise
    trees: list[TokenTree] = []
    for name, task in asked.items():
        tree = None if task in late else task.result()
        trees.append(tree if tree is not None else TokenTree())
    waited_ms = (time.perf_counter() - started) * 1e3
    stats.late_drafts += len(late)
    fusing = time.perf_counter()
    fused = fuse_trees(trees, plan.budget, plan.weights).within_depth(max_depth)
    return Draft(plan, tuple(trees), fused, tuple(answer_ms.get(n, waited_ms) for n in plan.drafters),
                 (time.perf_counter() - fusing) * 1e3, {n: t for n, t in asked.items() if t in late})
