"""The paged KV pool, the batched paged tree-attention kernel and the shape-stable runtime built on them.

On a CPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py); with
``TRITON_INTERPRET=0`` on a CUDA machine the same tests run the compiled kernel and the CUDA graphs.
"""

import random

import pytest
import torch
from conftest import DEVICE, tiny_llama

from specmesh.bench.runtime_speed import plain_greedy
from specmesh.errors import InvalidArgument, ResourceExhausted
from specmesh.kernels.paged_tree_attention import (
    ancestor_table,
    paged_tree_attention_reference,
    paged_tree_attention_triton,
)
from specmesh.kernels.tree_attention_reference import tree_attention_reference
from specmesh.runtime.kv_pool import KVPool
from specmesh.runtime.llama import LlamaRuntime, TreeBatch
from specmesh.runtime.paged_llama import PagedLlamaRuntime, bucket_pow2, bucket_rows
from specmesh.runtime.target import prefill_sessions
from specmesh.tree import TokenTree, compile_tree



def random_batch(lengths, rows, num_heads, num_kv_heads, head_dim, page_size=16, pages=64, dtype=torch.float32, seed=0):
    """A pool with random K/V, requests scattered over shuffled pages, random trees, two padded rows and
    one padded request (owning no row)."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(pages * page_size, num_kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(pages * page_size, num_kv_heads, head_dim, generator=generator)
    free = list(range(1, pages))
    rng.shuffle(free)
    max_pages = max(-(-(length + n) // page_size) for length, n in zip(lengths, rows))
    block_tables = torch.zeros(len(lengths) + 1, max_pages, dtype=torch.int32)
    masks = []
    for b, (length, n) in enumerate(zip(lengths, rows)):
        for i in range(-(-(length + n) // page_size)):
            block_tables[b, i] = free.pop()
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):  # a random forest: a node sees its parent's ancestors and itself
            parent = rng.randrange(-1, i)
            if parent >= 0:
                mask[i] = mask[parent]
            mask[i, i] = True
        masks.append(mask)
    total = sum(rows) + 2
    row_request, ancestors, seen = ancestor_table(masks, total, bucket_pow2(max(rows), least=16))
    query = torch.randn(total, num_heads, head_dim, generator=generator)
    tensors = [t.to(DEVICE) for t in (query.to(dtype), k_cache.to(dtype), v_cache.to(dtype), block_tables,
                                      torch.tensor(lengths + [0], dtype=torch.int32), row_request, ancestors, seen)]
    return (*tensors, page_size, head_dim**-0.5), masks


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_the_paged_kernel_matches_the_reference(num_kv_heads, head_dim):
    args, _ = random_batch([5, 0, 37, 70], [3, 1, 9, 17], 4, num_kv_heads, head_dim, seed=num_kv_heads + head_dim)
    out = paged_tree_attention_triton(*args)
    expected = paged_tree_attention_reference(*args)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    assert out[-2:].abs().max() == 0  # rows no request owns


def test_the_paged_reference_is_tree_attention_over_the_pages():
    args, (mask,) = random_batch([21], [6], 6, 3, 16)
    query, k_cache, v_cache, block_tables, *_, page, scale = args
    positions = torch.arange(27, device=DEVICE)
    slots = block_tables[0].long()[positions // page] * page + positions % page
    expected = tree_attention_reference(query[:6].transpose(0, 1), k_cache[slots].transpose(0, 1),
                                        v_cache[slots].transpose(0, 1), mask.to(DEVICE), scale).transpose(0, 1)
    torch.testing.assert_close(paged_tree_attention_reference(*args)[:6], expected)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="bf16 tolerance is a GPU check")
def test_the_paged_kernel_in_bf16():
    args, _ = random_batch([300, 511], [9, 1], 32, 8, 128, pages=64, dtype=torch.bfloat16)
    out = paged_tree_attention_triton(*args).float()
    reference_args = [a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
    expected = paged_tree_attention_reference(*reference_args).float()
    assert ((out - expected).norm() / expected.norm()).item() < 1e-2


def test_the_pool_hands_out_pages_and_refuses_when_full():
    pool = KVPool(2, 2, 16, torch.float32, torch.device("cpu"), budget_bytes=5 * 2 * 2 * 16 * 2 * 16 * 4)
    assert pool.capacity_pages == 4  # one page is the trash page
    a, b = pool.new_session(512), pool.new_session(512)
    a.reserve(40)  # 3 pages
    with pytest.raises(ResourceExhausted, match="KV cache full"):
        b.reserve(17)  # 2 more pages: only one is free
    assert b.pages == [] and pool.free_pages == 1  # the refused session holds nothing
    a.keep_rows(list(range(20)))  # 20 committed: 2 pages and one spare are kept
    assert len(a.pages) == 3
    with pytest.raises(InvalidArgument, match="context"):
        a.reserve(600)
    a.free()
    b.reserve(17)
    assert pool.free_pages == 2
    b.free()
    b.free()  # twice is harmless
    assert pool.free_pages == pool.capacity_pages


def test_a_session_dropped_without_free_gives_its_pages_back():
    pool = KVPool(1, 1, 16, torch.float32, torch.device("cpu"), budget_bytes=8 * 2 * 16 * 16 * 4)
    session = pool.new_session(512)
    session.reserve(40)
    del session
    assert pool.free_pages == pool.capacity_pages


def test_a_budget_below_two_pages_is_a_clear_error():
    with pytest.raises(InvalidArgument, match="kv_cache_gb"):
        KVPool(30, 3, 64, torch.float32, torch.device("cpu"), budget_bytes=1000)


def test_thousands_of_requests_leak_no_page():
    pool = KVPool(1, 1, 16, torch.float32, torch.device("cpu"), budget_bytes=64 * 2 * 16 * 16 * 4)
    rng = random.Random(0)
    live = []
    for _ in range(3000):
        if live and (rng.random() < 0.5 or pool.free_pages < 8):
            live.pop(rng.randrange(len(live))).free()
            continue
        session = pool.new_session(4096)
        session.reserve(rng.randrange(1, 60))
        rows = sorted(rng.sample(range(session.capacity - session.length), rng.randrange(1, 5)))
        session.keep_rows(rows if rng.random() < 0.5 else list(range(len(rows))))
        live.append(session)
    for session in live:
        session.free()
    assert pool.free_pages == pool.capacity_pages
    assert len(set(pool._free)) == pool.capacity_pages  # no page handed back twice


def test_keep_rows_moves_the_accepted_rows_into_place():
    pool = KVPool(1, 1, 16, torch.float32, torch.device("cpu"), budget_bytes=8 * 2 * 16 * 16 * 4)
    session = pool.new_session(512)
    session.reserve(14)
    session.length = 14  # as if 14 were committed
    session.reserve(20)  # a tree of 20 rows crosses into a third page
    slots = session.slots(14, 20)
    pool.k[0, slots] = torch.arange(20, dtype=torch.float32)[:, None, None].expand(20, 1, 16)
    session.keep_rows([0, 3, 17])
    assert pool.k[0, session.slots(14, 3), 0, 0].tolist() == [0.0, 3.0, 17.0]
    assert session.length == 17


def test_pass_inputs_already_on_a_device_move_without_pinning():
    from specmesh.runtime.paged_llama import PassInputs

    # what a tensor-parallel follower receives is on its device already; only host memory can be pinned
    on_device = PassInputs(*(torch.zeros(2, dtype=torch.long, device="meta") for _ in range(9)))
    moved = on_device.to(torch.device("meta"))
    assert all(t.device.type == "meta" for t in moved.tensors())
    on_host = PassInputs(*(torch.zeros(2, dtype=torch.long) for _ in range(9)))
    assert on_host.to(torch.device("cpu")) is on_host


def test_buckets():
    assert [bucket_rows(n) for n in (1, 16, 17, 200, 257, 320, 321, 600)] == [16, 16, 32, 256, 320, 320, 384, 1024]
    assert [bucket_pow2(n) for n in (1, 2, 3, 9)] == [1, 2, 4, 16]
    assert bucket_pow2(3, least=16) == 16


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=96, layers=2, hidden=64).to(DEVICE)


def test_the_paged_runtime_scores_as_the_lean_runtime(model):
    if DEVICE.type == "cuda":
        pytest.skip("fp32 on CPU: the lean runtime's per-request attention is the comparison")
    paged, lean = PagedLlamaRuntime(model, kv_cache_gb=0.01), LlamaRuntime(model)
    prompt = list(range(3, 40))
    assert plain_greedy(paged, prompt, 20) == plain_greedy(lean, prompt, 20)
    sessions = [runtime.new_session() for runtime in (paged, lean)]
    trees = [compile_tree(5, TokenTree.from_paths([[7, 8, 9], [7, 10], [11]]))]
    for runtime, session in zip((paged, lean), sessions):
        prefill_sessions(runtime, [session], [prompt])
    a = paged.forward(TreeBatch.build(sessions[:1], trees))
    b = lean.forward(TreeBatch.build(sessions[1:], trees))
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_the_fused_layer_ops_compute_the_pytorch_maths():
    from specmesh.kernels.llama_ops_triton import add_rms_norm, rope_and_cache, silu_mul
    from specmesh.runtime.llama import _rope

    generator = torch.Generator().manual_seed(3)
    x, delta = (torch.randn(5, 96, generator=generator).to(DEVICE) for _ in range(2))
    weight = torch.rand(96, generator=generator).to(DEVICE)
    summed, normed = add_rms_norm(x, delta, weight, 1e-5)
    expected = x + delta
    torch.testing.assert_close(summed, expected)
    torch.testing.assert_close(normed, weight * expected * torch.rsqrt(expected.pow(2).mean(-1, keepdim=True) + 1e-5))

    heads, kv_heads, head_dim = 4, 2, 16
    qkv = torch.randn(5, (heads + 2 * kv_heads) * head_dim, generator=generator).to(DEVICE)
    cos, sin = torch.randn(2, 40, head_dim, generator=generator).to(DEVICE)
    positions = torch.tensor([3, 0, 39, 7, 7], device=DEVICE)
    slots = torch.tensor([9, 2, 30, 31, 0], device=DEVICE)
    k_cache, v_cache = torch.zeros(2, 32, kv_heads, head_dim, device=DEVICE)
    q = rope_and_cache(qkv, positions, cos, sin, slots, k_cache, v_cache, heads)
    c, s_ = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    torch.testing.assert_close(q, _rope(qkv[:, :q_size].reshape(5, heads, head_dim), c, s_))
    torch.testing.assert_close(k_cache[slots], _rope(qkv[:, q_size : q_size + kv_size].reshape(5, kv_heads, head_dim), c, s_))
    torch.testing.assert_close(v_cache[slots], qkv[:, q_size + kv_size :].reshape(5, kv_heads, head_dim))

    gate_up = torch.randn(5, 2 * 1100, generator=generator).to(DEVICE)  # two column blocks, the second partial
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(gate_up), torch.nn.functional.silu(gate) * up)


def test_the_fused_runtime_scores_as_the_lean_runtime(model):
    if DEVICE.type == "cuda":
        pytest.skip("fp32 on CPU: the lean runtime is the comparison")
    fused, lean = PagedLlamaRuntime(model, kv_cache_gb=0.01, attention="triton"), LlamaRuntime(model)
    assert fused.fused_ops
    sessions = [runtime.new_session() for runtime in (fused, lean)]
    trees = [compile_tree(5, TokenTree.from_paths([[7, 8, 9], [7, 10], [11]]))]
    for runtime, session in zip((fused, lean), sessions):
        prefill_sessions(runtime, [session], [list(range(3, 40))])
    torch.testing.assert_close(fused.forward(TreeBatch.build(sessions[:1], trees)),
                               lean.forward(TreeBatch.build(sessions[1:], trees)), atol=1e-4, rtol=1e-4)


# 60: the path crosses a key block; 90: one block shared, which on some CPUs differs in the last bit in Triton's
# interpreter (numpy's dot sums in the order the machine's BLAS picks by shape; 872238a fails it here too)
@pytest.mark.parametrize("length", [27, 60, pytest.param(90, marks=pytest.mark.skipif(
    DEVICE.type != "cuda", reason="interpreted, a shared key block's sums follow numpy's BLAS by shape"))])
def test_a_tree_gets_exactly_the_logits_of_plain_steps(model, length):
    """Lossless by construction: a tree's rows equal the one-row steps bit for bit."""
    runtime = PagedLlamaRuntime(model, kv_cache_gb=0.01, attention="triton")  # the batch-invariant kernel
    prompt = [3 + i % 90 for i in range(length)]
    path = plain_greedy(runtime, prompt, 6)
    session = runtime.new_session()
    prefill_sessions(runtime, [session], [prompt[:-1]])
    plain_rows = []
    for token in [prompt[-1]] + path[:-1]:
        plain_rows.append(runtime.forward(TreeBatch.build([session], [compile_tree(token, TokenTree())]))[0])
        session.keep_rows([0])
    session.rollback(len(prompt) - 1)
    # a wrong branch first: the path's nodes are rows 0, 2, 3, ... (not where plain decoding had them)
    tree = TokenTree.from_paths([[(path[0] + 2) % 96, 4], path[:5], [path[0], (path[1] + 1) % 96]])
    logits = runtime.forward(TreeBatch.build([session], [compile_tree(prompt[-1], tree)]))
    on_path = [0, 3, 4, 5, 6, 7]  # the root, then the second path's nodes (from_paths numbers paths in order)
    assert [tree.tokens[row - 1] for row in on_path[1:]] == path[:5]
    for row, expected in zip(on_path, plain_rows):
        assert torch.equal(logits[row], expected)
    session.free()
    assert runtime.pool.free_pages == runtime.pool.capacity_pages


