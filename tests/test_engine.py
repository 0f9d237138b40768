"""The speculation loop on tiny random Llama models: greedy output equals plain greedy decoding."""

import random

import pytest
import torch
from conftest import hf_greedy, tiny_llama
from drafting import OracleTreeDrafter
from scipy.stats import chisquare

from specmesh.drafters.base import DrafterBase
from specmesh.drafters.model import ModelDrafter
from specmesh.drafters.ngram import NgramDrafter
from specmesh.errors import InvalidArgument
from specmesh.runtime.llama import LlamaRuntime
from specmesh.sampling import SamplingParams
from specmesh.speculation.engine import Request, SpeculativeEngine
from specmesh.speculation.policy import adaptive_policy
from specmesh.tree import TokenTree

MAX_TOKENS = 24


def ragged_prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(1, 30))] for _ in range(count)]


@pytest.fixture(scope="module")
def runtime(tiny_model):
    return LlamaRuntime(tiny_model)


def test_own_plain_decoding_matches_hugging_face(tiny_model, runtime):
    prompts = ragged_prompts(4, 96, seed=1)
    engine = SpeculativeEngine(runtime, drafters=[], max_tree_nodes=0)
    outputs = engine.generate([Request(tuple(p), SamplingParams(max_tokens=MAX_TOKENS)) for p in prompts])
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(tiny_model, prompt, MAX_TOKENS)
        assert out.finish_reason == "length"
        assert out.stats.mean_accepted_length == 1.0


FAST_SHAPES = {(1, 4), (3, 16), (5, 1)}  # a diagonal of the grid in the fast set; the whole grid is `slow`


@pytest.mark.parametrize("batch_size,budget", [
    pytest.param(b, k, marks=() if (b, k) in FAST_SHAPES else pytest.mark.slow)
    for k in (1, 4, 16) for b in (1, 2, 3, 5, 8)
])
def test_random_trees_give_the_plain_greedy_output(tiny_model, runtime, batch_size, budget):
    prompts = ragged_prompts(batch_size, 96, seed=batch_size * 100 + budget)
    answers = {tuple(p): hf_greedy(tiny_model, p, MAX_TOKENS) for p in prompts}
    drafter = OracleTreeDrafter(answers, vocab_size=96, seed=budget)
    engine = SpeculativeEngine(runtime, drafters=[drafter], max_tree_nodes=budget)
    outputs = engine.generate([Request(tuple(p), SamplingParams(max_tokens=MAX_TOKENS)) for p in prompts])
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == answers[tuple(prompt)]
    steps = sum(o.stats.target_steps for o in outputs)
    committed = sum(len(o.token_ids) for o in outputs)
    assert committed > steps or budget == 1, "the oracle's right guesses should have been accepted"


def test_model_and_ngram_drafters_together_are_lossless(tiny_model, runtime):
    draft_model = tiny_llama(layers=1, seed=7)
    drafters = [ModelDrafter(draft_model, vocab_size=96, name="small"), NgramDrafter()]
    prompts = [p * 3 for p in ragged_prompts(4, 96, seed=5)]  # repeats give the n-gram drafter hits
    engine = SpeculativeEngine(runtime, drafters=drafters, max_tree_nodes=6)
    outputs = engine.generate([Request(tuple(p), SamplingParams(max_tokens=MAX_TOKENS)) for p in prompts])
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(tiny_model, prompt, MAX_TOKENS)


def test_a_draft_model_grows_big_trees_best_first_each_node_at_its_paths_probability(tiny_model, runtime):
    draft_model = tiny_llama(layers=1, seed=7)
    drafter = ModelDrafter(draft_model, vocab_size=96, name="small", max_depth=4, branch_width=2)
    prompt = [5, 6, 7, 8]
    drafter.start("r", prompt)
    wide = drafter.propose("r", 48, assumed=[9])  # past 4 x 2: best first
    assert len(wide) == 48 and (max(wide.depths()) > 4 or max(len(c) for c in wide.children()) > 2)
    again = drafter.propose("r", 48, assumed=[9])  # from the cache this time: the tree's entries were scratch
    assert (again.tokens, again.parents) == (wide.tokens, wide.parents)
    assert again.draft_probs == pytest.approx(wide.draft_probs, abs=1e-5)
    with torch.no_grad():
        for node in range(len(wide)):  # each node's probability, with its path fed to the model from scratch
            path = [wide.tokens[a] for a in wide.path_to(node)]
            logits = draft_model(torch.tensor([prompt + [9] + path[:-1]])).logits[0, -1]
            assert float(logits.softmax(-1)[path[-1]]) == pytest.approx(wide.draft_probs[node], abs=1e-5), node
    prompts = ragged_prompts(4, 96, seed=5)
    engine = SpeculativeEngine(runtime, drafters=[ModelDrafter(draft_model, vocab_size=96, max_depth=4,
                                                               branch_width=2)], max_tree_nodes=64)
    outputs = engine.generate([Request(tuple(p), SamplingParams(max_tokens=MAX_TOKENS)) for p in prompts])
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(tiny_model, prompt, MAX_TOKENS)


