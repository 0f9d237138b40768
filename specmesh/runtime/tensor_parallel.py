"""A target split across N processes by tensor parallelism: each rank holds 1/N of every layer's attention
heads (with their share of the KV cache) and of its MLP, and the attention output and MLP down projections
are summed across the ranks (an all-reduce; PyTorch's own ``torch.distributed``: gloo on a CPU, NCCL on
CUDA, gloo where ranks share a GPU). The embeddings, norms and LM head are whole on every rank. Every tensor
a collective takes lives on the rank's own device (``group_plan``): NCCL carries GPU memory only.

Rank 0 serves: its sessions own the KV pages, it plans each pass and sends the pass's inputs (and each
accepted path's KV moves) to the others, which compute their shares in lockstep and never allocate a
page; the logits are rank 0's. Every rank computes a row the same way in any batch, so speculative
decoding on N ranks is exactly plain decoding on N ranks (the sums differ in order from one process's:
N ranks are compared with N ranks).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
import multiprocessing
import os
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from specmesh.errors import InvalidArgument
from specmesh.runtime.kv_pool import KVPool
from specmesh.runtime.loading import LoadedModel, load_hf_model, pick_dtype, resolve_model_dir
from specmesh.runtime.random_models import is_random
from specmesh.runtime.target import check_lean, host_compute_device, load_on_host
from specmesh.runtime.paged_llama import PagedLlamaRuntime, PassInputs

log = logging.getLogger(__name__)

PASS, MOVE, STOP = 1, 2, 3
HEADER = 24  # longs: command, then what the command's tensors look like
GROUP_FAILED = 70  # rank 0's exit code when a rank is gone: the group restarts as one (the supervisor's)
IDLE = timedelta(days=7)  # a collective may wait this long: followers wait for rank 0's next pass


def shard_plan(config, rank: int, world: int) -> tuple[object, dict[str, slice], dict[str, slice]]:
    """Rank ``rank``'s config (its heads and MLP width), and the slices of the projections it keeps: by
    row (q/k/v, gate/up) and by column (o, down)."""
    config = copy.deepcopy(config)
    heads, kv_heads, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    if heads % world or kv_heads % world or inter % world:
        raise InvalidArgument("tensor_parallel", f"{world} ranks must divide the {heads} heads, {kv_heads} KV heads "
                              f"and {inter}-wide MLP")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    config.head_dim, config.num_attention_heads = head_dim, heads // world
    config.num_key_value_heads, config.intermediate_size = kv_heads // world, inter // world
    q, kv, m = (slice(rank * n // world, (rank + 1) * n // world) for n in (heads * head_dim, kv_heads * head_dim, inter))
    return config, {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": m, "up_proj": m}, {"o_proj": q, "down_proj": m}


def _share(name: str, rows: dict[str, slice], columns: dict[str, slice]) -> tuple[slice, ...]:
    """The index of a named parameter's share: its rows, its columns, or all of it."""
    part = name.split(".")[-2] if name.count(".") >= 2 else ""
    if ".layers." in name and part in rows:
        return (rows[part],)
    if ".layers." in name and part in columns and name.endswith("weight"):
        return (slice(None), columns[part])
    return (slice(None),)


def shard_model(hf_model: torch.nn.Module, rank: int, world: int) -> torch.nn.Module:
    """Rank ``rank``'s share of a Llama-family model: its query and KV heads (q/k/v rows, o_proj columns) and
    its slice of the MLP (gate/up rows, down columns); everything else whole."""
    config, rows, columns = shard_plan(hf_model.config, rank, world)
    state = {name: tensor[_share(name, rows, columns)].clone() for name, tensor in hf_model.state_dict().items()}
    shard = type(hf_model)(config).to(dtype=next(hf_model.parameters()).dtype)
    shard.load_state_dict(state)
    return shard.to(next(hf_model.parameters()).device).eval()


