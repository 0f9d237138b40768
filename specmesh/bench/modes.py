"""The modes ``specmesh bench`` measures side by side: Hugging Face greedy ``generate`` and its assisted
decoding at each setting, llama.cpp's plain decoding in a process of its own (left out, with why, if that
process dies), specmesh in process and through its clusters; the order they run each prompt in, and what
each did (``ModeRecord``)."""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from specmesh.bench.isolated import BaselineFailed, IsolatedBaseline
from specmesh.client import Client
from specmesh.drafters.model import ModelDrafter
from specmesh.prompts import Prompt
from specmesh.speculation.assembly import Assembly, eos_token_ids
from specmesh.speculation.engine import SpeculativeEngine


HF_PROMPT_LOOKUP_TOKENS = (2, 3, 5, 10)  # Hugging Face assisted decoding's settings: its best one is the baseline
WARMUP_PROMPT = "Name three colours of the rainbow, then say which one you like best and why."  # in no prompt set


def hf_modes(drafters: list) -> dict[str, dict]:
    """Mode name -> the keyword arguments that Hugging Face ``generate`` gets for it: plain greedy decoding,
    prompt lookup at each of ``HF_PROMPT_LOOKUP_TOKENS``, and each drafter that is a Hugging Face model as
    the assistant (experts and model-free drafters cannot be)."""
    modes: dict[str, dict] = {"hf_plain": {}}
    for n in HF_PROMPT_LOOKUP_TOKENS:
        modes[f"hf_assisted:prompt_lookup_num_tokens={n}"] = {"prompt_lookup_num_tokens": n}
    for drafter in drafters:
        if isinstance(drafter, ModelDrafter):
            modes[f"hf_assisted:assistant_model={drafter.name}"] = {"assistant_model": drafter.model}
    return modes


def best_setting(speeds: dict[str, float], prefix: str = "hf_assisted:") -> tuple[str, float] | None:
    """The fastest of the modes named ``prefix<setting>``: its setting and its tokens/s (None if none ran);
    a tie goes to the setting listed first."""
    settings = [(mode[len(prefix):], speed) for mode, speed in speeds.items() if mode.startswith(prefix)]
    return max(settings, key=lambda item: item[1]) if settings else None


def is_specmesh_mode(mode: str) -> bool:
    return not mode.startswith(("hf_", "llama_cpp"))


def mode_references(modes: list[str], quantized: bool) -> dict[str, str]:
    """The mode whose greedy output each mode must reproduce. specmesh's modes: its own plain decoding on
    the GGUF's blocks (``quantized``), else Hugging Face's plain greedy decoding of the same weights when it
    ran. The fp32 runtime and Hugging Face's assisted modes: Hugging Face plain. llama.cpp computes the same
    blocks with its own rounding: compared with specmesh's plain decoding, for information."""
    exact = "hf_plain" if "hf_plain" in modes else ("own_plain_fp32" if "own_plain_fp32" in modes else "own_plain")
    own = "own_plain" if quantized else exact
    return {m: exact if m.startswith("hf_") or m == "own_plain_fp32" else own for m in modes}


LLAMA_CPP_CONTEXT = 4096  # tokens: the longest MT-Bench first turn and its answer fit


def llama_cpp_baseline(assembly: Assembly):
    """llama.cpp's plain greedy decoding of the same GGUF file on the same threads, through the optional
    ``llama-cpp-python``, in a process of its own (``IsolatedBaseline``: llama.cpp's native code may crash):
    a function (prompt ids, max tokens, eos ids) -> output ids (None when it is not installed, the target is
    not a GGUF file or llama.cpp's process failed to start), and what ran (its version and the CPU features
    it was built with, llama.cpp's system info) or why nothing did."""
    if assembly.target.gguf is None:
        return None, "not run: the target is not a GGUF file"
    if importlib.util.find_spec("llama_cpp") is None:
        print("llama.cpp baseline skipped: pip install llama-cpp-python to compare with it", flush=True)
        return None, "not run: llama-cpp-python is not installed"
    try:
        baseline = IsolatedBaseline("llama.cpp", llama_cpp_decoder, str(assembly.target.gguf), torch.get_num_threads())
    except BaselineFailed as exc:
        print(f"llama.cpp baseline skipped: {exc}", flush=True)
        return None, f"not run: {exc}"
    return baseline, baseline.info


