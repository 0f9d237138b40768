"""Loading targets and drafters from local directories; refusing drafters with another vocabulary."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import tiny_llama
from transformers import AutoTokenizer

from specmesh.drafters.catalog import expert_directory, shipped_experts
from specmesh.errors import InvalidArgument
from specmesh.runtime.loading import EMBEDDED_DEFAULT, resolve_model_dir, tokenizer_fingerprint
from specmesh.speculation.assembly import assemble


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer):
    """A tiny random Llama with the embedded model's tokenizer, saved as a Hugging Face directory."""
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(vocab_size=len(tokenizer), layers=1, seed=5).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_a_model_directory_loads_as_target_and_as_drafter(tiny_dir):
    assembly = assemble(str(tiny_dir), drafters=["ngram", str(tiny_dir)])
    assert [d.name for d in assembly.drafters] == ["ngram", str(tiny_dir)]
    assert assembly.runtime.vocab_size == len(assembly.target.tokenizer)


def test_a_drafter_with_another_vocabulary_is_refused(tiny_dir, tokenizer, tmp_path):
    other = tmp_path / "other"
    tiny_llama(vocab_size=len(tokenizer), layers=1, seed=6).save_pretrained(other)
    tokenizer.save_pretrained(other)
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    first, second = [token for token in vocab if token.isalpha() and len(token) > 3][:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # same tokens, two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(data))
    assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(other)) != tokenizer_fingerprint(tokenizer)
    with pytest.raises(InvalidArgument) as err:
        assemble(str(tiny_dir), drafters=[str(other)])
    assert err.value.field == "drafter" and "vocabulary" in str(err.value)


def test_an_expert_is_named_by_its_shipped_name_or_by_its_directory(tmp_path):
    shipped = shipped_experts(EMBEDDED_DEFAULT)
    assert {"code", "math", "writing"} <= set(shipped)
    assert expert_directory("code", EMBEDDED_DEFAULT) == shipped["code"]
    assert expert_directory(str(shipped["math"]), EMBEDDED_DEFAULT) == shipped["math"]
    assert expert_directory("code", "another-target") is None  # shipped names are per target
    (tmp_path / "drafter.json").write_text("{}")
    assert expert_directory(tmp_path, "another-target") == tmp_path
    assert expert_directory(tmp_path / "missing", EMBEDDED_DEFAULT) is None


@pytest.mark.slow  # the embedded target
def test_every_shipped_expert_loads_for_its_target():
    from specmesh.drafters.catalog import load_drafter
    from specmesh.drafters.expert import ExpertDrafter
    from specmesh.prompts import encode_chat
    from specmesh.runtime.loading import load_target_parts

    target = load_target_parts(EMBEDDED_DEFAULT)
    prompt = encode_chat(target.tokenizer, "Name three primary colors.")
    answer = target.tokenizer("The three primary colors are red, blue and yellow.")["input_ids"]
    for name in shipped_experts(EMBEDDED_DEFAULT):
        drafter = load_drafter(name, target, device=None, dtype=None)
        assert isinstance(drafter, ExpertDrafter) and drafter.name == name
        drafter.start("r", prompt)
        sizes = []
        for token in answer:
            sizes.append(len(drafter.propose("r", 4)))
            drafter.commit("r", [token])
        drafter.end("r")
        assert max(sizes) <= 4 and sum(sizes) > 0, (name, sizes)


@pytest.mark.slow  # the embedded target
def test_a_drafter_node_reads_the_targets_output_head_alone():
    """What an EAGLE-1/2 head drafts through, read from the target's files without loading the model:
    the final norm and the LM head (SmolLM2 ties it to its input embeddings), as the model holds them."""
    from specmesh.runtime.loading import load_hf_model, load_target_parts

    norm, head = load_target_parts(EMBEDDED_DEFAULT).output_head()
    model = load_hf_model(EMBEDDED_DEFAULT).model
    assert torch.equal(norm, model.model.norm.weight.detach().float())
    assert torch.equal(head, model.get_output_embeddings().weight.detach().float())


def test_a_directory_without_config_is_refused(tmp_path):
    with pytest.raises(InvalidArgument, match="no config.json"):
        resolve_model_dir(str(tmp_path))


def test_cli_generates_with_a_directory_model(tiny_dir):
    result = subprocess.run(
        [sys.executable, "-m", "specmesh", "generate", "Hello", "--model", str(tiny_dir), "--max-tokens", "6",
         "--compare-plain"], capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "outputs identical" in result.stdout


@pytest.mark.slow  # four command-line runs: distill, generate, distill boosted, generate (~1 min)
def test_distill_writes_a_drafter_directory_that_generate_uses(tiny_dir, tmp_path):
    import os

    env = {**os.environ, "SPECMESH_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "code-expert"
    result = subprocess.run(
        [sys.executable, "-m", "specmesh", "distill", "--model", str(tiny_dir), "--domain", "code", "--count", "12",
         "--answer-tokens", "12", "--minutes", "0.05", "--subset-size", "64", "--layers", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    spec = json.loads((out / "drafter.json").read_text())
    assert spec["domain"] == "code" and spec["format"] == "specmesh-drafter/1"
    assert set(spec["measured"]["mtbench_agreement"]) >= {"coding", "math", "writing", "all"}
    assert spec["measured"]["cost_fraction"] > 0
    assert (out / "answers.jsonl").read_text().count("\n") == 12  # cached target answers, resumable
    result = subprocess.run(
        [sys.executable, "-m", "specmesh", "generate", "Hi", "--model", str(tiny_dir), "--drafter", str(out),
         "--max-tokens", "6", "--compare-plain"], capture_output=True, text=True, timeout=300, env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "outputs identical" in result.stdout

    # Collective boost-tuning: the second expert learns from the first's misses.
    boosted = tmp_path / "math-expert"
    result = subprocess.run(
        [sys.executable, "-m", "specmesh", "distill", "--model", str(tiny_dir), "--domain", "math", "--count", "8",
         "--answer-tokens", "8", "--minutes", "0.05", "--subset-size", "64", "--layers", "1", "--out", str(boosted),
         "--boost-from", str(out)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    training = json.loads((boosted / "drafter.json").read_text())["training"]
    assert training["boosted_from"] == ["code-expert"] and training["examples"] == 7  # the held-out eighth not trained on


def test_random_weights_are_drawn_by_their_seed_as_the_architecture_draws_them():
    from transformers import AutoModelForCausalLM

    from specmesh.runtime.random_models import random_config, random_model

    name = "random:tiny"
    first, again = (random_model(name, torch.float32, torch.device("cpu"), seed=3) for _ in range(2))
    other = random_model(name, torch.float32, torch.device("cpu"), seed=4)
    reference = AutoModelForCausalLM.from_config(random_config(name))  # transformers' own initialisation
    drawn = dict(first.named_parameters())
    for key, value in reference.state_dict().items():  # every tensor there, buffers (RoPE's) included
        mine = first.state_dict()[key]
        if key.endswith("inv_freq") or value.ndim == 1:
            assert torch.equal(mine, value), key  # computed, or a norm's ones and a bias's zeros
    for key, weight in drawn.items():
        if weight.ndim > 1:
            assert abs(weight.std().item() - reference.config.initializer_range) < 0.1 * reference.config.initializer_range
            assert torch.equal(weight, dict(again.named_parameters())[key])  # the same seed: the same weights
            assert not torch.equal(weight, dict(other.named_parameters())[key])
    assert first.lm_head.weight is first.model.embed_tokens.weight  # tied as the configuration says