def read_shard(model: str, rank: int, world: int, dtype: torch.dtype) -> torch.nn.Module | None:
    """Rank ``rank``'s share read slice by slice from the model's safetensors, so that the host never holds
    more than the share (a 70B on N ranks: 1/N of its layers each). None where there are no local
    safetensors to read (random weights, a hub id not in the cache): the caller shards the whole model."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    if is_random(model):
        return None
    source, _ = resolve_model_dir(model)
    if not isinstance(source, Path):
        try:
            from huggingface_hub import snapshot_download

            source = Path(snapshot_download(source, local_files_only=True))
        except Exception:  # not cached as files: loading the whole model will say why
            return None
    files = sorted(source.glob("*.safetensors"))
    if not files:
        return None
    config, rows, columns = shard_plan(AutoConfig.from_pretrained(source), rank, world)
    state = {}
    for file in files:
        with safe_open(str(file), "pt") as reader:
            for name in reader.keys():
                state[name] = reader.get_slice(name)[_share(name, rows, columns)].to(dtype)
    with torch.device("meta"):  # no weights made only to be overwritten
        shard = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tied = ("lm_head.weight", "model.embed_tokens.weight")
    if config.tie_word_embeddings and sum(name in state for name in tied) == 1:  # one of the pair is stored
        state.update(dict.fromkeys(tied, next(state[name] for name in tied if name in state)))
    loaded = shard.load_state_dict(state, assign=True, strict=False)
    if loaded.missing_keys:  # a checkpoint laid out otherwise: the whole model's loader knows more layouts
        return None
    for name, module in list(shard.named_modules()):  # computed buffers (rotary frequencies) are not stored
        if any(b.is_meta for b in module.buffers(recurse=False)):
            parent, _, leaf = name.rpartition(".")
            setattr(shard.get_submodule(parent) if parent else shard, leaf, type(module)(config=config))
    return shard.eval()


def load_shard(model: str, dtype: torch.dtype, rank: int, world: int) -> torch.nn.Module:
    """Rank ``rank``'s share: read alone where the checkpoint allows (``read_shard``), else cut from the
    whole model loaded in host memory."""
    shard = read_shard(model, rank, world, dtype)
    return shard if shard is not None else shard_model(_model_on_host(model, dtype), rank, world)


def sharded(model_factory: Callable[[], torch.nn.Module], rank: int, world: int) -> torch.nn.Module:
    """Rank ``rank``'s share of the model ``model_factory`` makes whole."""
    return shard_model(model_factory(), rank, world)


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
        self.rank_modes = self._gather_modes()

    def _gather_modes(self) -> list[dict[str, bool]]:
        """Each rank's way of computing its share, the same on every rank or refused: the sums would mix
        two ways (products from Triton on one rank, cuBLAS on another) and no row would be any rank's."""
        mine = torch.tensor([self.batch_invariant, self.offload], dtype=torch.long, device=_group_device())
        every = [torch.empty_like(mine) for _ in range(self.world)]
        _all_gather(every, mine)
        modes = [dict(zip(("batch_invariant", "offload"), map(bool, t.tolist()))) for t in every]
        if any(m != modes[0] for m in modes):
            raise InvalidArgument("tensor_parallel", f"the ranks would compute differently: {modes}")
        return modes

    def _kv_budget_gb(self, kv_cache_gb: float | None) -> float:
        budget = super()._kv_budget_gb(kv_cache_gb)
        if kv_cache_gb is not None or self.device.type != "cuda":
            return budget
        # ranks sharing a GPU read its free memory at about the same time: each takes its part of the default
        return budget / _group["sharing"]

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return _all_reduce(partial)

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


def group_plan(where: torch.device, world: int, gpus: int) -> tuple[str, list[torch.device]]:
    """The backend of ``world`` ranks computing on ``where``'s kind of device among ``gpus`` GPUs, and each
    rank's device, where its collectives' tensors live too. A GPU per rank: NCCL, rank r on cuda:r. Fewer GPUs
    than ranks: the ranks share them in turn over gloo, which takes GPU tensors through host memory (NCCL
    refuses two ranks on one GPU, NVIDIA/nccl#418); slower, for trying a split on one GPU. A CPU: gloo."""
    if where.type != "cuda":
        return "gloo", [where] * world
    if gpus < 1:
        raise InvalidArgument("device", "CUDA asked for, but no GPU is visible")
    devices = [torch.device("cuda", r % gpus) for r in range(world)]
    return ("nccl" if gpus >= world else "gloo"), devices


