"""The feature drafter: its training unroll and its drafting runtime compute the same thing, and it
refuses features that do not fit."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
import torch
from cluster_parts import ServiceStack
from conftest import hf_greedy, tiny_llama

from specmesh.client import AsyncClient
from specmesh.cluster.remote_drafter import RemoteDrafter
from specmesh.cluster.wire import features_from_pb, features_to_pb
from specmesh.distill.data import Example, target_answers
from specmesh.distill.feature_train import FeatureTrainConfig, build_feature_head, train_feature_head
from specmesh.drafters.feature import FeatureConfig, FeatureDrafter, FeatureHead, FeatureMismatch
from specmesh.drafters.ngram import NgramDrafter
from specmesh.errors import InvalidArgument
from specmesh.runtime.features import Features
from specmesh.runtime.llama import LlamaRuntime, TreeBatch
from specmesh.runtime.tree_verifier import TreeVerifier, VerifyJob
from specmesh.sampling import SamplingParams
from specmesh.speculation.engine import Request, SpeculativeEngine
from specmesh.tree import TokenTree, compile_tree
from specmesh.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

CONFIG = FeatureConfig(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                       feature_layers=(1, 3), rope_theta=10000.0, rms_norm_eps=1e-5, subset_size=20)


def make_head(seed: int = 0) -> FeatureHead:
    torch.manual_seed(seed)
    embedding = torch.randn(50, 32)
    model = FeatureHead(CONFIG, embedding, torch.arange(20))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def test_drafting_computes_the_unroll_it_was_trained_with():
    model = make_head()
    drafter = FeatureDrafter(model, "feature", int8_weights=False)
    tokens = torch.randint(0, 50, (14,)).tolist()
    features = torch.randn(13, 2, 32)  # positions 0..12 (the last token has none)
    with torch.no_grad():
        steps = model.unrolled(features.unsqueeze(0), torch.tensor([tokens[1:]]), 3)
    for known in (5, 9):  # the target's features up to position known - 1
        for j in range(3):  # drafting j positions past the last feature
            context = tokens[: known + 1 + j]
            drafter.start("r", tokens[: known + 1])
            drafter.add_features("r", Features(0, features[:known], (1, 3)))
            drafter.commit("r", context[known + 1 :])
            step = drafter._catch_up(drafter._requests["r"], context)
            expected = model.logits(steps[j][0, known - 1 + j]).softmax(-1)
            assert torch.allclose(step.probs, expected, atol=1e-5), (known, j)
            drafter.end("r")


def test_a_drafter_in_another_precision_leaves_the_head_it_was_given_as_it_was():
    """Two drafters over one head, bf16 and fp32: the bf16 one computes in a copy; the head, and the fp32
    drafter over it, stay fp32 with the weights they had."""
    model = make_head()
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    low = FeatureDrafter(model, "low", int8_weights=False, dtype=torch.bfloat16)
    full = FeatureDrafter(model, "full", int8_weights=False)
    assert low.model.head.weight.dtype == torch.bfloat16 and full.model is model
    assert all(torch.equal(tensor, weights[name]) for name, tensor in model.state_dict().items())


def test_the_one_call_layer_drafts_what_the_step_by_step_layer_does():
    from specmesh.kernels.cpu_ops import load_cpu_ops
    from specmesh.runtime.loading import cache_root

    load_cpu_ops(cache_root() / "extensions")  # the project installs g++ (.ci/run): it builds there
    config = FeatureConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                           feature_layers=(1, 3), rope_theta=10000.0, rms_norm_eps=1e-5, subset_size=20)
    torch.manual_seed(2)
    model = FeatureHead(config, torch.randn(50, 64), torch.arange(20))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    tokens = torch.randint(0, 50, (16,)).tolist()
    features = torch.randn(15, 2, 64)
    fused, stepwise = (FeatureDrafter(model.eval(), name, int8_weights=True) for name in ("fused", "stepwise"))
    assert fused._one_call  # Q8_0 blocks: the C++ layer
    stepwise._one_call = False
    for drafter in (fused, stepwise):
        drafter.start("r", tokens[:9])
        drafter.add_features("r", Features(0, features[:6], (1, 3)))  # two committed tokens past the features
    with torch.no_grad():
        steps = [d._catch_up(d._requests["r"], tokens[:12]) for d in (fused, stepwise)]  # and one assumed
        guesses = [d._advance(d._requests["r"])(tokens[12]) for d in (fused, stepwise)]
    for a, b in (steps, guesses):
        assert torch.allclose(a.probs, b.probs, atol=1e-5)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "fixed-shape"])
def test_a_best_first_tree_reads_each_node_as_drafting_its_path_guess_by_guess(static):
    model = make_head(3)
    tokens = torch.randint(0, 50, (12,)).tolist()
    features = torch.randn(11, 2, 32)
    drafter = FeatureDrafter(model, "f", max_depth=2, branch_width=2, int8_weights=False, static_entries=static)
    drafter.start("r", tokens[:10])
    drafter.add_features("r", Features(0, features[:8], (1, 3)))  # a committed token past the features
    wide = drafter.propose("r", 40, assumed=tokens[10:])  # past 2 x 2: best first, below two assumed tokens
    assert len(wide) == 40 and max(wide.depths()) > 2 and max(len(c) for c in wide.children()) > 2
    assert wide == drafter.propose("r", 40, assumed=tokens[10:])  # the tree's entries were scratch
    state = drafter._requests["r"]
    with torch.no_grad():
        for node in range(len(wide)):
            step = drafter._catch_up(state, tokens)
            for ancestor in wide.path_to(node)[:-1]:
                step = drafter._advance(state)(wide.tokens[ancestor])
            assert float(step.probs[wide.tokens[node]]) == pytest.approx(wide.draft_probs[node], abs=1e-5), node
    chain = FeatureDrafter(model, "c", max_depth=2, branch_width=2, int8_weights=False, static_entries=static)
    chain.start("r", tokens[:10])
    chain.add_features("r", Features(0, features[:8], (1, 3)))
    assert drafter.propose("r", 4, assumed=tokens[10:]) == chain.propose("r", 4, assumed=tokens[10:])


def test_features_arriving_in_blocks_give_the_same_drafts():
    model = make_head(1)
    tokens = torch.randint(0, 50, (20,)).tolist()
    features = torch.randn(19, 2, 32)
    whole, pieces = FeatureDrafter(model, "a", int8_weights=False), FeatureDrafter(model, "b", int8_weights=False)
    whole.start("r", tokens)
    whole.add_features("r", Features(4, features[4:19], (1, 3)))  # a long prompt's first positions are not sent
    pieces.start("r", tokens[:8])
    pieces.add_features("r", Features(4, features[4:7], (1, 3)))
    pieces.propose("r", 4, assumed=tokens[8:11])  # draft-ahead scratch, rewritten later
    pieces.commit("r", tokens[8:])
    pieces.add_features("r", Features(7, features[7:19], (1, 3)))
    assert whole.propose("r", 6) == pieces.propose("r", 6)


def test_features_that_do_not_fit_are_refused():
    drafter = FeatureDrafter(make_head(), "feature", int8_weights=False)
    drafter.start("r", [1, 2, 3, 4])
    with pytest.raises(FeatureMismatch, match=r"expected \[n, 2, 32\]"):
        drafter.add_features("r", Features(0, torch.randn(3, 2, 16), (1, 3)))
    with pytest.raises(FeatureMismatch, match="NaN"):
        drafter.add_features("r", Features(0, torch.full((3, 2, 32), float("nan")), (1, 3)))
    with pytest.raises(FeatureMismatch, match="past the committed"):
        drafter.add_features("r", Features(0, torch.randn(4, 2, 32), (1, 3)))
    with pytest.raises(FeatureMismatch, match=r"layers \[1, 2\]"):
        drafter.add_features("r", Features(0, torch.randn(3, 2, 32), (1, 2)))
    drafter.add_features("r", Features(0, torch.randn(2, 2, 32), (1, 3)))
    with pytest.raises(FeatureMismatch, match="start at position 3"):
        drafter.add_features("r", Features(3, torch.randn(1, 2, 32), (1, 3)))
    assert len(drafter.propose("r", 4)) > 0


# ---- with a target: a tiny one, its head trained on its own answers ----

FEATURE_LAYERS = (1, 2)
MAX_TOKENS = 24


def ragged_prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(2, 20))] for _ in range(count)]


@pytest.fixture(scope="module")
def trained(tiny_model):
    """A feature head over the tiny target, trained on the target's greedy answers to 64 prompts."""
    runtime = LlamaRuntime(tiny_model)
    prompts = ragged_prompts(64, 96, seed=3)
    answers = target_answers(runtime, prompts, MAX_TOKENS, feature_layers=FEATURE_LAYERS)
    examples = [Example("", "tiny", tuple(p), tuple(a.tokens)) for p, a in zip(prompts, answers)]
    head = build_feature_head(tiny_model, FEATURE_LAYERS, torch.arange(2, 96))
    train_feature_head(head, examples, [a.features for a in answers],
                       FeatureTrainConfig(epochs=60, unroll=2, learning_rate=3e-3, tokens_per_batch=4096))
    return head


