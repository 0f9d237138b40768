"""The grounded prompt set: built from the standard library, two halves that share no text, every code
block real Python, typos that a spelling fix can undo."""

import ast
import json
import random
import re

import pytest

from specmesh.bench.grounded import GROUNDED, SPLITS, grounded_prompts, misspell, named_or_file
from specmesh.errors import InvalidArgument


def _body(prompt) -> str:
    """The text a prompt asks to rewrite: after the instruction, without a code fence."""
    text = prompt.text.split("\n\n", 1)[1]
    return text.removeprefix("```python\n").removesuffix("\n```")


def test_each_half_holds_24_prompts_of_both_kinds_the_same_every_time():
    for split in SPLITS:
        prompts = grounded_prompts(split)
        assert len(prompts) == 24
        assert [p.category for p in prompts] == ["spelling", "code-edit"] * 12
        assert prompts == grounded_prompts(split)
        assert len({_body(p) for p in prompts}) == 24


def test_the_halves_share_no_text():
    measure = {_body(p) for p in grounded_prompts("measure", 40)}
    tune = {_body(p) for p in grounded_prompts("tune", 40)}
    assert not measure & tune
    words = lambda texts: {tuple(t.split()[i:i + 8]) for t in texts for i in range(len(t.split()) - 7)}
    assert not words(measure) & words(tune)


def test_code_blocks_are_python_and_paragraphs_are_prose_with_typos():
    for prompt in grounded_prompts("measure"):
        body = _body(prompt)
        if prompt.category == "code-edit":
            (function,) = ast.parse(body).body
            assert isinstance(function, ast.FunctionDef)
            assert not (isinstance(function.body[0], ast.Expr) and isinstance(function.body[0].value, ast.Constant))
        else:
            assert 40 <= len(body.split()) <= 110 and body.endswith(".")


def test_misspell_swaps_letters_inside_long_words_only():
    text = "Handlers can optionally use Formatter instances to format records as desired by the caller. " * 6
    wrong = misspell(text, random.Random(1))
    assert wrong != text
    pairs = list(zip(text.split(), wrong.split()))
    assert len(pairs) == len(text.split())
    for right, typo in pairs:
        assert sorted(right) == sorted(typo) and right[0] == typo[0] and right[-1] == typo[-1]
        assert right == typo or len(re.sub(r"\W", "", right)) >= 5


def test_named_or_file(tmp_path):
    prompts, source = named_or_file(GROUNDED, "tune")
    assert prompts == grounded_prompts("tune") and "tune half" in source
    file = tmp_path / "p.jsonl"
    file.write_text(json.dumps({"prompt": "hello", "category": "x"}) + "\n")
    prompts, source = named_or_file(str(file), "measure")
    assert [(p.text, p.category) for p in prompts] == [("hello", "x")] and source == str(file)


def test_bad_arguments_name_what_is_wrong():
    with pytest.raises(InvalidArgument, match="split"):
        grounded_prompts("train")
    with pytest.raises(InvalidArgument, match="count"):
        grounded_prompts("measure", 0)
    with pytest.raises(InvalidArgument, match="holds"):
        grounded_prompts("measure", 100_000)
