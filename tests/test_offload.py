"""The offloaded target (``--offload``): decoder layers in host memory, streamed to the compute device a
layer at a time through two slots. On a CPU the same path copies host to host: its passes equal the
resident runtime's bit for bit, and speculation on it is lossless (judged against its own plain decoding,
greedy and sampled, with trees up to 256 nodes)."""

import copy

import pytest
import torch
from conftest import tiny_llama
from drafting import OracleTreeDrafter
from sampled_distribution import judge_sampling_on

from specmesh.errors import InvalidArgument
from specmesh.runtime.llama import TreeBatch
from specmesh.runtime.offload import StreamedLayers, layer_tensors
from specmesh.runtime.paged_llama import PagedLlamaRuntime
from specmesh.runtime.target import prefill_sessions
from specmesh.sampling import SamplingParams
from specmesh.speculation.engine import Request, SpeculativeEngine
from specmesh.tree import TokenTree, compile_tree

VOCAB = 96


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=VOCAB, layers=3, seed=5, max_position_embeddings=2048)


def offloaded(model) -> PagedLlamaRuntime:
    return PagedLlamaRuntime(copy.deepcopy(model), offload="cpu")


def test_each_layer_reaches_its_slot_before_it_computes(model):
    copied = copy.deepcopy(model)
    runtime = PagedLlamaRuntime(copied, offload="cpu")
    assert all(p.numel() == 0 for p in copied.model.layers.parameters())  # one copy of the weights: the runtime's
    layers = runtime.layers
    assert isinstance(layers, StreamedLayers) and len(layers) == 3 and not runtime.graphs
    seen = []
    for index, slot in enumerate(layers.streamed()):
        assert all(torch.equal(a, b) for a, b in zip(layer_tensors(slot), layer_tensors(layers[index])))
        seen.append(id(slot))
    assert seen[0] == seen[2] != seen[1]  # two slots, in turn


def test_an_offloaded_pass_equals_the_resident_one_bit_for_bit(model):
    trees = [TokenTree((3, 4, 5), (-1, 0, -1), (1.0,) * 3), TokenTree.chain([7, 8]), TokenTree()]
    logits = []
    for runtime in (PagedLlamaRuntime(model), offloaded(model)):
        sessions = [runtime.new_session() for _ in trees]
        prefill_sessions(runtime, sessions, [[5, 6, 7, 8], [9, 10], list(range(20, 60))])
        logits.append(runtime.forward(TreeBatch.build(sessions, [compile_tree(11, t) for t in trees])))
    assert torch.equal(*logits)


def test_each_pass_streams_every_layer_and_the_verifier_exports_it(model):
    """``specmesh_target_streamed_bytes_total``: every offloaded pass adds every decoder layer's weights (the
    bytes the host model held), a resident runtime nothing; a cluster's test reads it to tell that its verifier
    streamed."""
    from specmesh.cluster.metrics import VerifierMetrics

    layers = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    exported = []
    for runtime in (offloaded(model), PagedLlamaRuntime(model)):
        metrics = VerifierMetrics()
        metrics.watch(runtime)
        sessions = [runtime.new_session()]
        for passes in range(3):
            assert metrics.registry.get_sample_value("specmesh_target_streamed_bytes_total") == \
                runtime.streamed_bytes == (passes * layers if runtime.offload else 0)
            runtime.forward(TreeBatch.build(sessions, [compile_tree(5 + passes, TokenTree.chain([7, 8]))]))
        exported.append(runtime.streamed_bytes)
    assert exported == [3 * layers, 0]


@pytest.mark.parametrize("nodes", [8, 256])
def test_speculation_on_the_offloaded_target_is_its_plain_decoding(model, nodes):
    runtime = offloaded(model)
    prompts = [[5 + i, 17, 3 * i + 2, 40] for i in range(3)]
    requests = lambda: [Request(tuple(p), SamplingParams(max_tokens=16)) for p in prompts]  # noqa: E731
    plain = SpeculativeEngine(runtime, drafters=[], max_tree_nodes=0).generate(requests())
    answers = {tuple(p): out.token_ids for p, out in zip(prompts, plain)}
    drafter = OracleTreeDrafter(answers, VOCAB, seed=nodes, full=True)
    outputs = SpeculativeEngine(runtime, drafters=[drafter], max_tree_nodes=nodes).generate(requests())
    assert [out.token_ids for out in outputs] == [answers[tuple(p)] for p in prompts]
    assert sum(len(o.token_ids) for o in outputs) > sum(o.stats.target_steps for o in outputs)


