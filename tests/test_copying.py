"""Experts that copy from their context: candidates, the gate's fit, the drafter as trained, losslessness."""

import random

import pytest
from conftest import tiny_llama

from specmesh.distill.data import Example
from specmesh.distill.evaluate import agreement_by_category, interface_hits, teacher_forced_hits
from specmesh.distill.train import build_student, fit_copy_gate
from specmesh.drafters.copying import ContextIndex, CopyGate, copy_candidates
from specmesh.drafters.expert import ExpertDrafter, ExpertSpec, load_expert, save_expert, subset_for
from specmesh.drafters.ngram import NgramIndex
from specmesh.runtime.llama import LlamaRuntime
from specmesh.sampling import SamplingParams
from specmesh.speculation.engine import Request, SpeculativeEngine

VOCAB = 96


def test_the_candidate_follows_the_newest_occurrence_of_the_longest_suffix():
    index = NgramIndex(1, 4)
    index.extend(0, [7, 1, 8, 7, 1, 9, 7, 1])
    assert index.longest_match(index.documents[0], skip=(0, 8)) == (2, 9)  # [7, 1] -> 8 then 9: the newest
    assert index.longest_match([5], skip=None) is None

    # context [1, 2, 3]: nothing before; then [.., 1] -> 2 (n=1), [.., 1, 2] -> 3 (n=2), [.., 1, 2, 3] -> 1 (n=3)
    assert copy_candidates([1, 2, 3, 1, 2, 3, 4], first=2) == ([-1, 2, 3, 1], [0, 1, 2, 3])
    # guesses past the committed tokens are looked up too
    assert ContextIndex([1, 2, 3]).candidate([1, 2]) == (3, 2)
    assert ContextIndex([1, 2, 3]).candidate() == (-1, 0)


def test_a_drafting_step_computes_the_gate_as_training_did():
    import torch

    from specmesh.drafters.copying import gate_features, position_features

    generator = torch.Generator().manual_seed(0)
    gate = CopyGate(8)
    with torch.no_grad():
        for parameter in gate.parameters():
            parameter.normal_(generator=generator)
    scalar = gate.scalar()
    for candidate_index, length in ((3, 2), (-1, 1), (0, 6), (5, 4)):
        probs = torch.rand(7, generator=generator).softmax(-1)
        hidden_logit = torch.randn((), generator=generator)
        features = gate_features(probs, torch.tensor(candidate_index), torch.tensor(length))
        assert position_features(probs, candidate_index, length) == pytest.approx(features.tolist(), abs=1e-6)
        expected = gate(hidden_logit, features, torch.tensor(length)).detach()
        assert scalar(float(hidden_logit), features.tolist()) == pytest.approx(float(expected), abs=1e-6)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=VOCAB, layers=2, seed=5)


def repeating(count: int, seed: int) -> list[Example]:
    """Requests whose answer repeats the prompt: all but the first answer token can be copied."""
    rng = random.Random(seed)
    examples = []
    for i in range(count):
        prompt = tuple(rng.sample(range(2, VOCAB), 12))  # distinct tokens: one right candidate each
        examples.append(Example(f"r{seed}-{i}", "repeat", prompt, prompt))
    return examples


@pytest.fixture(scope="module")
def copying(target):
    """An untrained one-layer student (it cannot copy by itself) with a gate fit on repeating answers."""
    fit, held_out = repeating(24, seed=1), repeating(12, seed=2)
    subset = subset_for(list(range(2, VOCAB, 2)), VOCAB, 48)  # even ids only: odd ones are copied from outside it
    model = build_student(target, subset, layers=1)
    without = agreement_by_category(held_out, teacher_forced_hits(model, held_out))["all"]
    fit_info = fit_copy_gate(model, fit, steps=300)
    return model, held_out, without, fit_info


def test_a_fit_gate_copies_what_the_model_cannot_say(copying):
    model, held_out, without, fit_info = copying
    with_gate = agreement_by_category(held_out, teacher_forced_hits(model, held_out))["all"]
    assert without < 0.3
    assert with_gate > 0.85, (without, with_gate)
    assert fit_info["fit_on_positions"] == 24 * 12 and 0.9 < fit_info["candidate_share"] <= 1


