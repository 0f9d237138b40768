"""The exact distribution of whole sampled answers, computed in the harness's own process (never through
the cluster): what the soak judges speculative sampling against.

A seeded speculative answer is not plain sampling's answer for that seed: a step's random stream comes
from (seed, position), but speculative sampling spends its first draws on accepting tree nodes, and the
tree depends on the drafters. Only its distribution is plain sampling's, so that is what is judged.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specmesh.runtime.llama import TreeBatch
from specmesh.runtime.target import prefill_sessions
from specmesh.sampling import SamplingParams, target_probabilities
from specmesh.tree import TokenTree, compile_tree

Answer = tuple[int, ...]


def answer_distributions(runtime, prompts: Sequence[Sequence[int]], params: SamplingParams, floor: float,
                         eos_token_ids: Sequence[int] = ()) -> list[dict[Answer, float]]:
    """Per prompt: every whole answer that plain sampling with ``params`` gives with probability at least
    ``floor``, with that probability. An answer is ``params.max_tokens`` tokens, or fewer ending in an
    end-of-sequence token (the cluster returns that token). A prefix below ``floor`` is not expanded (no
    answer below it reaches ``floor``), so each level costs one tree pass over every prompt's live prefixes."""
    eos = frozenset(eos_token_ids)
    sessions = [runtime.new_session() for _ in prompts]
    try:
        prefill_sessions(runtime, sessions, [list(p[:-1]) for p in prompts])
        found: list[dict[Answer, float]] = [{} for _ in prompts]
        live: list[dict[Answer, float]] = [{(): 1.0} for _ in prompts]
        for depth in range(params.max_tokens):
            trees, rows = [], []
            for prompt, prefixes in zip(prompts, live):
                # one tree of every live prefix: the row of prefix a predicts the token after a
                tokens: list[int] = []
                parents: list[int] = []
                node = {(): -1}
                for prefix in prefixes:
                    for d in range(1, len(prefix) + 1):
                        if prefix[:d] not in node:
                            node[prefix[:d]] = len(tokens)
                            tokens.append(prefix[d - 1])
                            parents.append(node[prefix[: d - 1]])
                trees.append(compile_tree(prompt[-1], TokenTree(tuple(tokens), tuple(parents), (1.0,) * len(tokens))))
                rows.append({prefix: node[prefix] + 1 for prefix in prefixes})
            batch = TreeBatch.build(sessions, trees)
            probs = target_probabilities(runtime.forward(batch), params).double()  # [all rows, vocab]
            for i, (start, prefixes) in enumerate(zip(batch.cu_rows, live)):
                grown: dict[Answer, float] = {}
                for prefix, q in prefixes.items():
                    joint = probs[start + rows[i][prefix]] * q  # [vocab]
                    for token in torch.nonzero((joint >= floor) & (joint > 0)).flatten().tolist():
                        whole = token in eos or depth + 1 == params.max_tokens
                        (found[i] if whole else grown)[prefix + (token,)] = float(joint[token])
                live[i] = grown
        return found
    finally:
        for session in sessions:
            session.free()
