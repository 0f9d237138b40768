"""A target split across N processes by tensor parallelism: each rank holds 1/N of every layer's attention
heads (with their share of the KV cache) and of its MLP, and the attention output and MLP down projections
are summed across the ranks (an all-reduce; PyTorch's own ``torch.distributed``: gloo on a CPU, NCCL on
CUDA). The embeddings, norms and LM head are whole on every rank.

Rank 0 serves: its sessions own the KV pages, it plans each pass and sends the pass's inputs (and each
accepted path's KV moves) to the others, which compute their shares in lockstep and never allocate a
page; the logits are rank 0's. Every rank computes a row the same way in any batch, so speculative
decoding on N ranks is exactly plain decoding on N ranks (the sums differ in order from one process's:
N ranks are compared with N ranks).
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import multiprocessing
import os
import tempfile
import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from specmesh.errors import InvalidArgument
from specmesh.runtime.kv_pool import KVPool
from specmesh.runtime.loading import LoadedModel, load_hf_model
from specmesh.runtime.target import load_on_host
from specmesh.runtime.paged_llama import PagedLlamaRuntime, PassInputs

log = logging.getLogger(__name__)

PASS, MOVE, STOP = 1, 2, 3
HEADER = 24  # longs: command, then what the command's tensors look like
GROUP_FAILED = 70  # rank 0's exit code when a rank is gone: the group restarts as one (the supervisor's)
IDLE = timedelta(days=7)  # a collective may wait this long: followers wait for rank 0's next pass


def shard_model(hf_model: torch.nn.Module, rank: int, world: int) -> torch.nn.Module:
    """Rank ``rank``'s share of a Llama-family model: its query and KV heads (q/k/v rows, o_proj columns) and
    its slice of the MLP (gate/up rows, down columns); everything else whole."""
    config = copy.deepcopy(hf_model.config)
    heads, kv_heads, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    if heads % world or kv_heads % world or inter % world:
        raise InvalidArgument("tensor_parallel", f"{world} ranks must divide the {heads} heads, {kv_heads} KV heads "
                              f"and {inter}-wide MLP")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    config.head_dim, config.num_attention_heads = head_dim, heads // world
    config.num_key_value_heads, config.intermediate_size = kv_heads // world, inter // world
    q, kv, m = (slice(rank * n // world, (rank + 1) * n // world) for n in (heads * head_dim, kv_heads * head_dim, inter))
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": m, "up_proj": m}
    columns = {"o_proj": q, "down_proj": m}
    state = {}
    for name, tensor in hf_model.state_dict().items():
        part = name.split(".")[-2] if name.count(".") >= 2 else ""
        if ".layers." in name and part in rows:
            tensor = tensor[rows[part]]
        elif ".layers." in name and part in columns and name.endswith("weight"):
            tensor = tensor[:, columns[part]]
        state[name] = tensor.clone()
    shard = type(hf_model)(config).to(dtype=next(hf_model.parameters()).dtype)
    shard.load_state_dict(state)
    return shard.to(next(hf_model.parameters()).device).eval()


class _BroadcastPool(KVPool):
    """Rank 0's pool: every KV move is made on the other ranks' pools too."""

    def move(self, source: torch.Tensor, target: torch.Tensor) -> None:
        try:
            _send_command(MOVE, [source, target])
        except Exception as exc:  # the ranks' caches would no longer agree
            group_failed(exc)
        super().move(source, target)


class TensorParallelRuntime(PagedLlamaRuntime):
    """One rank's share of the target (``shard_model``) in an initialised process group. Rank 0 is used as
    any runtime; the others run ``follow()`` until rank 0 calls ``stop()``."""

    def __init__(self, shard: torch.nn.Module, rank: int, world: int, **kwargs) -> None:
        self.rank, self.world = rank, world
        if rank == 0:
            self.pool_type = _BroadcastPool
        super().__init__(shard, graphs=False, **kwargs)

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(partial)
        return partial

    def step(self, inputs: PassInputs, logits: bool, capture=None) -> torch.Tensor | None:
        if self.rank != 0:
            return super().step(inputs, logits, capture)
        try:
            _send_command(PASS, list(inputs.tensors()))
            return super().step(inputs, logits, capture)
        except Exception as exc:  # a rank gone, or a pass half done: the ranks are out of step
            group_failed(exc)

    def follow(self) -> None:
        """Compute this rank's share of every pass rank 0 sends, until it stops."""
        while True:
            command, tensors = _receive_command()
            if command == STOP:
                return
            if command == MOVE:
                self.pool.move(*tensors)
            else:
                super().step(PassInputs(*tensors).to(self.device), logits=False)

    def stop(self) -> None:
        if self.rank == 0:
            _send_command(STOP, [])