def test_a_full_pool_refuses_the_pass_and_recovers(model):
    runtime = PagedLlamaRuntime(model, kv_cache_gb=4 * runtime_page_bytes(model) / 2**30)
    assert runtime.pool.capacity_pages == 3
    first, second = runtime.new_session(), runtime.new_session()
    prefill_sessions(runtime, [first], [list(range(40))])  # 3 pages
    with pytest.raises(ResourceExhausted):
        prefill_sessions(runtime, [second], [list(range(10))])
    assert second.pages == [] and second.length == 0
    first.free()
    prefill_sessions(runtime, [second], [list(range(10))])
    assert second.length == 10


def runtime_page_bytes(model) -> int:
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * 16 * config.num_key_value_heads * head_dim * 4


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
def test_graph_replays_equal_eager_passes(model):
    graphed = PagedLlamaRuntime(model, kv_cache_gb=0.01, graphs=True)
    eager = PagedLlamaRuntime(model, kv_cache_gb=0.01, graphs=False)
    prompt = list(range(3, 50))
    assert plain_greedy(graphed, prompt, 30) == plain_greedy(eager, prompt, 30)


def test_a_verifier_frees_idle_sessions_when_the_pool_is_full(model):
    from specmesh.runtime.tree_verifier import TreeVerifier, VerifyJob
    from specmesh.sampling import SamplingParams

    runtime = PagedLlamaRuntime(model, kv_cache_gb=6 * runtime_page_bytes(model) / 2**30)  # 5 usable pages
    verifier = TreeVerifier(runtime)
    job = lambda rid, length: VerifyJob(rid, 0, length, 5, TokenTree.chain([6, 7]), SamplingParams(),  # noqa: E731
                                        history=tuple(3 + i % 90 for i in range(length)))
    (first,) = verifier.verify([job("a", 40)])  # 43 positions: 3 pages
    (second,) = verifier.verify([job("b", 30)])  # 2 more pages would leave none for a tree: "a" is evicted
    assert not first.resync and not second.resync
    assert verifier.num_sessions == 1 and runtime.pool.free_pages >= 1
    (refused,) = verifier.verify([job("c", 100)])  # larger than the whole pool: a clear refusal
    assert refused.verdict is None and not refused.resync and "KV cache full" in refused.refused
    assert runtime.pool.free_pages == runtime.pool.capacity_pages  # everyone else was evicted first
    small, large = verifier.verify([job("d", 20), job("e", 100)])  # one batch: only the job that cannot fit
    assert small.verdict is not None and large.refused


