"""Acceptance rules: greedy walks the argmax chain; tree MSS keeps the target's distribution exactly."""

import pytest
import torch
from scipy.stats import chisquare

from specmesh.acceptance import verify_greedy, verify_mss
from specmesh.errors import RequestFailed
from specmesh.sampling import MIN_TEMPERATURE, SamplingParams, target_probabilities
from specmesh.tree import ROOT, TokenTree, compile_tree

SIGNIFICANCE = 1e-3  # a correct rule fails this test once in a thousand seeds


def one_hot_logits(best: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(best), vocab)
    logits[torch.arange(len(best)), torch.tensor(best)] = 5.0
    return logits


def test_greedy_walks_the_matching_branch_and_adds_the_bonus():
    # root -> 3(0) -> 4(2); root -> 5(1) -> 6(3) -> 7(4)
    tree = compile_tree(0, TokenTree((3, 5, 4, 6, 7), (ROOT, ROOT, 0, 1, 3), (1.0,) * 5))
    # target argmax per row: root->5, node0->4, node1->6, node2->1, node3->8 (not 7), node4->2
    verdict = verify_greedy(tree, one_hot_logits([5, 4, 6, 1, 8, 2]))
    assert verdict.accepted_nodes == (1, 3)
    assert verdict.tokens == (5, 6, 8)


def test_greedy_accepts_a_whole_branch_then_the_bonus_and_nothing_on_a_miss():
    tree = compile_tree(0, TokenTree.chain([1, 2]))
    assert verify_greedy(tree, one_hot_logits([1, 2, 9])).tokens == (1, 2, 9)
    assert verify_greedy(tree, one_hot_logits([4, 2, 9])).tokens == (4,)
    assert verify_greedy(compile_tree(0, TokenTree()), one_hot_logits([6])).tokens == (6,)


def test_logits_that_are_not_finite_fail_the_verdict_naming_the_row():
    tree = compile_tree(0, TokenTree.chain([1, 2]))
    logits = one_hot_logits([1, 2, 9])
    logits[1, 4] = float("nan")
    with pytest.raises(RequestFailed, match="logits are not finite at tree row 1"):
        verify_greedy(tree, logits)
    probs = target_probabilities(one_hot_logits([1, 2, 9]), PARAMS)
    probs[2, 0] = float("inf")
    with pytest.raises(RequestFailed, match="probabilities are not finite at tree row 2"):
        verify_mss(tree, probs, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, MIN_TEMPERATURE / 2])
def test_a_temperature_too_small_to_divide_by_is_greedy(temperature):
    params = SamplingParams(temperature=temperature)
    assert params.greedy and params.temperature == 0.0
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy
    # at the floor the distribution is finite and already the argmax's
    probs = target_probabilities(torch.tensor([[30.0, 29.0, -40.0]]), SamplingParams(temperature=MIN_TEMPERATURE))
    assert torch.isfinite(probs).all() and probs[0, 0] == 1.0


# ---- distribution of the next two tokens under tree MSS, against the exact target distribution ----

VOCAB = 6
PARAMS = SamplingParams(temperature=0.9, top_k=5, top_p=0.95)


