"""Training prompts written by the target itself.

An instruction-tuned model, given its chat template only up to the start of a user turn, writes a user
turn: a request drawn from what it was tuned on (the Magpie recipe, Xu et al. 2024). Sampled at a high
temperature these are far more varied and realistic than templates, and they are the requests the target
expects, so a drafter distilled on the target's answers to them sees the contexts real chat traffic gives.

Kept: requests that ended on their own (the model closed the turn), of a sensible length, not seen
before, and overlapping no MT-Bench question (``specmesh.distill.overlap``: the benchmark is never trained on).
The pool is cached and grows to the size asked for, so a run can be resumed or extended.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

import torch
from tqdm.auto import tqdm

from specmesh.distill.data import target_answers
from specmesh.distill.overlap import Benchmark, key, overlaps
from specmesh.errors import InvalidArgument
from specmesh.prompts import Prompt
from specmesh.speculation.expertise import GENERAL

_MARK = "\x00REQUEST\x00"
SYNTHESIS_TEMPERATURE = 1.0  # the target's own spread of requests, untempered
MIN_CHARS, MAX_CHARS = 16, 800


def user_turn_prefix(tokenizer) -> list[int]:
    """The chat template's tokens up to where a user's message begins (system turn included)."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidArgument("synthesize", "the target has no chat template: it cannot be asked to write requests")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False)
    return [int(t) for t in tokenizer(text[: text.index(_MARK)], add_special_tokens=False)["input_ids"]]


def acceptable(text: str, seen: set[str], avoid: Benchmark | None = None) -> bool:
    """A request worth training on: sensible length, printable, new (``seen``: the keys of those kept), and
    overlapping no MT-Bench question, nor any text of ``avoid``."""
    if not MIN_CHARS <= len(text) <= MAX_CHARS or not text.replace("\n", " ").isprintable():
        return False
    identity = key(text)
    if not identity or identity in seen:
        return False
    return not overlaps(text) and not (avoid is not None and avoid.overlaps(text))


def synthesize_requests(
    runtime,
    tokenizer,
    count: int,
    cache_file: Path,
    eos_token_ids: Sequence[int],
    avoid: Iterable[str] = (),
    max_tokens: int = 128,
    temperature: float = SYNTHESIS_TEMPERATURE,
    batch_size: int = 64,
    seed: int = 0,
    max_batches: int | None = None,
) -> list[str]:
    """``count`` requests the target writes for itself (fewer only if ``max_batches`` runs out), cached in
    ``cache_file`` (one JSON string a line) and grown from it. None overlaps MT-Bench, and no new one
    overlaps (in the same sense) a text of ``avoid``."""
    if count < 1:
        raise InvalidArgument("synthesize", f"must be >= 1, got {count}")
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    cached = [json.loads(line) for line in cache_file.read_text(encoding="utf-8").splitlines() if line.strip()] \
        if cache_file.exists() else []
    avoid = list(avoid)
    avoided = Benchmark.of(enumerate(avoid)) if avoid else None
    seen = {key(r) for r in cached}
    requests = [r for r in cached if not overlaps(r)]  # a pool cached under a narrower filter is filtered again
    prefix = user_turn_prefix(tokenizer)
    eos = frozenset(eos_token_ids)
    # Each batch's draws are seeded by the seed and the batch's index; a resumed pool starts from the index its
    # size suggests, so it is reproducible for a given history of runs though not identical to a whole one.
    batch_index = len(requests) // batch_size
    limit = max_batches if max_batches is not None else 4 * (count // batch_size + 1) + 8
    with cache_file.open("a", encoding="utf-8") as out, tqdm(total=count, initial=min(len(requests), count),
                                                             desc="target-written requests", unit="request") as bar:
        for _ in range(limit):
            if len(requests) >= count:
                break
            generator = torch.Generator().manual_seed(seed * 1_000_003 + batch_index)
            batch_index += 1
            drawn = target_answers(runtime, [prefix] * batch_size, max_tokens, eos, top_k=1,
                                   temperature=temperature, generator=generator)
            for ids, _, _ in drawn:
                if not ids or ids[-1] not in eos:
                    continue  # cut off at max_tokens: not a whole request
                text = tokenizer.decode(ids[:-1], skip_special_tokens=True).strip()
                if len(requests) >= count or not acceptable(text, seen, avoided):
                    continue
                seen.add(key(text))
                requests.append(text)
                out.write(json.dumps(text) + "\n")
                bar.update(1)
            out.flush()
    return requests[:count]


def domain_kinds(domain: str) -> tuple[str, ...]:
    """The request kinds an expert of ``domain`` trains on: its own; a general (chat) expert's are writing,
    knowledge and requests of no clear kind: all but code and math."""
    return (GENERAL, "writing", "knowledge") if domain == GENERAL else (domain,)


def classified_prompts(requests: Sequence[str], domain: str, classify) -> list[Prompt]:
    """The requests ``classify`` (text -> kind) puts in one of ``domain``'s kinds, as that domain's prompts."""
    kinds = domain_kinds(domain)
    return [Prompt(text, domain) for text in requests if classify(text) in kinds]
