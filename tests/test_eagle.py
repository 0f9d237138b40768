"""Published EAGLE-3 heads (``--drafter eagle3:DIR``): checkpoints written here in SafeAILab's and
SpecForge's layout (their config keys, tensor names, shapes and dtypes) with random weights, for a
random Llama target: the loaded head computes the published step, drafts losslessly (greedy and the
distribution, with a decoy), and a head made for another target is refused."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import hf_greedy, tiny_llama
from sampled_distribution import (
    judge,
    lying_rule,
    next_distribution,
    sampled_pairs_pvalue,
    two_token_distribution,
)

from specmesh.drafters.catalog import load_drafter
from specmesh.drafters.feature import FeatureDrafter
from specmesh.errors import InvalidArgument
from specmesh.runtime.features import Features
from specmesh.runtime.llama import LlamaRuntime
from specmesh.runtime.loading import TargetParts
from specmesh.sampling import SamplingParams
from specmesh.speculation.engine import Request, SpeculativeEngine

VOCAB, HIDDEN, LAYERS, DRAFT_VOCAB = 96, 64, 8, 40
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=VOCAB, layers=LAYERS, hidden=HIDDEN, seed=4)


def parts(model, tokenizer=None, output_head: bool = True) -> TargetParts:
    head = lambda: (model.model.norm.weight.detach(), model.get_output_embeddings().weight.detach())  # noqa: E731
    return TargetParts("tiny", tokenizer, VOCAB, 512, (1,), lambda: model.get_input_embeddings().weight.detach(),
                       HIDDEN, LAYERS, head if output_head else None)


def assert_greedy_is_plain(target, drafter, prompts: int = 5) -> None:
    """Greedy speculative decoding with ``drafter`` gives Hugging Face's greedy tokens, and it drafted."""
    engine = SpeculativeEngine(LlamaRuntime(target), drafters=[drafter], max_tree_nodes=6)
    prompt_ids = [[random.Random(i).randrange(2, VOCAB) for _ in range(3 + 2 * i)] for i in range(prompts)]
    outputs = engine.generate([Request(tuple(p), SamplingParams(max_tokens=MAX_TOKENS)) for p in prompt_ids])
    for prompt, out in zip(prompt_ids, outputs):
        assert out.token_ids == hf_greedy(target, prompt, MAX_TOKENS)
    assert sum(o.stats.drafted_nodes for o in outputs) > 0, "the head should have drafted"