def test_the_verifier_returns_the_hidden_states_of_what_it_committed(tiny_model):
    runtime = LlamaRuntime(tiny_model)
    verifier = TreeVerifier(runtime)
    prompt = [5, 9, 11, 3, 7, 22, 41]
    answer = hf_greedy(tiny_model, prompt, 8)
    context = list(prompt)
    tree = TokenTree.chain(answer[:3])  # right three times: the root, three accepted nodes, then the bonus
    job = VerifyJob("r", 0, len(context) - 1, context[-1], tree, SamplingParams(), tuple(context[:-1]),
                    feature_layers=(2,), max_prompt_features=4)
    [result] = verifier.verify([job])
    assert list(result.verdict.tokens) == answer[:4]
    context += answer[:4]
    # the whole sequence scored at once: the hidden states each position had
    session = runtime.new_session()
    full = runtime.score(TreeBatch.build([session], [compile_tree(context[0], TokenTree.chain(context[1:]))]),
                         feature_layers=(2,)).features
    features = result.features
    assert features.layers == (2,) and features.values.dtype == torch.float16
    assert features.start == len(prompt) - 1 - 4  # the prompt's last 4 prefilled positions, then the step's
    assert features.end == len(context) - 1  # every committed position but the newest
    assert torch.allclose(features.values.float(), full[features.start : features.end].float(), atol=2e-2, rtol=1e-2)
    assert verifier.verify([VerifyJob("r", 1, len(context) - 1, context[-1], TokenTree(), SamplingParams())])[0].features is None