class NoiseDrafter(DrafterBase):
    """Always wrong: random chains."""

    name = "noise"

    def __init__(self, vocab_size: int) -> None:
        self.rng = random.Random(0)
        self.vocab_size = vocab_size

    def start(self, request_id, prompt_ids):
        pass

    def commit(self, request_id, new_token_ids):
        pass

    def end(self, request_id):
        pass

    def propose(self, request_id, budget, assumed=()):
        return TokenTree.chain([self.rng.randrange(self.vocab_size) for _ in range(budget)], [0.9] * budget)


@pytest.mark.parametrize("adapt_budget", [True, False])
def test_the_router_policy_is_lossless_and_routes_to_the_drafter_that_is_right(tiny_model, runtime, adapt_budget):
    prompts = ragged_prompts(6, 96, seed=11)
    answers = {tuple(p): hf_greedy(tiny_model, p, MAX_TOKENS) for p in prompts}
    drafters = [NoiseDrafter(96), OracleTreeDrafter(answers, vocab_size=96, seed=3), NgramDrafter()]
    # the noise drafter claims the requests' domain: routing must learn it is wrong
    policy = adaptive_policy({"noise": ["code"], "oracle-tree": ["general"], "ngram": ["general"]},
                             adapt_budget=adapt_budget, seed=0, free=["ngram"])
    engine = SpeculativeEngine(runtime, drafters=drafters, max_tree_nodes=8, policy=policy)
    outputs = []
    for start in (0, 3):  # two batches: the second starts from what the first taught the router
        batch = [Request(tuple(p), SamplingParams(max_tokens=MAX_TOKENS), kind="code") for p in prompts[start : start + 3]]
        outputs += engine.generate(batch)
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == answers[tuple(prompt)]
        assert out.stats.request_kind == "code"
    if not adapt_budget:  # (adaptive: on a tiny model's cheap passes, whether it drafts at all depends on timings)
        table = policy.expertise.table()["code"]
        assert table["oracle-tree"] > table["noise"]
        later = outputs[3:]
        steps = {name: sum(o.stats.drafter_steps.get(name, 0) for o in later) for name in ("noise", "oracle-tree")}
        assert steps["oracle-tree"] > 3 * steps["noise"], steps  # the noise drafter only when explored


def test_the_target_as_its_own_drafter_is_accepted_almost_entirely(tiny_model, runtime):
    chain = ModelDrafter(tiny_model, vocab_size=96, branch_below=0.0)  # never branches: 4 nodes, 4 deep
    engine = SpeculativeEngine(runtime, drafters=[chain], max_tree_nodes=4)
    (out,) = engine.generate([Request((5, 6, 7), SamplingParams(max_tokens=MAX_TOKENS))])
    assert out.token_ids == hf_greedy(tiny_model, [5, 6, 7], MAX_TOKENS)
    assert out.stats.mean_accepted_length > 3.5


def test_end_of_sequence_stops_and_is_included(tiny_model, runtime):
    prompt = [3, 4, 5]
    reference = hf_greedy(tiny_model, prompt, MAX_TOKENS)
    stop_token = reference[5]
    engine = SpeculativeEngine(
        runtime, drafters=[OracleTreeDrafter({tuple(prompt): reference}, 96)], max_tree_nodes=8,
        eos_token_ids=[stop_token],
    )
    (out,) = engine.generate([Request(tuple(prompt), SamplingParams(max_tokens=MAX_TOKENS))])
    assert out.finish_reason == "stop"
    assert out.token_ids == reference[: reference.index(stop_token) + 1]


def test_seeded_sampling_is_reproducible_and_temperature_zero_is_deterministic(runtime):
    engine = SpeculativeEngine(runtime, drafters=[NgramDrafter()], max_tree_nodes=4)
    sampled = SamplingParams(temperature=1.0, seed=42, max_tokens=16)
    first = engine.generate([Request((5, 6, 7, 5, 6), sampled)])[0].token_ids
    again = engine.generate([Request((5, 6, 7, 5, 6), sampled)])[0].token_ids
    other = engine.generate([Request((5, 6, 7, 5, 6), SamplingParams(temperature=1.0, seed=43, max_tokens=16))])
    assert first == again and first != other[0].token_ids
    greedy = [engine.generate([Request((5, 6, 7), SamplingParams(max_tokens=16))])[0].token_ids for _ in range(2)]
    assert greedy[0] == greedy[1]