def save_checkpoint(directory: Path, config: dict, tensors: dict[str, torch.Tensor], fmt: str) -> None:
    """A published checkpoint folder: config.json and the tensors as safetensors or pytorch_model.bin."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(tensors, str(directory / "model.safetensors"))
    else:
        torch.save(tensors, directory / "pytorch_model.bin")


def write_head(directory: Path, *, hidden: int = HIDDEN, heads: int = 4, kv: int = 2, inter: int = 2 * HIDDEN,
               fc_input: int | None = None, vocab: int = VOCAB, draft_ids=None, seed: int = 0,
               fmt: str = "safetensors", config_extra: dict | None = None, drop: str = "", t2d_ids=None,
               two_guesses: bool = False) -> str:
    """An EAGLE-3 checkpoint folder as published: config.json and fp16 tensors (int64 d2t, bool t2d)."""
    head_dim = hidden // heads
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: (torch.randn(*shape, generator=gen) * 0.2).half()  # noqa: E731
    ids = torch.tensor(draft_ids if draft_ids is not None else sorted(random.Random(seed).sample(range(vocab), DRAFT_VOCAB)))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.tensor(t2d_ids if t2d_ids is not None else ids.tolist())] = True
    tensors = {
        "fc.weight": rand(hidden, fc_input or 3 * hidden),
        "midlayer.hidden_norm.weight": (1 + rand(hidden).float() * 0.1).half(),
        "midlayer.input_layernorm.weight": (1 + rand(hidden).float() * 0.1).half(),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden).half(),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
        "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "norm.weight": torch.ones(hidden).half(),
        "lm_head.weight": rand(len(ids), hidden) * 4,
        "d2t": ids - torch.arange(len(ids)),
        "t2d": t2d,
    }
    if two_guesses:  # draft id 0 or 1, by the sign of one coordinate of the output, always confidently
        tensors["lm_head.weight"].zero_()
        tensors["lm_head.weight"][0, 0], tensors["lm_head.weight"][1, 0] = 30.0, -30.0
    tensors.pop(drop, None)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
              "num_hidden_layers": 1, "hidden_act": "silu", "vocab_size": vocab, "draft_vocab_size": len(ids),
              "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "tie_word_embeddings": False,
              "torch_dtype": "float16", "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0,
              **(config_extra or {})}
    save_checkpoint(directory, config, tensors, fmt)
    return f"eagle3:{directory}"


def published_eagle3_layer(t: dict[str, torch.Tensor], embedding: torch.Tensor, g: torch.Tensor,
                           next_ids: list[int], heads: int = 4, kv_heads: int = 2, theta: float = 10000.0,
                           eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's draft layer (SafeAILab's cnets.py, SpecForge's llama3_eagle.py) from its equations, apart from
    specmesh's head so that both cannot share a mistake. Entry p (rotary position p) reads g [n, hidden] at p and
    the embedding of the token after it; the entries attend causally. Returns the outputs [n, hidden] (unnormed:
    what a next entry reads back as g) and the draft-vocabulary logits [n, draft vocab]."""
    n, hidden = g.shape
    d = hidden // heads
    w = lambda name: t["midlayer." + name]  # noqa: E731
    rms = lambda x, weight: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight  # noqa: E731
    x = torch.cat([rms(embedding[next_ids], w("input_layernorm.weight")), rms(g, w("hidden_norm.weight"))], -1)
    q, k, v = ((x @ w(f"self_attn.{p}_proj.weight").T).view(n, -1, d).transpose(0, 1) for p in "qkv")  # [heads, n, d]
    # Llama's RoPE: coordinates i and i + d/2 turn together by the angle position * theta^(-2i/d)
    angle = torch.arange(n, dtype=torch.float64)[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = angle.cos().float(), angle.sin().float()  # [n, d/2]
    rope = lambda z: torch.cat([z[..., : d // 2] * cos - z[..., d // 2 :] * sin,  # noqa: E731
                                z[..., d // 2 :] * cos + z[..., : d // 2] * sin], -1)
    q, k = rope(q), rope(k)
    groups = heads // kv_heads  # kv head j serves query heads j * groups .. (j + 1) * groups - 1
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    scores = (q @ k.transpose(1, 2) / d**0.5).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    h = g + (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, heads * d) @ w("self_attn.o_proj.weight").T
    m = rms(h, w("post_attention_layernorm.weight"))
    out = h + (F.silu(m @ w("mlp.gate_proj.weight").T) * (m @ w("mlp.up_proj.weight").T)) @ w("mlp.down_proj.weight").T
    return out, rms(out, t["norm.weight"]) @ t["lm_head.weight"].T


def test_the_loaded_head_computes_the_published_step(target, tmp_path):
    """The loaded head's next-token distribution at each of 7 positions fed with the target's features, and at 2
    more past them that read the head's own outputs (EAGLE's drafting in feature space), is the published step's:
    fc over the raw low/mid/high layers, attention over several rotated positions, the draft head, d2t. Fed a
    feature at a time (one entry a step, both the eager and the fixed-shape step) and all at once (one block)."""
    spec = write_head(tmp_path / "head")
    drafter = load_drafter(spec, parts(target), None, None)
    assert isinstance(drafter, FeatureDrafter) and drafter.feature_layers == (2, 4, 5)
    from safetensors.torch import load_file

    t = {k: v.float() for k, v in load_file(str(tmp_path / "head" / "model.safetensors")).items()}
    embedding = target.get_input_embeddings().weight.detach()
    n, tokens, guesses = 7, [random.Random(3).randrange(2, VOCAB) for _ in range(8)], [11, 29]
    features = torch.randn(n, 3, HIDDEN, generator=torch.Generator().manual_seed(1))  # layers 2, 4, 5 at 0..6
    draft_ids = torch.arange(DRAFT_VOCAB) + t["d2t"].long()

    def over_vocabulary(probs: torch.Tensor, ids) -> torch.Tensor:  # [draft vocab] -> [VOCAB]
        return torch.zeros(VOCAB).index_add_(0, torch.as_tensor(list(ids)), probs.float())

    g = features.flatten(1) @ t["fc.weight"].T  # [n, hidden]
    out, logits = published_eagle3_layer(t, embedding, g, tokens[1:])
    expected = [over_vocabulary(row.softmax(-1), draft_ids) for row in logits]  # entry p predicts token p + 2
    for _ in guesses:  # the next entry reads the last one's output and the guessed token
        g = torch.cat([g, out[-1:]])
        out, logits = published_eagle3_layer(t, embedding, g, [*tokens[1:], *guesses][: g.shape[0]])
    expected.append(over_vocabulary(logits[-1].softmax(-1), draft_ids))

    def assert_published(drafter: FeatureDrafter, context: list[int], want: torch.Tensor) -> None:
        with torch.no_grad():
            step = drafter._catch_up(drafter._requests["r"], context)
        assert list(step.token_ids) == draft_ids.tolist()
        error = (over_vocabulary(step.probs, step.token_ids) - want).abs().max()
        assert error < 1e-4, f"after {len(context)} tokens: max |p - published| = {error:.2e}"

    for static in (False, True):  # exact fp32 linears, to compare
        stepwise = FeatureDrafter(drafter.model, drafter.name, int8_weights=False, static_entries=static)
        stepwise.start("r", tokens[:2])
        for p in range(n):
            if p:
                stepwise.commit("r", [tokens[p + 1]])
            stepwise.add_features("r", Features(p, features[p : p + 1], (2, 4, 5)))
            assert_published(stepwise, tokens[: p + 2], expected[p])
        assert_published(stepwise, [*tokens, *guesses], expected[n])
    block = FeatureDrafter(drafter.model, drafter.name, int8_weights=False, static_entries=False)
    block.start("r", tokens)
    block.add_features("r", Features(0, features, (2, 4, 5)))
    assert_published(block, tokens, expected[n - 1])
    assert_published(block, [*tokens, *guesses], expected[n])


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_a_published_head_drafts_and_greedy_output_is_plain_decodings(target, tmp_path, fmt):
    drafter = load_drafter(write_head(tmp_path / "head", fmt=fmt, draft_ids=list(range(DRAFT_VOCAB))),
                           parts(target), None, None)
    assert_greedy_is_plain(target, drafter)
    assert not drafter._requests  # every session ended


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fixed_shape_step_cuda_replays_drafts_as_the_eager_step(target, tmp_path, dtype):
    """On CUDA a guess is one fixed-shape entry over the request's whole cache, captured as a graph
    (``static_entries``); run eagerly here, it proposes the trees of the variable-shape step (bf16, as
    drafted on CUDA, included), and greedy output stays plain decoding's."""
    head = load_drafter(write_head(tmp_path / "head", draft_ids=list(range(DRAFT_VOCAB))), parts(target),
                        None, None).model
    static, eager = (FeatureDrafter(head, "h", int8_weights=False, dtype=dtype, static_entries=flag)
                     for flag in (True, False))
    features = torch.randn(40, 3, HIDDEN)
    for drafter in (static, eager):
        drafter.start("r", list(range(5, 25)))
        drafter.add_features("r", Features(0, features[:19], (2, 4, 5)))
    position = 19
    for step in (1, 1, 1, 1, 2, 2, 3):  # new features a step: one (a fixed-shape entry) or several (eager)
        trees = [drafter.propose("r", 8, assumed=[9]) for drafter in (static, eager)]
        assert trees[0].tokens == trees[1].tokens and trees[0].parents == trees[1].parents
        assert trees[0].draft_probs == pytest.approx(trees[1].draft_probs, abs=1e-5)
        for drafter in (static, eager):
            drafter.commit("r", [7] * step)
            drafter.add_features("r", Features(position, features[position : position + step], (2, 4, 5)))
        position += step
    assert_greedy_is_plain(target, static)


def test_the_layers_a_specforge_config_names_are_read(target, tmp_path):
    spec = write_head(tmp_path / "head", config_extra={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3, 6],
                                                                        "use_aux_hidden_state": True}})
    assert load_drafter(spec, parts(target), None, None).feature_layers == (1, 4, 7)  # the output of layer i


def _tokenizer(words: list[str]):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=words[0])


@pytest.mark.parametrize("case,message", [
    ("hidden", "reads hidden states of size 32"),
    ("vocabulary", "a vocabulary of 100 tokens"),
    ("d2t outside", "d2t map does not name"),
    ("d2t repeated", "d2t map does not name"),
    ("t2d", "t2d and d2t maps disagree"),
    ("layers", "reads layers [1, 4, 12]"),
    ("tensor", "not an EAGLE-3 head in the published layout: no midlayer.hidden_norm.weight"),
    ("tokenizer", "tokenizer is not the target's"),
])
def test_a_head_made_for_another_target_is_refused(target, tmp_path, case, message):
    ours = _tokenizer([f"w{i}" for i in range(VOCAB)])
    directory = tmp_path / "head"
    spec = {
        "hidden": lambda: write_head(directory, fc_input=3 * 32),
        "vocabulary": lambda: write_head(directory, vocab=100),
        "d2t outside": lambda: write_head(directory, draft_ids=[*range(DRAFT_VOCAB - 1), VOCAB + 3],
                                          t2d_ids=list(range(DRAFT_VOCAB))),
        "d2t repeated": lambda: write_head(directory, draft_ids=[3, 3, *range(4, DRAFT_VOCAB + 2)]),
        "t2d": lambda: write_head(directory, t2d_ids=list(range(50, 50 + DRAFT_VOCAB))),
        "layers": lambda: write_head(directory, config_extra={"eagle_config": {"eagle_aux_hidden_state_layer_ids":
                                                                                [0, 3, 11]}}),
        "tensor": lambda: write_head(directory, drop="midlayer.hidden_norm.weight"),
        "tokenizer": lambda: write_head(directory),
    }[case]()
    if case == "tokenizer":  # the folder carries a tokenizer of as many tokens, but other ones
        _tokenizer([f"v{i}" for i in range(VOCAB)]).save_pretrained(directory)
    with pytest.raises(InvalidArgument, match="drafter") as refused:
        load_drafter(spec, parts(target, ours), None, None)
    assert message in str(refused.value)
    if case == "tokenizer":  # the target's own tokenizer in the folder is accepted
        ours.save_pretrained(directory)
        assert load_drafter(spec, parts(target, ours), None, None).feature_layers == (2, 4, 5)


@pytest.mark.parametrize("rule", ["exact", "lying"])
def test_sampling_with_a_published_head_keeps_the_targets_distribution(target, tmp_path, rule, monkeypatch):
    """Two sampled tokens (top-4, temperature 1) through the head against the target's exact two-token
    distribution; the same test given a wrong acceptance rule (the decoy) must see it. The head's final norm
    guesses one of two tokens, both likely after the likeliest first token."""
    runtime = LlamaRuntime(target)
    prompt, top_k = [2, 9, 4, 2, 9], 4
    if rule == "lying":
        monkeypatch.setattr("specmesh.runtime.tree_verifier.verify_mss", lying_rule)
    exact = two_token_distribution(runtime, prompt, top_k)
    # a feature head drafts from the prefill's features on: it guesses the second token, here one of the
    # two likeliest after the likeliest first token (draft ids 0 and 1)
    first = int(next_distribution(runtime, prompt, top_k)[0][0])
    guessed = sorted(next_distribution(runtime, prompt + [first], top_k)[0][:2].tolist())
    draft_ids = [*guessed, *[i for i in range(VOCAB) if i > guessed[1]]][:DRAFT_VOCAB]
    drafter = load_drafter(write_head(tmp_path / "head", draft_ids=draft_ids, two_guesses=True), parts(target),
                           None, None)
    engine = SpeculativeEngine(runtime, drafters=[drafter], max_tree_nodes=4)
    # three tokens, the first two counted: with one token left no tree would be drafted
    pvalue = sampled_pairs_pvalue(engine, prompt, exact, top_k, batches=24, max_tokens=3)
    judge(rule, pvalue, "speculative sampling with the head")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["eagle3", "eagle"])
def test_specmesh_generate_drafts_with_a_published_head_for_the_embedded_target(tmp_path, layout):
    """The command line end to end: a random head in a published layout for SmolLM2-135M (576 wide, 30
    layers, 9 heads over 3 KV heads): `specmesh generate --drafter eagle3:DIR --compare-plain` (and eagle:,
    which reads the target's final norm and LM head)."""
    import subprocess
    import sys

    if layout == "eagle3":
        spec = write_head(tmp_path / "smollm2-eagle3", hidden=576, heads=9, kv=3, inter=1536, vocab=49152,
                          draft_ids=sorted(random.Random(1).sample(range(49152), 2000)))
    else:
        spec = write_eagle_head(tmp_path / "smollm2-eagle", hidden=576, vocab=49152)
    result = subprocess.run([sys.executable, "-m", "specmesh", "generate", "Count from one to ten.", "--drafter", spec,
                             "--max-tokens", "24", "--compare-plain"], capture_output=True, text=True, timeout=600,
                            env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "outputs identical" in result.stdout, result.stdout


def test_a_head_trained_in_the_published_layout_round_trips_with_its_agreement(target, tmp_path):
    """`distill --kind feature --format eagle3`'s head and writer: trained without feature norms or a
    fallback class on the target's greedy answers, written as an EAGLE-3 checkpoint, loaded back as
    eagle3:DIR: the same guesses (teacher-forced agreement equal), accepted in a run, greedy == plain."""
    from specmesh.distill.data import Example, target_answers
    from specmesh.distill.feature_train import FeatureTrainConfig, build_feature_head, feature_hits, train_feature_head
    from specmesh.drafters.eagle import write_eagle3
    from specmesh.drafters.expert import round_to_stored

    layers = (2, 4, 5)
    rng = random.Random(3)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(2, 16))] for _ in range(72)]
    answers = target_answers(LlamaRuntime(target), prompts, MAX_TOKENS, feature_layers=layers)
    examples = [Example("", "tiny", tuple(p), tuple(a.tokens)) for p, a in zip(prompts, answers)]
    subset = torch.randperm(VOCAB - 2, generator=torch.Generator().manual_seed(0))[: VOCAB - 12] + 2  # unordered,
    head = build_feature_head(target, layers, subset, eagle3=True)  # as distill's by frequency; 10 ids outside it
    held, held_features = examples[64:], [a.features for a in answers[64:]]
    rate = lambda hits: sum(map(sum, hits)) / sum(map(len, hits))  # noqa: E731
    untrained = rate(feature_hits(head, held, held_features)[0])
    train_feature_head(head, examples[:64], [a.features for a in answers[:64]],
                       FeatureTrainConfig(epochs=40, unroll=2, learning_rate=3e-3, tokens_per_batch=4096))
    round_to_stored(head)  # fp16, as written
    write_eagle3(head, tmp_path / "trained", VOCAB, 512, card={"measured": "here"})
    drafter = load_drafter(f"eagle3:{tmp_path / 'trained'}", parts(target), None, None)
    ours = feature_hits(head, held, held_features)[0]
    assert feature_hits(drafter.model, held, held_features)[0] == ours
    assert rate(ours) > untrained, "the head should have learned"
    engine = SpeculativeEngine(LlamaRuntime(target), drafters=[drafter], max_tree_nodes=6)
    outputs = engine.generate([Request(tuple(p), SamplingParams(max_tokens=MAX_TOKENS)) for p in prompts[64:]])
    for prompt, out in zip(prompts[64:], outputs):
        assert out.token_ids == hf_greedy(target, prompt, MAX_TOKENS)
    assert sum(o.stats.accepted_tokens for o in outputs) > 0