def test_the_head_learns_and_the_engine_stays_lossless(tiny_model, trained):
    prompts = ragged_prompts(6, 96, seed=21)  # not trained on
    drafter = FeatureDrafter(trained, "feature", int8_weights=False)
    engine = SpeculativeEngine(LlamaRuntime(tiny_model), drafters=[drafter, NgramDrafter()], max_tree_nodes=6)
    outputs = engine.generate([Request(tuple(p), SamplingParams(max_tokens=MAX_TOKENS)) for p in prompts])
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(tiny_model, prompt, MAX_TOKENS)
    steps = sum(o.stats.target_steps for o in outputs)
    committed = sum(len(o.token_ids) for o in outputs)
    assert committed / steps > 1.5, "the trained head's guesses should be accepted"
    assert all(not drafter._requests for drafter in [drafter])  # every session ended
    engine = SpeculativeEngine(LlamaRuntime(tiny_model), drafters=[drafter], max_tree_nodes=64)  # best first
    wide = engine.generate([Request(tuple(p), SamplingParams(max_tokens=MAX_TOKENS)) for p in prompts])
    assert [o.token_ids for o in wide] == [o.token_ids for o in outputs]
    assert sum(len(o.token_ids) for o in wide) / sum(o.stats.target_steps for o in wide) > committed / steps


def test_wire_round_trip_and_malformed_blocks():
    block = Features(7, torch.randn(3, 2, 16).half(), (4, 9))
    back = features_from_pb(features_to_pb(block))
    assert (back.start, back.layers) == (7, (4, 9)) and torch.equal(back.values, block.values)
    bf16 = features_from_pb(features_to_pb(Features(0, torch.randn(2, 1, 8).bfloat16(), (3,))))
    assert bf16.values.dtype == torch.bfloat16
    good = features_to_pb(block)
    for change, words in [({"dtype": "int8"}, "dtype"), ({"data": good.data[:-2]}, "bytes"),
                          ({"hidden_size": 0}, "hidden_size"), ({"start": -1}, "start"), ({"positions": 4}, "bytes")]:
        message = common_pb2.Features()
        message.CopyFrom(good)
        for key, value in change.items():
            setattr(message, key, value)
        with pytest.raises(InvalidArgument, match=words):
            features_from_pb(message)


# ---- through the services: real gRPC, a real Redis queue ----


class RecordingFeatureDrafter(FeatureDrafter):
    """Counts the feature positions it hears."""

    heard = 0

    def add_features(self, request_id, block):
        super().add_features(request_id, block)
        RecordingFeatureDrafter.heard += len(block)