def _drafter_for_distribution_test(kind: str, model, vocab: int, prompt: list[int], mode: int):
    from specmesh.distill.train import build_student
    from specmesh.drafters.expert import ExpertDrafter
    from specmesh.drafters.ngram import HistoryDrafter

    if kind == "oracle":  # guesses the mode first, then random branches
        return OracleTreeDrafter({tuple(prompt): [mode]}, vocab, seed=1)
    if kind == "ngram":
        return NgramDrafter()
    if kind == "history":
        history = HistoryDrafter(min_n=1, max_n=3)
        for i, answer in enumerate([[mode, 5, 6], [7, mode, 9], [mode, 3]]):  # earlier requests to look up
            history.start(f"old{i}", prompt + answer)
            history.end(f"old{i}")
        return history
    if kind == "model":
        return ModelDrafter(tiny_llama(vocab_size=vocab, layers=1, seed=8), vocab_size=vocab)
    if kind == "expert":
        subset = torch.arange(2, vocab - 4)
        return ExpertDrafter(build_student(model, subset, layers=1), name="expert", branch_below=1.01)
    if kind == "feature":  # reads the target's hidden states, which the verifier returns with each result
        from specmesh.distill.feature_train import build_feature_head
        from specmesh.drafters.feature import FeatureDrafter

        head = build_feature_head(model, (1, 2), torch.arange(2, vocab - 4))
        return FeatureDrafter(head, "feature", branch_below=1.01, int8_weights=False)
    raise ValueError(kind)


@pytest.mark.parametrize("kind", [
    # fast: a model-free drafter, and the router fusing three; each is 2,000 sampled requests
    *(pytest.param(k, marks=pytest.mark.slow) for k in ("oracle", "ngram", "model", "expert", "feature")),
    "history", "router",
])
def test_sampled_two_token_distribution_end_to_end(kind):
    """Engine + tiny model: the first two sampled tokens follow the model's exact (top-k) distribution,
    whichever drafter proposes the trees — and with the router's policy fusing several drafters'
    trees by learned trust."""
    vocab, top_k = 32, 4
    model = tiny_llama(vocab_size=vocab, seed=3)
    runtime = LlamaRuntime(model)
    prompt = [2, 9, 4, 2, 9]
    params = dict(temperature=1.0, top_k=top_k, max_tokens=3)
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
        keep = first.topk(top_k).indices
        exact = {}
        p1 = first[keep] / first[keep].sum()
        for x, px in zip(keep.tolist(), p1.tolist()):
            second = torch.softmax(model(torch.tensor([prompt + [x]])).logits[0, -1], -1)
            keep2 = second.topk(top_k).indices
            p2 = second[keep2] / second[keep2].sum()
            for y, py in zip(keep2.tolist(), p2.tolist()):
                exact[(x, y)] = px * py
    if kind == "router":  # every step: the best expert and prompt lookup, fused by trust (fixed budget)
        drafters = [_drafter_for_distribution_test(k, model, vocab, prompt, int(keep[0])) for k in ("oracle", "ngram", "model")]
        policy = adaptive_policy({d.name: ["general"] for d in drafters}, adapt_budget=False, seed=0, free=["ngram"])
        engine = SpeculativeEngine(runtime, drafters=drafters, max_tree_nodes=6, policy=policy)
    else:
        drafter = _drafter_for_distribution_test(kind, model, vocab, prompt, int(keep[0]))
        engine = SpeculativeEngine(runtime, drafters=[drafter], max_tree_nodes=6)
    counts = dict.fromkeys(exact, 0)
    drafted = 0
    for batch in range(40):
        requests = [Request(tuple(prompt), SamplingParams(seed=batch * 100 + i, **params)) for i in range(50)]
        for out in engine.generate(requests):
            drafted += out.stats.drafted_nodes
            pair = tuple(out.token_ids[:2])
            assert pair in counts, f"sampled {pair}, outside the target's top-{top_k} support"
            counts[pair] += 1
    total = sum(counts.values())
    mass = sum(exact.values())
    pvalue = chisquare([counts[k] for k in exact], [exact[k] * total / mass for k in exact]).pvalue
    assert pvalue > 1e-3, f"speculative sampling changed the distribution (p = {pvalue:.2e})"
    assert drafted > 0, f"the {kind} drafter never proposed anything: the test would prove nothing"


@pytest.mark.parametrize(
    "prompt,max_tokens,field",
    [((), 4, "prompt"), ((5,) * 600, 4, "prompt"), ((5, 6), 600, "max_tokens"), ((5, 500), 4, "prompt")],
)
def test_bad_requests_name_the_argument(runtime, prompt, max_tokens, field):
    engine = SpeculativeEngine(runtime, drafters=[], max_tree_nodes=4)
    with pytest.raises(InvalidArgument) as err:
        engine.generate([Request(prompt, SamplingParams(max_tokens=max_tokens))])
    assert err.value.field == field


