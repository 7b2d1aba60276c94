"""treeflow/_json.py: JSON with a nesting limit; every failure a ValueError naming the input."""

import json

import pytest

from treeflow._json import loads


@pytest.mark.parametrize("text", ["[" * 64 + "]" * 64, '{"a":' * 64 + "1" + "}" * 64])
def test_the_limit_itself_is_read(text):
    assert loads(text, what="x", max_depth=64) == json.loads(text)


@pytest.mark.parametrize("text", ["[" * 65 + "]" * 65, '{"a":' * 65 + "1" + "}" * 65,
                                  "[" * 100_000 + "]" * 100_000, "[" * 100_000])
def test_deeper_is_refused_naming_what(text):
    with pytest.raises(ValueError, match=r"^frame header: JSON nested more than the 64 levels"):
        loads(text.encode(), what="frame header", max_depth=64)


def test_brackets_and_escaped_quotes_inside_strings_are_not_levels():
    text = r'[{"a": "[[[[\"{{{{", "b": ["]]]]\\"]}]'
    assert loads(text, what="x", max_depth=3) == json.loads(text)
    with pytest.raises(ValueError, match="more than the 2 levels"):
        loads(text, what="x", max_depth=2)


@pytest.mark.parametrize("text, needle", [("[1,", "not valid JSON"), (b"\xff", "not UTF-8"),
                                          ('{"n": ' + "9" * 5000 + "}", "a value cannot be read")])
def test_other_failures_are_one_value_error_naming_what(text, needle):
    with pytest.raises(ValueError, match=f"^log line 3: {needle}"):
        loads(text, what="log line 3", max_depth=8)


@pytest.mark.parametrize("text, needle", [("[" * 100_000 + "]" * 100_000, "nested more than"),
                                          ('{"a": 1, "a": 2}', "key 'a' appears twice")])
def test_a_models_config_and_a_safetensors_index_are_read_through_it(tmp_path, text, needle):
    """What a user's checkpoint directory holds is read by the one reader: a config.json nested
    100,000 deep was a RecursionError traceback, a repeated key silently the last value."""
    from treeflow.models import ModelConfig
    from treeflow.tensorfile import stored_files

    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=f"config.json: .*{needle}"):
        ModelConfig.from_hf_dir(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ValueError, match=f"index.json.*{needle}"):
        stored_files(str(tmp_path), "model")
