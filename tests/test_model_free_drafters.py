"""Prompt lookup and history lookup: what they propose, and that they stay lossless and bounded."""

import random

from specmesh.drafters.ngram import HistoryDrafter, NgramDrafter, NgramIndex, tree_by_agreement
from specmesh.runtime.llama import LlamaRuntime
from specmesh.sampling import SamplingParams
from specmesh.speculation.engine import Request, SpeculativeEngine
from specmesh.tree import ROOT


def test_prompt_lookup_proposes_what_followed_the_longest_match():
    drafter = NgramDrafter(min_n=1, max_n=3)
    drafter.start("r", [1, 2, 3, 4, 5, 9, 2, 3])
    tree = drafter.propose("r", 3)
    assert tree.tokens == (4, 5, 9) and tree.parents == (ROOT, 0, 1)
    drafter.commit("r", [4])
    assert drafter.propose("r", 2).tokens == (5, 9)
    drafter.start("s", [7, 8])
    assert len(drafter.propose("s", 4)) == 0
    drafter.end("r")
    drafter.end("unknown")


def test_continuations_branch_by_agreement():
    tree = tree_by_agreement([[1, 2], [1, 3], [1, 2], [4]], budget=3)
    assert tree.tokens == (1, 2, 3) and tree.parents == (ROOT, 0, 0)
    assert tree.draft_probs[0] == 0.75 and abs(tree.draft_probs[1] - 2 / 3) < 1e-9


def test_index_skips_the_context_itself_and_dropped_documents():
    index = NgramIndex(1, 2)
    index.extend(0, [5, 6, 7])
    index.extend(1, [5, 6, 8])
    assert index.continuations([5, 6], 1, limit=4) == [[8], [7]]
    index.drop(1)
    index.compact()
    assert index.continuations([5, 6], 1, limit=4) == [[7]]
    assert index.continuations([6, 7], 2, limit=4, skip=(0, 3)) == []


def test_history_makes_a_repeated_request_nearly_free(tiny_model):
    runtime = LlamaRuntime(tiny_model)
    history = HistoryDrafter(min_n=2, max_n=4)
    engine = SpeculativeEngine(runtime, [history], max_tree_nodes=8)
    prompt = tuple(random.Random(4).randrange(2, 96) for _ in range(12))
    first = engine.generate([Request(prompt, SamplingParams(max_tokens=32))])[0]
    again = engine.generate([Request(prompt, SamplingParams(max_tokens=32))])[0]
    assert again.token_ids == first.token_ids
    assert again.stats.mean_accepted_length > 4  # 32 tokens in a handful of target passes
    assert history.stored_tokens == 2 * (len(prompt) + 32)


def test_history_is_bounded():
    history = HistoryDrafter(capacity_tokens=100)
    for i in range(50):
        history.start(f"r{i}", list(range(i, i + 30)))
        history.end(f"r{i}")
    assert history.stored_tokens <= 100
    assert len(history._index.documents) <= 4
