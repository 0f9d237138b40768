"""Expert drafters on a tiny target: training, saving, loading, confidence-shaped trees, losslessness."""

import copy
import json
import platform
import random

import pytest
import torch
from conftest import need, not_here, tiny_llama

from specmesh.distill.data import Example, SoftLabels, generate_examples, recorded_soft_labels, target_answers
from specmesh.distill.evaluate import agreement_by_category, expected_tokens_per_step, teacher_forced_hits, union_hits
from specmesh.distill.train import TrainConfig, build_student, labels_for, train_student
from specmesh.drafters.catalog import load_expert_for
from specmesh.drafters.expert import ExpertDrafter, ExpertSpec, load_expert, round_to_stored, save_drafter, subset_for
from specmesh.errors import InvalidArgument
from specmesh.runtime.llama import LlamaRuntime
from specmesh.runtime.loading import TargetParts
from specmesh.sampling import SamplingParams
from specmesh.speculation.engine import Request, SpeculativeEngine
from specmesh.tree import ROOT

VOCAB = 96


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=VOCAB, layers=3, seed=21)


@pytest.fixture(scope="module")
def examples(target):
    rng = random.Random(0)
    runtime = LlamaRuntime(target)
    engine = SpeculativeEngine(runtime, [], max_tree_nodes=0)
    prompts = [tuple(rng.randrange(2, VOCAB) for _ in range(rng.randint(2, 8))) for _ in range(40)]
    outputs = engine.generate([Request(p, SamplingParams(max_tokens=16)) for p in prompts])
    return [Example(f"p{i}", "even" if i % 2 == 0 else "odd", p, tuple(o.token_ids))
            for i, (p, o) in enumerate(zip(prompts, outputs))]


@torch.no_grad()
def teacher_forced_labels(target, examples, top_k):
    """The reference: the plain Hugging Face model's top-k distribution after each answer position's input."""
    labels = []
    for example in examples:
        logits = target(torch.tensor([example.token_ids[:-1]])).logits[0, len(example.prompt_ids) - 1 :]  # [answer_len, vocab]
        top = logits.softmax(-1).topk(top_k, dim=-1)
        labels.append(SoftLabels(top.indices, top.values))
    return labels


@pytest.fixture(scope="module")
def trained(target, examples):
    subset = subset_for([t for e in examples for t in e.response_ids], VOCAB, 48)
    model = build_student(target, subset, layers=1)
    before = agreement_by_category(examples, teacher_forced_hits(model, examples))["all"]
    soft = teacher_forced_labels(target, examples, top_k=8)
    result = train_student(model, examples, TrainConfig(layers=1, steps=150, learning_rate=3e-3, tokens_per_batch=512),
                           soft_labels=soft, validation=examples[:6])
    return model, before, result


def test_greedy_answers_record_the_teacher_forced_distribution(target, examples):
    runtime = LlamaRuntime(target)
    chosen = examples[:6]
    results = target_answers(runtime, [e.prompt_ids for e in chosen], max_tokens=16, top_k=8)
    forced = teacher_forced_labels(target, chosen, top_k=8)
    for example, (answer, labels, _), reference in zip(chosen, results, forced):
        assert tuple(answer) == example.response_ids  # plain greedy decoding, as the engine does it
        assert labels.token_ids.shape == (len(answer), 8)
        assert labels.token_ids[:, 0].tolist() == answer
        assert torch.allclose(labels.probs, reference.probs, atol=1e-4)


def test_greedy_answers_stop_at_eos(target, examples):
    example = examples[0]
    eos = example.response_ids[2]
    [(answer, labels, _)] = target_answers(LlamaRuntime(target), [example.prompt_ids], max_tokens=16, eos_token_ids=[eos])
    assert answer == list(example.response_ids[: example.response_ids.index(eos) + 1])
    assert labels.token_ids.shape[0] == len(answer)


class CharTokenizer:
    """Text to ids by character (the tiny target has no real tokenizer)."""

    def __call__(self, text):
        return {"input_ids": [2 + ord(c) % (VOCAB - 2) for c in text]}


def test_generated_examples_are_cached_with_their_soft_labels(target, tmp_path):
    from specmesh.prompts import Prompt

    runtime = LlamaRuntime(target)
    prompts = [Prompt(f"prompt number {i}", "c") for i in range(5)]
    cache = tmp_path / "answers.jsonl"
    first = generate_examples(runtime, CharTokenizer(), prompts[:3], cache, max_tokens=10, batch_size=2)
    again = generate_examples(runtime, CharTokenizer(), prompts, cache, max_tokens=10, batch_size=2)
    assert again[:3] == first and len(again) == 5
    assert len(cache.read_text().splitlines()) == 5  # only the two new prompts were generated
    labels = recorded_soft_labels(cache, again)
    assert [l.token_ids[:, 0].tolist() for l in labels] == [list(e.response_ids) for e in again]