def _tables(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    first = target_probabilities(torch.randn(1, VOCAB, generator=gen) * 2, PARAMS)[0]  # [V]
    second = target_probabilities(torch.randn(VOCAB, VOCAB, generator=gen) * 2, PARAMS)  # [V, V]: row = first token
    draft = torch.softmax(torch.randn(VOCAB + 1, VOCAB, generator=gen) * 2, dim=-1)  # q per context (V = root)
    return first, second, draft


def _draft_tree(draft: torch.Tensor, context: int, mode: str, gen: torch.Generator):
    """A depth-2 tree below ``context``; returns the tree and the q each node was sampled from (if any)."""
    tokens, parents, dists = [], [], {}

    def add_children(parent: int, ctx: int, count: int):
        q = draft[ctx]
        if mode == "sampled":  # i.i.d. draws from q: MSS must be told q
            picks = torch.multinomial(q, count, replacement=True, generator=gen).tolist()
        else:  # deterministic top-k guesses: q is a point mass
            picks = q.topk(count).indices.tolist()
        for token in picks:
            if mode == "sampled" or mode == "lying":
                dists[len(tokens)] = q
            tokens.append(token)
            parents.append(parent)

    add_children(ROOT, context, 3)
    for node in range(len(tokens)):
        add_children(node, tokens[node], 2)
    return TokenTree(tuple(tokens), tuple(parents), (1.0,) * len(tokens)), dists


def _sample_two_tokens(mode: str, trials: int, seed: int) -> torch.Tensor:
    first, second, draft = _tables()
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(trials):
        tree, dists = _draft_tree(draft, VOCAB, mode, gen)
        compiled = compile_tree(0, tree)
        # row 0 predicts token 1; a depth-1 node x predicts token 2 from second[x]; deeper rows are unused
        rows = [first] + [second[t] if p == ROOT else first for t, p in zip(tree.tokens, tree.parents)]
        out = list(verify_mss(compiled, torch.stack(rows), gen, dists).tokens)
        if len(out) == 1:  # rejected at depth 1: the next step drafts again from the recovered token
            tree, dists = _draft_tree(draft, out[0], mode, gen)
            rows = [second[out[0]]] + [first] * len(tree)
            out += list(verify_mss(compile_tree(out[0], tree), torch.stack(rows), gen, dists).tokens[:1])
        counts[out[0], out[1]] += 1
    return counts


def _exact_two_tokens() -> torch.Tensor:
    first, second, _ = _tables()
    return first[:, None] * second  # [V, V]


def _chi_square_pvalue(counts: torch.Tensor, exact: torch.Tensor) -> float:
    support = exact.flatten() > 0
    observed = counts.flatten()
    assert observed[~support].sum() == 0, "sampled a token the target gives zero probability"
    expected = exact.flatten()[support] * observed.sum()
    return float(chisquare(observed[support].numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize("mode", ["sampled", "top_k"])
def test_tree_mss_reproduces_the_target_distribution(mode):
    counts = _sample_two_tokens(mode, trials=6000, seed=1)
    pvalue = _chi_square_pvalue(counts, _exact_two_tokens())
    assert pvalue > SIGNIFICANCE, f"{mode}: sampled distribution differs from the target's (p = {pvalue:.2e})"


def test_a_broken_rule_is_caught():
    # The bug: deterministic top-k guesses verified as if they had been sampled from q.
    counts = _sample_two_tokens("lying", trials=6000, seed=1)
    pvalue = _chi_square_pvalue(counts, _exact_two_tokens())
    assert pvalue < 1e-6, f"the test failed to notice a wrong acceptance rule (p = {pvalue:.2e})"


def test_total_variation_shrinks_with_samples():
    exact = _exact_two_tokens()
    few = _sample_two_tokens("sampled", trials=500, seed=2)
    many = _sample_two_tokens("sampled", trials=8000, seed=3)
    tv = [0.5 * (c / c.sum() - exact).abs().sum().item() for c in (few, many)]
    assert tv[1] < tv[0] and tv[1] < 0.04, tv


# ---- target distribution after temperature / top-k / top-p ----


def test_top_k_and_top_p_cut_the_tail():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    probs = target_probabilities(logits, SamplingParams(temperature=1.0, top_k=3))
    assert (probs[0, 3:] == 0).all() and probs.sum().item() == pytest.approx(1.0)
    plain = logits.softmax(-1)[0]
    probs = target_probabilities(logits, SamplingParams(temperature=1.0, top_p=float(plain[0] + 1e-3)))
    assert probs[0, 0] > 0 and probs[0, 1] > 0 and (probs[0, 2:] == 0).all()
    assert target_probabilities(logits, SamplingParams(temperature=1.0, top_p=1e-6))[0].tolist() == [1, 0, 0, 0, 0]


@pytest.mark.parametrize(
    "kwargs,field",
    [({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
     ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
     ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -5}, "max_tokens")],
)
def test_bad_sampling_parameters_name_the_field(kwargs, field):
    from specmesh.errors import InvalidArgument

    with pytest.raises(InvalidArgument) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field


def test_exact_table_is_a_distribution_with_cut_tokens():
    exact = _exact_two_tokens()
    assert exact.sum().item() == pytest.approx(1.0, abs=1e-5)
    assert (exact == 0).any(), "top-k/top-p should cut tokens, so the test covers zero-probability guesses"
