"""Acceptance rules: which drafted tree nodes the target keeps, and the token it adds.

Terms, over the rows ``[root] + nodes`` of a compiled tree:
- *accepted*: drafted nodes on one root-to-node path that the target would itself have produced;
- *recovered*: when a node's children are all rejected, the token the target produces instead, drawn
  from what is left of its distribution (greedy: its argmax);
- *bonus*: when the accepted path ends at a leaf, the target's next token after it, for free.
A verdict's ``tokens`` are the accepted tokens followed by one recovered-or-bonus token, so every
verification step commits at least one token.

Both rules are exact: greedy reproduces the target's argmax chain, and multi-step speculative sampling
(SpecInfer's MSS) leaves the target's sampling distribution unchanged for any tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specmesh.errors import RequestFailed
from specmesh.tree import CompiledTree


@dataclass(frozen=True)
class Verdict:
    accepted_nodes: tuple[int, ...]  # node indices along the accepted path, root side first
    tokens: tuple[int, ...]  # accepted tokens, then the recovered or bonus token

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)


def verify_greedy(
    tree: CompiledTree,
    logits: torch.Tensor,  # [num_rows, vocab]: row r predicts the token after row r
) -> Verdict:
    """Walk down from the root while some child is the target's argmax; then add the argmax."""
    top, index = logits.max(dim=-1)  # [num_rows]: a row with a NaN has a NaN maximum
    best = torch.where(torch.isfinite(top), index, -1).tolist()
    if -1 in best:
        raise RequestFailed(f"the target's logits are not finite at tree row {best.index(-1)}")
    tokens = tree.tree.tokens
    accepted: list[int] = []
    row = 0
    while True:
        match = next((c for c in tree.children[row] if tokens[c] == best[row]), None)
        if match is None:
            break
        accepted.append(match)
        row = match + 1
    return Verdict(tuple(accepted), tuple(tokens[c] for c in accepted) + (best[row],))


def verify_mss(
    tree: CompiledTree,
    target_probs: torch.Tensor,  # [num_rows, vocab]: row r is p(. | context up to row r), after top-k/p
    generator: torch.Generator,
    draft_dists: dict[int, torch.Tensor] | None = None,  # node -> [vocab] q it was sampled from
) -> Verdict:
    """Multi-step speculative sampling over a token tree.

    At each accepted row, try its children in order: child x is accepted with probability
    min(1, p(x) / q(x)); on rejection p becomes norm(max(0, p - q)) and the next child is tried. When no
    child is left, the recovered token is sampled from the remaining p. A child sampled from a real
    draft distribution q carries it in ``draft_dists``; any other child (greedy or top-k drafts, n-gram
    guesses, merged duplicates) is treated as proposed by a point mass, q = one-hot(x), which is exact
    for any way of choosing it that does not look at the target's random draws.
    """
    finite = torch.isfinite(target_probs.sum(dim=-1))  # [num_rows]: a NaN or inf anywhere in a row shows here
    if not bool(finite.all()):
        raise RequestFailed(f"the target's probabilities are not finite at tree row {int((~finite).nonzero()[0])}")
    draft_dists = draft_dists or {}
    tokens = tree.tree.tokens
    accepted: list[int] = []
    row = 0
    while True:
        residual = target_probs[row].double()  # [vocab]
        chosen = None
        for child in tree.children[row]:
            x = tokens[child]
            q = draft_dists.get(child)
            if q is None:
                accept_prob = residual[x].item()
            else:
                q = q.to(residual)
                accept_prob = min(1.0, residual[x].item() / max(q[x].item(), 1e-300))
            if _uniform(generator) < accept_prob:
                chosen = child
                break
            if q is None:
                residual = residual.clone()
                residual[x] = 0.0
            else:
                residual = (residual - q).clamp_min(0.0)
            total = residual.sum()
            if total <= 0:  # only reachable through rounding: p was (numerically) q itself
                residual = target_probs[row].double()
                total = residual.sum()
            residual = residual / total
        if chosen is None:
            recovered = int(torch.multinomial(residual.float(), 1, generator=generator).item())
            return Verdict(tuple(accepted), tuple(tokens[c] for c in accepted) + (recovered,))
        accepted.append(chosen)
        row = chosen + 1


def _uniform(generator: torch.Generator) -> float:
    return float(torch.rand((), generator=generator, dtype=torch.float64, device=generator.device).item())