def test_long_prompts_prefill_in_chunks(tiny_model, runtime, monkeypatch):
    import specmesh.runtime.tree_verifier as verifier_module

    monkeypatch.setattr(verifier_module, "PREFILL_CHUNK", 4)
    prompts = ragged_prompts(3, 96, seed=9)
    engine = SpeculativeEngine(runtime, drafters=[NgramDrafter()], max_tree_nodes=4)
    outputs = engine.generate([Request(tuple(p), SamplingParams(max_tokens=MAX_TOKENS)) for p in prompts])
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(tiny_model, prompt, MAX_TOKENS)


def test_a_drafter_that_raises_costs_speculation_not_the_request(tiny_model, runtime, caplog):
    class Broken(NgramDrafter):
        proposals = 0

        def propose(self, request_id, budget, assumed=()):
            Broken.proposals += 1
            raise RuntimeError("drafter died")

    drafter = Broken()
    engine = SpeculativeEngine(runtime, [drafter], max_tree_nodes=4)
    with caplog.at_level("WARNING", logger="specmesh.speculation.drafting"):
        (out,) = engine.generate([Request((5, 6, 7), SamplingParams(max_tokens=8))])
    assert out.token_ids == hf_greedy(tiny_model, [5, 6, 7], 8)
    assert out.finish_reason == "length"
    assert Broken.proposals > 0 and out.stats.drafter_failures == Broken.proposals
    assert out.stats.target_steps == 8, "every step decodes plainly: the broken drafter drafted nothing"
    failures = [r for r in caplog.records if r.exc_info and "drafter died" in str(r.exc_info[1])]
    assert len(failures) == Broken.proposals, "each failure is logged with its exception"
    assert drafter._indexes == {}, "the drafter's per-request state must be freed"


def test_a_drafter_that_fails_now_and_then_is_reopened_and_still_accepted(tiny_model, runtime):
    """After a failed call the drafter's session is re-opened with the whole context: its later
    proposals continue the right tokens and are accepted."""

    class Flaky(ModelDrafter):
        calls = {"propose": 0, "commit": 0}

        def propose(self, request_id, budget, assumed=()):
            self.calls["propose"] += 1
            if self.calls["propose"] == 2:
                raise RuntimeError("propose failed once")
            return super().propose(request_id, budget, assumed)

        def commit(self, request_id, new_token_ids):
            self.calls["commit"] += 1
            if self.calls["commit"] == 3:  # before the drafter heard the tokens: its context is behind
                raise RuntimeError("commit failed once")
            super().commit(request_id, new_token_ids)

    flaky = Flaky(tiny_model, vocab_size=96, branch_below=0.0)  # the target as a chain drafter
    engine = SpeculativeEngine(runtime, drafters=[flaky], max_tree_nodes=4)
    (out,) = engine.generate([Request((5, 6, 7), SamplingParams(max_tokens=MAX_TOKENS))])
    assert out.token_ids == hf_greedy(tiny_model, [5, 6, 7], MAX_TOKENS)
    assert out.stats.drafter_failures == 2
    # 24 tokens: a failed step commits 1, the others up to 5 each; a drafter left behind would commit ~1 a step
    assert out.stats.mean_accepted_length > 3.0, out.stats


def test_duplicate_request_ids_are_refused(runtime):
    engine = SpeculativeEngine(runtime, [], max_tree_nodes=0)
    with pytest.raises(InvalidArgument) as err:
        engine.generate([Request((5,), request_id="a"), Request((6,), request_id="a")])
    assert err.value.field == "request_id"


def test_at_most_concurrency_requests_run_at_once_and_the_answers_stay(tiny_model, runtime):
    prompts = ragged_prompts(5, 96, seed=11)
    answers = {tuple(p): hf_greedy(tiny_model, p, MAX_TOKENS) for p in prompts}
    engine = SpeculativeEngine(runtime, drafters=[OracleTreeDrafter(answers, vocab_size=96, seed=3)], max_tree_nodes=4)
    widest = []
    verify = engine.verifier.verify
    engine.verifier.verify = lambda jobs: widest.append(len(jobs)) or verify(jobs)
    outputs = engine.generate([Request(tuple(p), SamplingParams(max_tokens=MAX_TOKENS)) for p in prompts], concurrency=2)
    assert [o.token_ids for o in outputs] == [answers[tuple(p)] for p in prompts]
    assert max(widest) == 2 and widest.count(2) > len(widest) // 2  # the next request joins as one ends
    with pytest.raises(InvalidArgument) as err:
        engine.generate([Request((5,))], concurrency=0)
    assert err.value.field == "concurrency"
