"""A target split over two processes by tensor parallelism (gloo on this CPU; on a GPU, `make gpu-check`,
both ranks share it over gloo with GPU tensors): each holds half of every layer's heads and MLP;
speculative decoding on the pair is exactly the pair's plain decoding, greedy and with trees of hundreds of
nodes, and the pair computes what one process does up to the order of its sums. The ranks run NCCL's code
path: every collective's tensors are checked to be on the rank's device, and the commands are built on
whatever device the group gives."""

import functools
import multiprocessing

import pytest
import torch
import torch.distributed as dist
from conftest import DEVICE, tiny_llama
from drafting import OracleTreeDrafter
from sampled_distribution import judge_sampling_on

from specmesh.errors import InvalidArgument
from specmesh.runtime.paged_llama import PagedLlamaRuntime
from specmesh.runtime.tensor_parallel import (
    MOVE, PASS, _all_reduce, _broadcast, decode_header, encode_command, group_plan, join_group, rank_runtime,
    read_shard, run_follower, shard_model, sharded, start_group,
)
from specmesh.sampling import SamplingParams
from specmesh.speculation.engine import Request, SpeculativeEngine

VOCAB = 96
FACTORY = functools.partial(tiny_llama, vocab_size=VOCAB, layers=2, seed=5, max_position_embeddings=2048)


def start_follower(init: str, **kwargs) -> multiprocessing.Process:
    follower = multiprocessing.get_context("spawn").Process(
        target=run_follower, args=(1, 2, init, functools.partial(sharded, FACTORY)), kwargs=kwargs)
    follower.start()
    return follower


@pytest.fixture
def pair(tmp_path, request):
    """Rank 0 here, rank 1 in a spawned process (each streaming its share's layers where the parameter says
    so); the group is taken down after the test."""
    offload = getattr(request, "param", False)
    init = f"file://{tmp_path / 'group'}"
    follower = start_follower(init, offload=offload, device=DEVICE.type)
    mine = join_group(DEVICE, init, 0, 2)
    runtime = rank_runtime(shard_model(FACTORY(), 0, 2), 0, 2, mine, offload)
    try:
        yield runtime
    finally:
        runtime.stop()
        dist.destroy_process_group()
        follower.join(60)
    assert follower.exitcode == 0


@pytest.mark.parametrize("pair", [False, True], indirect=True, ids=["resident", "offloaded"])
def test_speculation_on_two_ranks_is_their_plain_decoding(pair, request):
    offload = request.node.callspec.params["pair"]
    invariant = DEVICE.type == "cuda"  # the paged runtime's default
    assert pair.offload == offload and pair.rank_modes == [{"batch_invariant": invariant, "offload": offload}] * 2
    prompts = [[5 + i, 17, 3 * i + 2, 40] for i in range(3)]
    requests = lambda: [Request(tuple(p), SamplingParams(max_tokens=16)) for p in prompts]  # noqa: E731
    plain = SpeculativeEngine(pair, drafters=[], max_tree_nodes=0).generate(requests())
    answers = {tuple(p): out.token_ids for p, out in zip(prompts, plain)}
    for nodes in (6, 256):
        drafter = OracleTreeDrafter(answers, VOCAB, seed=nodes, full=nodes > 6)
        outputs = SpeculativeEngine(pair, drafters=[drafter], max_tree_nodes=nodes).generate(requests())
        assert [out.token_ids for out in outputs] == [answers[tuple(p)] for p in prompts]
        assert sum(len(o.token_ids) for o in outputs) > sum(o.stats.target_steps for o in outputs)
    one = PagedLlamaRuntime(FACTORY().to(DEVICE))
    alone = SpeculativeEngine(one, drafters=[], max_tree_nodes=0).generate(requests())
    assert [o.token_ids for o in alone] == [o.token_ids for o in plain]  # the same model, summed in halves


@pytest.mark.parametrize("rule", ["exact", "lying"])
def test_sampling_on_two_ranks_keeps_their_distribution(pair, rule, monkeypatch):
    judge_sampling_on(pair, rule, monkeypatch, VOCAB, "speculative sampling on two ranks")


