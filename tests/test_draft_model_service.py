"""A Hugging Face draft model served by the drafter service: a launched cluster (Redis, router, verifier and
the drafter as processes) whose drafter is given a model folder, as `specmesh up --drafter DIR` gives it. The
target is a tiny random Llama over the embedded model's tokenizer; the draft model is its first layer alone
(the same embeddings, norm and head), so that it guesses right often, not always. Over gRPC the service
proposes the trees the same model proposes in process, and greedy output through it is plain decoding's."""

import asyncio

import pytest
from conftest import hf_greedy, tiny_llama

from specmesh.client import Client
from specmesh.cluster.launcher import ClusterSpec, LocalCluster
from specmesh.cluster.remote_drafter import RemoteDrafter
from specmesh.drafters.model import ModelDrafter
from specmesh.runtime.loading import load_target_parts, tokenizer_fingerprint

MAX_TOKENS = 24
PROMPTS = ["The quick brown fox", "Count: one two three", "Hello there, how are", "def add(a, b):"]

pytestmark = pytest.mark.slow  # a launched cluster: its processes take a minute to start


@pytest.fixture(scope="module")
def models(tokenizer, tmp_path_factory):
    """The target, the draft model and their folders (each with the tokenizer beside the weights)."""
    target = tiny_llama(vocab_size=len(tokenizer), layers=2, seed=5)
    draft = tiny_llama(vocab_size=len(tokenizer), layers=1, seed=6)
    draft.load_state_dict({k: v for k, v in target.state_dict().items() if not k.startswith("model.layers.1.")})
    folders = {}
    for name, model in (("target", target), ("draft", draft)):
        folders[name] = tmp_path_factory.mktemp(name)
        model.save_pretrained(folders[name])
        tokenizer.save_pretrained(folders[name])
    return target, draft, folders


@pytest.fixture(scope="module")
def cluster(models, tmp_path_factory):
    _, _, folders = models
    spec = ClusterSpec(model=str(folders["target"]), drafters=(str(folders["draft"]),), speculation="fixed",
                       max_tree_nodes=8, job_timeout_s=60, log_dir=tmp_path_factory.mktemp("cluster-logs"))
    with LocalCluster(spec) as running:
        yield running


def test_the_service_proposes_the_trees_of_the_draft_model_in_process(models, cluster, tokenizer):
    target, draft, folders = models
    local = ModelDrafter(draft, vocab_size=len(tokenizer), name="in process")
    prompt = tokenizer.encode(PROMPTS[0])
    answer = hf_greedy(target, prompt, 6)

    async def remote_trees():
        remote = RemoteDrafter(cluster.drafters[0].address, timeout_s=60)
        try:
            assert await remote.connect(tokenizer_fingerprint(load_target_parts(str(folders["target"])).tokenizer))
            assert remote.kind == "model"
            await remote.start("r", prompt)
            trees = [await remote.propose("r", 8)]
            await remote.commit("r", answer[:3])  # the session's cache is cut back to what was committed
            trees.append(await remote.propose("r", 8, assumed=answer[3:4]))
            trees.append(await remote.propose("r", 40))  # past depth x width: grown best-first
            await remote.end("r")
            return trees
        finally:
            await remote.close()

    trees = asyncio.run(remote_trees())
    local.start("r", prompt)
    expected = [local.propose("r", 8)]
    local.commit("r", answer[:3])
    expected += [local.propose("r", 8, assumed=answer[3:4]), local.propose("r", 40)]
    assert [len(t) for t in trees] == [len(t) for t in expected] and len(expected[2]) == 40
    for tree, want in zip(trees, expected):
        assert (tree.tokens, tree.parents) == (want.tokens, want.parents)
        assert tree.draft_probs == pytest.approx(want.draft_probs, abs=1e-4)


def test_greedy_output_through_the_served_draft_model_is_plain_decoding(models, cluster, tokenizer):
    target, _, folders = models
    eos = set(load_target_parts(str(folders["target"])).eos_token_ids)
    steps = []
    with Client(cluster.router_address, api_key=cluster.client_key, timeout_s=120) as client:
        for text in PROMPTS:
            prompt = tokenizer.encode(text)
            plain = hf_greedy(target, prompt, MAX_TOKENS)
            assert not eos & set(plain), "the reference should run the whole length"
            out = client.generate(prompt_ids=prompt, max_tokens=MAX_TOKENS)
            assert out.token_ids == plain, text
            assert out.stats.drafters == (str(folders["draft"]),)
            assert out.stats.accepted_tokens > 0, (text, out.stats)  # its guesses were kept ...
            steps.append(out.stats.target_steps)
    # ... and some refused: 3 steps would be 8 right guesses and the bonus token each time
    assert max(steps) > -(-MAX_TOKENS // 9), steps