def test_the_drafter_guesses_as_it_was_measured(copying):
    model, held_out, _, _ = copying
    drafter = ExpertDrafter(model, name="copier", int8_weights=False)
    through_interface, _ = interface_hits(drafter, held_out)
    forced = teacher_forced_hits(model, held_out)
    same = sum(a == b for row_a, row_b in zip(through_interface, forced) for a, b in zip(row_a, row_b))
    assert same >= 0.98 * sum(len(row) for row in forced)

    # a copied token outside the head's subset is proposed, and the tree continues past it
    example = held_out[0]
    drafter.start("r", example.prompt_ids)
    drafter.commit("r", example.response_ids[:2])
    tree = drafter.propose("r", budget=6)
    drafter.end("r")
    assert tree.tokens[:4] == example.response_ids[2:6]
    assert any(token % 2 == 1 for token in tree.tokens[:4])  # odd: not in the subset
    assert all(0 < p <= 1 for p in tree.draft_probs)


def test_the_gate_is_saved_and_an_expert_without_one_loads_as_before(copying, target, tmp_path):
    model, held_out, _, fit_info = copying
    embedding = target.model.embed_tokens.weight.detach()
    save_expert(model, ExpertSpec(name="copier", domain="repeat", target={}, architecture=model.config.to_dict(),
                                  copy=fit_info), tmp_path / "copier")
    loaded, spec = load_expert(tmp_path / "copier", embedding)
    assert spec.copy == fit_info and loaded.copy_gate is not None
    assert teacher_forced_hits(loaded, held_out) == teacher_forced_hits(model, held_out)

    plain = build_student(target, model.subset_ids, layers=1)
    save_expert(plain, ExpertSpec(name="plain", domain="repeat", target={}, architecture=plain.config.to_dict()),
                tmp_path / "plain")
    loaded_plain, plain_spec = load_expert(tmp_path / "plain", embedding)
    assert plain_spec.copy == {} and loaded_plain.copy_gate is None


def test_a_gate_with_a_minimum_match_copies_only_after_it(target, tmp_path):
    """In a repeating answer the match grows a token a position (1, 2, 3, 4, 4, ...): a gate that needs 3
    tokens leaves the first two copyable positions to the model, everywhere it runs."""
    fit, held_out = repeating(24, seed=1), repeating(12, seed=2)
    subset = subset_for(list(range(2, VOCAB, 2)), VOCAB, 48)
    model = build_student(target, subset, layers=1)
    fit_info = fit_copy_gate(model, fit, min_match=3, steps=300)
    assert model.copy_gate.min_match == 3 and fit_info["min_match"] == 3
    assert fit_info["candidate_share"] == pytest.approx(9 / 12, abs=1e-3)  # 9 of 12 positions match 3+ tokens

    hits = teacher_forced_hits(model, held_out)
    copied = [row[3:] for row in hits]  # positions 3.. have a match of 3 tokens or more
    assert sum(map(sum, copied)) >= 0.85 * sum(map(len, copied))
    model_only = build_student(target, subset, layers=1)
    assert [row[:3] for row in hits] == [row[:3] for row in teacher_forced_hits(model_only, held_out)]

    drafter = ExpertDrafter(model, name="copier", int8_weights=False)
    through_interface, _ = interface_hits(drafter, held_out)
    same = sum(a == b for row_a, row_b in zip(through_interface, hits) for a, b in zip(row_a, row_b))
    assert same >= 0.98 * sum(len(row) for row in hits)

    save_expert(model, ExpertSpec(name="copier", domain="repeat", target={}, architecture=model.config.to_dict(),
                                  copy=fit_info), tmp_path / "copier")
    loaded, _ = load_expert(tmp_path / "copier", target.model.embed_tokens.weight.detach())
    assert loaded.copy_gate.min_match == 3 and teacher_forced_hits(loaded, held_out) == hits
    with pytest.raises(ValueError, match="min_match"):
        CopyGate(8, min_match=0)
    import json

    from specmesh.errors import InvalidArgument

    file = tmp_path / "copier" / "drafter.json"
    file.write_text(file.read_text().replace('"min_match": 3', '"min_match": 9'))
    with pytest.raises(InvalidArgument, match="min_match"):
        load_expert(tmp_path / "copier", target.model.embed_tokens.weight.detach())
    assert json.loads(file.read_text())["copy"]["min_match"] == 9


def test_a_copying_expert_is_lossless(copying, target):
    model, held_out, _, _ = copying
    requests = [Request(e.prompt_ids + e.prompt_ids[:4], SamplingParams(max_tokens=12)) for e in held_out[:6]]
    plain = SpeculativeEngine(LlamaRuntime(target), [], max_tree_nodes=0).generate(requests)
    drafter = ExpertDrafter(model, name="copier", int8_weights=False)
    speculative = SpeculativeEngine(LlamaRuntime(target), [drafter], max_tree_nodes=6).generate(requests)
    assert [o.token_ids for o in speculative] == [o.token_ids for o in plain]
