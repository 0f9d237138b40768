"""The Triton tree-attention kernel against its PyTorch reference: on CPU through Triton's interpreter,
and compiled on CUDA where TRITON_INTERPRET=0 (`make gpu-check`)."""

import os

import pytest
import torch
import torch.nn.functional as F

# conftest.py sets TRITON_INTERPRET=1 before anything imports triton; without it this file needs a GPU.
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1 (set by tests/conftest.py)", allow_module_level=True)
import triton  # noqa: E402,F401  a dependency of specmesh: its absence is an error, not a skip

from specmesh.kernels.tree_attention_reference import tree_attention_reference  # noqa: E402
from specmesh.kernels.tree_attention_triton import tree_attention_triton  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"


def random_tree_mask(num_nodes: int, generator: torch.Generator) -> torch.Tensor:
    """[num_nodes, num_nodes] bool: mask[i, j] iff j is i or an ancestor of i in a random forest."""
    mask = torch.zeros(num_nodes, num_nodes, dtype=torch.bool)
    for node in range(num_nodes):
        parent = int(torch.randint(-1, node, (1,), generator=generator))  # -1: a new root
        if parent >= 0:
            mask[node] = mask[parent]
        mask[node, node] = True
    return mask


def random_inputs(num_heads, num_kv_heads, num_queries, prefix_len, head_dim, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    num_keys = prefix_len + num_queries
    query = torch.randn(num_heads, num_queries, head_dim, generator=generator)  # [num_heads, num_queries, head_dim]
    key = torch.randn(num_kv_heads, num_keys, head_dim, generator=generator)  # [num_kv_heads, num_keys, head_dim]
    value = torch.randn(num_kv_heads, num_keys, head_dim, generator=generator)  # [num_kv_heads, num_keys, head_dim]
    tree_mask = random_tree_mask(num_queries, generator)  # [num_queries, num_queries]
    return (*(t.to(DEVICE, dtype) for t in (query, key, value)), tree_mask.to(DEVICE))


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("num_queries", [1, 5, 17])
@pytest.mark.parametrize("prefix_len", [0, 3, 40])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_matches_reference(num_kv_heads, num_queries, prefix_len, head_dim):
    query, key, value, tree_mask = random_inputs(4, num_kv_heads, num_queries, prefix_len, head_dim, seed=num_queries)
    scale = head_dim**-0.5

    out = tree_attention_triton(query, key, value, tree_mask, scale)

    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(out, tree_attention_reference(query, key, value, tree_mask, scale), atol=1e-4, rtol=1e-4)


def test_several_query_and_key_blocks():
    # 70 nodes make two query blocks and two tree key blocks; a 150-key prefix makes three prefix blocks.
    query, key, value, tree_mask = random_inputs(2, 1, 70, 150, 32, seed=11)

    out = tree_attention_triton(query, key, value, tree_mask, 0.2)

    torch.testing.assert_close(out, tree_attention_reference(query, key, value, tree_mask, 0.2), atol=1e-4, rtol=1e-4)


def test_each_node_equals_causal_attention_over_its_path():
    prefix_len, num_queries, head_dim = 6, 9, 16
    query, key, value, tree_mask = random_inputs(2, 1, num_queries, prefix_len, head_dim, seed=7)
    scale = head_dim**-0.5

    out = tree_attention_triton(query, key, value, tree_mask, scale)  # [2, num_queries, head_dim]

    for node in range(num_queries):
        path = list(range(prefix_len)) + [prefix_len + j for j in tree_mask[node].nonzero().flatten().tolist()]
        expected = F.scaled_dot_product_attention(
            query[:, node : node + 1], key[:, path].expand(2, -1, -1), value[:, path].expand(2, -1, -1), scale=scale
        )
        torch.testing.assert_close(out[:, node : node + 1], expected, atol=1e-4, rtol=1e-4)


BF16_INTERPRETER_BUG = "Triton's interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584)"


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(
    torch.bfloat16, marks=pytest.mark.skipif(INTERPRETED, reason=BF16_INTERPRETER_BUG + "; it runs on CUDA"))])
