"""Expert drafters: small Llama-style models trained by specmesh to imitate the target on one domain.

What makes them cheap: a few layers at the target's width, the target's own (frozen) input embeddings,
and an output head over a frequency-ranked subset of the vocabulary (the domain's common tokens) plus
one *fallback* class meaning "the next token is not in my subset" — when it wins, the drafter stops
guessing instead of proposing a token it cannot know. At run time the model runs on the lean runtime
(pre-packed linears, KV sessions), like the target.

A drafter directory holds ``drafter.json`` (architecture, domain, target tokenizer hash, the measured
agreement and cost) and ``weights.safetensors`` (fp16: the layers, the final norm, the head rows and the
subset's token ids). The input embeddings are read from the target model's safetensors at load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from specmesh.drafters.base import DrafterBase
from specmesh.drafters.shape import (WIDE_DEPTH, WIDE_WIDTH, Step, best_first_tree, common_prefix, confident_tree,
                                     round_steps, with_ancestors)
from specmesh.errors import InvalidArgument
from specmesh.runtime.kv_cache import KVSession
from specmesh.runtime.linear import block_kernel_available, int8_available
from specmesh.runtime.llama import LlamaRuntime, TreeBatch
from specmesh.runtime.target import PREFILL_CHUNK, quantized_projections
from specmesh.tree import TokenTree, compile_tree

FORMAT = "specmesh-drafter/1"


class ExpertModel(nn.Module):
    """Token ids [batch, seq] -> logits [batch, seq, subset + 1] (last column = fallback)."""

    def __init__(self, config, embedding: torch.Tensor, subset_ids: torch.Tensor) -> None:
        from transformers import LlamaModel

        super().__init__()
        self.config = config
        self.body = LlamaModel(config)
        self.body.embed_tokens.weight = nn.Parameter(embedding.clone(), requires_grad=False)
        subset_ids = subset_ids.to(torch.long)
        self.register_buffer("subset_ids", subset_ids, persistent=False)  # [subset]
        output_tokens = torch.cat([subset_ids, subset_ids.new_tensor([-1])])
        self.register_buffer("output_tokens", output_tokens, persistent=False)  # [subset + 1]: output -> token id, -1 = fallback
        self.head = nn.Linear(config.hidden_size, len(subset_ids) + 1, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.hidden_states(input_ids, attention_mask))

    @property
    def device(self) -> torch.device:
        """Where the model's weights are: its inputs go there."""
        return self.head.weight.device

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[batch, seq] -> the final (normed) hidden states [batch, seq, hidden]."""
        return self.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    def guesses(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [n, hidden] -> top-1 token ids [n]; -1 = no guess (the fallback)."""
        return self.output_tokens[self.head(hidden).argmax(-1)]

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Everything but the frozen embeddings (which are the target's)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("body.embed_tokens")}


def subset_for(token_ids: Sequence[int] | torch.Tensor, vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent ids of ``token_ids`` (ties broken by id), sorted by frequency."""
    counts = torch.bincount(torch.as_tensor(list(token_ids), dtype=torch.long), minlength=vocab_size)
    size = min(size, int((counts > 0).sum()))
    return torch.argsort(counts, descending=True, stable=True)[:size]


@dataclass
class ExpertSpec:
    """What ``drafter.json`` says about an expert."""

    name: str
    domain: str
    target: dict  # {"name": ..., "tokenizer_hash": ..., "vocab_size": ...}
    architecture: dict  # LlamaConfig fields
    measured: dict = field(default_factory=dict)
    training: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **self.__dict__}, indent=2) + "\n"

    @classmethod
    def read(cls, directory: Path) -> ExpertSpec:
        file = directory / "drafter.json"
        if not file.is_file():
            raise InvalidArgument("drafter", f"{str(directory)!r} has no drafter.json; not a specmesh drafter directory")
        data = json.loads(file.read_text())
        if data.pop("format", None) != FORMAT:
            raise InvalidArgument("drafter", f"{file} is not in format {FORMAT}")
        data.pop("copy", None)  # a retired copy gate's fit, {} where there is none (the weights say: ``load_expert``)
        return cls(**data)


def drafter_dtype(device: torch.device | str) -> torch.dtype:
    """Drafters may run in lower precision than the target (their numbers never reach the output):
    bf16 on CUDA; on a CPU fp32 with int8 linears where FBGEMM runs (``drafter_int8``), else bf16
    where the CPU multiplies bf16 fast, else fp32. Int8 before bf16 on a CPU: a drafting step streams
    every weight once, int8 half of bf16's bytes, and PyTorch's CPU attention is slow in bf16 (measured:
    docs/experiments/2026-11-25-int8-drafting.md)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16
    if int8_available(device):
        return torch.float32
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16
    return torch.float32


def drafter_int8(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Int8 linears for a drafter in fp32 on a CPU: a drafting step streams the weights once per
    token, so a quarter of the bytes is most of the cost saved."""
    return dtype == torch.float32 and int8_available(device)


STORED_DTYPE = torch.float16  # the precision of a drafter's weights in ``weights.safetensors``


def round_to_stored(model):
    """Round a trained drafter's own weights (an expert's or a feature head's ``trainable_state``) to the
    precision they are saved in (in place), so that what is measured before saving is what ships (the
    rounding alone moved MT-Bench writing agreement by 0.013)."""
    with torch.no_grad():
        for tensor in model.trainable_state().values():
            if tensor.is_floating_point():
                tensor.copy_(tensor.to(STORED_DTYPE))
    return model


def save_drafter(model, spec, directory: Path) -> None:
    """A trained drafter (an expert, a feature head) and its ``drafter.json`` spec into ``directory``: its
    own weights in fp16, its head's token ids."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(device="cpu", dtype=STORED_DTYPE).contiguous() for k, v in model.trainable_state().items()}
    tensors["subset_ids"] = model.subset_ids.to(device="cpu", dtype=torch.int32)
    save_file(tensors, str(directory / "weights.safetensors"))
    (directory / "drafter.json").write_text(spec.to_json())


def load_expert(directory: str | Path, embedding: torch.Tensor, dtype: torch.dtype = torch.float32,
                device: torch.device | str | None = None) -> tuple[ExpertModel, ExpertSpec]:
    """The expert in ``directory`` over ``embedding`` (the target's), on ``device`` (default: the embedding's)."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    directory = Path(directory)
    spec = ExpertSpec.read(directory)
    tensors = load_file(str(directory / "weights.safetensors"))
    subset = tensors.pop("subset_ids").to(torch.long)
    if any(name.startswith("copy_gate.") for name in tensors):
        raise InvalidArgument("drafter", f"{directory} has a copy gate, which specmesh no longer runs "
                              "(see docs/experiments/2026-11-24-copy-gate.md): distill it again without one")
    model = ExpertModel(LlamaConfig(**spec.architecture), embedding.to(dtype), subset)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False)
    missing = [k for k in missing if not k.startswith("body.embed_tokens")]
    if missing or unexpected:
        raise InvalidArgument("drafter", f"{directory}: weights do not match drafter.json (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model.to(device=embedding.device if device is None else device, dtype=dtype).eval(), spec


# Blocks a drafter computes on: a drafted token streams every weight once, so bytes are its cost (Q4_0
# drafts ~20 % faster than Q8_0 for ~0.005 of agreement); the C++ layer also spares the per-op dispatch
# (docs/experiments/2026-11-27-experts-on-blocks.md).
DRAFTER_BLOCKS = "Q4_0"


@dataclass
class _ExpertRequest:
    committed: list[int]
    session: KVSession
    cached: list[int] = field(default_factory=list)  # tokens whose K/V the session holds


class ExpertDrafter(DrafterBase):
    """Drafts a confidence-shaped tree (see ``shape.py``) with the expert on the lean runtime."""

    kind = "expert"

    def __init__(
        self,
        model: ExpertModel,
        name: str,
        domain: str = "general",
        max_depth: int = 8,
        branch_below: float = 0.6,
        branch_width: int = 2,
        stop_below: float = 0.0,
        int8_weights: bool | None = None,
    ) -> None:
        """``int8_weights``: approximate low-precision linears (None: where they pay, see ``drafter_int8``):
        ``DRAFTER_BLOCKS`` blocks where specmesh's kernel runs (a layer is one C++ call), else FBGEMM's int8."""
        self.name = name
        self.domains = (domain,)
        weight = model.head.weight
        if int8_weights is None:
            int8_weights = drafter_int8(weight.device, weight.dtype)
        blocks = None
        if int8_weights and block_kernel_available(weight.device):  # by the names LlamaRuntime looks up
            blocks = quantized_projections(((f"model.{n}", p) for n, p in model.body.named_parameters()), weight,
                                           DRAFTER_BLOCKS)
        self.runtime = LlamaRuntime(model.body, head_weight=weight, int8_weights=int8_weights, block_weights=blocks)
        self.subset_ids = model.subset_ids.tolist()
        self.fallback = len(self.subset_ids)
        self.max_depth = max_depth
        self.branch_below = branch_below
        self.branch_width = branch_width
        self.stop_below = stop_below
        self._requests: dict[str, _ExpertRequest] = {}

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self._requests[request_id] = _ExpertRequest([int(t) for t in prompt_ids], self.runtime.new_session())

    def commit(self, request_id: str, new_token_ids: Sequence[int]) -> None:
        self._requests[request_id].committed.extend(int(t) for t in new_token_ids)

    def end(self, request_id: str) -> None:
        state = self._requests.pop(request_id, None)
        if state is not None:
            state.session.free()

    def _catch_up(self, state: _ExpertRequest, context: list[int]) -> Step:
        """Bring the session to ``context``; return the distribution after its last token."""
        shared = min(common_prefix(state.cached, context), len(context) - 1)  # the last token is always fed
        state.session.rollback(min(shared, state.session.length))
        feed = context[state.session.length :]
        for start in range(0, len(feed), PREFILL_CHUNK):  # chunks bound the attention memory of long prompts
            chunk = feed[start : start + PREFILL_CHUNK]
            tree = compile_tree(chunk[0], TokenTree.chain(chunk[1:]))
            logits = self.runtime.forward(
                TreeBatch.build([state.session], [tree]), logits_rows=torch.tensor([tree.num_rows - 1])
            )
            state.session.keep_rows(list(range(tree.num_rows)))
        state.cached = list(context)
        return Step(logits[0].softmax(-1), self.subset_ids)

    def propose(self, request_id: str, budget: int, assumed: Sequence[int] = ()) -> TokenTree:
        state = self._requests[request_id]
        if budget <= 0:
            return TokenTree()
        context = [*state.committed, *assumed]
        first = self._catch_up(state, context)
        if budget > self.max_depth * self.branch_width:
            return best_first_tree(first, lambda tree, rows: self._score(state, context[-1], tree, rows), budget,
                                   WIDE_DEPTH, WIDE_WIDTH, stop_index=self.fallback)
        # guesses fed by ``advance`` are scratch: the next proposal rolls the session back to the commits
        return confident_tree(
            first,
            lambda token: self._advance(state, token),
            budget,
            self.max_depth,
            self.branch_below,
            self.branch_width,
            stop_index=self.fallback,
            stop_below=self.stop_below,
        )

    def _score(self, state: _ExpertRequest, last: int, grown: TokenTree, nodes: list[int]) -> list[Step]:
        """The expert's distributions after ``nodes`` of ``grown`` below the context's last token ``last``
        (one pass over them and their ancestors; the session keeps the context and nothing of the tree)."""
        tree, rows = with_ancestors(grown, nodes)
        state.session.rollback(state.session.length - 1)  # the last token again, as the tree's root
        compiled = compile_tree(last, tree)
        logits = self.runtime.forward(TreeBatch.build([state.session], [compiled]),
                                      logits_rows=torch.tensor([r + 1 for r in rows]))
        state.session.keep_rows([0])
        return round_steps(logits.softmax(-1), self.subset_ids)  # [rows, subset + 1]

    def _advance(self, state: _ExpertRequest, token: int) -> Step:
        tree = compile_tree(token, TokenTree())
        logits = self.runtime.forward(TreeBatch.build([state.session], [tree]))
        state.session.keep_rows([0])
        state.cached.append(token)
        return Step(logits[0].softmax(-1), self.subset_ids)  # [subset + 1]
