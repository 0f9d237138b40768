import pytest
import torch

from specmesh.fusion import fuse_trees
from specmesh.tree import ROOT, TokenTree, chained, compile_tree


def test_chain_compiles_to_causal_mask():
    compiled = compile_tree(7, TokenTree.chain([1, 2, 3]))
    assert compiled.input_ids.tolist() == [7, 1, 2, 3]
    assert compiled.depths.tolist() == [0, 1, 2, 3]
    assert torch.equal(compiled.mask, torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    assert compiled.retrieve_indices.tolist() == [[0, 1, 2, 3]]


def test_branching_tree_mask_positions_and_paths():
    # root -> a(0) -> c(2); root -> b(1) -> d(3) -> e(4)
    tree = TokenTree(tokens=(10, 11, 12, 13, 14), parents=(ROOT, ROOT, 0, 1, 3), draft_probs=(0.5,) * 5)
    compiled = compile_tree(9, tree)
    assert compiled.depths.tolist() == [0, 1, 1, 2, 2, 3]
    expected_ancestors = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 2, 4], 5: [0, 2, 4, 5]}
    for row, ancestors in expected_ancestors.items():
        assert compiled.mask[row].nonzero().flatten().tolist() == ancestors
    assert compiled.retrieve_indices.tolist() == [[0, 1, 3, -1], [0, 2, 4, 5]]
    assert compiled.children == [[0, 1], [2], [3], [], [4], []]


def test_from_paths_merges_prefixes_and_truncation_stays_a_tree():
    tree = TokenTree.from_paths([[1, 2, 3], [1, 2, 4], [5]])
    assert tree.tokens == (1, 2, 3, 4, 5)
    assert tree.parents == (ROOT, 0, 1, 1, ROOT)
    assert tree.truncated(3) == TokenTree((1, 2, 3), (ROOT, 0, 1), (1.0, 1.0, 1.0))
    assert tree.path_to(3) == [0, 1, 3]


def test_invalid_trees_are_refused():
    with pytest.raises(ValueError, match="parents must precede"):
        TokenTree(tokens=(1, 2), parents=(1, ROOT), draft_probs=(1.0, 1.0))
    with pytest.raises(ValueError, match="differ in length"):
        TokenTree(tokens=(1,), parents=(), draft_probs=())


def test_fusion_merges_agreeing_drafters_and_keeps_ancestors_first():
    a = TokenTree.chain([1, 2, 3], [0.9, 0.8, 0.7])
    b = TokenTree.chain([1, 2, 9], [0.6, 0.5, 0.9])
    c = TokenTree.chain([4], [0.3])
    fused = fuse_trees([a, b, c], budget=4)
    assert len(fused) == 4
    for i, parent in enumerate(fused.parents):
        assert parent < i
    paths = {tuple(fused.tokens[n] for n in fused.path_to(i)) for i in range(len(fused))}
    # [1] and [1, 2] are backed by two drafters and come first; then the strongest continuation
    assert {(1,), (1, 2), (1, 2, 3)} <= paths
    assert fused.tokens[:2] == (1, 2)
    assert fuse_trees([a, b], budget=0) == TokenTree()
    assert fuse_trees([], budget=5) == TokenTree()


def test_within_depth_drops_deep_nodes_and_renumbers():
    tree = TokenTree((1, 2, 3, 4), (ROOT, 0, ROOT, 1), (0.9, 0.8, 0.7, 0.6))
    shallow = tree.within_depth(1)
    assert shallow == TokenTree((1, 3), (ROOT, ROOT), (0.9, 0.7))
    assert tree.within_depth(2) == TokenTree((1, 2, 3), (ROOT, 0, ROOT), (0.9, 0.8, 0.7))
    assert tree.within_depth(5) is tree


def test_likeliest_path_and_re_rooting_below_a_child():
    #        root
    #       /    \
    #   5 (.3)   6 (.6)
    #    |       /    \
    #   7 (.9) 8 (.2) 9 (.7)
    #                  |
    #                 4 (.5)
    tree = TokenTree((5, 6, 7, 8, 9, 4), (-1, -1, 0, 1, 1, 4), (0.3, 0.6, 0.9, 0.2, 0.7, 0.5))
    assert tree.likeliest_path() == [6, 9, 4]
    below = tree.below(6)
    assert below == TokenTree((8, 9, 4), (-1, -1, 1), (0.2, 0.7, 0.5))
    assert tree.below(5) == TokenTree((7,), (-1,), (0.9,))
    assert tree.below(3) is None
    assert TokenTree().likeliest_path() == [] and TokenTree().below(1) is None


def test_a_chunk_chained_before_a_tree_compiles_as_the_whole_tree_would():
    """A pass that caches a history's chunk and verifies the tree after it: the chunk's rows are a chain,
    the tree hangs below its last; built from tensors, it equals ``compile_tree`` of the whole."""
    branching = TokenTree((5, 6, 7, 8), (ROOT, ROOT, 0, 1), (0.5, 0.4, 0.3, 0.2))
    for chunk, tree in [((11,), branching), ((11, 12, 13), branching), ((11, 12), TokenTree()), ((11, 12, 13), None)]:
        got = chained(chunk, compile_tree(4, tree) if tree is not None else None)
        if tree is None:
            want = compile_tree(chunk[0], TokenTree.chain(chunk[1:]))
        else:
            whole = TokenTree(chunk[1:] + (4,) + tree.tokens,
                              tuple(range(-1, len(chunk) - 1)) + tuple(len(chunk) - 1 if p == ROOT else len(chunk) + p
                                                                       for p in tree.parents),
                              (1.0,) * len(chunk) + tree.draft_probs)
            want = compile_tree(chunk[0], whole)
        for name in ("input_ids", "depths", "mask", "retrieve_indices"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (chunk, tree, name)
        assert got.children == want.children and got.tree == want.tree
    only = compile_tree(4, branching)
    assert chained((), only) is only