def llama_cpp_decoder(gguf: str, threads: int):
    """In the baseline's process: llama.cpp's greedy decoding of ``gguf`` (a function), and its build."""
    import llama_cpp

    build = {"version": llama_cpp.__version__, "system_info": llama_cpp.llama_print_system_info().decode().strip()}
    model = llama_cpp.Llama(model_path=gguf, n_ctx=LLAMA_CPP_CONTEXT, n_threads=threads, n_threads_batch=threads,
                            verbose=False)

    def generate(prompt_ids: tuple[int, ...], max_tokens: int, eos: list[int]) -> list[int]:
        model.reset()  # no prefix reuse between prompts: every mode prefills its whole prompt
        tokens: list[int] = []
        for token in model.generate(list(prompt_ids), top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
            tokens.append(int(token))
            if token in eos or len(tokens) >= max_tokens:
                break
        return tokens

    return generate, build


def mode_order(modes: list[str], index: int) -> list[str]:
    """The order in which prompt ``index`` runs the modes: ``modes`` rotated by ``index``, so that over
    ``len(modes)`` prompts each mode runs once in every slot (first, right after the previous prompt's
    last mode, ..., last) and none always follows the same one into a warm or cold cache."""
    shift = index % len(modes) if modes else 0
    return modes[shift:] + modes[:shift]


def _hf_generate(assembly: Assembly, ids: tuple[int, ...], max_tokens: int, extra: dict) -> list[int]:
    model, tokenizer = assembly.target.model, assembly.target.tokenizer
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids], device=model.device), max_new_tokens=max_tokens, do_sample=False,
            eos_token_id=eos_token_ids(assembly.target), pad_token_id=tokenizer.pad_token_id, **extra,
        )
    return out[0, len(ids) :].tolist()


@dataclass
class ModeRecord:
    """What one mode did, per prompt category: output tokens, seconds, target passes; and latencies."""

    tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    steps: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    first_token_ms: list[float] = field(default_factory=list)
    per_token_ms: list[float] = field(default_factory=list)  # after the first token
    draft_s: float = 0.0  # waiting for drafters (through the cluster: their work and the gRPC round trips)
    transport_s: float = 0.0  # waiting for verification beyond the verifier's own work (the queue, the hops)
    identical: int = 0  # prompts whose output is the greedy reference's, token for token

    def add(self, category: str, token_ids: list[int], seconds: float, steps: int | None, first_token_s: float | None) -> None:
        self.tokens[category] += len(token_ids)
        self.seconds[category] += seconds
        if steps is not None:
            self.steps[category] += steps
        if first_token_s is not None:
            self.first_token_ms.append(first_token_s * 1e3)
            if len(token_ids) > 1:
                self.per_token_ms.append((seconds - first_token_s) * 1e3 / (len(token_ids) - 1))

    def speed(self, category: str | None = None) -> float:
        cats = [category] if category else list(self.tokens)
        return sum(self.tokens[c] for c in cats) / max(sum(self.seconds[c] for c in cats), 1e-9)

    def step_ms(self) -> float:
        """Wall-clock milliseconds per target pass, over every category (at least one pass counted)."""
        return sum(self.seconds.values()) / max(sum(self.steps.values()), 1) * 1e3

    def accepted_length(self, category: str | None = None) -> float:
        cats = [category] if category else list(self.tokens)
        return sum(self.tokens[c] for c in cats) / max(sum(self.steps.get(c, 0) for c in cats), 1)

    def latency(self) -> dict[str, float]:
        return {"ttft_p50_ms": percentile(self.first_token_ms, 50), "ttft_p99_ms": percentile(self.first_token_ms, 99),
                "per_token_p50_ms": percentile(self.per_token_ms, 50), "per_token_p99_ms": percentile(self.per_token_ms, 99)}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return round(ordered[index], 2)


