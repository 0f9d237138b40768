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