def test_answers_cached_without_their_soft_labels_are_refused(target, tmp_path):
    from specmesh.prompts import Prompt

    runtime = LlamaRuntime(target)
    cache = tmp_path / "answers.jsonl"
    generate_examples(runtime, CharTokenizer(), [Prompt("a prompt", "c")], cache, max_tokens=6)
    row = json.loads(cache.read_text())
    del row["labels"]  # as an older specmesh cached answers
    older = tmp_path / "older.jsonl"
    older.write_text(json.dumps(row) + "\n")
    examples = generate_examples(runtime, CharTokenizer(), [Prompt("a prompt", "c")], older, max_tokens=6)
    assert examples[0].labels is None and len(older.read_text().splitlines()) == 1  # read back, not answered again
    with pytest.raises(InvalidArgument, match="delete it"):
        recorded_soft_labels(older, examples)
    for shard in (tmp_path / "answers.jsonl.labels").iterdir():
        shard.unlink()
    with pytest.raises(InvalidArgument, match="delete it"):
        recorded_soft_labels(cache, generate_examples(runtime, CharTokenizer(), [Prompt("a prompt", "c")], cache, max_tokens=6))


def test_batched_teacher_forcing_equals_one_example_at_a_time(trained, examples):
    model, _, _ = trained
    assert teacher_forced_hits(model, examples, tokens_per_batch=128) == teacher_forced_hits(model, examples, tokens_per_batch=1)


def test_subset_is_frequency_ranked():
    assert subset_for([5, 5, 5, 2, 2, 9], vocab_size=10, size=2).tolist() == [5, 2]
    assert subset_for([5, 2], vocab_size=10, size=8).tolist() == [2, 5]  # only seen tokens; ties by id


def test_soft_targets_send_mass_outside_the_subset_to_the_fallback(target, examples):
    from specmesh.distill.train import soft_targets

    soft = teacher_forced_labels(target, examples[:1], top_k=4)[0]
    example = examples[0]
    assert soft.token_ids.shape == (len(example.response_ids), 4)
    assert soft.token_ids[:, 0].tolist() == list(example.response_ids)  # greedy answer = top-1 under teacher forcing
    subset = {int(soft.token_ids[0, 0]): 0}
    positions, classes, probs = soft_targets(example, soft, subset, fallback=1, length=len(example.token_ids))
    assert positions[0] == len(example.prompt_ids) - 1
    assert torch.allclose(probs.sum(-1), torch.ones(len(positions)))
    assert classes[0, 0] == 0 and (classes[1:, :-1] == 1).sum() > 0


def test_labels_cover_answer_positions_with_a_fallback():
    example = Example("x", "c", (10, 11), (12, 13, 99))
    labels = labels_for(example, {12: 0, 13: 1}, fallback=2)
    assert labels == [-100, 0, 1, 2, -100]


def test_training_raises_agreement(trained, examples):
    model, before, result = trained
    after = agreement_by_category(examples, teacher_forced_hits(model, examples))
    assert result.steps == 150
    assert result.best_held_out is not None and 0 <= result.best_held_out <= 1
    assert after["all"] > before + 0.1, (before, after)
    assert set(after) == {"even", "odd", "all"}


def test_a_run_by_steps_repeats_exactly(target, examples):
    subset = subset_for([t for e in examples for t in e.response_ids], VOCAB, 48)
    states = []
    for _ in range(2):
        model = build_student(target, subset, layers=1)
        result = train_student(model, examples, TrainConfig(layers=1, steps=12, tokens_per_batch=512), validation=examples[:6])
        assert result.steps == 12
        states.append(model.trainable_state())
    assert all(torch.equal(states[0][name], states[1][name]) for name in states[0])


def test_expected_tokens_follow_runs_of_right_guesses():
    # runs from each position of [T, T, F, T]: 2, 1, 0, 1
    assert expected_tokens_per_step([[True, True, False, True]], max_k=3) == {"1": 1.75, "2": 2.0, "3": 2.0}
    assert union_hits([[[True, False]], [[False, False]]]) == [[True, False]]


