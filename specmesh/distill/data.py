"""The target's own answers to training prompts, with its top-k next-token distribution at every
answer position, cached (JSONL + safetensors shards) and resumable.

Under teacher forcing on its own greedy output, the target's argmax at every position is the next
token of the answer, so these answers are exactly the labels that top-1 agreement is measured by; and
the distribution greedy decoding computes at each step is exactly the teacher-forced one, so the soft
labels come free with the answers.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Sequence

import torch
from tqdm.auto import tqdm

from specmesh.errors import InvalidArgument
from specmesh.prompts import Prompt, encode_chat
from specmesh.runtime.llama import TreeBatch
from specmesh.runtime.target import prefill_sessions, score_with_features
from specmesh.tree import TokenTree, compile_tree

SOFT_LABEL_TOP_K = 16


@dataclass(frozen=True)
class Example:
    prompt: str
    category: str
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    labels: tuple[str, int] | None = None  # (shard file, index in it) of the soft labels recorded with the answer

    @property
    def token_ids(self) -> list[int]:
        return [*self.prompt_ids, *self.response_ids]


@dataclass(frozen=True)
class SoftLabels:
    """The target's top-k next-token distribution at each answer position (teacher forcing)."""

    token_ids: torch.Tensor  # [answer_len, k] long
    probs: torch.Tensor  # [answer_len, k] float32, the target's probabilities (not renormalised)


def load_examples(path: Path) -> list[Example]:
    if not path.exists():
        return []
    examples = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            labels = tuple(row["labels"]) if "labels" in row else None
            examples.append(Example(row["prompt"], row["category"], tuple(row["prompt_ids"]), tuple(row["response_ids"]),
                                    labels))
    return examples


class Answer(NamedTuple):
    tokens: list[int]  # the answer's token ids
    labels: SoftLabels  # the target's top-k at each answer position
    features: torch.Tensor | None = None  # [prompt + answer - 1, layers, hidden] fp16: hidden states at every
    # position whose next token is known (all but the answer's last), when ``feature_layers`` were asked for


def target_answers(
    runtime, prompts: Sequence[Sequence[int]], max_tokens: int, eos_token_ids: Sequence[int] = (), top_k: int = SOFT_LABEL_TOP_K,
    temperature: float = 0.0, generator: torch.Generator | None = None, feature_layers: Sequence[int] = (),
) -> list[Answer]:
    """Plain decoding of every prompt together (one target pass per step), recording the target's top-k
    distribution at each step: the answer, and the soft labels of its every position. Greedy at
    temperature 0; above it, each token is sampled from the tempered distribution (the recorded one
    stays untempered: its top-1 is the greedy label). With ``feature_layers``, also the hidden states
    after those layers at every position, prompt included (what a feature drafter learns from)."""
    eos = frozenset(eos_token_ids)
    sessions = [runtime.new_session() for _ in prompts]
    try:
        for session, ids in zip(sessions, prompts):
            session.reserve(len(ids) + max_tokens)  # one buffer for the whole answer: no regrowth, no fragments
        prompt_features = prefill_sessions(runtime, sessions, [ids[:-1] for ids in prompts], feature_layers)
        features: list[list[torch.Tensor]] = [[f.half()] if f is not None else [] for f in prompt_features] \
            if feature_layers else [[] for _ in prompts]
        answers: list[list[int]] = [[] for _ in prompts]
        tops: list[list[torch.Tensor]] = [[] for _ in prompts]  # per step [2, k]: ids, probs
        last = [ids[-1] for ids in prompts]
        active = list(range(len(prompts)))
        while active:
            trees = [compile_tree(last[i], TokenTree()) for i in active]
            batch = TreeBatch.build([sessions[i] for i in active], trees)
            if feature_layers:
                scored = score_with_features(runtime, batch, feature_layers)
                logits, hidden = scored.logits, scored.features.half()  # [active, vocab], [active, layers, hidden]
            else:
                logits, hidden = runtime.forward(batch), None
            scores = logits.float()  # [active, vocab]
            top = scores.softmax(-1).topk(top_k, dim=-1)
            top_ids, top_probs = top.indices.cpu(), top.values.cpu()  # [active, k]: one transfer a step
            if temperature > 0:
                tempered = (scores / temperature).softmax(-1)
                drawn = torch.multinomial(tempered, 1, generator=generator)[:, 0].tolist()  # [active]
            still = []
            for row, i in enumerate(active):
                sessions[i].keep_rows([0])
                token = drawn[row] if temperature > 0 else int(top_ids[row, 0])  # softmax keeps the argmax
                answers[i].append(token)
                tops[i].append(torch.stack([top_ids[row].float(), top_probs[row]]))
                if hidden is not None:
                    features[i].append(hidden[row : row + 1].cpu())
                last[i] = token
                if token not in eos and len(answers[i]) < max_tokens:
                    still.append(i)
            active = still
    finally:
        for session in sessions:
            session.free()
        release_freed_memory()
    results = []
    for answer, steps, hidden in zip(answers, tops, features):
        stacked = torch.stack(steps)  # [answer_len, 2, k]
        # the last step's input is the answer's second-to-last token's successor: all but the last position
        results.append(Answer(answer, SoftLabels(stacked[:, 0].long(), stacked[:, 1].contiguous()),
                              torch.cat(hidden) if feature_layers else None))
    return results


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise: a long generation's KV buffers of
    varying sizes fragment the heap until the process holds many times what it uses)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


