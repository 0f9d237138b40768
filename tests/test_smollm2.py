"""Greedy losslessness on the real embedded model, SmolLM2-135M-Instruct, on 20 MT-Bench prompts x 64 tokens.

Three independent decodings must agree token for token: Hugging Face's own ``generate`` (plain greedy),
specmesh's runtime with speculation off, and specmesh with drafters (prompt lookup and a 4-layer
truncation of the target as a small model), batched with ragged prompt lengths. A divergence reports
the target's top-2 logit margin there, so a floating-point near-tie is told apart from a bug.
"""

import copy

import pytest
import torch

from specmesh.drafters.model import ModelDrafter
from specmesh.drafters.ngram import NgramDrafter
from specmesh.prompts import encode_chat, mtbench_prompts
from specmesh.runtime.llama import LlamaRuntime
from specmesh.runtime.loading import EMBEDDED_DEFAULT, load_hf_model
from specmesh.sampling import SamplingParams
from specmesh.speculation.assembly import eos_token_ids
from specmesh.speculation.engine import Request, SpeculativeEngine

pytestmark = pytest.mark.slow
MAX_TOKENS = 64
NUM_PROMPTS = 20


@pytest.fixture(scope="module")
def target():
    return load_hf_model(EMBEDDED_DEFAULT, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def questions():
    return mtbench_prompts()[:: len(mtbench_prompts()) // NUM_PROMPTS][:NUM_PROMPTS]  # every category


@pytest.fixture(scope="module")
def prompts(target, questions):
    return [tuple(encode_chat(target.tokenizer, q.text)) for q in questions]


@pytest.fixture(scope="module")
def hf_outputs(target, prompts):
    outputs = []
    eos = eos_token_ids(target)
    for prompt in prompts:
        with torch.no_grad():
            out = target.model.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=eos,
                pad_token_id=target.tokenizer.pad_token_id,
            )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def truncated_target(model, layers: int):
    """The target's first ``layers`` layers with its embeddings, final norm and head: a (weak) small model."""
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    small = type(model)(config).eval()
    small.load_state_dict(model.state_dict(), strict=False)
    small.tie_weights()
    return small


def divergence_report(target, prompt, expected, got) -> str:
    index = next(i for i, (a, b) in enumerate(zip(expected + [None], got + [None])) if a != b)
    with torch.no_grad():
        logits = target.model(torch.tensor([list(prompt) + expected[:index]])).logits[0, -1]
    top2 = logits.topk(2)
    margin = (top2.values[0] - top2.values[1]).item()
    return f"first difference at token {index}: expected {expected[index:index + 3]}, got {got[index:index + 3]}; " \
           f"target top-2 logit margin there {margin:.2e}"


def test_own_plain_decoding_equals_hugging_face(target, prompts, hf_outputs):
    engine = SpeculativeEngine(LlamaRuntime(target.model), [], max_tree_nodes=0, eos_token_ids=eos_token_ids(target))
    for prompt, expected in zip(prompts, hf_outputs):
        (out,) = engine.generate([Request(prompt, SamplingParams(max_tokens=MAX_TOKENS))])
        assert out.token_ids == expected, divergence_report(target, prompt, expected, out.token_ids)


def test_speculative_decoding_equals_plain_greedy(target, prompts, hf_outputs):
    drafters = [NgramDrafter(), ModelDrafter(truncated_target(target.model, 4), target.model.config.vocab_size, "trunc4")]
    engine = SpeculativeEngine(LlamaRuntime(target.model), drafters, max_tree_nodes=8, eos_token_ids=eos_token_ids(target))
    steps = tokens = 0
    for start in range(0, len(prompts), 5):  # batches of 5 ragged prompts share each target pass
        batch = prompts[start : start + 5]
        outputs = engine.generate([Request(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in batch])
        for prompt, expected, out in zip(batch, hf_outputs[start : start + 5], outputs):
            assert out.token_ids == expected, divergence_report(target, prompt, expected, out.token_ids)
            steps += out.stats.target_steps
            tokens += len(out.token_ids)
    assert tokens / steps > 1.0, "no drafted token was ever accepted"
    print(f"\nSmolLM2 greedy: {len(prompts)} prompts identical; mean accepted length {tokens / steps:.2f}")


def test_shipped_experts_are_lossless(target, prompts, hf_outputs):
    """Every shipped expert, alone and fused with prompt lookup, keeps the greedy output exactly."""
    from specmesh.drafters.catalog import load_drafter, shipped_experts

    experts = shipped_experts(EMBEDDED_DEFAULT)
    assert set(experts) >= {"code", "math", "writing", "knowledge", "chat"}, f"shipped experts: {sorted(experts)}"
    runtime = LlamaRuntime(target.model)
    for name in experts:
        drafter = load_drafter(name, target, device=None, dtype=None)
        assert drafter.name == name and drafter.domains == ("general" if name == "chat" else name,)
        engine = SpeculativeEngine(runtime, [drafter, NgramDrafter()], max_tree_nodes=8,
                                   eos_token_ids=eos_token_ids(target))
        chosen = range(0, len(prompts), 4)  # five prompts across the categories
        outputs = engine.generate([Request(prompts[i], SamplingParams(max_tokens=MAX_TOKENS)) for i in chosen])
        for i, out in zip(chosen, outputs):
            assert out.token_ids == hf_outputs[i], divergence_report(target, prompts[i], hf_outputs[i], out.token_ids)
        assert sum(len(o.token_ids) for o in outputs) > sum(o.stats.target_steps for o in outputs)


def routed_outputs(target, runtime, questions, prompts, adapt_budget: bool = True) -> list:
    """Prompt lookup and every shipped expert behind the router's policy (classifier, routing, trust-
    weighted fusion), on ``runtime``, the prompts in batches of five: each request's result."""
    from specmesh.drafters.catalog import load_drafter, shipped_experts
    from specmesh.speculation.classifier import default_classifier
    from specmesh.speculation.policy import adaptive_policy

    experts = [load_drafter(name, target, device=None, dtype=None) for name in shipped_experts(EMBEDDED_DEFAULT)]
    drafters = [NgramDrafter(), *experts]
    policy = adaptive_policy({d.name: [getattr(d, "domain", "general")] for d in drafters}, seed=0, free=["ngram"],
                             adapt_budget=adapt_budget)
    engine = SpeculativeEngine(runtime, drafters, max_tree_nodes=8, eos_token_ids=eos_token_ids(target), policy=policy)
    classifier = default_classifier()
    requests = [Request(p, SamplingParams(max_tokens=MAX_TOKENS), kind=classifier.classify(q.text))
                for q, p in zip(questions, prompts)]
    outputs = []
    for start in range(0, len(requests), 5):
        outputs += engine.generate(requests[start : start + 5])
    return outputs


@pytest.mark.parametrize("speculation", ["adaptive", "fixed"])
def test_the_full_router_is_lossless_and_routes_by_kind(target, questions, prompts, hf_outputs, speculation):
    """Prompt lookup and every shipped expert behind the router's policy (classifier, routing, trust-
    weighted fusion; the budget by goodput or fixed), batched: the greedy output exactly; with the whole
    budget every step, coding questions are drafted by the code expert."""
    outputs = routed_outputs(target, LlamaRuntime(target.model), questions, prompts, speculation == "adaptive")
    for prompt, expected, out in zip(prompts, hf_outputs, outputs):
        assert out.token_ids == expected, divergence_report(target, prompt, expected, out.token_ids)
    coding = [o for q, o in zip(questions, outputs) if q.category == "coding"]
    assert coding and all(o.stats.request_kind == "code" for o in coding)
    if speculation == "fixed":  # (adaptive: whether an expert pays in a batch of five is the controller's call)
        code_steps = sum(o.stats.drafter_steps.get("code", 0) for o in coding)
        other_steps = sum(o.stats.drafter_steps.get(name, 0) for o in coding for name in ("math", "writing", "knowledge", "chat"))
        assert code_steps > other_steps, (code_steps, other_steps)
    tokens = sum(len(o.token_ids) for o in outputs)
    steps = sum(o.stats.target_steps for o in outputs)
    print(f"\nSmolLM2 full router ({speculation}): {len(prompts)} prompts identical; mean accepted length {tokens / steps:.2f}")


@pytest.fixture(scope="module")
def shipped_runtime(target):
    """The embedded default computed as shipped: its GGUF's Q4_1 blocks and Q8_0 head."""
    from specmesh.runtime.loading import embedded_gguf_path
    from specmesh.runtime.target import shipped_blocks

    assert target.gguf == embedded_gguf_path()
    runtime = LlamaRuntime(target.model, block_weights=shipped_blocks(target))  # checks blocks == fp32 weights
    assert runtime.precision == "Q4_1+Q8_0"
    return runtime


def test_the_gguf_blocks_are_the_converted_weights(target):
    """Every block matrix de-quantizes to exactly the converted fp32 weights (q/k rows un-permuted)."""
    from specmesh.runtime.gguf import read_block_weights
    from specmesh.runtime.loading import embedded_gguf_path

    blocks = read_block_weights(embedded_gguf_path(), target.model.config)
    assert len(blocks) == 30 * 7 + 2  # seven projections a layer, the embeddings and the tied head
    parameters = dict(target.model.named_parameters())
    for name, weight in blocks.items():
        reference = parameters.get(name, target.model.lm_head.weight)
        assert torch.equal(weight.dequantize(), reference.detach()), name


def test_speculative_decoding_on_the_shipped_blocks_equals_their_plain_decoding(target, shipped_runtime, questions,
                                                                               prompts):
    """Lossless on the quantized path: every expert and prompt lookup behind the router, batched, give
    exactly what plain decoding on the same blocks gives. The budget is fixed so that every step drafts
    (whether drafting pays on this machine's clock is the adaptive controller's call, not this test's)."""
    plain = SpeculativeEngine(shipped_runtime, [], max_tree_nodes=0, eos_token_ids=eos_token_ids(target))
    expected = [plain.generate([Request(p, SamplingParams(max_tokens=MAX_TOKENS))])[0].token_ids for p in prompts]
    outputs = routed_outputs(target, shipped_runtime, questions, prompts, adapt_budget=False)
    for prompt, want, out in zip(prompts, expected, outputs):
        assert out.token_ids == want, f"prompt {prompt[:8]}...: first difference at " \
            f"{next(i for i, (a, b) in enumerate(zip(want + [None], out.token_ids + [None])) if a != b)}"
    tokens = sum(len(o.token_ids) for o in outputs)
    steps = sum(o.stats.target_steps for o in outputs)
    assert tokens > steps
    print(f"\nSmolLM2 shipped (Q4_1): {len(prompts)} prompts identical to plain; mean accepted length {tokens / steps:.2f}")