def test_the_head_cost_bench_times_a_head_of_the_targets_shape(tmp_path):
    """`python -m specmesh.bench.head_cost` (the GPU must-show's measurement) on a random SmolLM2-shaped
    target: a head of its shape in the published layout, read back through `eagle3:`, its proposals
    timed, and greedy output checked against plain decoding."""
    from specmesh.bench.head_cost import main

    assert main(["--model", "random:smollm2-135m", "--device", "cpu", "--repeats", "8", "--draft-vocab", "4000",
                 "--json", str(tmp_path / "cost.json")]) == 0
    report = json.loads((tmp_path / "cost.json").read_text())
    assert report["feature_layers"] == [2, 15, 27] and report["draft_vocab"] == 4000
    assert report["greedy_equal"] == [True, True, True] and report["target_step_ms"] > 0
    assert [row["budget"] for row in report["proposals"]] == [1, 8, 16, 64, 256]
    assert all(row["nodes"] > 16 for row in report["proposals"] if row["budget"] > 16)  # best-first trees
    assert all(row["nodes"] >= 1 and 0 < row["vs_step"] for row in report["proposals"])
    assert report["provenance"]["command"].startswith("python -m specmesh.bench.head_cost")


# -- EAGLE-1/2 heads (``eagle:DIR``) --------------------------------------------------------------------