def test_the_batch_invariant_matmul_gives_a_row_the_same_bits_in_any_batch():
    from specmesh.kernels.matmul_triton import invariant_linear, tile_for

    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(200, 192, generator=generator).to(DEVICE)  # a partial column tile; K = 3 x 64
    bias = torch.randn(200, generator=generator).to(DEVICE)
    x = torch.randn(80, 192, generator=generator).to(DEVICE)
    everything = invariant_linear(x, weight, bias)
    torch.testing.assert_close(everything, torch.nn.functional.linear(x, weight, bias), atol=1e-4, rtol=1e-4)
    slices = [(0, 1), (0, 17), (64, 80)]  # other row counts, the same places in a tile
    # the interpreter's numpy dot sums by place in the tile and by tile shape: there, one tile for all
    tile = None if DEVICE.type == "cuda" else tile_for(len(x))
    if DEVICE.type == "cuda":
        slices += [(5, 9), (20, 37), (60, 70)]
    for start, end in slices:
        assert torch.equal(invariant_linear(x[start:end].contiguous(), weight, bias, tile=tile), everything[start:end])


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the ladder's tiles agree on the GPU's matrix instructions; the "
                    "interpreter's numpy dot sums by tile shape")
def test_every_tile_of_the_ladder_gives_a_row_the_same_bits():
    from specmesh.kernels.matmul_triton import TILES, invariant_linear

    generator = torch.Generator().manual_seed(6)
    weight = (torch.randn(1000, 2048, generator=generator) * 0.02).to(DEVICE, torch.bfloat16)  # a partial column tile
    x = torch.randn(520, 2048, generator=generator).to(DEVICE, torch.bfloat16)
    first = invariant_linear(x, weight, tile=TILES[0][1])
    for _, tile in TILES:
        for rows in (1, 16, 130, 520):
            assert torch.equal(invariant_linear(x[:rows].contiguous(), weight, tile=tile), first[:rows]), (tile, rows)
    for rows in (1, 40, 100, 300):  # the ladder's own choice at each row count
        assert torch.equal(invariant_linear(x[:rows].contiguous(), weight), first[:rows]), rows