def test_half_precision_returns_input_dtype(dtype):
    query, key, value, tree_mask = random_inputs(4, 2, 5, 3, 128, dtype=dtype, seed=3)
    scale = 128**-0.5

    out = tree_attention_triton(query, key, value, tree_mask, scale)

    assert out.dtype == dtype
    expected = tree_attention_reference(query.float(), key.float(), value.float(), tree_mask, scale)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_non_contiguous_inputs():
    query, key, value, tree_mask = random_inputs(2, 2, 5, 3, 16, seed=5)
    # Same values, transposed storage: [num_queries, num_heads, head_dim] viewed as [num_heads, num_queries, head_dim].
    query_t, key_t, value_t = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (query, key, value))
    assert not query_t.is_contiguous()

    out = tree_attention_triton(query_t, key_t, value_t, tree_mask.t().contiguous().t(), 0.25)

    torch.testing.assert_close(out, tree_attention_reference(query, key, value, tree_mask, 0.25), atol=1e-4, rtol=1e-4)


def _bad_inputs(case: str):
    query, key, value, tree_mask = random_inputs(4, 2, 3, 2, 16)
    if case == "head_dim":
        query, key, value, tree_mask = random_inputs(2, 2, 3, 2, 24)
    elif case == "rank":
        query = query[0]
    elif case == "key_value_shapes":
        value = value[:, :-1]
    elif case == "heads":
        query, key, value, tree_mask = random_inputs(3, 2, 3, 2, 16)
    elif case == "num_keys":
        key, value = key[:, :2], value[:, :2]
    elif case == "tree_mask":
        tree_mask = tree_mask[:2]
    elif case == "dtype":
        query, key, value = query.double(), key.double(), value.double()
    elif case == "mixed_dtypes":
        key = key.half()
    elif case == "devices":
        key = key.to("meta")
    return query, key, value, tree_mask


@pytest.mark.parametrize(
    "case,message",
    [
        ("head_dim", "head_dim must be one of"),
        ("rank", "query must be 3-D"),
        ("key_value_shapes", "key .* and value .* must both be"),
        ("heads", "num_heads 3 is not a multiple of num_kv_heads 2"),
        ("num_keys", "num_keys 2 < num_queries 3"),
        ("tree_mask", r"tree_mask must be \[3, 3\]"),
        ("dtype", "dtype must be one of"),
        ("mixed_dtypes", "must share one dtype"),
        ("devices", "must be on one device"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_problem_before_any_launch(monkeypatch, case, message):
    import specmesh.kernels.tree_attention_triton as kernel_module

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("the kernel was launched with bad inputs")

    monkeypatch.setattr(kernel_module, "_tree_attention_kernel", NoLaunch())
    query, key, value, tree_mask = _bad_inputs(case)
    with pytest.raises(ValueError, match=message):
        tree_attention_triton(query, key, value, tree_mask, 0.2)


def test_keys_may_be_a_slice_of_a_larger_cache_buffer():
    query, key, value, tree_mask = random_inputs(4, 2, 5, 7, 16, seed=9)
    buffer = torch.zeros(2, 2, 64, 16, device=DEVICE)  # [k/v, kv_heads, capacity, head_dim], like a KV session
    buffer[0, :, :12], buffer[1, :, :12] = key, value
    key_view, value_view = buffer[0, :, :12], buffer[1, :, :12]
    assert not key_view.is_contiguous() and key_view.stride(-1) == 1

    out = tree_attention_triton(query, key_view, value_view, tree_mask, 0.25)

    torch.testing.assert_close(out, tree_attention_reference(query, key, value, tree_mask, 0.25), atol=1e-4, rtol=1e-4)