@functools.cache
def _libc():
    """The C library, found once (``find_library`` runs ``ldconfig``: not for every answer)."""
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def generate_examples(
    runtime,
    tokenizer,
    prompts: Sequence[Prompt],
    cache_file: Path,
    max_tokens: int = 128,
    eos_token_ids: Sequence[int] = (),
    batch_size: int = 64,  # the lean runtime decodes ~2.5x more tokens/s at 64 requests a pass than at 16
) -> list[Example]:
    """The target's greedy answers to every prompt, reusing those already in ``cache_file`` and appending
    the new ones; each batch's soft labels go to a safetensors shard beside it (``<cache>.labels/``)."""
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    shards = _shard_dir(cache_file)
    shards.mkdir(exist_ok=True)
    done = {e.prompt: e for e in load_examples(cache_file)}
    todo = [p for p in prompts if p.text not in done]
    with cache_file.open("a", encoding="utf-8") as out, tqdm(total=len(prompts), initial=len(prompts) - len(todo),
                                                             desc="target answers", unit="prompt") as bar:
        for start in range(0, len(todo), batch_size):
            batch = todo[start : start + batch_size]
            encoded = [tuple(encode_chat(tokenizer, p.text)) for p in batch]
            shard = hashlib.sha256(repr(encoded).encode()).hexdigest()[:16] + ".safetensors"
            results = target_answers(runtime, encoded, max_tokens, eos_token_ids)
            _save_shard(shards / shard, [result.labels for result in results])
            for index, (prompt, ids, (answer, _, _)) in enumerate(zip(batch, encoded, results)):
                row = {"prompt": prompt.text, "category": prompt.category, "prompt_ids": list(ids), "response_ids": answer,
                       "labels": [shard, index]}
                done[prompt.text] = Example(prompt.text, prompt.category, ids, tuple(answer), (shard, index))
                out.write(json.dumps(row) + "\n")
            out.flush()
            bar.update(len(batch))
    return [done[p.text] for p in prompts if p.text in done]


def recorded_soft_labels(cache_file: Path, examples: Sequence[Example]) -> list[SoftLabels]:
    """The soft labels that ``generate_examples`` recorded with ``examples``' answers in ``cache_file``."""
    shards: dict[str, list[SoftLabels]] = {}
    labels = []
    for example in examples:
        if example.labels is None or not (_shard_dir(cache_file) / example.labels[0]).is_file():
            raise InvalidArgument("out", f"{cache_file} holds answers without their soft labels (cached by an older "
                                  "specmesh, or a shard deleted): delete it to answer again")
        name, index = example.labels
        if name not in shards:
            shards[name] = _load_shard(_shard_dir(cache_file) / name)
        label = shards[name][index]
        if label.token_ids.shape[0] != len(example.response_ids):
            raise InvalidArgument("out", f"{cache_file}'s soft labels do not match its answers: delete it to answer again")
        labels.append(label)
    return labels


def _shard_dir(cache_file: Path) -> Path:
    return cache_file.with_name(cache_file.name + ".labels")


def _save_shard(path: Path, labels: Sequence[SoftLabels]) -> None:
    from safetensors.torch import save_file

    offsets = [0]
    for label in labels:
        offsets.append(offsets[-1] + label.token_ids.shape[0])
    save_file({
        "offsets": torch.tensor(offsets, dtype=torch.int64),
        "token_ids": torch.cat([l.token_ids for l in labels]).to(torch.int32),
        "probs": torch.cat([l.probs for l in labels]).to(torch.float16),
    }, str(path))


def _load_shard(path: Path) -> list[SoftLabels]:
    from safetensors.torch import load_file

    stored = load_file(str(path))
    offsets = stored["offsets"].tolist()
    return [SoftLabels(stored["token_ids"][a:b].long(), stored["probs"][a:b].float()) for a, b in zip(offsets, offsets[1:])]
