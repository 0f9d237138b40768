"""Grounded prompts: requests whose answer rewrites text the prompt holds (fix a paragraph's spelling, edit a
function), where prompt lookup's guesses are right. Built from text installed with Python itself (the
standard library's docstrings and source): nothing is downloaded, the set is the same on every machine with
one Python version, and nothing overlaps MT-Bench. The modules are split in two halves that share no text:
``measure`` (what ``specmesh bench --prompts grounded`` judges) and ``tune`` (what ``specmesh tune --prompts
grounded`` and drafter experiments may look at).
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import platform
import random
import re
import textwrap

from specmesh.errors import InvalidArgument
from specmesh.prompts import Prompt, load_prompts

# modules whose docs and code are plain prose and plain Python (no C stubs, no generated tables)
MODULES = ("argparse", "base64", "bisect", "calendar", "colorsys", "configparser", "csv", "difflib", "fnmatch",
           "fractions", "ftplib", "getopt", "gettext", "glob", "gzip", "heapq", "hmac", "imaplib", "ipaddress",
           "json.decoder", "json.encoder", "logging", "mailbox", "netrc", "numbers", "optparse", "pathlib",
           "pprint", "queue", "quopri", "random", "sched", "secrets", "selectors", "shlex", "shutil", "smtplib",
           "statistics", "string", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize",
           "uuid", "warnings", "wave", "zipfile")
SPLITS = ("measure", "tune")
GROUNDED = "grounded"  # the name ``--prompts`` takes for this set
PARAGRAPH_WORDS = (40, 110)  # a paragraph long enough to copy, short enough for the answer's budget
FUNCTION_LINES = (6, 24)
TYPO_EVERY = 7

SPELLING = "Fix the spelling mistakes in this paragraph and return the whole paragraph:\n\n{text}"
CODE_TASKS = (
    "Rename the function `{name}` to `{new}` and return the whole function:\n\n```python\n{text}\n```",
    "Return this function with its comments removed:\n\n```python\n{text}\n```",
    "Add a one-line docstring to this function and return the whole function:\n\n```python\n{text}\n```",
)


def _split_of(module: str) -> str:
    """Each module's half, by a hash of its name (stable across runs and machines)."""
    return SPLITS[hashlib.sha256(module.encode()).digest()[0] % 2]


def _paragraphs(module) -> list[str]:
    """Prose paragraphs of a module's docstrings (module, classes, functions), each joined into one line."""
    docs = [inspect.getdoc(module) or ""]
    docs += [inspect.getdoc(v) or "" for _, v in sorted(vars(module).items())
             if (inspect.isclass(v) or inspect.isfunction(v)) and getattr(v, "__module__", None) == module.__name__]
    found = []
    for doc in docs:
        for block in re.split(r"\n\s*\n", doc):
            if re.search(r"[>{}|=_\[\]]|\s{3}|^\s*[-*]", block, re.M):  # examples, tables, lists: not prose
                continue
            text = " ".join(block.split())
            if PARAGRAPH_WORDS[0] <= len(text.split()) <= PARAGRAPH_WORDS[1] and text.endswith("."):
                found.append(text)
    return found


def _functions(module) -> list[tuple[str, str]]:
    """(name, source) of a module's own top-level functions of a few lines, comments kept, docstrings left out."""
    try:
        source = inspect.getsource(module)
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return []
    lines = source.splitlines()
    found = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("__") or node.decorator_list:
            continue
        body = node.body
        skip = range(0)  # the docstring's lines
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            if len(body) == 1:
                continue
            skip = range(body[0].lineno - 1, body[0].end_lineno)
        text = "\n".join(line for n, line in enumerate(lines[node.lineno - 1:node.end_lineno], start=node.lineno - 1)
                         if n not in skip)
        if FUNCTION_LINES[0] <= text.count("\n") + 1 <= FUNCTION_LINES[1]:
            found.append((node.name, text))
    return found


def misspell(text: str, rng: random.Random) -> str:
    """Two adjacent inner letters swapped in about one word of five letters or more in ``TYPO_EVERY``."""
    def swap(match: re.Match) -> str:
        word = match.group(0)
        if rng.randrange(TYPO_EVERY):
            return word
        i = rng.randrange(1, len(word) - 2)
        return word[:i] + word[i + 1] + word[i] + word[i + 2:] if word[i] != word[i + 1] else word
    return re.sub(r"[A-Za-z]{5,}", swap, text)


def grounded_prompts(split: str = "measure", count: int = 24, seed: int = 0) -> list[Prompt]:
    """``count`` prompts of ``split``, paragraphs to correct (category ``spelling``) and functions to edit
    (``code-edit``) in turn, drawn with ``seed`` from the split's modules."""
    if split not in SPLITS:
        raise InvalidArgument("split", f"must be one of {', '.join(SPLITS)}, got {split!r}")
    if count < 1:
        raise InvalidArgument("count", f"must be >= 1, got {count}")
    rng = random.Random(f"{split}:{seed}")
    paragraphs, functions = [], []
    for name in MODULES:
        if _split_of(name) != split:
            continue
        module = importlib.import_module(name)
        paragraphs += _paragraphs(module)
        functions += _functions(module)
    rng.shuffle(paragraphs)
    rng.shuffle(functions)
    prompts = []
    for i in range(count):
        if i % 2 == 0 and paragraphs:
            prompts.append(Prompt(SPELLING.format(text=misspell(paragraphs.pop(), rng)), "spelling"))
        elif functions:
            name, text = functions.pop()
            task = CODE_TASKS[(i // 2) % len(CODE_TASKS)]
            prompts.append(Prompt(task.format(name=name, new=f"{name}_v2", text=textwrap.dedent(text)), "code-edit"))
        else:
            break
    if len(prompts) < count:
        raise InvalidArgument("count", f"the {split} split holds {len(prompts)} prompts on this Python, asked for {count}")
    return prompts


def named_or_file(prompts: str, split: str) -> tuple[list[Prompt], str]:
    """``--prompts``: ``grounded`` (this set's ``split`` half) or a JSONL file; the prompts and their source."""
    if prompts == GROUNDED:
        return grounded_prompts(split), f"grounded ({split} half, Python {platform.python_version()}'s standard library)"
    return load_prompts(prompts), prompts
