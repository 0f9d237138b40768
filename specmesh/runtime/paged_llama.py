"""The Llama runtime on one paged KV pool, in shape-stable passes: what a GPU verifier runs.

Every pass is padded to a bucket of row count, request count and tree width, so its tensors (and its
kernels) depend only on the bucket: a pass can be captured once as a CUDA graph and replayed for any
batch that fits the bucket, with no per-op Python dispatch and one attention launch per layer for the
whole batch (``kernels/paged_tree_attention.py``). Padded rows write their K/V into the pool's trash page
and belong to no request.

Lossless by construction: every op computes a row the same way whatever the other rows hold (matrix
products whose reduction order is fixed by the weights, ``kernels/matmul_triton.py``; row-wise norms; an
attention kernel that walks each row's keys in plain decoding's order), so a tree's rows get exactly the
logits plain decoding gets for the same tokens, in any batch, bucket and tree size. ``batch_invariant=False``
puts cuBLAS under the products instead: faster for large batches, exact only within one row bucket (the
library picks other kernels per shape, so a near tie can flip a greedy token across buckets).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from specmesh.errors import InvalidArgument
from specmesh.kernels.paged_tree_attention import ancestor_table, group_bound, row_groups, rows_per_group
from specmesh.runtime.kv_pool import PAGE_SIZE, TRASH_PAGE, KVPool, PagedSession
from specmesh.runtime.linear import InvariantLinear, PackedLinear
from specmesh.runtime.llama import LlamaRuntime, Scores, TreeBatch, check_feature_layers, stacked
from specmesh.runtime.offload import StreamedLayers, host_layer

log = logging.getLogger(__name__)

ROW_BUCKETS = (16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512)  # rows of a pass; beyond, multiples of 512
GRAPH_MAX_ROWS = 512  # passes up to this many rows replay a CUDA graph; longer ones (prefill) run eagerly
DEFAULT_KV_FRACTION = 0.5  # of the device memory free after loading, when no --kv-cache-gb is given
DEFAULT_CPU_KV_GB = 2.0


def bucket_rows(rows: int) -> int:
    for bucket in ROW_BUCKETS:
        if rows <= bucket:
            return bucket
    return -(-rows // ROW_BUCKETS[-1]) * ROW_BUCKETS[-1]


def bucket_pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


@dataclass
class PassInputs:
    """One padded pass, ready for ``PagedLlamaRuntime.step``: long tensors, on the host or the device."""

    input_ids: torch.Tensor  # [rows]
    positions: torch.Tensor  # [rows]
    slots: torch.Tensor  # [rows]: where each row's K/V goes in the pool
    block_tables: torch.Tensor  # [batch, pages]
    cached: torch.Tensor  # [batch]: committed entries of each request
    row_request: torch.Tensor  # [rows]: each row's request, -1 for padding
    ancestors: torch.Tensor  # [rows, depth]: the tree rows each row sees, root first, itself last
    seen: torch.Tensor  # [rows]: valid entries of ``ancestors``
    groups: torch.Tensor  # [groups, 2]: (first row, rows) of the row groups that share their committed keys

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.input_ids, self.positions, self.slots, self.block_tables, self.cached, self.row_request,
                self.ancestors, self.seen, self.groups)

    @property
    def key(self) -> tuple[int, int, int, int]:
        """What a captured graph is specific to: rows, requests, tree depth, pages per request."""
        return self.input_ids.shape[0], self.cached.shape[0], self.ancestors.shape[1], self.block_tables.shape[1]

    def flat(self) -> torch.Tensor:
        """Every field in one buffer: a pass's inputs cross to the device in one copy."""
        return torch.cat([t.reshape(-1) for t in self.tensors()])

    def views(self, flat: torch.Tensor) -> PassInputs:
        """Inputs of this pass's shapes viewing ``flat`` (what ``flat()`` made, wherever it now lives)."""
        fields, offset = [], 0
        for t in self.tensors():
            fields.append(flat[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()
        return PassInputs(*fields)

    def to(self, device: torch.device) -> PassInputs:
        if self.input_ids.device.type != "cpu":  # made on a device (a tensor-parallel follower's): nothing to pin
            return PassInputs(*(t.to(device) for t in self.tensors()))
        if device.type == "cpu":
            return self
        return self.views(self.flat().pin_memory().to(device, non_blocking=True))


class _Graph:
    """One captured pass: static inputs, replayed with new contents."""

    def __init__(self, runtime: PagedLlamaRuntime, shape: PassInputs, memory_pool) -> None:
        self.flat = shape.flat().to(runtime.device)
        self.inputs = shape.views(self.flat)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compiles kernels, picks matrix algorithms: never inside a capture
            for _ in range(2):
                runtime.step(self.inputs, logits=True)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=memory_pool):
            self.logits = runtime.step(self.inputs, logits=True)

    def run(self, inputs: PassInputs) -> torch.Tensor:
        self.flat.copy_(inputs.flat().pin_memory(), non_blocking=True)
        self.graph.replay()
        return self.logits


class PagedLlamaRuntime(LlamaRuntime):
    """``LlamaRuntime`` whose sessions live in one ``KVPool`` and whose passes are shape-stable (CUDA
    graphs on a GPU with ``graphs=True``). Sessions are ``PagedSession``; a full pool raises
    ``ResourceExhausted`` from ``forward`` before anything is written."""

    pool_type: type[KVPool] = KVPool

    def __init__(self, hf_model: torch.nn.Module, kv_cache_gb: float | None = None, graphs: bool | None = None,
                 page_size: int = PAGE_SIZE, attention: str | None = None, batch_invariant: bool | None = None,
                 offload: str | torch.device | None = None) -> None:
        """``attention``: "triton" (the default on CUDA; on a CPU only under ``TRITON_INTERPRET=1``, for tests:
        attention and the fused elementwise kernels) or "reference" (PyTorch ops, the default elsewhere; its
        attention is not batch-invariant). ``batch_invariant`` (default: on CUDA): the matrix products in
        Triton with a reduction fixed by the weights' shapes, so that a request's logits never depend on the
        rest of its batch; off, cuBLAS (exact only within a row bucket). ``offload``: the device to compute on
        while the decoder layers stay where ``hf_model`` holds them (host memory), streamed a layer at a time
        (``offload.py``); the embeddings, final norm and LM head move to that device, and ``hf_model``'s
        decoder layers are emptied (the runtime holds their weights, once). No CUDA graphs then."""
        self.offload = offload is not None
        if self.offload:
            inner = hf_model.model
            for module in (inner.embed_tokens, inner.norm, inner.rotary_emb, hf_model.lm_head):
                module.to(offload)
        cuda = hf_model.get_input_embeddings().weight.device.type == "cuda"
        # read by _linear, which the base class calls
        self.batch_invariant = cuda if batch_invariant is None else batch_invariant
        super().__init__(hf_model)
        self.attention = attention or ("triton" if self.device.type == "cuda" else "reference")
        if self.attention not in ("triton", "reference"):
            raise InvalidArgument("attention", f"must be triton or reference, got {attention!r}")
        # Triton for everything between the matrix products: on CUDA, or on a CPU with ``attention="triton"``
        # (the interpreter, for tests)
        self.fused_ops = self.attention == "triton"
        if kv_cache_gb is not None and not kv_cache_gb > 0:
            raise InvalidArgument("kv_cache_gb", f"must be > 0, got {kv_cache_gb}")
        self.graphs = self.device.type == "cuda" and not self.offload if graphs is None else graphs
        if self.graphs and self.device.type != "cuda":
            raise InvalidArgument("graphs", "CUDA graphs need a CUDA device")
        if self.graphs and self.offload:
            raise InvalidArgument("graphs", "an offloaded pass streams its layers eagerly: no CUDA graphs")
        positions = torch.arange(self.max_length, device=self.device)
        probe = self.embed[:1]
        cos, sin = zip(*(self.rotary(probe, chunk.unsqueeze(0)) for chunk in positions.split(8192)))
        self.cos = torch.cat([c[0] for c in cos])  # [max_length, head_dim], in the model's dtype
        self.sin = torch.cat([s[0] for s in sin])
        self.pool = self.pool_type(len(self.layers), self.num_kv_heads, self.head_dim, self.dtype, self.device,
                           int(self._kv_budget_gb(kv_cache_gb) * 2**30), page_size)
        self.max_pages = self.pool.pages_for(self.max_length)
        self._graphs: dict[tuple[int, int, int], _Graph] = {}
        self._graph_memory = torch.cuda.graph_pool_handle() if self.graphs else None
        log.info("KV pool: %d pages of %d positions (%.2f GiB), %s", self.pool.capacity_pages, page_size,
                 self.pool.num_pages * self.pool.page_bytes / 2**30, "CUDA graphs" if self.graphs else "eager")
        if self.offload:
            log.info("decoder layers in host memory (%.2f GiB), streamed to %s a layer at a time",
                     len(self.layers) * self.layers.layer_bytes / 2**30, self.device)

    def _kv_budget_gb(self, kv_cache_gb: float | None) -> float:
        if kv_cache_gb is not None:
            return kv_cache_gb
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return free * DEFAULT_KV_FRACTION / 2**30
        return DEFAULT_CPU_KV_GB

    def _build_layers(self, layers):
        if not self.offload:
            return super()._build_layers(layers)
        as_loaded = lambda names, weights, bias=None: PackedLinear(stacked(weights), bias, pack=False)  # noqa: E731
        host = []
        for index, layer in enumerate(layers):  # the weights as they are, where they are
            host.append(host_layer(self._fuse_layer(index, layer, as_loaded), self.device, self._slot_linear))
            for parameter in layer.parameters():  # held by the runtime now: one copy in host memory
                parameter.data = parameter.data.new_empty(0)
        return StreamedLayers(host, self.device, self._slot_linear)

    def _slot_linear(self, weight: torch.Tensor, bias: torch.Tensor | None):
        return InvariantLinear(weight, bias) if self.batch_invariant else PackedLinear(weight, bias, pack=False)

    @property
    def streamed_bytes(self) -> int:
        """Decoder-layer weights copied from host memory to the device so far (0: every weight resident)."""
        return self.layers.streamed_bytes if self.offload else 0

    def _computed_layers(self):
        """The decoder layers as a pass computes them: streamed to the device when offloaded."""
        return self.layers.streamed() if self.offload else self.layers

    def _linear(self, names, weights, bias=None):
        if not self.batch_invariant:
            return super()._linear(names, weights, bias)
        return InvariantLinear(stacked(weights), bias)

    def new_session(self) -> PagedSession:
        return self.pool.new_session(self.max_length)

    def prepare(self, batch: TreeBatch) -> PassInputs:
        """The padded inputs of one pass (host tensors); holds the pool pages the trees need."""
        for session, start, end in zip(batch.sessions, batch.cu_rows, batch.cu_rows[1:]):
            session.reserve(end - start)
        rows, size = batch.cu_rows[-1], batch.size
        padded_rows, padded_size = bucket_rows(rows), bucket_pow2(size)
        page = self.pool.page_size
        width = min(self.max_pages, bucket_pow2(max(len(s.pages) for s in batch.sessions), least=64))
        # numpy, not torch ops: this runs on the host for every pass, between two device passes
        block_tables = np.zeros((padded_size, width), dtype=np.int64)
        cached = np.zeros(padded_size, dtype=np.int64)
        slots = TRASH_PAGE * page + np.arange(padded_rows, dtype=np.int64) % page  # padded rows: the trash page
        row_positions = batch.positions.numpy()
        deepest = 0  # tree rows seen by the deepest row (its depth + 1)
        for b, (session, start, end) in enumerate(zip(batch.sessions, batch.cu_rows, batch.cu_rows[1:])):
            pages = np.asarray(session.pages, dtype=np.int64)
            block_tables[b, : len(pages)] = pages
            cached[b] = session.length
            stored = np.arange(session.length, session.length + end - start)  # tree row i at length + i
            slots[start:end] = pages[stored // page] * page + stored % page
            deepest = max(deepest, int(row_positions[start:end].max()) - session.length + 1)
        depth = bucket_pow2(deepest, least=ROW_BUCKETS[0])
        row_request, ancestors, seen = ancestor_table(list(batch.masks), padded_rows, depth)
        per_group = rows_per_group(self.num_heads, self.num_kv_heads)
        groups = row_groups(row_request.numpy(), per_group, group_bound(padded_rows, padded_size, per_group))
        ids, positions = (torch.zeros(padded_rows, dtype=torch.long) for _ in range(2))
        ids[:rows], positions[:rows] = batch.input_ids, batch.positions
        return PassInputs(ids, positions, torch.from_numpy(slots), torch.from_numpy(block_tables),
                          torch.from_numpy(cached), row_request, ancestors, seen, torch.from_numpy(groups))

    @torch.no_grad()
    def forward(self, batch: TreeBatch, logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Score every row of every tree (see ``LlamaRuntime.forward``); logits [rows, vocab] fp32."""
        inputs = self.prepare(batch)
        rows = batch.cu_rows[-1]
        if logits_rows is not None and logits_rows.numel() == 0:
            self.step(inputs.to(self.device), logits=False)  # a prefill: K/V only
            if self.device.type == "cuda":  # nothing read back to wait on: its time is timed (prefill pace) once done
                torch.cuda.synchronize(self.device)
            return torch.empty(0, self.vocab_size, device=self.device)
        if self.graphs and inputs.key[0] <= GRAPH_MAX_ROWS:
            logits = self._graph(inputs).run(inputs)[:rows].clone()
        else:
            logits = self.step(inputs.to(self.device), logits=True)[:rows]
        return logits if logits_rows is None else logits[logits_rows.to(self.device)]

    @torch.no_grad()
    def score(self, batch: TreeBatch, logits_rows: torch.Tensor | None = None,
              feature_layers: Sequence[int] = ()) -> Scores:
        """``forward``, and the hidden states after ``feature_layers`` (see ``LlamaRuntime.score``). A pass
        with features runs eagerly: the graphs are captured without them."""
        if not feature_layers:
            return Scores(self.forward(batch, logits_rows))
        check_feature_layers(feature_layers, len(self.layers))
        rows = batch.cu_rows[-1]
        captured: dict[int, torch.Tensor] = {}
        logits = self.step(self.prepare(batch).to(self.device), logits=True, capture=(frozenset(feature_layers), captured))
        features = torch.stack([captured[n][:rows] for n in feature_layers], dim=1)
        logits = logits[:rows]
        return Scores(logits if logits_rows is None else logits[logits_rows.to(self.device)], features)

    def _graph(self, inputs: PassInputs) -> _Graph:
        graph = self._graphs.get(inputs.key)
        if graph is None:
            graph = self._graphs[inputs.key] = _Graph(self, inputs, self._graph_memory)
        return graph

    def step(self, inputs: PassInputs, logits: bool,
             capture: tuple[frozenset[int], dict[int, torch.Tensor]] | None = None) -> torch.Tensor | None:
        """One padded pass on device tensors: writes every row's K/V into its slot; logits [rows, vocab]
        fp32 when ``logits``. Shapes alone decide the work (graph-capturable on CUDA). ``capture``: (layer
        counts, a dict to fill with the hidden states after them)."""
        x = self.embed[inputs.input_ids]  # [rows, hidden]
        wanted, captured = capture if capture is not None else (frozenset(), {})
        if self.fused_ops:
            return self._fused_step(x, inputs, logits, wanted, captured)
        cos = self.cos[inputs.positions].unsqueeze(1)  # [rows, 1, head_dim]
        sin = self.sin[inputs.positions].unsqueeze(1)
        for index, layer in enumerate(self._computed_layers()):
            q, k, v = self._attention_inputs(layer, x, cos, sin)
            self.pool.k[index].index_copy_(0, inputs.slots, k)
            self.pool.v[index].index_copy_(0, inputs.slots, v)
            attended = self._paged_attention(q.contiguous(), index, inputs)  # [rows, heads, head_dim]
            x = self._finish_layer(layer, x, attended)
            if index + 1 in wanted:
                captured[index + 1] = x
        if not logits:
            return None
        return self.lm_head(self._norm(x, self.final_norm)).float()

    def _fused_step(self, x: torch.Tensor, inputs: PassInputs, logits: bool, wanted: frozenset[int] = frozenset(),
                    captured: dict[int, torch.Tensor] | None = None) -> torch.Tensor | None:
        # the same maths with the elementwise ops fused (kernels/llama_ops_triton.py): 9 launches a layer
        from specmesh.kernels.llama_ops_triton import add_rms_norm, rope_and_cache, silu_mul

        rows, q_size = x.shape[0], self.num_heads * self.head_dim
        delta = None  # what the last layer adds to the residual stream
        for index, layer in enumerate(self._computed_layers()):
            x, h = add_rms_norm(x, delta, layer.input_norm, self.eps)
            q = rope_and_cache(layer.qkv(h), inputs.positions, self.cos, self.sin, inputs.slots, self.pool.k[index],
                               self.pool.v[index], self.num_heads)  # [rows, heads, head_dim]
            attended = self._paged_attention(q, index, inputs)
            x, h = add_rms_norm(x, self._reduce(layer.out(attended.reshape(rows, q_size))), layer.post_norm, self.eps)
            delta = self._reduce(layer.down(silu_mul(layer.gate_up(h))))
            if index + 1 in wanted:  # the residual stream is x + delta until the next norm adds it
                captured[index + 1] = x + delta
        if not logits:
            return None
        _, h = add_rms_norm(x, delta, self.final_norm, self.eps)
        return self.lm_head(h).float()

    def _paged_attention(self, q: torch.Tensor, layer: int, inputs: PassInputs) -> torch.Tensor:
        args = (q, self.pool.k[layer], self.pool.v[layer], inputs.block_tables, inputs.cached, inputs.row_request,
                inputs.ancestors, inputs.seen, self.pool.page_size, self.scale)
        if self.attention == "triton":
            from specmesh.kernels.paged_tree_attention import paged_tree_attention_triton

            return paged_tree_attention_triton(*args, groups=inputs.groups)
        from specmesh.kernels.paged_tree_attention import paged_tree_attention_reference

        return paged_tree_attention_reference(*args)
