"""The generic runtime (any Hugging Face causal LM, custom 4D tree mask) is lossless too."""

import random

import pytest
import torch
from conftest import tiny_llama
from drafting import OracleTreeDrafter

from specmesh.runtime.hf import HFRuntime
from specmesh.runtime.llama import LlamaRuntime, TreeBatch
from specmesh.runtime.target import make_runtime
from specmesh.sampling import SamplingParams
from specmesh.speculation.engine import Request, SpeculativeEngine
from specmesh.tree import TokenTree, compile_tree

VOCAB, MAX_TOKENS = 80, 20


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1)
    config = GPT2Config(vocab_size=VOCAB, n_positions=256, n_embd=64, n_layer=2, n_head=4, eos_token_id=1, bos_token_id=0)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        model.transformer.wte.weight.mul_(20.0)  # tied head: sharper logits, fewer near-ties
    return model


def tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(2)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def greedy(model, prompt, max_tokens):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("factory", [tiny_gpt2, tiny_qwen3, lambda: tiny_llama(vocab_size=VOCAB)])
def test_random_trees_are_lossless_through_hugging_face_forward(factory):
    model = factory()
    runtime = HFRuntime(model)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 20))] for _ in range(3)]
    answers = {tuple(p): greedy(model, p, MAX_TOKENS) for p in prompts}
    engine = SpeculativeEngine(runtime, [OracleTreeDrafter(answers, VOCAB, seed=3)], max_tree_nodes=8)
    outputs = engine.generate([Request(tuple(p), SamplingParams(max_tokens=MAX_TOKENS)) for p in prompts])
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == answers[tuple(prompt)]
    assert sum(len(o.token_ids) for o in outputs) > sum(o.stats.target_steps for o in outputs)


def test_both_runtimes_score_a_tree_alike():
    model = tiny_llama(vocab_size=VOCAB, seed=4)
    lean, generic = LlamaRuntime(model), HFRuntime(model)
    tree = compile_tree(5, TokenTree((6, 7, 8, 9), (-1, 0, -1, 2), (1.0,) * 4))
    prefix = compile_tree(3, TokenTree.chain([4, 10, 11]))
    logits = []
    for runtime in (lean, generic):
        session = runtime.new_session()
        runtime.forward(TreeBatch.build([session], [prefix]))
        session.keep_rows(list(range(prefix.num_rows)))
        logits.append(runtime.forward(TreeBatch.build([session], [tree])))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)


def test_runtime_choice():
    assert isinstance(make_runtime(tiny_llama(vocab_size=VOCAB)), LlamaRuntime)
    assert isinstance(make_runtime(tiny_gpt2()), HFRuntime)
    assert isinstance(make_runtime(tiny_llama(vocab_size=VOCAB), lean=False), HFRuntime)


def test_models_the_lean_path_would_compute_differently_fall_back():
    assert isinstance(make_runtime(tiny_llama(vocab_size=VOCAB, attention_bias=True)), HFRuntime)
    assert isinstance(make_runtime(tiny_llama(vocab_size=VOCAB, mlp_bias=True)), HFRuntime)
    assert isinstance(make_runtime(tiny_llama(vocab_size=VOCAB, hidden_act="gelu")), HFRuntime)