class BenchModes:
    """The modes measured side by side, how each runs one prompt, and what each did (``records``); a mode
    whose isolated baseline process fails is left out from then on (``failed``: mode -> why)."""

    def __init__(self, assembly: Assembly, args: argparse.Namespace, engines: dict[str, SpeculativeEngine],
                 hf: dict[str, dict], llama_cpp, clients: dict[str, Client], quantized: bool) -> None:
        self.assembly, self.args, self.engines, self.hf, self.llama_cpp, self.clients = (
            assembly, args, engines, hf, llama_cpp, clients)
        self.names = list(hf) + (["llama_cpp_plain"] if llama_cpp else []) + list(engines) + list(clients)
        self.references = mode_references(self.names, quantized)
        self.records = {m: ModeRecord() for m in self.names}
        self.failed: dict[str, str] = {}

    def run(self, mode: str, prompt: Prompt, request) -> tuple[list[int], float, int | None, float | None] | None:
        """One prompt through one mode: output tokens, seconds, target passes (None: not known), time to the
        first token (the cluster's and the engines' waits go into the mode's record); None when the mode's
        isolated process failed."""
        try:
            return self._run(mode, prompt, request)
        except BaselineFailed as exc:
            print(f"{mode} left out: {exc}", flush=True)
            self.failed[mode] = str(exc)
            self.names.remove(mode)
            del self.records[mode]
            return None

    def _run(self, mode: str, prompt: Prompt, request) -> tuple[list[int], float, int | None, float | None]:
        args, started = self.args, time.perf_counter()
        if mode in self.hf:
            tokens = _hf_generate(self.assembly, request.prompt_ids, args.max_tokens, self.hf[mode])
            return tokens, time.perf_counter() - started, len(tokens) if mode == "hf_plain" else None, None
        if mode == "llama_cpp_plain":
            tokens = self.llama_cpp(request.prompt_ids, args.max_tokens, eos_token_ids(self.assembly.target))
            return tokens, time.perf_counter() - started, len(tokens), None
        if mode in self.clients:
            fixed = mode == "cluster_fixed"
            answer = self.clients[mode].generate(chat=[("user", prompt.text)], max_tokens=args.max_tokens,
                                                 max_tree_nodes=args.fixed_tree_nodes if fixed else args.max_tree_nodes,
                                                 speculation="fixed" if fixed else None)
            seconds, stats_ = time.perf_counter() - started, answer.stats
            self.records[mode].draft_s += stats_.draft_ms / 1e3
            self.records[mode].transport_s += max(stats_.verify_ms - stats_.verifier_ms, 0.0) / 1e3
            return answer.token_ids, seconds, stats_.target_steps, stats_.first_token_ms / 1e3
        (result,) = self.engines[mode].generate([request])
        seconds, stats_ = time.perf_counter() - started, result.stats
        self.records[mode].draft_s += stats_.draft_s
        self.records[mode].transport_s += max(stats_.verify_s - stats_.verifier_s, 0.0)
        return result.token_ids, seconds, stats_.target_steps, stats_.first_token_s

    def measure(self, prompts: list[Prompt], requests: list, warmup_request) -> tuple[int, list[list[int]]]:
        """An untimed warm-up prompt through every mode, then every prompt through every mode, interleaved and
        rotated (drift and going first hit every mode alike): how many prompts every specmesh mode answered as
        its reference, and each prompt's own plain answer (what every policy at load must give)."""
        warmup = Prompt(WARMUP_PROMPT, "warm-up")
        for mode in tqdm(list(self.names), desc="warm-up (untimed)", unit="mode"):
            self.run(mode, warmup, warmup_request)
        self.records = {mode: ModeRecord() for mode in self.names}  # the warm-up is not measured
        all_identical, own_answers = 0, []
        for index, (prompt, request) in enumerate(tqdm(list(zip(prompts, requests)), desc="prompts", unit="prompt")):
            outputs = {}
            for mode in mode_order(self.names, index):
                if (answer := self.run(mode, prompt, request)) is not None:
                    outputs[mode], seconds, steps, first_token_s = answer
                    self.records[mode].add(prompt.category, outputs[mode], seconds, steps, first_token_s)
            for mode in self.names:
                self.records[mode].identical += outputs[mode] == outputs[self.references[mode]]
            all_identical += all(outputs[m] == outputs[self.references[m]] for m in self.names if is_specmesh_mode(m))
            own_answers.append(outputs["own_plain"])
        return all_identical, own_answers