def test_ranks_get_a_gpu_each_over_nccl_or_share_them_over_gloo():
    """NCCL with a GPU per rank (rank r on cuda:r); fewer GPUs than ranks: gloo, the ranks on the GPUs in
    turn (NCCL refuses two ranks on one GPU); a CPU: gloo. Collectives take tensors on the rank's device."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert group_plan(cuda, 2, 2) == ("nccl", [torch.device("cuda:0"), torch.device("cuda:1")])
    assert group_plan(cuda, 2, 8) == ("nccl", [torch.device("cuda:0"), torch.device("cuda:1")])
    assert group_plan(cuda, 2, 1) == ("gloo", [torch.device("cuda:0")] * 2)
    assert group_plan(cuda, 4, 2) == ("gloo", [torch.device(f"cuda:{r % 2}") for r in range(4)])
    assert group_plan(cpu, 3, 0) == ("gloo", [cpu] * 3)
    with pytest.raises(InvalidArgument, match="no GPU"):
        group_plan(cuda, 2, 0)


def test_a_command_is_built_on_the_groups_device():
    """What rank 0 sends is made where the group's collectives take it, from tensors anywhere (a pass's
    inputs are host tensors): here the meta device stands for a rank's GPU."""
    inputs = [torch.arange(6, dtype=torch.int32).view(2, 3), torch.tensor([7, 8]), torch.tensor(9)]
    header, values = encode_command(PASS, inputs, torch.device("meta"))
    assert header.device.type == values.device.type == "meta" and header.dtype == values.dtype == torch.long
    header, values = encode_command(PASS, inputs, torch.device("cpu"))
    assert decode_header(header.tolist()) == (PASS, [(2, 3), (2,), ()])
    assert values.tolist() == [0, 1, 2, 3, 4, 5, 7, 8, 9]
    header, values = encode_command(MOVE, [], torch.device("meta"))
    assert header.device.type == "meta" and values is None


def test_a_collective_refuses_a_tensor_off_the_groups_device(tmp_path):
    join_group(torch.device("cpu"), f"file://{tmp_path / 'group'}", 0, 1)
    try:
        assert _all_reduce(torch.ones(2)).tolist() == [1.0, 1.0]
        for collective in (_all_reduce, _broadcast):
            with pytest.raises(RuntimeError, match="on meta given to a gloo collective, whose tensors live on cpu"):
                collective(torch.ones(2, device="meta"))
    finally:
        dist.destroy_process_group()


def test_batch_invariance_reaches_every_rank():
    """`--batch-invariant` (not the CPU's default) given to the group: each rank's runtime computes so."""
    _, runtime = start_group("random:tiny", 2, device="cpu", kv_cache_gb=0.01, batch_invariant=True)
    try:
        assert runtime.batch_invariant
        assert runtime.rank_modes == [{"batch_invariant": True, "offload": False}] * 2
    finally:
        runtime.stop()
        dist.destroy_process_group()


def test_ranks_that_would_compute_differently_are_refused(tmp_path):
    init = f"file://{tmp_path / 'group'}"
    follower = start_follower(init, batch_invariant=True, kv_cache_gb=0.01)
    join_group(torch.device("cpu"), init, 0, 2)
    try:
        with pytest.raises(InvalidArgument, match="the ranks would compute differently"):
            rank_runtime(shard_model(FACTORY(), 0, 2), 0, 2, torch.device("cpu"), False, batch_invariant=False,
                         kv_cache_gb=0.01)
    finally:
        dist.destroy_process_group()
        follower.join(60)
    assert follower.exitcode != 0  # it refused too


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
        plain = client.generate(prompt_ids=prompt, max_tokens=160, speculation="off").token_ids
        verifier = cluster.verifiers[0]
        (rank,) = spawned_children(verifier.popen.pid)
        before = verifier.popen
        tokens, killed = [], False
        for chunk in client.stream(prompt_ids=prompt, max_tokens=160, speculation="fixed", timeout_s=300):
            tokens += chunk.token_ids
            if len(tokens) >= 40 and not killed:
                import os

                os.kill(rank, signal.SIGKILL)
                killed = True
        assert killed and tokens == plain and len(plain) == 160  # killed with 120 tokens to go
        wait_until(lambda: verifier.popen is not before, timeout_s=60, what="the group started again")
        assert before.wait(5) == 70  # rank 0 ended the group when its peer went
        verifier.wait_ready(300)
        assert client.generate(prompt_ids=prompt, max_tokens=160).token_ids == plain  # the new group serves