def test_save_load_round_trip_and_losslessness(trained, target, examples, tmp_path):
    model, _, _ = trained
    spec = ExpertSpec(name="tiny", domain="even", target={"tokenizer_hash": "x", "vocab_size": VOCAB},
                      architecture=model.config.to_dict())
    save_drafter(model, spec, tmp_path / "tiny")
    loaded, loaded_spec = load_expert(tmp_path / "tiny", target.model.embed_tokens.weight.detach())
    assert loaded_spec.domain == "even"
    tokens = torch.tensor([list(examples[0].token_ids)])
    torch.testing.assert_close(loaded(tokens), model(tokens), atol=2e-2, rtol=2e-2)  # fp16 on disk

    # the whole expert goes where it is asked (a GPU node drafts on its GPU), its buffers too
    elsewhere, _ = load_expert(tmp_path / "tiny", target.model.embed_tokens.weight.detach(), device="meta")
    assert {t.device.type for t in [*elsewhere.parameters(), *elsewhere.buffers()]} == {"meta"}
    parts = TargetParts("tiny", None, VOCAB, 64, (), lambda: target.model.embed_tokens.weight.detach())
    with pytest.raises(InvalidArgument, match="device"):
        load_expert_for(tmp_path / "tiny", parts, device="gpu-please")

    drafter = ExpertDrafter(loaded, name="tiny", branch_below=0.9)
    engine = SpeculativeEngine(LlamaRuntime(target), [drafter], max_tree_nodes=6)
    outputs = engine.generate([Request(e.prompt_ids, SamplingParams(max_tokens=16)) for e in examples[:8]])
    for example, out in zip(examples[:8], outputs):
        assert tuple(out.token_ids) == example.response_ids
    assert sum(len(o.token_ids) for o in outputs) > sum(o.stats.target_steps for o in outputs)


def test_a_drafter_directory_with_a_copy_gate_is_refused(trained, target, tmp_path):
    from safetensors.torch import load_file, save_file

    model, _, _ = trained
    spec = ExpertSpec(name="tiny", domain="even", target={"tokenizer_hash": "x", "vocab_size": VOCAB},
                      architecture=model.config.to_dict())
    save_drafter(model, spec, tmp_path / "tiny")
    embedding = target.model.embed_tokens.weight.detach()
    drafter_json = tmp_path / "tiny" / "drafter.json"
    drafter_json.write_text(json.dumps(json.loads(drafter_json.read_text()) | {"copy": {}}))  # as the shipped writing expert's
    load_expert(tmp_path / "tiny", embedding)
    weights = tmp_path / "tiny" / "weights.safetensors"
    save_file(load_file(str(weights)) | {"copy_gate.hidden": torch.zeros(model.config.hidden_size, dtype=torch.float16)},
              str(weights))
    with pytest.raises(InvalidArgument, match="copy gate") as err:
        load_expert(tmp_path / "tiny", embedding)
    assert err.value.field == "drafter"


def test_rounded_to_the_stored_precision_an_expert_computes_exactly_what_it_loads_as(trained, target, examples, tmp_path):
    model = copy.deepcopy(trained[0])
    round_to_stored(model)
    spec = ExpertSpec(name="tiny", domain="even", target={"tokenizer_hash": "x", "vocab_size": VOCAB},
                      architecture=model.config.to_dict())
    save_drafter(model, spec, tmp_path / "tiny")
    loaded, _ = load_expert(tmp_path / "tiny", target.model.embed_tokens.weight.detach())
    tokens = torch.tensor([list(e.token_ids) for e in examples[:1]])
    assert torch.equal(loaded(tokens), model(tokens))  # what distill measures is what ships
    assert teacher_forced_hits(loaded, examples) == teacher_forced_hits(model, examples)


def test_trees_branch_where_the_drafter_is_unsure():
    from specmesh.drafters.shape import Step, confident_tree

    # outputs 0..3 name tokens 10..13; output 4 is the fallback ("not in my subset")
    names = [10, 11, 12, 13]
    sure = Step(torch.tensor([0.9, 0.05, 0.03, 0.01, 0.01]), names)
    unsure = Step(torch.tensor([0.4, 0.35, 0.15, 0.05, 0.05]), names)
    stop = Step(torch.tensor([0.1, 0.1, 0.1, 0.1, 0.6]), names)
    script = iter([unsure, sure, stop])
    fed = []

    def advance(token):
        fed.append(token)
        return next(script)

    tree = confident_tree(sure, advance, budget=8, max_depth=8, branch_below=0.6,
                          branch_width=3, stop_index=4)
    # depth 1: sure -> 10 alone; depth 2: unsure -> 10 with siblings 11, 12; depth 3: sure -> 10; then stop
    assert tree.tokens == (10, 10, 11, 12, 10)
    assert tree.parents == (ROOT, 0, 0, 0, 1)
    assert fed == [10, 10, 10]
    small = confident_tree(Step(unsure.probs, None), lambda t: sure, budget=2, max_depth=8, branch_below=0.6, branch_width=3)
    assert small.tokens == (0, 1) and small.parents == (ROOT, ROOT)


