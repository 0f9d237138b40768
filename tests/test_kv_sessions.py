"""KV sessions: keeping the accepted path, rolling back and growing leave the cache as if built directly."""

import pytest
import torch
from conftest import tiny_llama

from specmesh.errors import InvalidArgument, ResourceExhausted
from specmesh.runtime.hf import HFRuntime
from specmesh.runtime.llama import LlamaRuntime, TreeBatch
from specmesh.tree import TokenTree, compile_tree


@pytest.fixture(scope="module", params=["lean", "hf"])
def runtime(request):
    model = tiny_llama(seed=11)
    return LlamaRuntime(model) if request.param == "lean" else HFRuntime(model)


def prefill(runtime, tokens):
    session = runtime.new_session()
    tree = compile_tree(tokens[0], TokenTree.chain(tokens[1:]))
    logits = runtime.forward(TreeBatch.build([session], [tree]))
    session.keep_rows(list(range(tree.num_rows)))
    return session, logits


def next_logits(runtime, session, root):
    return runtime.forward(TreeBatch.build([session], [compile_tree(root, TokenTree())]))[0]


def test_keeping_a_branch_equals_prefilling_its_tokens(runtime):
    session, _ = prefill(runtime, [3, 4, 5])
    # root 6 -> a: 10 -> 11 ; root -> b: 12 -> 13 -> 14   (rows: 0 root, 1..5 nodes)
    tree = compile_tree(6, TokenTree((10, 12, 11, 13, 14), (-1, -1, 0, 1, 3), (1.0,) * 5))
    runtime.forward(TreeBatch.build([session], [tree]))
    session.keep_rows([0, 2, 4])  # root, 12, 13: not contiguous, so entries are moved into place
    assert session.length == 6
    fresh, _ = prefill(runtime, [3, 4, 5, 6, 12, 13])
    torch.testing.assert_close(next_logits(runtime, session, 14), next_logits(runtime, fresh, 14), atol=1e-5, rtol=1e-5)


