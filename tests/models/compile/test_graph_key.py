"""The compile cache's source hash (models/compile/graph_key.py) covers every file a compiled
function can inline: all of treeflow.models, its sub-packages included, megatron/ excluded."""

import shutil

import treeflow.models.compile.graph_key as graph_key


def _hash_of(root) -> str:
    return graph_key.tree_hash(str(root))


def test_source_hash_is_the_hash_of_treeflow_models():
    src = graph_key.__file__.rsplit("/compile/", 1)[0]
    assert graph_key.source_hash() == graph_key.tree_hash(src)


def test_source_hash_changes_with_a_file_in_any_sub_package(tmp_path):
    src = graph_key.__file__.rsplit("/compile/", 1)[0]
    root = tmp_path / "models"
    shutil.copytree(src, root, ignore=shutil.ignore_patterns("__pycache__"))
    before = _hash_of(root)
    assert _hash_of(root) == before  # deterministic
    for sub in ("ssm/tree.py", "attention/flex.py", "reference/decoder.py", "families.py"):
        path = root / sub
        path.write_text(path.read_text() + "\n# changed\n")
        after = _hash_of(root)
        assert after != before, sub
        before = after
    megatron = root / "megatron" / "backend.py"
    megatron.write_text(megatron.read_text() + "\n# changed\n")
    assert _hash_of(root) == before  # megatron/ is not compiled by treeflow