def test_expert_drafter_proposes_within_budget(trained, examples):
    model, _, _ = trained
    drafter = ExpertDrafter(model, name="t", branch_below=1.01, branch_width=2)
    drafter.start("r", examples[0].prompt_ids)
    for budget in (1, 3, 8):
        tree = drafter.propose("r", budget)
        assert len(tree) <= budget
    drafter.end("r")


def test_trees_stop_where_the_path_is_unlikely():
    from specmesh.drafters.shape import Step, confident_tree

    half = Step(torch.tensor([0.5, 0.3, 0.2]), None)
    tree = confident_tree(half, lambda t: half, budget=8, max_depth=8, branch_below=0.0, branch_width=1,
                          stop_below=0.2)
    assert tree.tokens == (0, 0)  # path confidence 0.5, 0.25, then 0.125 < 0.2: stop
    first_only = confident_tree(half, lambda t: half, budget=8, max_depth=8, branch_below=0.0, branch_width=1,
                                stop_below=0.9)
    assert len(first_only) == 1  # the first guess is always made


def test_soft_targets_of_a_prompt_longer_than_the_training_window(target, examples):
    from specmesh.distill.train import soft_targets

    example = examples[0]
    soft = teacher_forced_labels(target, [example], top_k=4)[0]
    positions, classes, probs = soft_targets(example, soft, {}, fallback=0, length=len(example.prompt_ids) - 1)
    assert positions.numel() == 0 and classes.shape == (0, 5) and probs.shape == (0, 5)


def test_no_drafter_step_is_wasted_after_the_deepest_guess():
    from specmesh.drafters.shape import Step, confident_tree

    calls = []
    sure = Step(torch.tensor([0.9, 0.1]), None)
    tree = confident_tree(sure, lambda t: calls.append(t) or sure, budget=8, max_depth=3, branch_below=0.0,
                          branch_width=1)
    assert len(tree) == 3 and len(calls) == 2


def test_experts_on_a_cpu_draft_with_int8_linears_where_fbgemm_runs():
    from specmesh.drafters.expert import drafter_dtype, drafter_int8
    from specmesh.runtime.linear import int8_available

    dtype = drafter_dtype("cpu")
    if int8_available("cpu"):  # int8 streams half of bf16's bytes a drafted token: fp32 activations, int8 weights
        assert dtype == torch.float32 and drafter_int8("cpu", dtype)
    else:
        assert dtype in (torch.float32, torch.bfloat16) and not drafter_int8("cpu", dtype)


