"""The sampled-distribution check with its decoy: a runtime's exact distribution of a prompt's first two
tokens (top-k, temperature 1) against what speculative sampling draws, and a wrong acceptance rule the
check must catch."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from specmesh.runtime.llama import TreeBatch
from specmesh.runtime.target import prefill_sessions
from specmesh.sampling import SamplingParams
from specmesh.speculation.engine import Request
from specmesh.tree import TokenTree, compile_tree


def lying_rule(tree, target_probs, generator, draft_dists=None):
    """The decoy: deterministic guesses verified as if drawn from a uniform q (accepted nearly always)."""
    from specmesh.acceptance import verify_mss

    uniform = torch.full((target_probs.shape[1],), 1.0 / target_probs.shape[1], dtype=torch.float64)
    return verify_mss(tree, target_probs, generator, {node: uniform for node in range(len(tree.tree))})


def next_distribution(runtime, tokens: list[int], top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The runtime's top-k next tokens after ``tokens`` and their renormalised probabilities."""
    session = runtime.new_session()
    prefill_sessions(runtime, [session], [tokens[:-1]])
    logits = runtime.forward(TreeBatch.build([session], [compile_tree(tokens[-1], TokenTree.chain([]))]))[0]
    session.free()
    probs = torch.softmax(logits.double(), -1)
    keep = probs.topk(top_k).indices
    return keep, probs[keep] / probs[keep].sum()


def two_token_distribution(runtime, prompt: list[int], top_k: int) -> dict[tuple[int, int], float]:
    exact = {}
    keep, p1 = next_distribution(runtime, prompt, top_k)
    for x, px in zip(keep.tolist(), p1.tolist()):
        keep2, p2 = next_distribution(runtime, prompt + [x], top_k)
        for y, py in zip(keep2.tolist(), p2.tolist()):
            exact[(x, y)] = px * py
    return exact


def sampled_pairs_pvalue(engine, prompt: list[int], exact: dict, top_k: int, batches: int, max_tokens: int = 2) -> float:
    """Chi-square p-value of the engine's first two sampled tokens (50 seeded requests a batch) against
    ``exact``; every pair must lie in the top-k support."""
    counts = dict.fromkeys(exact, 0)
    for batch in range(batches):
        requests = [Request(tuple(prompt), SamplingParams(temperature=1.0, top_k=top_k, max_tokens=max_tokens,
                                                          seed=batch * 100 + i)) for i in range(50)]
        for out in engine.generate(requests):
            pair = tuple(out.token_ids[:2])
            assert pair in counts, f"sampled {pair}, outside the model's top-{top_k} support"
            counts[pair] += 1
    total = sum(counts.values())
    return chisquare([counts[k] for k in exact], [exact[k] * total for k in exact]).pvalue


def judge(rule: str, pvalue: float, what: str) -> None:
    """The exact rule must keep the distribution (p > 1e-3); the decoy must be seen (p < 1e-6)."""
    if rule == "exact":
        assert pvalue > 1e-3, f"{what} changed the distribution (p = {pvalue:.2e})"
    else:
        assert pvalue < 1e-6, f"the test failed to notice a wrong acceptance rule (p = {pvalue:.2e})"


def judge_sampling_on(runtime, rule: str, monkeypatch, vocab: int, what: str, nodes: int = 6,
                      batches: int = 12) -> None:
    """Two sampled tokens (top-4) through trees of ``nodes`` whose right path is the likeliest pair,
    against ``runtime``'s exact two-token distribution; with ``rule`` "lying" the acceptance rule is the
    decoy, which must be seen."""
    from drafting import OracleTreeDrafter

    from specmesh.speculation.engine import SpeculativeEngine

    top_k, prompt = 4, [2, 9, 4, 2, 9]
    if rule == "lying":
        monkeypatch.setattr("specmesh.runtime.tree_verifier.verify_mss", lying_rule)
    exact = two_token_distribution(runtime, prompt, top_k)
    drafter = OracleTreeDrafter({tuple(prompt): list(max(exact, key=exact.get))}, vocab, seed=1, full=nodes > 6)
    engine = SpeculativeEngine(runtime, drafters=[drafter], max_tree_nodes=nodes)
    judge(rule, sampled_pairs_pvalue(engine, prompt, exact, top_k, batches=batches, max_tokens=3), what)