@pytest.mark.parametrize("rule", ["exact", "lying"])
def test_sampling_on_the_offloaded_target_keeps_its_distribution(rule, monkeypatch):
    runtime = PagedLlamaRuntime(tiny_llama(vocab_size=32, seed=3), offload="cpu")
    judge_sampling_on(runtime, rule, monkeypatch, 32, "speculative sampling on the offloaded target", batches=20)


def test_an_offloaded_target_is_not_captured_in_graphs(model):
    with pytest.raises(InvalidArgument, match="graphs"):
        PagedLlamaRuntime(copy.deepcopy(model), offload="cpu", graphs=True)


@pytest.mark.slow  # the embedded target
def test_specmesh_generate_serves_the_embedded_target_offloaded():
    """`specmesh generate --offload --compare-plain`: the GGUF's de-quantized layers streamed from host
    memory; speculative and plain decoding on them give the same tokens."""
    import os
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "specmesh", "generate", "Count from one to ten.", "--offload",
                             "--max-tokens", "24", "--compare-plain"], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "outputs identical" in result.stdout, result.stdout


def test_the_runtime_bench_times_an_offloaded_step_against_the_link_and_its_big_trees(tmp_path):
    import json

    from specmesh.cli import main

    out = tmp_path / "offload.json"
    assert main(["bench", "--model", "random:tiny", "--offload", "--repeats", "1", "--context", "32",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["offload"] and report["host_to_device_gbps"] > 0
    assert report["streamed_bytes"] < report["weight_bytes"]  # the layers stream; the head stays on the device
    assert report["streaming_limit_ms"] > 0 and report["step_vs_limit"] > 0
    assert report["tree256_vs_step"] > 0 and report["tree1024_vs_step"] > 0
    # a streamed pass is slow (~0.26 s for an 8B over PCIe): two requests checked, no invariance batches
    assert report["lossless"]["identical"]
    assert set(report["lossless"]) == {"tokens", "identical", "batch1", "batch2"}
    assert "batch_invariance" not in report
    assert not any(key.startswith("batch") and key.endswith("_ms") for key in report)


def test_the_runtime_bench_times_a_step_on_the_device_against_its_copy_limit(tmp_path, monkeypatch):
    import json

    from specmesh.bench import runtime_speed
    from specmesh.cli import main

    monkeypatch.setattr(runtime_speed, "BATCHES", ((2, 4),))
    monkeypatch.setattr(runtime_speed, "CURVE_NODES", (0, 3))
    out = tmp_path / "step.json"
    assert main(["bench", "--model", "random:tiny", "--repeats", "1", "--context", "32", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "offload" not in report and report["copy_bandwidth_gbps"] > 0 and report["hf_step_ms"] > 0
    assert report["step_vs_limit"] > 0 and report["tree16_vs_step"] > 0 and "tree256_vs_step" not in report
    assert report["lossless"]["identical"]


def test_a_pass_curve_is_measured_whole_where_every_pass_is_slow_but_flat(model):
    import time

    from specmesh.runtime.calibration import measure_pass_curve

    class StreamedOverASlowLink(PagedLlamaRuntime):  # every pass waits on the link, whatever its rows
        def forward(self, batch, logits_rows=None):
            time.sleep(0.03)
            return super().forward(batch, logits_rows)

    curve = measure_pass_curve(StreamedOverASlowLink(model, kv_cache_gb=0.05, offload="cpu"), time_cap_ms=10.0,
                               repeats=1)
    assert curve.samples[0].ms > 10.0 and len(curve.samples) >= 3  # not cut at the first pass over the cap