@pytest.fixture(scope="module")
def services_model():
    from transformers import AutoTokenizer

    from specmesh.runtime.loading import EMBEDDED_DEFAULT, resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(EMBEDDED_DEFAULT)[0])
    return tiny_llama(vocab_size=len(tokenizer), layers=2, seed=5), tokenizer


def test_features_reach_a_remote_feature_drafter_and_bad_ones_are_refused(redis_server, services_model):
    model, tokenizer = services_model
    head = build_feature_head(model, FEATURE_LAYERS, torch.arange(2, 4000))
    drafter = RecordingFeatureDrafter(head, "feature", int8_weights=False)
    prompt = [5, 6, 7, 5, 6, 7, 8, 9]

    async def main():
        async with ServiceStack(redis_server.url, model, tokenizer, drafter) as stack:
            async with AsyncClient(stack.address) as client:
                answer = await client.generate(prompt_ids=prompt, max_tokens=12)
            proposed = stack.remote.failures
            async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.drafter_server.port}") as channel:
                stub = drafter_pb2_grpc.DrafterStub(channel)
                await stub.OpenSession(drafter_pb2.OpenSessionRequest(request_id="r", prompt_ids=prompt), timeout=10)
                good = features_to_pb(Features(0, torch.randn(7, 2, 64).half(), FEATURE_LAYERS))
                codes = []
                for bad in (features_to_pb(Features(0, torch.randn(7, 2, 32).half(), FEATURE_LAYERS)),  # other size
                            features_to_pb(Features(0, torch.randn(7, 1, 64).half(), (2,))),  # other layers
                            common_pb2.Features(start=0, positions=7, layers=FEATURE_LAYERS, hidden_size=64,
                                                dtype="float16", data=b"\x00" * 10)):  # truncated
                    try:
                        await stub.Propose(drafter_pb2.ProposeRequest(request_id="r", budget=4, features=bad), timeout=10)
                        codes.append(grpc.StatusCode.OK)
                    except grpc.aio.AioRpcError as exc:
                        codes.append((exc.code(), exc.details()))
                tree = (await stub.Propose(drafter_pb2.ProposeRequest(request_id="r", budget=4, features=good),
                                           timeout=10)).tree
            wrong = RemoteDrafter(f"127.0.0.1:{stack.drafter_server.port}")
            with pytest.raises(InvalidArgument, match="hidden states of size 64; the target's are 128"):
                await wrong.connect(None, hidden_size=128)
            await wrong.close()
            return answer, proposed, codes, len(tree.tokens)

    answer, failures, codes, drafted = asyncio.run(main())
    engine = SpeculativeEngine(LlamaRuntime(model), [], max_tree_nodes=0)
    assert answer.token_ids == engine.generate([Request(tuple(prompt), SamplingParams(max_tokens=12))])[0].token_ids
    assert RecordingFeatureDrafter.heard >= len(prompt) - 1 + 12 - 2  # the prompt's and every step's
    assert failures == 0
    assert [c[0] for c in codes] == [grpc.StatusCode.INVALID_ARGUMENT] * 3
    assert "expected [n, 2, 64]" in codes[0][1] and "layers [2]" in codes[1][1] and "bytes" in codes[2][1]
    assert drafted > 0  # the session goes on after refused blocks


class Vocabulary:
    """A stand-in tokenizer: only its vocabulary matters to the fingerprint."""

    def __init__(self, size: int, salt: str = "") -> None:
        self.size, self.salt = size, salt

    def get_vocab(self) -> dict[str, int]:
        return {f"{self.salt}t{i}": i for i in range(self.size)}


def test_a_feature_drafter_made_for_another_target_is_refused_at_load(tiny_model, tmp_path):
    from specmesh.drafters.catalog import load_drafter
    from specmesh.drafters.expert import save_drafter
    from specmesh.drafters.feature import FeatureSpec
    from specmesh.runtime.loading import TargetParts, tokenizer_fingerprint

    head = build_feature_head(tiny_model, FEATURE_LAYERS, torch.arange(2, 96))
    vocabulary = Vocabulary(96)
    spec = FeatureSpec(name="feature", target={"name": "tiny", "tokenizer_hash": tokenizer_fingerprint(vocabulary),
                                               "vocab_size": 96, "hidden_size": 64, "precision": "float32"},
                       architecture={**head.config.__dict__, "feature_layers": list(FEATURE_LAYERS)})
    save_drafter(head, spec, tmp_path / "feature")
    embeddings = tiny_model.model.embed_tokens.weight.detach()

    def target(tokenizer, hidden=64, layers=2):
        return TargetParts("tiny", tokenizer, 96, 512, (1,), lambda: embeddings, hidden, layers)

    drafter = load_drafter(str(tmp_path / "feature"), target(vocabulary), "cpu", None)
    assert drafter.kind == "feature" and drafter.feature_layers == FEATURE_LAYERS
    for other, words in [(target(Vocabulary(96, "x")), "another vocabulary"), (target(vocabulary, hidden=128),
                         "hidden states of size 64; this target's are 128"), (target(vocabulary, layers=1), "layer 2")]:
        with pytest.raises(InvalidArgument, match=words):
            load_drafter(str(tmp_path / "feature"), other, "cpu", None)


