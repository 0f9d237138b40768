"""The quantized CPU kernel (GGUF Q4_0 / Q4_1 / Q8_0 blocks) and the runtime computing on it.

What losslessness needs of it: a row's result never depends on the other rows of the call, so scoring a
tree gives the logits plain decoding gives, and speculative output equals plain decoding on these weights.
"""

import os
import subprocess
import sys

import pytest
import torch
from conftest import not_here, tiny_llama
from drafting import OracleTreeDrafter
from sampled_distribution import judge, lying_rule, next_distribution, sampled_pairs_pvalue, two_token_distribution

from specmesh.kernels.block_linear import (
    FORMATS,
    BlockWeight,
    PackedBlocks,
    block_linear,
    quantize,
    quantized_reference,
)
from specmesh.kernels.cpu_ops import PATH_NAMES, KernelUnavailable, chosen_path, load_cpu_ops, supported_paths
from specmesh.runtime.linear import BlockLinear
from specmesh.runtime.llama import LlamaRuntime, TreeBatch
from specmesh.runtime.loading import cache_root
from specmesh.runtime.target import prefill_sessions
from specmesh.sampling import SamplingParams
from specmesh.speculation.engine import Request, SpeculativeEngine
from specmesh.tree import TokenTree, compile_tree

MAX_TOKENS = 24


@pytest.fixture(scope="module", autouse=True)
def ops():
    try:
        return load_cpu_ops(cache_root() / "extensions")
    except KernelUnavailable as exc:  # the project installs g++ (.ci/run): this must not happen there
        pytest.fail(f"the quantized kernel does not build here: {exc}")


def random_weight(format: str, out: int, inputs: int, seed: int) -> BlockWeight:
    generator = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(out, inputs, generator=generator) * 0.05, format)


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("out,inputs", [(1, 32), (7, 64), (96, 576), (333, 160)])
def test_the_kernel_computes_the_reference_maths(format, out, inputs):
    weight = random_weight(format, out, inputs, seed=out)
    x = torch.randn(5, inputs) * 3
    y = block_linear(x, PackedBlocks.pack(weight))
    assert y.shape == (5, out) and y.dtype == torch.float32
    # the same 8-bit activations in fp64: only fp32 rounding apart
    reference = quantized_reference(x, weight)
    assert torch.allclose(y.double(), reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())
    # against the weights in fp64 with unrounded activations: the activations' 8 bits (~0.5 %)
    exact = x.double() @ weight.dequantize(torch.float64).T
    assert ((y.double() - exact).norm() / exact.norm()).item() < 0.02