def test_the_paged_runtime_is_batch_invariant_by_default_on_cuda_only(model):
    assert PagedLlamaRuntime(model, kv_cache_gb=0.01).batch_invariant == (DEVICE.type == "cuda")
    assert not PagedLlamaRuntime(model, kv_cache_gb=0.01, batch_invariant=False).batch_invariant


@pytest.mark.skipif(DEVICE.type != "cuda", reason="rows land anywhere in a tile: the interpreter's numpy dot sums by "
                    "place in the tile")
def test_a_batch_invariant_runtime_scores_a_request_alike_in_any_batch(model):
    runtime = PagedLlamaRuntime(model, kv_cache_gb=0.01, attention="triton", batch_invariant=True)
    prompts = [list(range(3, 30)), list(range(10, 50)), list(range(5, 12))]
    sessions = [runtime.new_session() for _ in prompts]
    prefill_sessions(runtime, sessions, prompts)
    trees = [compile_tree(5, TokenTree.from_paths([[7, 8, 9], [7, 10]])), compile_tree(6, TokenTree.chain([1] * 20)),
             compile_tree(7, TokenTree())]
    together = runtime.forward(TreeBatch.build(sessions, trees))  # 30 rows: another row bucket than each alone
    alone = torch.cat([runtime.forward(TreeBatch.build([s], [t])) for s, t in zip(sessions, trees)])
    assert torch.equal(together, alone)