@pytest.mark.parametrize("path", ["blocks", "fbgemm"])
def test_low_precision_drafting_stays_close_to_fp32_and_lossless(trained, target, examples, path, monkeypatch):
    import specmesh.drafters.expert as expert
    from specmesh.runtime.linear import BlockLinear, Int8Linear, block_kernel_available, int8_available

    if path == "fbgemm":
        if not int8_available("cpu"):
            if platform.machine() in ("x86_64", "AMD64"):  # FBGEMM ships in PyTorch's x86 builds: CI's CPU has it
                not_here("PyTorch's FBGEMM int8 kernels are missing from this x86 build")
            pytest.skip(f"no FBGEMM on {platform.machine()}")
        monkeypatch.setattr(expert, "block_kernel_available", lambda device: False)
        weight, x = torch.randn(40, 24), torch.randn(3, 24)
        approx, exact = Int8Linear(weight)(x), x @ weight.T
        assert (approx - exact).abs().max() < 0.05 * exact.abs().max()  # ~1 % per row, scaled
    else:
        need(block_kernel_available("cpu"), "a C++ compiler for specmesh's block kernel", "install g++ (Debian: g++)")

    model, _, _ = trained
    fp32 = ExpertDrafter(model, name="fp32", int8_weights=False)
    int8 = ExpertDrafter(model, name="int8", int8_weights=True)
    kind = BlockLinear if path == "blocks" else Int8Linear
    assert isinstance(int8.runtime.layers[0].qkv, kind) and isinstance(int8.runtime.lm_head, kind)
    assert int8.runtime.fused_layers == (path == "blocks")  # on blocks a layer is one C++ call
    differences = []
    same, total = 0, 0
    for number, example in enumerate(examples[:10]):
        for drafter in (fp32, int8):
            drafter.start(f"r{number}", example.prompt_ids)
        for token in example.response_ids:
            a = fp32._catch_up(fp32._requests[f"r{number}"], [*fp32._requests[f"r{number}"].committed]).probs
            b = int8._catch_up(int8._requests[f"r{number}"], [*int8._requests[f"r{number}"].committed]).probs
            differences.append(float((a - b).abs().max()))  # probabilities over the subset + fallback
            same += int(a.argmax() == b.argmax())
            total += 1
            fp32.commit(f"r{number}", [token])
            int8.commit(f"r{number}", [token])
    assert same >= 0.9 * total
    # measured: FBGEMM's int8 median 0.007, max 0.043; 4-bit blocks of this 64-wide model round coarser,
    # median 0.038, max 0.14
    median_bound, max_bound = (0.015, 0.06) if path == "fbgemm" else (0.06, 0.25)
    assert sorted(differences)[len(differences) // 2] < median_bound and max(differences) < max_bound

    engine = SpeculativeEngine(LlamaRuntime(target), [int8], max_tree_nodes=6)  # the target stays exact
    outputs = engine.generate([Request(e.prompt_ids, SamplingParams(max_tokens=16)) for e in examples[:8]])
    assert [tuple(o.token_ids) for o in outputs] == [e.response_ids for e in examples[:8]]


def test_best_first_trees_hold_the_nodes_of_highest_path_probability():
    import itertools

    from specmesh.drafters.shape import Step, best_first_tree

    def step_after(path):  # a drafter whose distribution over 5 outputs depends on the whole path
        weights = torch.tensor([1.0 + ((hash(path) >> (4 * i)) % 7) for i in range(5)]) ** 2
        return Step(weights / weights.sum(), [20 + i for i in range(5)])

    rounds = []

    def score(tree, rows):
        rounds.append(len(rows))
        paths = []
        for row in rows:  # the path of tokens down to each node
            path, node = [], row
            while node != ROOT:
                path.append(tree.tokens[node])
                node = tree.parents[node]
            paths.append(tuple(reversed(path)))
        return [step_after(p) for p in paths]

    depth, width, budget = 4, 3, 40
    values = {}  # every path the drafter could grow (depth <= 4, top 3 a node) -> its probability
    for length in range(1, depth + 1):
        for ranks in itertools.product(range(width), repeat=length):
            path, value = (), 1.0
            for rank in ranks:
                probs = step_after(path).probs
                top = probs.topk(width)
                value *= float(top.values[rank])
                path += (20 + int(top.indices[rank]),)
            values[path] = value
    tree = best_first_tree(step_after(()), score, budget, depth, width)
    assert len(tree) == budget and len(rounds) <= depth - 1
    grown = {}
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        grown[i] = (grown[parent] if parent != ROOT else ()) + (token,)
    best = sorted(values.values(), reverse=True)
    assert sorted((values[p] for p in grown.values()), reverse=True) == pytest.approx(best[:budget])
    for i, parent in enumerate(tree.parents):  # siblings come best first
        later = [j for j in range(i + 1, len(tree)) if tree.parents[j] == parent]
        assert all(tree.draft_probs[i] >= tree.draft_probs[j] for j in later)


def test_an_expert_grows_big_trees_best_first_and_stays_lossless(trained, target, examples):
    model, _, _ = trained
    drafter = ExpertDrafter(model, name="t", max_depth=4, branch_width=2)
    drafter.start("r", examples[0].prompt_ids)
    wide = drafter.propose("r", 64)  # past 4 x 2: best first
    assert 8 < len(wide) <= 64 and wide == drafter.propose("r", 64)  # the session kept the context alone
    assert max(len(c) for c in wide.children()) > 2 or max(wide.depths()) > 4
    assert len(drafter.propose("r", 6)) <= 6  # and the confident path still works after
    drafter.end("r")
    engine = SpeculativeEngine(LlamaRuntime(target), [ExpertDrafter(model, name="t", max_depth=4, branch_width=2)],
                               max_tree_nodes=64)  # the whole budget every step
    outputs = engine.generate([Request(e.prompt_ids, SamplingParams(max_tokens=16)) for e in examples[:8]])
    for example, out in zip(examples[:8], outputs):
        assert tuple(out.token_ids) == example.response_ids