@pytest.fixture
def threads():
    """Sets torch's intra-op threads for a test, and puts them back."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("format", FORMATS)
def test_a_row_in_a_batch_equals_the_row_alone(format, count, threads):
    weight = random_weight(format, 70, 192, seed=1)
    x = torch.randn(13, 192)
    packed = PackedBlocks.pack(weight)
    threads(1)
    alone = torch.cat([block_linear(x[i : i + 1], packed) for i in range(13)])
    threads(count)  # from 4 rows on, rows are quantized on both threads
    for rows in (2, 3, 5, 13):
        assert torch.equal(block_linear(x[:rows], packed), alone[:rows])


def test_zero_rows_zero_activations_and_bad_shapes():
    weight = PackedBlocks.pack(random_weight("Q4_1", 8, 64, seed=2))
    assert block_linear(torch.empty(0, 64), weight).shape == (0, 8)
    assert torch.equal(block_linear(torch.zeros(2, 64), weight), torch.zeros(2, 8))
    with pytest.raises(RuntimeError, match="inputs"):
        block_linear(torch.randn(1, 96), weight)
    with pytest.raises(ValueError, match="no block kernel"):
        BlockWeight("Q5_K", torch.zeros(1, 22, dtype=torch.uint8))
    with pytest.raises(ValueError, match="in % 32"):
        quantize(torch.randn(4, 40), "Q8_0")


def test_block_weights_stack_and_pick_rows():
    a, b = random_weight("Q4_0", 6, 64, seed=3), random_weight("Q4_0", 4, 64, seed=4)
    stacked = BlockWeight.cat([a, b])
    assert stacked.shape == (10, 64)
    assert torch.equal(stacked.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    order = torch.tensor([9, 0, 3])
    assert torch.equal(stacked.rows(order).dequantize(), stacked.dequantize()[order])
    with pytest.raises(ValueError, match="share"):
        BlockWeight.cat([a, random_weight("Q8_0", 4, 64, seed=5)])


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in supported_paths() if p != chosen_path()])
def test_every_build_this_cpu_runs_gives_the_same_bits(path):
    """Each CPU runs the best build it can (VNNI, AVX2, or the plain C++ path on others and on ARM): every
    one gives the same numbers, not just close ones, for any number of rows."""
    other = load_cpu_ops(cache_root() / "extensions", path)
    for format in FORMATS:
        weight = random_weight(format, 37, 128, seed=6)
        packed = PackedBlocks.pack(weight)
        for rows in (1, 3, 9, 17):
            x = torch.randn(rows, 128)
            expected = block_linear(x, packed)
            assert torch.equal(other.block_linear(x, packed.data, FORMATS[format][0], 37), expected), (format, rows)
    query, key, value = torch.randn(5, 9, 64), torch.randn(3, 75, 64), torch.randn(3, 75, 64)
    mask = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    expected = load_cpu_ops(cache_root() / "extensions").tree_attention(query, key, value, 70, mask, 0.125)
    assert torch.equal(other.tree_attention(query, key, value, 70, mask, 0.125), expected)


def test_the_cpu_build_is_chosen_by_the_cpu_and_can_be_forced(monkeypatch):
    monkeypatch.delenv("SPECMESH_CPU_KERNEL", raising=False)
    assert supported_paths()[-1] == "portable" and chosen_path() == supported_paths()[0]
    monkeypatch.setenv("SPECMESH_CPU_KERNEL", "portable")
    assert chosen_path() == "portable"
    monkeypatch.setenv("SPECMESH_CPU_KERNEL", "sse9")
    with pytest.raises(KernelUnavailable, match="must be auto or one of"):
        chosen_path()
    missing = [name for name in PATH_NAMES if name not in supported_paths()]
    if missing:  # a build this CPU cannot run is refused by name, not crashed into
        monkeypatch.setenv("SPECMESH_CPU_KERNEL", missing[0])
        with pytest.raises(KernelUnavailable, match="lacks"):
            chosen_path()


@pytest.mark.slow
@pytest.mark.parametrize("rows, heads, kv_heads, dim, cached", [
    (1, 9, 3, 64, 0), (1, 9, 3, 64, 131), (6, 9, 3, 64, 200), (33, 4, 4, 128, 70), (5, 4, 1, 16, 9),
])
def test_tree_attention_is_the_portable_path_bit_for_bit_and_exact_per_row(rows, heads, kv_heads, dim, cached):
    """The AVX2 path shares key blocks between a task's queries; each query's numbers stay the portable
    path's, and a row's output is the same scored alone (its ancestors cached) as inside its tree. Shapes
    cross the tiling's edges: partial row blocks, runs of keys not a multiple of 8 or of a key block,
    one or two lane-block passes per head."""
    ops = load_cpu_ops(cache_root() / "extensions")
    portable = load_cpu_ops(cache_root() / "extensions", "portable")
    generator = torch.Generator().manual_seed(rows * 1000 + cached)
    query = torch.randn(rows, heads, dim, generator=generator)
    key, value = (torch.randn(kv_heads, cached + rows, dim, generator=generator) for _ in range(2))
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, rows)]
    mask = torch.eye(rows, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] |= mask[parent]
    out = ops.tree_attention(query, key, value, cached, mask, 0.125)
    assert torch.equal(out, portable.tree_attention(query, key, value, cached, mask, 0.125))
    last = rows - 1  # alone: its ancestors moved into the cache, in order, then itself
    path = [j for j in range(rows) if mask[last, j]]
    order = list(range(cached)) + [cached + j for j in path]
    alone = ops.tree_attention(query[last:], key[:, order], value[:, order], len(order) - 1,
                               torch.ones(1, 1, dtype=torch.bool), 0.125)
    assert torch.equal(alone[0], out[last])


# ---- the runtime on quantized weights: a tiny Llama whose every projection is Q4_1 / Q8_0 blocks ----


def quantized_llama(seed: int = 0, vocab: int = 96):
    model = tiny_llama(vocab_size=vocab, seed=seed)
    blocks = {}
    for name, parameter in model.named_parameters():
        if parameter.dim() == 2 and "embed" not in name:
            blocks[name] = quantize(parameter, "Q8_0" if name == "lm_head.weight" else "Q4_1")
    return model, LlamaRuntime(model, block_weights=blocks)


def runtime_greedy(runtime, prompt, max_tokens) -> list[int]:
    (out,) = SpeculativeEngine(runtime, [], max_tree_nodes=0).generate(
        [Request(tuple(prompt), SamplingParams(max_tokens=max_tokens))])
    return out.token_ids


def test_every_projection_runs_on_blocks():
    _, runtime = quantized_llama()
    assert runtime.precision == "Q4_1+Q8_0"
    assert all(isinstance(p, BlockLinear)
               for layer in runtime.layers for p in (layer.qkv, layer.out, layer.gate_up, layer.down))


@pytest.mark.parametrize("count", [1, 2])
def test_tree_rows_score_exactly_as_plain_decoding_on_blocks(count, threads):
    """On blocks every op is row-exact (linears, attention): every row of every tree in a pass of several
    gives the logits plain decoding gives at the end of that row's path, bit for bit, so 8-bit activation
    rounding cannot turn last-bit differences into other tokens; on one thread or two (the fused layer
    splits a pass's rows over the threads from 4 rows on)."""
    _, runtime = quantized_llama()
    prompts = [[5, 17, 3, 44, 9, 12], [8, 2, 61, 7], [40, 41]]
    trees = [TokenTree.from_paths([[30, 31, 32], [77, 5]]),  # a branch the chain's rows must not see
             TokenTree.from_paths([[3, 3], [4], [5, 6, 7, 8]]), TokenTree.chain([])]
    compiled = [compile_tree(prompt[-1], tree) for prompt, tree in zip(prompts, trees)]

    def prefilled(prompt):
        session = runtime.new_session()
        prefill_sessions(runtime, [session], [prompt[:-1]])
        return session

    def alone(prompt, path) -> torch.Tensor:  # plain decoding: one row a pass, committing each
        session = prefilled(prompt)
        for token in path:
            logits = runtime.forward(TreeBatch.build([session], [compile_tree(token, TokenTree.chain([]))]))[0]
            session.keep_rows([0])
        session.free()
        return logits

    threads(1)
    expected = [[alone(prompt, tree.input_ids[tree.mask[row]].tolist()) for row in range(tree.num_rows)]
                for prompt, tree in zip(prompts, compiled)]
    threads(count)
    batch = TreeBatch.build([prefilled(p) for p in prompts], compiled)
    logits = runtime.forward(batch)  # [total rows, vocab]
    for i, rows in enumerate(expected):
        for row, reference in enumerate(rows):
            assert torch.equal(logits[batch.cu_rows[i] + row], reference), f"tree {i}, row {row}"


def test_speculative_greedy_equals_plain_greedy_on_blocks():
    _, runtime = quantized_llama(seed=1)
    prompts = [[7, 3, 9, 3, 7, 3, 9][: n + 2] * 2 for n in range(5)]
    answers = {tuple(p): runtime_greedy(runtime, p, MAX_TOKENS) for p in prompts}
    engine = SpeculativeEngine(runtime, [OracleTreeDrafter(answers, vocab_size=96, seed=0)], max_tree_nodes=6)
    outputs = engine.generate([Request(tuple(p), SamplingParams(max_tokens=MAX_TOKENS)) for p in prompts])
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == answers[tuple(prompt)]
    assert sum(len(o.token_ids) for o in outputs) > sum(o.stats.target_steps for o in outputs)


@pytest.mark.parametrize("rule", ["exact", "lying"])
def test_sampled_two_token_distribution_on_blocks(rule, monkeypatch):
    """Speculative sampling on quantized weights follows the quantized model's own distribution; the
    same test given a wrong acceptance rule (the decoy) must see it."""
    vocab, top_k = 32, 4
    _, runtime = quantized_llama(seed=3, vocab=vocab)
    prompt = [2, 9, 4, 2, 9]
    if rule == "lying":
        monkeypatch.setattr("specmesh.runtime.tree_verifier.verify_mss", lying_rule)
    exact = two_token_distribution(runtime, prompt, top_k)
    keep = next_distribution(runtime, prompt, top_k)[0]
    answers = {tuple(prompt): [int(keep[0]), int(next_distribution(runtime, prompt + [int(keep[0])], top_k)[0][0])]}
    drafter = OracleTreeDrafter(answers, vocab_size=vocab, seed=1)
    engine = SpeculativeEngine(runtime, drafters=[drafter], max_tree_nodes=6)
    pvalue = sampled_pairs_pvalue(engine, prompt, exact, top_k, batches=30)
    judge(rule, pvalue, "speculative sampling on blocks")


def test_any_llama_model_can_run_int8_weight_only():
    """--precision q8_0: every projection and the head rounded to Q8_0 blocks at load; speculative decoding
    on them reproduces plain decoding on them."""
    from specmesh.runtime.loading import LoadedModel
    from specmesh.runtime.target import shipped_blocks

    model = tiny_llama(seed=2)
    blocks = shipped_blocks(LoadedModel("tiny", model, tokenizer=None), "q8_0")
    assert set(blocks) == {n for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n}
    assert shipped_blocks(LoadedModel("tiny", model, tokenizer=None), "shipped") is None  # not a GGUF file
    runtime = LlamaRuntime(model, block_weights=blocks)
    assert runtime.precision == "Q8_0" and runtime.fused_layers
    prompts = [[4, 8, 15, 16, 23, 42][: n + 2] * 2 for n in range(4)]
    answers = {tuple(p): runtime_greedy(runtime, p, MAX_TOKENS) for p in prompts}
    engine = SpeculativeEngine(runtime, [OracleTreeDrafter(answers, vocab_size=96, seed=2)], max_tree_nodes=6)
    outputs = engine.generate([Request(tuple(p), SamplingParams(max_tokens=MAX_TOKENS)) for p in prompts])
    assert [o.token_ids for o in outputs] == [answers[tuple(p)] for p in prompts]


@pytest.mark.slow
def test_a_build_that_does_not_compile_here_falls_back_to_the_next(tmp_path):
    """An older compiler without the best build's flags: the runtime runs the next build, with a warning."""
    best = supported_paths()[0]
    if best == "portable":
        not_here("this CPU has one build only: nothing to fall back from (CI's CPUs have AVX2 at least)")
    flag = {"avx512vnni": "-mavx512vnni", "avxvnni": "-mavxvnni", "avx2": "-mavx2"}[best]
    compiler = tmp_path / "c++"
    compiler.write_text(f'#!/bin/sh\ncase " $* " in *" {flag} "*) echo "unknown flag {flag}" >&2; exit 1;; esac\n'
                        'exec c++ "$@"\n')
    compiler.chmod(0o755)
    code = ("import logging, torch; logging.basicConfig(); from pathlib import Path; "
            "from specmesh.kernels.cpu_ops import load_cpu_ops; "
            f"ops = load_cpu_ops(Path({str(tmp_path / 'extensions')!r})); x = torch.ones(1, 32); "
            "print('loaded', ops.block_linear.__name__ if hasattr(ops.block_linear, '__name__') else 'ok')")
    env = {**os.environ, "CXX": str(compiler), "SPECMESH_CPU_KERNEL": "auto"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loaded" in done.stdout
    assert f"the CPU kernels run as {supported_paths()[1]}" in done.stderr and best in done.stderr
