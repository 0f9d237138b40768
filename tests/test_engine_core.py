"""The engine core on a tiny random Llama: requests that join and leave between steps (continuous batching)
get plain greedy's output, every pass carries every running request, and an abort frees what it held."""

import asyncio
import random

import pytest
from conftest import hf_greedy
from drafting import OracleTreeDrafter

from specmesh.runtime.llama import LlamaRuntime
from specmesh.runtime.tree_verifier import TreeVerifier
from specmesh.sampling import SamplingParams
from specmesh.speculation.drafting import LocalDrafter
from specmesh.speculation.engine import InlineExecutor
from specmesh.speculation.engine_core import EngineCore
from specmesh.speculation.policy import FixedPolicy
from specmesh.speculation.requests import Request, SpeculationStats

MAX_TOKENS = 20


@pytest.fixture(scope="module")
def runtime(tiny_model):
    return LlamaRuntime(tiny_model)


class CountingVerifier(InlineExecutor):
    """The in-process verifier, remembering which requests each pass carried."""

    def __init__(self, verifier: TreeVerifier) -> None:
        super().__init__(verifier)
        self.passes: list[list[str]] = []

    async def verify(self, jobs):
        self.passes.append([job.request_id for job in jobs])
        return await super().verify(jobs)


def prompts(count: int, seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(2, 96) for _ in range(rng.randint(3, 20))) for _ in range(count)]


def test_requests_joining_between_steps_get_plain_greedy_output(tiny_model, runtime):
    chosen = prompts(6, seed=1)
    answers = {p: hf_greedy(tiny_model, list(p), MAX_TOKENS) for p in chosen}
    verifier = CountingVerifier(TreeVerifier(runtime))
    drafters = [LocalDrafter(OracleTreeDrafter(answers, vocab_size=96, seed=3))]

    async def main():
        core = EngineCore(verifier, max_running=3)
        outputs: dict[str, list[int]] = {}
        finished: dict[str, str] = {}
        arrivals = {0: chosen[:2], 2: chosen[2:4], 5: chosen[4:]}  # step -> the requests that arrive before it
        step = 0
        while step < 3 or core.num_requests:
            for prompt in arrivals.get(step, []):
                core.add(Request(prompt, SamplingParams(max_tokens=MAX_TOKENS), request_id=str(chosen.index(prompt))),
                         FixedPolicy().begin("", 6), drafters)
            for output in await core.step():
                outputs.setdefault(output.request_id, []).extend(output.token_ids)
                if output.finish_reason:
                    finished[output.request_id] = output.finish_reason
            step += 1
        return outputs, finished

    outputs, finished = asyncio.run(main())
    assert {chosen[int(rid)]: tokens for rid, tokens in outputs.items()} == answers
    assert set(finished.values()) == {"length"}
    assert max(len(p) for p in verifier.passes) == 3, "at most max_running requests a pass"
    assert [len(p) for p in verifier.passes[:3]] == [2, 2, 3], "a request joins at the first step after it came"
    assert verifier.verifier.num_sessions == 0, "every request's cache is freed at its end"
    assert drafters[0].drafter.contexts == {}, "and its drafter session"


def test_an_aborted_request_frees_its_cache_and_sessions_and_the_others_go_on(tiny_model, runtime):
    chosen = prompts(3, seed=2)
    verifier = InlineExecutor(TreeVerifier(runtime))
    drafter = OracleTreeDrafter({}, vocab_size=96)

    async def main():
        core = EngineCore(verifier)
        for i, prompt in enumerate(chosen):
            core.add(Request(prompt, SamplingParams(max_tokens=MAX_TOKENS), request_id=str(i)),
                     FixedPolicy().begin("", 4), [LocalDrafter(drafter)])
        await core.step()
        await core.step()
        held = verifier.verifier.num_sessions
        assert await core.abort("1")
        assert not await core.abort("1"), "an abort of a request no longer held says so"
        after = verifier.verifier.num_sessions, set(drafter.contexts)
        outputs: dict[str, list[int]] = {}
        while core.num_requests:
            for output in await core.step():
                outputs.setdefault(output.request_id, []).extend(output.token_ids)
        return held, after, outputs

    held, after, outputs = asyncio.run(main())
    assert held == 3 and after == (2, {"0", "2"})
    assert set(outputs) == {"0", "2"}
    for rid in ("0", "2"):  # the first two steps' tokens came before the abort
        assert len(outputs[rid]) < MAX_TOKENS