def test_rollback_forgets_later_tokens(runtime):
    session, _ = prefill(runtime, [3, 4, 5, 6, 7, 8])
    session.rollback(3)
    fresh, _ = prefill(runtime, [3, 4, 5])
    torch.testing.assert_close(next_logits(runtime, session, 9), next_logits(runtime, fresh, 9), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        session.rollback(10)


def test_a_batch_of_ragged_sessions_matches_each_alone(runtime):
    prompts = [[3, 4], [5, 6, 7, 8, 9, 10, 11], [12]]
    trees = [TokenTree.chain([20, 21]), TokenTree(), TokenTree((30, 31, 32), (-1, -1, 1), (1.0,) * 3)]

    def session_for(prompt):  # everything but the last token cached; the last is the tree's root
        return prefill(runtime, prompt[:-1])[0] if len(prompt) > 1 else runtime.new_session()

    compiled = [compile_tree(p[-1], t) for p, t in zip(prompts, trees)]
    batched = runtime.forward(TreeBatch.build([session_for(p) for p in prompts], compiled))
    offset = 0
    for prompt, tree in zip(prompts, compiled):
        alone = runtime.forward(TreeBatch.build([session_for(prompt)], [tree]))
        torch.testing.assert_close(batched[offset : offset + tree.num_rows], alone, atol=1e-5, rtol=1e-5)
        offset += tree.num_rows


def test_sessions_grow_past_their_first_allocation_and_stop_at_the_context(runtime):
    session, _ = prefill(runtime, list(range(2, 90)) * 3)  # 264 entries: past the first 256-entry chunk
    fresh, _ = prefill(runtime, list(range(2, 90)) * 3)
    torch.testing.assert_close(next_logits(runtime, session, 5), next_logits(runtime, fresh, 5), atol=1e-5, rtol=1e-5)
    with pytest.raises(InvalidArgument):
        session.reserve(runtime.max_length)
    session.free()
    assert session.length == 0


def test_sessions_share_one_budget_and_give_it_back(tiny_model):
    position_bytes = LlamaRuntime(tiny_model).pool.position_bytes
    runtime = LlamaRuntime(tiny_model, kv_cache_gb=600 * position_bytes / 2**30)  # 600 positions in all
    a, b, c = (runtime.new_session() for _ in range(3))
    a.reserve(10)  # capacity grows by 256 positions
    with pytest.raises(ResourceExhausted, match="KV cache full"):
        b.reserve(300)  # 512 more: over the budget
    assert b.capacity == 0
    b.reserve(200)
    with pytest.raises(ResourceExhausted):
        c.reserve(1)
    a.free()
    c.reserve(1)
    for session in (b, c):
        session.free()
    assert runtime.pool.used_bytes == 0


def test_a_verifier_on_a_cpu_budget_refuses_only_what_cannot_fit(tiny_model):
    from specmesh.runtime.tree_verifier import TreeVerifier, VerifyJob
    from specmesh.sampling import SamplingParams

    position_bytes = LlamaRuntime(tiny_model).pool.position_bytes
    runtime = LlamaRuntime(tiny_model, kv_cache_gb=300 * position_bytes / 2**30)  # one chunk of 256 positions
    verifier = TreeVerifier(runtime)
    job = lambda rid, length: VerifyJob(rid, 0, length, 5, TokenTree.chain([6, 7]), SamplingParams(),  # noqa: E731
                                        history=tuple(3 + i % 90 for i in range(length)))
    assert verifier.verify([job("a", 40)])[0].verdict is not None
    assert verifier.verify([job("b", 40)])[0].verdict is not None  # "a" made room
    assert verifier.num_sessions == 1
    small, large = verifier.verify([job("c", 20), job("d", 400)])
    assert small.verdict is not None and "KV cache full" in large.refused and not large.resync
    verifier.close_all()
    assert runtime.pool.used_bytes == 0


def test_a_session_dropped_without_free_gives_its_budget_back(tiny_model):
    runtime = LlamaRuntime(tiny_model, kv_cache_gb=0.01)
    session = runtime.new_session()
    session.reserve(100)
    assert runtime.pool.used_bytes > 0
    del session
    assert runtime.pool.used_bytes == 0


def test_a_budgeted_prefill_goes_a_chunk_per_call_and_ends_as_the_whole_one(tiny_model):
    """Chunked prefill: with a prefill time budget a long history is cached over several calls (the job
    comes back ``prefilling``, the other job of the batch is verified every time) and the step's verdict
    and features equal those of one whole prefill."""
    from specmesh.runtime.tree_verifier import TreeVerifier, VerifyJob
    from specmesh.sampling import SamplingParams

    history = tuple(3 + (i * 7) % 90 for i in range(400))
    long = VerifyJob("long", 0, len(history), 5, TokenTree.chain([6, 7, 8]), SamplingParams(), history,
                     feature_layers=(1, 2), max_prompt_features=100)
    short = lambda step, position: VerifyJob("short", step, position, 9, TokenTree.chain([10]), SamplingParams(),  # noqa: E731
                                             history=tuple(range(1, position + 1)) if step == 0 else None)
    whole = TreeVerifier(LlamaRuntime(tiny_model)).verify([long])[0]
    chunked = TreeVerifier(LlamaRuntime(tiny_model))
    calls, position, result = 0, 4, None
    while result is None or result.prefilling:
        result, beside = chunked.verify([long, short(calls, position)], prefill_ms=0.5)
        assert beside.verdict is not None  # the short request's step is never held back
        position += len(beside.verdict.tokens)
        calls += 1
        assert calls < 400, "the prefill made no progress"
    assert calls > 2 and not result.resync
    assert result.verdict == whole.verdict and result.prefilled_tokens == len(history)
    assert result.features.start == whole.features.start and result.features.layers == whole.features.layers
    torch.testing.assert_close(result.features.values, whole.features.values, rtol=0, atol=2e-3)
    # another step of the request (its router re-sent it elsewhere and came back) starts over, cleanly
    again = chunked.verify([VerifyJob("long", 7, len(history), 5, TokenTree(), SamplingParams(), history)])[0]
    assert again.verdict is not None


def test_a_bursts_prompts_are_cached_in_passes_of_their_own_a_lone_prompt_beside_decoding_is_paced(tiny_model):
    """Prompts still caching that outnumber the requests a pass verifies 3 to 1 (a burst beside its first
    decoding requests) go in passes of about ``alone_ms``, sized at once on their first chunks; fewer are
    paced within ``prefill_ms`` beside the decoding ones (the last of a burst too, once the others decode)."""
    from specmesh.runtime.tree_verifier import PROMPTS_TO_ONE, TreeVerifier, VerifyJob
    from specmesh.sampling import SamplingParams

    def calls_to_cache(prompts: int, all_but: int = 0) -> int:
        verifier = TreeVerifier(LlamaRuntime(tiny_model))
        decoding = VerifyJob("decoding", 0, 8, 9, TokenTree(), SamplingParams(), history=tuple(range(1, 9)))
        verifier.verify([decoding])
        jobs = [VerifyJob(f"p{i}", 0, 200, 5, TokenTree(), SamplingParams(),
                          history=tuple(3 + (i + j) % 90 for j in range(200))) for i in range(prompts)]
        calls = 0
        while len(jobs) > all_but:
            step = VerifyJob("decoding", calls + 1, 9 + calls, 9, TokenTree(), SamplingParams())
            results = verifier.verify([step, *jobs], prefill_ms=0.5, alone_ms=10_000.0)
            assert results[0].verdict is not None  # the decoding request's step goes on
            jobs = [job for job, result in zip(jobs, results[1:]) if result.prefilling]
            calls += 1
        return calls

    # (the last of a burst is then paced beside the others: test_prefill_pace sizes its first chunk)
    assert calls_to_cache(4 * PROMPTS_TO_ONE, all_but=1) <= 3
    # paced, 2 x 136 rows after the first chunks take 5 calls at least (8 rows, doubling at most a pass)
    assert calls_to_cache(PROMPTS_TO_ONE - 1) > 5