def test_the_runtime_bench_lossless_check_holds_and_catches_a_batch_dependent_runtime(model):
    from specmesh.bench.runtime_speed import lossless_check

    class BatchDependent(PagedLlamaRuntime):  # a decoy: a request's logits change when others share its pass
        def forward(self, batch, logits_rows=None):
            logits = super().forward(batch, logits_rows)
            if len(batch.sessions) > 1:
                logits[:, 7] += 50.0
            return logits

    prompts = [[3 + (i * 7 + j) % 90 for j in range(length)] for i, length in enumerate((60, 63, 20))]
    honest = lossless_check(PagedLlamaRuntime(model, kv_cache_gb=0.01), prompts, [1, 3], steps=8)
    assert honest["identical"] and honest["batch3"]["identical_requests"] == 3
    decoy = lossless_check(BatchDependent(model, kv_cache_gb=0.01), prompts, [1, 3], steps=8)
    assert not decoy["identical"] and decoy["batch1"]["identical_requests"] == 1


def test_a_model_the_invariant_products_cannot_take_is_refused_clearly():
    from specmesh.kernels.matmul_triton import plan
    from specmesh.runtime.linear import InvariantLinear

    assert plan(4096, 4096, 132) == 1 and plan(576, 576, 132) > 1  # wide weights are never split
    assert plan(96, 48, 16) in (1, 3)  # K a multiple of 16 only: steps of 16
    from specmesh.kernels.matmul_triton import invariant_linear

    x, w = torch.randn(5, 48).to(DEVICE), torch.randn(96, 48).to(DEVICE)
    torch.testing.assert_close(invariant_linear(x, w), torch.nn.functional.linear(x, w), atol=1e-4, rtol=1e-4)
    with pytest.raises(InvalidArgument, match="no-batch-invariant"):
        InvariantLinear(torch.zeros(8, 40))
