"""The PyTorch tree-attention reference, node by node, against causal attention over each node's path."""

import pytest
import torch

from specmesh.kernels.tree_attention_reference import tree_attention_reference
from specmesh.tree import TokenTree, compile_tree


def random_tree(num_nodes: int, generator: torch.Generator) -> TokenTree:
    parents = tuple(int(torch.randint(-1, i, (1,), generator=generator)) for i in range(num_nodes))
    return TokenTree(tokens=tuple(range(num_nodes)), parents=parents, draft_probs=(1.0,) * num_nodes)


def causal_attention_over(query, key, value, scale):
    # query [heads, 1, d]; key, value [heads, n, d]: the last query sees every key (plain softmax maths)
    weights = (query @ key.transpose(-1, -2) * scale).softmax(dim=-1)
    return weights @ value


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("prefix_len", [0, 1, 13])
@pytest.mark.parametrize("seed", range(4))
def test_each_node_sees_exactly_the_prefix_and_its_ancestors(num_heads, num_kv_heads, prefix_len, seed):
    generator = torch.Generator().manual_seed(seed)
    tree = random_tree(int(torch.randint(1, 20, (1,), generator=generator)), generator)
    compiled = compile_tree(0, tree)
    rows, head_dim = compiled.num_rows, 8
    query = torch.randn(num_heads, rows, head_dim, generator=generator, dtype=torch.float64)
    key = torch.randn(num_kv_heads, prefix_len + rows, head_dim, generator=generator, dtype=torch.float64)
    value = torch.randn(num_kv_heads, prefix_len + rows, head_dim, generator=generator, dtype=torch.float64)

    out = tree_attention_reference(query, key, value, compiled.mask, head_dim**-0.5)  # [heads, rows, d]

    group = num_heads // num_kv_heads
    for row in range(rows):
        path_rows = [0] + [n + 1 for n in tree.path_to(row - 1)] if row else [0]
        keys = list(range(prefix_len)) + [prefix_len + r for r in path_rows]
        for head in range(num_heads):
            kv = head // group
            expected = causal_attention_over(
                query[head, row : row + 1], key[kv, keys], value[kv, keys], head_dim**-0.5
            )
            torch.testing.assert_close(out[head, row : row + 1], expected)