def test_a_verifier_that_cannot_give_the_hidden_states_verifies_without_them(tiny_model, caplog):
    from specmesh.runtime.hf import HFRuntime

    prompt = [5, 9, 11, 3]
    for runtime, layers in [(HFRuntime(tiny_model), (1,)), (LlamaRuntime(tiny_model), (7,))]:
        verifier = TreeVerifier(runtime)
        job = VerifyJob("r", 0, len(prompt) - 1, prompt[-1], TokenTree.chain([4]), SamplingParams(), tuple(prompt[:-1]),
                        feature_layers=layers)
        [result] = verifier.verify([job])
        assert result.verdict is not None and result.features is None
    assert "returns no hidden states" in caplog.text and "1..2" in caplog.text


class CharTokenizer:
    """Text to ids by character (the tiny target has no real tokenizer)."""

    def __call__(self, text: str) -> dict:
        return {"input_ids": [2 + ord(c) % 90 for c in text]}


def test_the_feature_store_grows_resumes_and_refuses_other_targets(tiny_model, tmp_path):
    from specmesh.distill.feature_data import FeatureStore, FeatureStoreCard
    from specmesh.prompts import Prompt

    card = FeatureStoreCard("tiny", "hash", "float32", FEATURE_LAYERS, 64)
    runtime = LlamaRuntime(tiny_model)
    prompts = [Prompt(f"prompt number {i}", "test") for i in range(7)]
    store = FeatureStore(tmp_path / "store", card)
    first = store.record(runtime, CharTokenizer(), prompts[:5], max_tokens=6, eos_token_ids=(), batch_size=4)
    again = FeatureStore(tmp_path / "store", card)
    both = again.record(runtime, CharTokenizer(), prompts, max_tokens=6, eos_token_ids=(), batch_size=4)
    assert both[:5] == first and len(again.examples()) == 7  # only the two new prompts were answered
    assert len(list((tmp_path / "store").glob("*.safetensors"))) == 3
    for example, features in zip(both, again.features(both)):
        assert features.shape == (len(example.token_ids) - 1, 2, 64) and features.dtype == torch.float16
        assert list(example.response_ids) == hf_greedy(tiny_model, list(example.prompt_ids), 6)
    with pytest.raises(InvalidArgument, match="holds features of"):
        FeatureStore(tmp_path / "store", FeatureStoreCard("tiny", "hash", "float32", (2,), 64))


def test_the_routers_adapter_keeps_blocks_in_order_and_bounded():
    async def main():
        drafter = RemoteDrafter("127.0.0.1:9")  # never called: blocks wait for the next proposal
        drafter.feature_layers = (1,)
        drafter._context["r"], drafter._open = [1, 2, 3], {"r"}
        block = lambda start, n: Features(start, torch.zeros(n, 1, 8), (1,))  # noqa: E731
        await drafter.add_features("r", block(0, 300))
        await drafter.add_features("r", block(300, 4))
        kept = [(b.start, len(b)) for b in drafter._features["r"]]
        still_open = "r" in drafter._open and "r" not in drafter._stale
        await drafter.add_features("r", block(310, 4))  # 304..309 lost: the drafter must start afresh
        after_gap = [(b.start, len(b)) for b in drafter._features["r"]], "r" in drafter._stale
        drafter._stale.discard("r")
        await drafter.add_features("r", block(314, 300))
        await drafter.add_features("r", block(614, 300))  # over 512 unsent positions: the oldest go
        bounded = [(b.start, len(b)) for b in drafter._features["r"]], "r" in drafter._stale
        await drafter.close()
        return kept, still_open, after_gap, bounded

    kept, still_open, after_gap, bounded = asyncio.run(main())
    assert kept == [(0, 300), (300, 4)] and still_open
    assert after_gap == ([(310, 4)], True)  # opened afresh before its next proposal
    assert bounded == ([(614, 300)], True)