def test_a_failing_pass_fails_its_requests_not_the_core(tiny_model, runtime):
    class Failing(InlineExecutor):
        calls = 0

        async def verify(self, jobs):
            Failing.calls += 1
            if Failing.calls == 2:
                raise RuntimeError("device lost")
            return await super().verify(jobs)

    verifier = Failing(TreeVerifier(runtime))

    async def main():
        core = EngineCore(verifier)
        core.add(Request((5, 6, 7), SamplingParams(max_tokens=4), request_id="a"), FixedPolicy().begin("", 0))
        first = await core.step()
        second = await core.step()
        core.add(Request((5, 6, 7), SamplingParams(max_tokens=4), request_id="b"), FixedPolicy().begin("", 0))
        rest = []
        while core.num_requests:
            rest += await core.step()
        return first, second, rest

    first, second, rest = asyncio.run(main())
    assert len(first) == 1 and first[0].finish_reason is None
    assert [(o.request_id, o.finish_reason) for o in second] == [("a", "failed")]
    assert "RuntimeError" in str(second[0].error)
    assert sum(len(o.token_ids) for o in rest) == 4 and rest[-1].finish_reason == "length"
    assert verifier.verifier.num_sessions == 0


def test_trees_drafted_ahead_during_the_pass_keep_plain_greedy_output(tiny_model, runtime):
    """With drafting ahead, a step whose verdict confirmed the path the last draft assumed takes the draft
    made meanwhile; answers are still plain greedy's, and the drafter's sessions end with their requests."""
    chosen = prompts(4, seed=5)
    answers = {p: hf_greedy(tiny_model, list(p), MAX_TOKENS) for p in chosen}
    verifier = CountingVerifier(TreeVerifier(runtime))
    drafter = OracleTreeDrafter(answers, vocab_size=96, seed=7)
    stats = {}

    async def main():
        core = EngineCore(verifier, draft_ahead="on")
        for i, prompt in enumerate(chosen):
            request = Request(prompt, SamplingParams(max_tokens=MAX_TOKENS), request_id=str(i))
            stats[str(i)] = SpeculationStats()
            core.add(request, FixedPolicy().begin("", 6), [LocalDrafter(drafter)], stats[str(i)])
        outputs: dict[str, list[int]] = {}
        while core.num_requests:
            for output in await core.step():
                outputs.setdefault(output.request_id, []).extend(output.token_ids)
        return outputs

    outputs = asyncio.run(main())
    assert {chosen[int(rid)]: tokens for rid, tokens in outputs.items()} == answers
    ahead = sum(s.drafted_ahead for s in stats.values())
    steps = sum(s.target_steps for s in stats.values())
    assert 0 < ahead < steps, (ahead, steps)
    assert sum(s.late_drafts for s in stats.values()) == 0
    assert drafter.contexts == {} and verifier.verifier.num_sessions == 0


def test_steps_under_the_plain_arm_are_counted_in_the_budget_histogram(tiny_model, runtime):
    """The batch's plain arm still asks each adaptive policy (with budget 0): a metered request counts those
    steps as budget 0, so the histogram shows every step, not only the drafting ones."""
    from specmesh.cluster.metrics import MeteredRequest, VerifierMetrics
    from specmesh.speculation.batch_budget import BatchBudget
    from specmesh.speculation.policy import adaptive_policy

    (prompt,) = prompts(1, seed=4)
    answer = hf_greedy(tiny_model, list(prompt), MAX_TOKENS)
    drafter = OracleTreeDrafter({prompt: answer}, vocab_size=96, seed=3)
    policy = adaptive_policy({})
    policy.expertise.register(drafter)
    metrics = VerifierMetrics()

    async def main():
        core = EngineCore(CountingVerifier(TreeVerifier(runtime)), budget=BatchBudget(arms=(0,)))
        core.add(Request(prompt, SamplingParams(max_tokens=MAX_TOKENS), request_id="r"),
                 MeteredRequest(policy.begin("", 6), metrics), [LocalDrafter(drafter)])
        tokens = []
        while core.num_requests:
            for output in await core.step():
                tokens += output.token_ids
        return tokens

    assert asyncio.run(main()) == answer
    value = metrics.registry.get_sample_value
    assert value("specmesh_speculation_budget_count") == value("specmesh_target_steps_total") >= MAX_TOKENS - 1
    assert value("specmesh_speculation_budget_sum") == 0