def write_eagle_head(directory: Path, *, hidden: int = HIDDEN, fc_input: int | None = None, vocab: int = VOCAB,
                     bias: bool = True, prefix: str = "", fmt: str = "safetensors", drop: str = "",
                     layers: int = 1, seed: int = 0) -> str:
    """An EAGLE-1/2 checkpoint folder as SafeAILab publishes it: a LlamaConfig of one layer, fp16 tensors
    (``fc`` over [embedding, feature], layer 0 without an input norm, the target's embeddings beside)."""
    heads, kv, inter = 4, 2, 2 * hidden
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: (torch.randn(*shape, generator=gen) * 0.2).half()  # noqa: E731
    tensors = {"fc.weight": rand(hidden, fc_input or 2 * hidden), "embed_tokens.weight": rand(vocab, hidden)}
    if bias:
        tensors["fc.bias"] = rand(hidden)
    for layer in range(layers):
        p = f"layers.{layer}."
        tensors |= {p + "self_attn.q_proj.weight": rand(hidden, hidden),
                    p + "self_attn.o_proj.weight": rand(hidden, hidden),
                    p + "self_attn.k_proj.weight": rand(hidden // 2, hidden),
                    p + "self_attn.v_proj.weight": rand(hidden // 2, hidden),
                    p + "post_attention_layernorm.weight": (1 + rand(hidden).float() * 0.1).half(),
                    p + "mlp.gate_proj.weight": rand(inter, hidden), p + "mlp.up_proj.weight": rand(inter, hidden),
                    p + "mlp.down_proj.weight": rand(hidden, inter)}
    tensors = {prefix + name: t for name, t in tensors.items() if name != drop}
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
              "num_hidden_layers": layers, "hidden_act": "silu", "vocab_size": vocab, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 2048, "torch_dtype": "float16", "bias": bias}
    save_checkpoint(directory, config, tensors, fmt)
    return f"eagle:{directory}"


def test_an_eagle_head_computes_the_published_step(target, tmp_path):
    """SafeAILab's EAGLE-1/2 step from the published equations and the checkpoint's tensors: the target's
    final norm over its last layer; fc over [embedding, feature] (with its bias) is the layer's input and
    residual, no input norm; the output goes to the target's own LM head unnormed."""
    spec = write_eagle_head(tmp_path / "head")
    norm = 1 + 0.3 * torch.randn(HIDDEN)  # a final norm that is not all ones, so that it counts
    lm_head = target.get_output_embeddings().weight.detach()
    drafter = load_drafter(spec, dataclasses.replace(parts(target), output_head=lambda: (norm, lm_head)), None, None)
    assert isinstance(drafter, FeatureDrafter) and drafter.feature_layers == (LAYERS,)
    from safetensors.torch import load_file

    t = {k: v.float() for k, v in load_file(str(tmp_path / "head" / "model.safetensors")).items()}
    w = lambda name: t["layers.0." + name]  # noqa: E731
    features = torch.randn(1, 1, HIDDEN)  # the target's last layer at position 0, before its final norm
    tokens = [5, 17]
    g = F.rms_norm(features[:, 0], (HIDDEN,), norm, target.config.rms_norm_eps)
    embedding = target.get_input_embeddings().weight.detach()  # the target's, not the checkpoint's copy
    x = torch.cat([embedding[[17]], g], -1) @ t["fc.weight"].T + t["fc.bias"]
    v = (x @ w("self_attn.v_proj.weight").T).view(1, 2, 16).repeat_interleave(2, 1)  # one key: attention = v
    h = x + v.flatten(1) @ w("self_attn.o_proj.weight").T
    m = F.rms_norm(h, (HIDDEN,), w("post_attention_layernorm.weight"), 1e-5)
    out = h + (F.silu(m @ w("mlp.gate_proj.weight").T) * (m @ w("mlp.up_proj.weight").T)) @ w("mlp.down_proj.weight").T
    expected = (out @ lm_head.T).softmax(-1)[0]
    drafter = FeatureDrafter(drafter.model, drafter.name, int8_weights=False)  # exact fp32 linears, to compare
    drafter.start("r", tokens)
    drafter.add_features("r", Features(0, features, (LAYERS,)))
    with torch.no_grad():
        step = drafter._catch_up(drafter._requests["r"], tokens)
    assert torch.allclose(step.probs, expected, atol=1e-5)
    assert list(step.token_ids) == list(range(VOCAB))


@pytest.mark.parametrize("fmt,prefix,bias", [("safetensors", "", True), ("bin", "model.", False)])
def test_an_eagle_head_drafts_and_greedy_output_is_plain_decodings(target, tmp_path, fmt, prefix, bias):
    drafter = load_drafter(write_eagle_head(tmp_path / "head", fmt=fmt, prefix=prefix, bias=bias), parts(target),
                           None, None)
    assert_greedy_is_plain(target, drafter)
    assert_greedy_is_plain(target, FeatureDrafter(drafter.model, drafter.name, int8_weights=False,
                                                  static_entries=True))  # the fixed-shape step, as on CUDA


@pytest.mark.parametrize("case,message", [
    ("hidden", "reads hidden states of size 48"),
    ("vocabulary", "a vocabulary of 100 tokens"),
    ("tensor", "not an EAGLE head in the published layout: no layers.0.mlp.down_proj.weight"),
    ("two layers", "more than one decoder layer"),
    ("no head", "drafts through the target's LM head"),
])
def test_an_eagle_head_made_for_another_target_is_refused(target, tmp_path, case, message):
    directory = tmp_path / "head"
    spec = {
        "hidden": lambda: write_eagle_head(directory, fc_input=2 * 48),
        "vocabulary": lambda: write_eagle_head(directory, vocab=100),
        "tensor": lambda: write_eagle_head(directory, drop="layers.0.mlp.down_proj.weight"),
        "two layers": lambda: write_eagle_head(directory, layers=2),
        "no head": lambda: write_eagle_head(directory),
    }[case]()
    with pytest.raises(InvalidArgument, match="drafter") as refused:
        load_drafter(spec, parts(target, output_head=case != "no head"), None, None)
    assert message in str(refused.value)


def test_the_training_layer_scales_fold_into_fc_exactly(target):
    """`--format eagle3` trains with each target layer divided by its RMS and folds the scales into fc
    before writing: the folded head computes the same feature from raw hidden states."""
    from specmesh.distill.feature_train import build_feature_head, layer_rms

    features = [torch.randn(7, 3, HIDDEN) * torch.tensor([0.5, 20.0, 300.0]).view(1, 3, 1) for _ in range(4)]
    scales = layer_rms(features)
    assert torch.allclose(scales, torch.tensor([0.5, 20.0, 300.0]), rtol=0.1)
    head = build_feature_head(target, (2, 4, 5), torch.arange(DRAFT_VOCAB), eagle3=True)
    torch.nn.init.normal_(head.fuse.weight)
    head.feature_scales.copy_(scales)
    trained = head.fused(features[0])
    head.fold_feature_scales()
    assert torch.equal(head.feature_scales, torch.ones(3))
    assert torch.allclose(head.fused(features[0]), trained, rtol=1e-4, atol=1e-4)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def test_a_head_with_rope_scaling_rotates_as_its_target_does(target, tmp_path):
    """Llama-3.1's heads carry its RoPE scaling (llama3): the head's rotations are the ones transformers
    computes for that config, at short and long positions alike, and it drafts losslessly; a scaling that
    changes with the length is refused."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from specmesh.drafters.feature import rope_tables

    spec = write_head(tmp_path / "head", draft_ids=list(range(DRAFT_VOCAB)),
                      config_extra={"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0})
    drafter = load_drafter(spec, parts(target), None, None)
    assert drafter.config.rope_scaling == LLAMA3_ROPE and drafter.config.rope_theta == 500000.0
    head_dim = HIDDEN // 4
    reference = LlamaRotaryEmbedding(LlamaConfig(hidden_size=HIDDEN, num_attention_heads=4, rope_theta=500000.0,
                                                 rope_scaling=LLAMA3_ROPE, max_position_embeddings=512))
    positions = torch.tensor([0, 3, 40, 300, 511])
    cos, sin = reference(torch.zeros(1, 1, head_dim), positions.unsqueeze(0))
    ours = rope_tables(positions, head_dim, 500000.0, LLAMA3_ROPE)
    assert torch.allclose(ours[0], cos[0], atol=1e-6) and torch.allclose(ours[1], sin[0], atol=1e-6)
    assert not torch.allclose(ours[0], rope_tables(positions, head_dim, 500000.0)[0], atol=1e-3)  # it matters
    assert_greedy_is_plain(target, drafter)
    dynamic = write_head(tmp_path / "dynamic", config_extra={"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(InvalidArgument, match="RoPE scaling 'dynamic' is not supported"):
        load_drafter(dynamic, parts(target), None, None)
