"""The target's answers with its hidden states recorded: what a feature drafter learns from.

A store is a directory: ``store.json`` (the target, its precision and tokenizer hash, the layers recorded),
``examples.jsonl`` (prompt, category, prompt and answer ids, where its features are) and safetensors shards
of fp16 features, one per batch of prompts. It grows batch by batch, so a run can be stopped and resumed;
a store made for another target, precision or layers is refused rather than mixed.

An example's features are ``[prompt + answer - 1, layers, hidden]``: the hidden state at every position whose
next token is known (the last answer token's is never computed). Plain decoding computes each position's
row as a prefill would (bit for bit on the lean runtime), so these are what a verifier sends at run time.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from tqdm.auto import tqdm

from specmesh.distill.data import Example, release_freed_memory, target_answers
from specmesh.errors import InvalidArgument
from specmesh.prompts import Prompt, encode_chat

STORE_FORMAT = "specmesh-features/1"


@dataclass(frozen=True)
class FeatureStoreCard:
    """What a store was recorded from: features of another target or layers are another store."""

    target: str
    tokenizer_hash: str
    precision: str
    layers: tuple[int, ...]
    hidden_size: int

    def to_json(self) -> str:
        return json.dumps({"format": STORE_FORMAT, **self.__dict__, "layers": list(self.layers)}, indent=2) + "\n"


class FeatureStore:
    def __init__(self, directory: Path, card: FeatureStoreCard) -> None:
        self.directory = Path(directory)
        self.card = card
        file = self.directory / "store.json"
        if file.is_file():
            data = json.loads(file.read_text())
            data.pop("format", None)
            found = FeatureStoreCard(**{**data, "layers": tuple(data["layers"])})
            if found != card:
                raise InvalidArgument("features", f"{self.directory} holds features of {found}, not of {card}: "
                                      "give another directory")
        else:
            self.directory.mkdir(parents=True, exist_ok=True)
            file.write_text(card.to_json())
        self._examples = self.directory / "examples.jsonl"

    def examples(self) -> list[Example]:
        """Every recorded example; ``Example.labels`` names its shard and index there."""
        if not self._examples.exists():
            return []
        rows = [json.loads(line) for line in self._examples.read_text(encoding="utf-8").splitlines() if line.strip()]
        return [Example(r["prompt"], r["category"], tuple(r["prompt_ids"]), tuple(r["response_ids"]),
                        (r["shard"], r["index"])) for r in rows]

    def record(self, runtime, tokenizer, prompts: Sequence[Prompt], max_tokens: int, eos_token_ids: Sequence[int],
               batch_size: int = 64) -> list[Example]:
        """The target's greedy answers to ``prompts`` with their features, answering only those not yet
        recorded; returns the examples of ``prompts`` (in their order)."""
        done = {e.prompt: e for e in self.examples()}
        todo = list({p.text: p for p in prompts if p.text not in done}.values())
        with self._examples.open("a", encoding="utf-8") as out, tqdm(
                total=len(prompts), initial=len(prompts) - len(todo), desc="target answers and features",
                unit="prompt") as bar:
            for start in range(0, len(todo), batch_size):
                batch = todo[start : start + batch_size]
                encoded = [encode_chat(tokenizer, p.text) for p in batch]
                answers = target_answers(runtime, encoded, max_tokens, eos_token_ids, top_k=1,
                                         feature_layers=self.card.layers)
                shard = hashlib.sha256(repr(encoded).encode()).hexdigest()[:16] + ".safetensors"
                _save(self.directory / shard, [a.features for a in answers])
                for index, (prompt, ids, answer) in enumerate(zip(batch, encoded, answers)):
                    row = {"prompt": prompt.text, "category": prompt.category, "prompt_ids": ids,
                           "response_ids": answer.tokens, "shard": shard, "index": index}
                    out.write(json.dumps(row) + "\n")
                    done[prompt.text] = Example(prompt.text, prompt.category, tuple(ids), tuple(answer.tokens),
                                                (shard, index))
                out.flush()
                release_freed_memory()
                bar.update(len(batch))
        return [done[p.text] for p in prompts]

    def features(self, examples: Sequence[Example]) -> Iterator[torch.Tensor]:
        """Each example's features [prompt + answer - 1, layers, hidden] fp16, shard by shard as needed."""
        loaded: tuple[str, list[torch.Tensor]] | None = None
        for example in examples:
            name, index = example.labels
            if loaded is None or loaded[0] != name:
                loaded = (name, _load(self.directory / name))
            features = loaded[1][index]
            if features.shape[0] != len(example.token_ids) - 1:
                raise InvalidArgument("features", f"{self.directory / name} does not match its examples: delete the store")
            yield features


def _save(path: Path, features: Sequence[torch.Tensor]) -> None:
    from safetensors.torch import save_file

    offsets = [0]
    for f in features:
        offsets.append(offsets[-1] + f.shape[0])
    save_file({"offsets": torch.tensor(offsets, dtype=torch.int64),
               "features": torch.cat(list(features)).to(torch.float16).contiguous()}, str(path))


def _load(path: Path) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    stored = load_file(str(path))
    offsets = stored["offsets"].tolist()
    return [stored["features"][a:b] for a, b in zip(offsets, offsets[1:])]
