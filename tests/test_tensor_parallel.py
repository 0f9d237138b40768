"""A target split over two processes by tensor parallelism (gloo on this CPU): each holds half of every
layer's heads and MLP; speculative decoding on the pair is exactly the pair's plain decoding, greedy and
with trees of hundreds of nodes, and the pair computes what one process does up to the order of its sums."""

import functools
import multiprocessing

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_llama
from drafting import OracleTreeDrafter
from sampled_distribution import judge_sampling_on

from specmesh.errors import InvalidArgument
from specmesh.runtime.paged_llama import PagedLlamaRuntime
from specmesh.runtime.tensor_parallel import TensorParallelRuntime, run_follower, shard_model
from specmesh.sampling import SamplingParams
from specmesh.speculation.engine import Request, SpeculativeEngine

VOCAB = 96
FACTORY = functools.partial(tiny_llama, vocab_size=VOCAB, layers=2, seed=5, max_position_embeddings=2048)


@pytest.fixture
def pair(tmp_path):
    """Rank 0 here, rank 1 in a spawned process; the group is taken down after the test."""
    init = f"file://{tmp_path / 'group'}"
    follower = multiprocessing.get_context("spawn").Process(target=run_follower, args=(1, 2, init, FACTORY))
    follower.start()
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=2)
    runtime = TensorParallelRuntime(shard_model(FACTORY(), 0, 2), 0, 2)
    try:
        yield runtime
    finally:
        runtime.stop()
        dist.destroy_process_group()
        follower.join(60)
    assert follower.exitcode == 0


def test_speculation_on_two_ranks_is_their_plain_decoding(pair):
    prompts = [[5 + i, 17, 3 * i + 2, 40] for i in range(3)]
    requests = lambda: [Request(tuple(p), SamplingParams(max_tokens=16)) for p in prompts]  # noqa: E731
    plain = SpeculativeEngine(pair, drafters=[], max_tree_nodes=0).generate(requests())
    answers = {tuple(p): out.token_ids for p, out in zip(prompts, plain)}
    for nodes in (6, 256):
        drafter = OracleTreeDrafter(answers, VOCAB, seed=nodes, full=nodes > 6)
        outputs = SpeculativeEngine(pair, drafters=[drafter], max_tree_nodes=nodes).generate(requests())
        assert [out.token_ids for out in outputs] == [answers[tuple(p)] for p in prompts]
        assert sum(len(o.token_ids) for o in outputs) > sum(o.stats.target_steps for o in outputs)
    alone = SpeculativeEngine(PagedLlamaRuntime(FACTORY()), drafters=[], max_tree_nodes=0).generate(requests())
    assert [o.token_ids for o in alone] == [o.token_ids for o in plain]  # the same model, summed in halves


@pytest.mark.parametrize("rule", ["exact", "lying"])
def test_sampling_on_two_ranks_keeps_their_distribution(pair, rule, monkeypatch):
    judge_sampling_on(pair, rule, monkeypatch, VOCAB, "speculative sampling on two ranks")


def test_ranks_must_divide_the_heads():
    with pytest.raises(InvalidArgument, match="tensor_parallel"):
        shard_model(FACTORY(), 0, 3)


def test_the_shards_hold_every_weight_once():
    model = FACTORY()
    shards = [shard_model(model, rank, 2) for rank in range(2)]
    for name, tensor in model.state_dict().items():
        parts = [s.state_dict()[name] for s in shards]
        if any(p.shape != tensor.shape for p in parts):
            dim = 0 if parts[0].shape[0] != tensor.shape[0] else 1
            assert torch.equal(torch.cat(parts, dim), tensor), name
        else:
            assert all(torch.equal(p, tensor) for p in parts), name