def _send_command(command: int, tensors: list[torch.Tensor]) -> None:
    """Rank 0 to the others: a header (the command, each tensor's rank and shape), then the tensors' values
    in one buffer (long tensors, on the host)."""
    header = [command, len(tensors)]
    for t in tensors:
        header += [t.dim(), *t.shape]
    if len(header) > HEADER:
        raise ValueError(f"a command of {len(tensors)} tensors does not fit the header")
    dist.broadcast(torch.tensor(header + [0] * (HEADER - len(header)), dtype=torch.long), src=0)
    if tensors:
        dist.broadcast(torch.cat([t.reshape(-1).long().cpu() for t in tensors]), src=0)


def _receive_command() -> tuple[int, list[torch.Tensor]]:
    header = torch.empty(HEADER, dtype=torch.long)
    dist.broadcast(header, src=0)
    values = header.tolist()
    command, count, at = values[0], values[1], 2
    shapes = []
    for _ in range(count):
        dims = values[at]
        shapes.append(tuple(values[at + 1 : at + 1 + dims]))
        at += 1 + dims
    if not shapes:
        return command, []
    flat = torch.empty(sum(math.prod(s) for s in shapes), dtype=torch.long)
    dist.broadcast(flat, src=0)
    tensors, offset = [], 0
    for shape in shapes:
        tensors.append(flat[offset : offset + math.prod(shape)].view(shape))
        offset += math.prod(shape)
    return command, tensors


def group_failed(exc: BaseException) -> None:
    """Rank 0 lost a rank: end this process, so that the group is started again as one (the followers end
    with it) and the router sends its requests' steps again."""
    log.critical("tensor-parallel group broken (%s): exiting for a restart of the whole group", exc)
    logging.shutdown()
    os._exit(GROUP_FAILED)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: its own GPU (cuda:rank), or the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def run_follower(rank: int, world: int, init_method: str, model_factory: Callable[[], torch.nn.Module],
                 device: str = "cpu", parent: int | None = None, **kwargs) -> None:
    """A follower process's whole life: join the group, load and shard the model, follow rank 0. It ends
    with its parent (rank 0's process), whose death would otherwise leave it waiting forever."""
    if parent is not None:
        threading.Thread(target=_end_with, args=(parent,), daemon=True).start()
    where = torch.device(device)
    dist.init_process_group(backend_for(where), init_method=init_method, rank=rank, world_size=world, timeout=IDLE)
    try:
        shard = shard_model(model_factory(), rank, world).to(rank_device(where, rank))
        TensorParallelRuntime(shard, rank, world, **kwargs).follow()
    finally:
        dist.destroy_process_group()


def _end_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(GROUP_FAILED)


def _model_on_host(model: str, dtype: torch.dtype) -> torch.nn.Module:
    return load_hf_model(model, dtype=dtype, device="cpu").model


def start_group(model: str, world: int, dtype: str | None = None, device: str | None = None,
                kv_cache_gb: float | None = None, precision: str = "shipped") -> tuple[LoadedModel, TensorParallelRuntime]:
    """Rank 0 of a new group of ``world`` processes serving ``model`` (this process; the others spawned
    here): each loads the model in host memory, keeps its share of its own weights (never GGUF blocks or
    ``q8_0``), and puts it on its device."""
    loaded, where = load_on_host(model, dtype, device, precision, "a tensor-parallel target")
    init = f"file://{tempfile.mkdtemp(prefix='specmesh-tp-')}/group"
    factory = functools.partial(_model_on_host, model, loaded.model.dtype)
    spawn = multiprocessing.get_context("spawn")
    for rank in range(1, world):
        spawn.Process(target=run_follower, args=(rank, world, init, factory, str(where), os.getpid()),
                      kwargs={"kv_cache_gb": kv_cache_gb}, daemon=True, name=f"tensor-parallel-rank-{rank}").start()
    dist.init_process_group(backend_for(where), init_method=init, rank=0, world_size=world, timeout=IDLE)
    shard = shard_model(loaded.model, 0, world).to(rank_device(where, 0))
    log.info("tensor parallel over %d processes (%s): this is rank 0", world, backend_for(where))
    return loaded, TensorParallelRuntime(shard, 0, world, kv_cache_gb=kv_cache_gb)