# this process's rank device and how many ranks compute there, once it joined its group (one per process)
_group: dict[str, torch.device | int] = {}


def _group_device() -> torch.device:
    return _group["device"]


def _on_group_device(*tensors: torch.Tensor) -> None:
    """Every collective's tensors pass here: one elsewhere is this module's bug, said here rather than by NCCL
    from inside a pass (where it would end the group, and its restart would fail the same way)."""
    device = _group_device()
    for t in tensors:
        if t.device != device:
            raise RuntimeError(f"a tensor on {t.device} given to a {dist.get_backend()} collective, whose tensors "
                               f"live on {device}")


def _broadcast(tensor: torch.Tensor) -> torch.Tensor:
    _on_group_device(tensor)
    dist.broadcast(tensor, src=0)
    return tensor


def _all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    _on_group_device(tensor)
    dist.all_reduce(tensor)
    return tensor


def _all_gather(parts: list[torch.Tensor], tensor: torch.Tensor) -> None:
    _on_group_device(tensor, *parts)
    dist.all_gather(parts, tensor)


def encode_command(command: int, tensors: list[torch.Tensor],
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A command as rank 0 broadcasts it, on ``device`` (the rank's, ``join_group``): a header of HEADER
    longs (the command, each tensor's rank and shape) and the tensors' values in one long buffer (None
    for none)."""
    header = [command, len(tensors)]
    for t in tensors:
        header += [t.dim(), *t.shape]
    if len(header) > HEADER:
        raise ValueError(f"a command of {len(tensors)} tensors does not fit the header")
    values = torch.cat([t.reshape(-1).to(device, torch.long) for t in tensors]) if tensors else None
    return torch.tensor(header + [0] * (HEADER - len(header)), dtype=torch.long, device=device), values


def decode_header(header: list[int]) -> tuple[int, list[tuple[int, ...]]]:
    """The command and its tensors' shapes, from a header's values."""
    command, count, at = header[0], header[1], 2
    shapes = []
    for _ in range(count):
        dims = header[at]
        shapes.append(tuple(header[at + 1 : at + 1 + dims]))
        at += 1 + dims
    return command, shapes


def _send_command(command: int, tensors: list[torch.Tensor]) -> None:
    """Rank 0 to the others: the header, then the values (``encode_command``)."""
    header, values = encode_command(command, tensors, _group_device())
    _broadcast(header)
    if values is not None:
        _broadcast(values)


def _receive_command() -> tuple[int, list[torch.Tensor]]:
    header, _ = encode_command(0, [], _group_device())  # room for rank 0's header, where it will be sent
    command, shapes = decode_header(_broadcast(header).tolist())
    if not shapes:
        return command, []
    sizes = [math.prod(s) for s in shapes]
    flat = _broadcast(header.new_empty(sum(sizes)))
    return command, [part.view(shape) for part, shape in zip(flat.split(sizes), shapes)]


def group_failed(exc: BaseException) -> None:
    """Rank 0 lost a rank: end this process, so that the group is started again as one (the followers end
    with it) and the router sends its requests' steps again."""
    log.critical("tensor-parallel group broken (%s): exiting for a restart of the whole group", exc)
    logging.shutdown()
    os._exit(GROUP_FAILED)


def join_group(where: torch.device, init_method: str, rank: int, world: int) -> torch.device:
    """Join the group of ranks computing on ``where``'s kind of device (``group_plan``); this rank's device,
    made the process's current GPU on CUDA (NCCL's buffers and streams go there)."""
    backend, devices = group_plan(where, world, torch.cuda.device_count() if where.type == "cuda" else 0)
    device = _group["device"] = devices[rank]
    _group["sharing"] = devices.count(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=IDLE)
    return device


def rank_runtime(shard: torch.nn.Module, rank: int, world: int, device: torch.device, offload: bool,
                 **kwargs) -> TensorParallelRuntime:
    """Rank ``rank``'s runtime over its share, loaded in host memory: the share moved to the rank's device
    (``join_group``'s), or with ``offload`` its decoder layers left on the host and streamed there
    (``offload.py``)."""
    if offload:
        return TensorParallelRuntime(shard, rank, world, offload=device, **kwargs)
    return TensorParallelRuntime(shard.to(device), rank, world, **kwargs)


def run_follower(rank: int, world: int, init_method: str, shard_factory: Callable[[int, int], torch.nn.Module],
                 device: str = "cpu", parent: int | None = None, offload: bool = False, **kwargs) -> None:
    """A follower process's whole life: join the group, load its share of the model (``shard_factory(rank,
    world)``: ``load_shard`` or ``sharded``), follow rank 0. It ends with its parent (rank 0's process),
    whose death would otherwise leave it waiting forever."""
    if parent is not None:
        threading.Thread(target=_end_with, args=(parent,), daemon=True).start()
    mine = join_group(torch.device(device), init_method, rank, world)
    try:
        rank_runtime(shard_factory(rank, world), rank, world, mine, offload, **kwargs).follow()
    finally:
        dist.destroy_process_group()


def _end_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(GROUP_FAILED)


def _model_on_host(model: str, dtype: torch.dtype) -> torch.nn.Module:
    return load_hf_model(model, dtype=dtype, device="cpu").model


def start_group(model: str, world: int, dtype: str | None = None, device: str | None = None,
                kv_cache_gb: float | None = None, precision: str = "shipped", batch_invariant: bool | None = None,
                offload: bool = False) -> tuple[LoadedModel, TensorParallelRuntime]:
    """Rank 0 of a new group of ``world`` processes serving ``model`` (this process; the others spawned
    here): each reads its share of the model's own weights into host memory (``load_shard``; never GGUF
    blocks or ``q8_0``) and puts it on its device, or with ``offload`` streams its share's layers there.
    Every rank computes its products as ``batch_invariant`` says (``PagedLlamaRuntime``). The returned
    model is rank 0's share."""
    what = "a tensor-parallel target"
    where = host_compute_device(precision, device, what)
    torch_dtype = pick_dtype(dtype, where)
    shard = read_shard(model, 0, world, torch_dtype)
    if shard is None:
        loaded, _ = load_on_host(model, dtype, device, precision, what)
        loaded = dataclasses.replace(loaded, model=shard_model(loaded.model, 0, world))  # the whole one is let go
    else:
        from transformers import AutoTokenizer

        check_lean(shard.config, what)
        source, gguf = resolve_model_dir(model)
        loaded = LoadedModel(model, shard, AutoTokenizer.from_pretrained(source), gguf,
                             Path(source) if gguf is not None else None)
    init = f"file://{tempfile.mkdtemp(prefix='specmesh-tp-')}/group"
    factory = functools.partial(load_shard, model, torch_dtype)
    spawn = multiprocessing.get_context("spawn")
    computing = {"kv_cache_gb": kv_cache_gb, "batch_invariant": batch_invariant}
    for rank in range(1, world):
        spawn.Process(target=run_follower, args=(rank, world, init, factory, str(where), os.getpid(), offload),
                      kwargs=computing, daemon=True, name=f"tensor-parallel-rank-{rank}").start()
    mine = join_group(where, init, 0, world)
    runtime = rank_runtime(loaded.model, 0, world, mine, offload, **computing)
    log.info("tensor parallel over %d processes (%s)%s: this is rank 0", world, dist.get_backend(),
             ", layers streamed from host memory" if offload else "")
    if dist.get_backend() == "gloo" and where.type == "cuda":
        log.warning("%d ranks share %d GPU(s): their sums cross host memory (gloo), slower than NCCL with a GPU "
                    "per rank", world, torch.cuda.device_count())
    return loaded, runtime
