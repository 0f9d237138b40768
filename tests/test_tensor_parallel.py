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
from specmesh.runtime.tensor_parallel import rank_runtime, read_shard, run_follower, shard_model, sharded
from specmesh.sampling import SamplingParams
from specmesh.speculation.engine import Request, SpeculativeEngine

VOCAB = 96
FACTORY = functools.partial(tiny_llama, vocab_size=VOCAB, layers=2, seed=5, max_position_embeddings=2048)


@pytest.fixture
def pair(tmp_path, request):
    """Rank 0 here, rank 1 in a spawned process (each streaming its share's layers where the parameter says
    so); the group is taken down after the test."""
    offload = getattr(request, "param", False)
    init = f"file://{tmp_path / 'group'}"
    follower = multiprocessing.get_context("spawn").Process(
        target=run_follower, args=(1, 2, init, functools.partial(sharded, FACTORY)), kwargs={"offload": offload})
    follower.start()
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=2)
    runtime = rank_runtime(shard_model(FACTORY(), 0, 2), 0, 2, torch.device("cpu"), offload)
    try:
        yield runtime
    finally:
        runtime.stop()
        dist.destroy_process_group()
        follower.join(60)
    assert follower.exitcode == 0


@pytest.mark.parametrize("pair", [False, True], indirect=True, ids=["resident", "offloaded"])
def test_speculation_on_two_ranks_is_their_plain_decoding(pair, request):
    assert pair.offload == request.node.callspec.params["pair"]
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


def test_a_rank_reads_only_its_share_of_the_checkpoint_and_it_is_the_cut_of_the_whole():
    from specmesh.runtime.loading import load_hf_model

    whole = load_hf_model("smollm2-135m-instruct", dtype="float32", device="cpu").model  # 9 heads, 3 KV heads
    for rank in range(3):
        read = read_shard("smollm2-135m-instruct", rank, 3, torch.float32)
        cut = shard_model(whole, rank, 3)
        assert read.config.num_attention_heads == 3 and read.config.num_key_value_heads == 1
        expected = cut.state_dict()
        assert read.state_dict().keys() == expected.keys()
        for name, tensor in read.state_dict().items():
            assert torch.equal(tensor, expected[name]), name
        ids = torch.tensor([[1, 2, 3, 4]])
        torch.testing.assert_close(read(ids).logits, cut(ids).logits, rtol=0, atol=0)  # rotary tables rebuilt alike
    assert read_shard("random:tiny", 0, 2, torch.float32) is None  # nothing to read: the whole model is cut


def spawned_children(pid: int) -> list[int]:
    """The processes ``pid`` spawned with multiprocessing (its tensor-parallel ranks), from /proc (a bare
    image has no ps)."""
    from pathlib import Path

    found = []
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if parent == pid and b"spawn_main" in command:
            found.append(int(entry.name))
    return found


@pytest.mark.slow  # a cluster
def test_a_rank_killed_mid_request_costs_time_not_the_request(tmp_path):
    """`specmesh up --tensor-parallel 2` on a random target: the second rank killed while a request is
    under way; the group ends and starts again as one (the supervisor's), and the request completes with
    the group's plain output."""
    import signal

    from conftest import wait_until

    from specmesh.client import Client
    from specmesh.cluster.launcher import ClusterSpec, LocalCluster

    prompt = [5, 17, 9, 33, 2, 40, 41, 7]
    # the job is sent again once the group is back (the timeout covers its start): no other verifier takes it
    spec = ClusterSpec(model="random:tiny", drafters=(), tensor_parallel=2, job_timeout_s=30.0, log_dir=tmp_path)
    with LocalCluster(spec) as cluster, Client(cluster.router_address) as client:
        plain = client.generate(prompt_ids=prompt, max_tokens=300, speculation="off").token_ids
        verifier = cluster.verifiers[0]
        (rank,) = spawned_children(verifier.popen.pid)
        before = verifier.popen
        tokens, killed = [], False
        for chunk in client.stream(prompt_ids=prompt, max_tokens=300, speculation="fixed", timeout_s=300):
            tokens += chunk.token_ids
            if len(tokens) >= 40 and not killed:
                import os

                os.kill(rank, signal.SIGKILL)
                killed = True
        assert killed and tokens == plain
        wait_until(lambda: verifier.popen is not before, timeout_s=60, what="the group started again")
        assert before.wait(5) == 70  # rank 0 ended the group when its peer went
        verifier.wait_ready(300)
        assert client.generate(prompt_ids=prompt, max_tokens=300).token_ids == plain  # the new group serves
