"""Trees of hundreds to a thousand nodes (SpecExec-sized: for targets whose pass costs about the same for
a thousand rows as for one, such as an offloaded one): every CPU runtime verifies them losslessly,
greedy and sampled, with the right path hidden among random branches."""

import pytest
from conftest import hf_greedy, tiny_llama
from drafting import OracleTreeDrafter
from sampled_distribution import judge_sampling_on

from specmesh.kernels.block_linear import quantize
from specmesh.kernels.cpu_ops import load_cpu_ops
from specmesh.runtime.llama import LlamaRuntime
from specmesh.runtime.loading import cache_root
from specmesh.runtime.paged_llama import PagedLlamaRuntime
from specmesh.sampling import SamplingParams
from specmesh.speculation.engine import Request, SpeculativeEngine
from specmesh.tree import MAX_TREE_NODES

VOCAB, MAX_TOKENS = 96, 16


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=VOCAB, seed=5, max_position_embeddings=4096)


def runtime_of(kind: str, model):
    if kind == "lean":
        return LlamaRuntime(model)
    if kind == "blocks":  # what the CPU verifier runs: Q4_1 / Q8_0 blocks, every row exact (the C++ layer)
        load_cpu_ops(cache_root() / "extensions")
        return LlamaRuntime(model, block_weights={
            name: quantize(p, "Q8_0" if name == "lm_head.weight" else "Q4_1")
            for name, p in model.named_parameters() if p.dim() == 2 and "embed" not in name})
    return PagedLlamaRuntime(model, attention="triton" if kind == "paged-triton" else "reference")


# the GPU's kernels run under Triton's interpreter here: 256 nodes (~20 s), not 1,024 (~2 min)
@pytest.mark.parametrize("kind,nodes", [(kind, nodes) for kind in ("lean", "blocks", "paged")
                                        for nodes in (256, MAX_TREE_NODES)] + [("paged-triton", 256)])
def test_a_thousand_node_tree_gives_the_plain_greedy_output(target, kind, nodes):
    prompts = [[5 + i, 17, 3 * i + 2, 40] for i in range(1 if kind == "paged-triton" else 3)]
    runtime = runtime_of(kind, target)
    requests = lambda: [Request(tuple(p), SamplingParams(max_tokens=MAX_TOKENS)) for p in prompts]  # noqa: E731
    plain = SpeculativeEngine(runtime, drafters=[], max_tree_nodes=0).generate(requests())
    answers = {tuple(p): out.token_ids for p, out in zip(prompts, plain)}
    if kind != "blocks":  # rounded weights have their own greedy path
        assert all(answers[tuple(p)] == hf_greedy(target, p, MAX_TOKENS) for p in prompts)
    drafter = OracleTreeDrafter(answers, VOCAB, seed=nodes, full=True)
    outputs = SpeculativeEngine(runtime, drafters=[drafter], max_tree_nodes=nodes).generate(requests())
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == answers[tuple(prompt)]
    steps = sum(o.stats.target_steps for o in outputs)
    assert sum(o.stats.drafted_nodes for o in outputs) >= (nodes - MAX_TOKENS) * steps // 2  # full-size trees
    assert sum(len(o.token_ids) for o in outputs) > steps, "the right paths should have been accepted"


@pytest.mark.parametrize("rule", ["exact", "lying"])
def test_sampling_through_a_256_node_tree_keeps_the_targets_distribution(rule, monkeypatch):
    """Two sampled tokens (top-4) through 256-node trees whose right path guesses the likeliest first
    token; a wrong acceptance rule (the decoy) must be seen."""
    runtime = LlamaRuntime(tiny_llama(vocab_size=32, seed=3, max_position_embeddings=4096))
    judge_sampling_on(runtime, rule, monkeypatch, 32, "sampling through 256-node trees", nodes=256, batches=8)
