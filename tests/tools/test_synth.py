import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treeflow.tools.synth import synth_episodes, write_episodes
from treeflow.schemas.episode import EPISODE_SCHEMA, read_episodes, validate_episodes

SMALL = dict(system_tokens=40, user_tokens=(5, 20), completion_tokens=(3, 15), tool_tokens=(2, 25))


def _calls(table):
    """Per episode, the list of calls as (tokens ndarray, sampled_start, call dict)."""
    out = []
    for row in table.column("calls").to_pylist():
        out.append([(np.asarray(c["token_ids"]), c["sampled_start"], c) for c in row])
    return out


def _is_strict_prefix(a, b):
    return len(a) < len(b) and np.array_equal(a, b[: len(a)])


def _pairs(episodes):
    return [(a, b) for calls in episodes for (a, _, _), (b, _, _) in zip(calls, calls[1:])]


def test_deterministic_given_seed():
    a = synth_episodes(episodes=12, group_size=4, routes=2, seed=7, **SMALL)
    b = synth_episodes(episodes=12, group_size=4, routes=2, seed=7, **SMALL)
    c = synth_episodes(episodes=12, group_size=4, routes=2, seed=8, **SMALL)
    assert a.equals(b)
    assert not a.equals(c)


def test_conforms_to_schema_and_fills_fields():
    t = synth_episodes(episodes=20, group_size=8, vocab_size=1000, seed=1)
    assert t.schema.equals(EPISODE_SCHEMA)
    assert validate_episodes(t, vocab_size=1000).equals(t)
    assert t.num_rows == 20
    assert t.column("group_id").to_pylist() == [f"g{e // 8}" for e in range(20)]
    assert t.column("episode_id").to_pylist() == [f"g{e // 8}-e{e % 8}" for e in range(20)]
    assert t.column("sample_index").to_pylist() == list(range(20))
    assert t.column("weight_version").to_pylist() == [0] * 20
    reward = t.column("reward").to_numpy()
    assert ((reward >= 0) & (reward < 1)).all()
    adv = t.column("advantage").to_numpy()
    for g in range(3):
        r, a = reward[g * 8:(g + 1) * 8], adv[g * 8:(g + 1) * 8]
        np.testing.assert_allclose(a, (r - r.mean()) / (r.std() + 1e-6), rtol=1e-5, atol=1e-6)
    tokens = np.concatenate([c[0] for calls in _calls(t) for c in calls])
    assert tokens.min() >= 1 and tokens.max() < 1000
    assert t.column("calls").combine_chunks().flatten().field("routed_experts").null_count == \
        sum(len(c) for c in _calls(t))


def test_turn_counts_and_sampled_fields():
    t = synth_episodes(episodes=64, turns=(2, 5), seed=2, **SMALL)
    n_calls = [len(c) for c in _calls(t)]
    assert min(n_calls) >= 2 and max(n_calls) <= 5 and len(set(n_calls)) > 1
    masked = with_adv = 0
    for calls in _calls(t):
        for tokens, start, c in calls:
            n = len(tokens) - start
            assert 3 <= n <= 15 and start >= 1
            lp = np.asarray(c["generation_logprobs"])
            assert len(lp) == n and (lp <= 0).all()
            assert len(c["loss_mask"]) == n
            masked += not all(c["loss_mask"])
            if c["advantages"] is not None:
                assert len(c["advantages"]) == n
                with_adv += 1
    total = sum(n_calls)
    assert 0 < masked < total * 0.2
    assert 0 < with_adv < total * 0.2


def test_append_only_calls_are_previous_call_plus_tool_output_plus_completion():
    t = synth_episodes(episodes=24, branch_prob=0.0, seed=3, **SMALL)
    for calls in _calls(t):
        for (prev, _, _), (cur, start, _) in zip(calls, calls[1:]):
            assert _is_strict_prefix(prev, cur)
            assert 2 <= start - len(prev) <= 25       # the tool output sits between them
            assert 3 <= len(cur) - start <= 15        # the sampled span is the completion


def test_branch_events_break_append_only_sometimes():
    t = synth_episodes(episodes=64, turns=(4, 8), branch_prob=0.2, seed=4, **SMALL)
    episodes = _calls(t)
    pairs = _pairs(episodes)
    broken = [(a, b) for a, b in pairs if not _is_strict_prefix(a, b)]
    assert 0 < len(broken) < len(pairs) / 2
    system = episodes[0][0][0][:40]
    roots = {"compaction": 0, "sub-agent": 0}
    for calls in episodes:
        for i, (tokens, _, _) in enumerate(calls[1:], 1):
            if not any(_is_strict_prefix(c[0], tokens) for c in calls[:i]):
                # a new root: the main system prompt (compaction) or another one (sub-agent)
                roots["compaction" if np.array_equal(tokens[:40], system) else "sub-agent"] += 1
    assert roots["compaction"] > 0 and roots["sub-agent"] > 0


def test_sub_agent_result_returns_to_main_thread():
    # after a sub-agent call, the main thread continues from the call before it, and
    # the sub-agent's completion appears in the next main call's prompt
    t = synth_episodes(episodes=64, turns=(4, 8), branch_prob=0.3, seed=5, **SMALL)
    found = 0
    for calls in _calls(t):
        for (a, _, _), (sub, s_start, _), (b, b_start, _) in zip(calls, calls[1:], calls[2:]):
            if not _is_strict_prefix(a, sub) and _is_strict_prefix(a, b) and \
                    sub[0] != calls[0][0][0]:
                between = b[len(a):b_start]
                result = sub[s_start:]
                assert np.array_equal(between[len(between) - len(result):], result)
                found += 1
    assert found > 0


def test_no_broken_pairs_without_branching():
    t = synth_episodes(episodes=32, turns=(3, 8), branch_prob=0.0, seed=6, **SMALL)
    assert all(_is_strict_prefix(a, b) for a, b in _pairs(_calls(t)))


def test_groups_share_prompts_and_all_share_the_system_prompt():
    t = synth_episodes(episodes=32, group_size=8, seed=7, **SMALL)
    episodes = _calls(t)
    prompts = [calls[0][0][: calls[0][1]] for calls in episodes]
    for g in range(4):
        group = prompts[g * 8:(g + 1) * 8]
        assert all(np.array_equal(p, group[0]) for p in group)
    assert all(np.array_equal(p[:40], prompts[0][:40]) for p in prompts)
    assert not np.array_equal(prompts[0], prompts[8])
    # episodes of a group diverge at their first completion (apart from the duplicates)
    firsts = [tuple(calls[0][0][calls[0][1]:]) for calls in episodes]
    assert len(set(firsts)) > 24


def test_duplicate_first_completions_occur():
    t = synth_episodes(episodes=256, group_size=8, turns=(1, 2), seed=8, **SMALL)
    episodes = _calls(t)
    dups = 0
    for g in range(32):
        firsts = [tuple(calls[0][0]) for calls in episodes[g * 8:(g + 1) * 8]]
        dups += len(firsts) - len(set(firsts))
    assert 0 < dups < 256 * 0.3
    # identical samples carry identical engine logprobs
    seen = {}
    for calls in episodes:
        key, lp = tuple(calls[0][0]), calls[0][2]["generation_logprobs"]
        assert seen.setdefault(key, lp) == lp


def test_routes_shape_and_sharing():
    t = synth_episodes(episodes=48, routes=4, branch_prob=0.0, seed=9, **SMALL)
    calls = t.column("calls").combine_chunks().flatten()
    routes = calls.field("routed_experts")
    assert routes.null_count == 0
    per_tok = routes.flatten()
    assert per_tok.type == pa.list_(pa.int16())
    tok_lens = [len(x) for x in calls.field("token_ids").to_pylist()]
    assert [len(r) for r in routes.to_pylist()] == tok_lens
    r_NR = np.asarray(per_tok.flatten()).reshape(-1, 4)
    assert r_NR.min() >= 0 and r_NR.max() < 128
    assert all(len(set(row)) == 4 for row in r_NR[:2000].tolist())
    # shared prefixes (consecutive append-only calls) mostly carry equal routes; a few differ
    episodes = t.column("calls").to_pylist()
    same = differ = 0
    for row in episodes:
        for a, b in zip(row, row[1:]):
            n = len(a["token_ids"])
            if a["routed_experts"] == b["routed_experts"][:n]:
                same += 1
            else:
                differ += 1
    assert differ > 0 and same > 4 * differ
    # the same token at the same depth gets the same route, anywhere in the data
    first = {}
    for row in episodes:
        for c in row:
            for d, (tok, r) in enumerate(zip(c["token_ids"][:40], c["routed_experts"][:40])):
                first.setdefault((tok, d), []).append(tuple(r))
    agree = sum(len(set(v)) == 1 for v in first.values())
    assert agree > 0.9 * len(first)


@pytest.mark.parametrize("suffix", [".arrow", ".parquet"])
def test_round_trip_through_files(tmp_path, suffix):
    t = synth_episodes(episodes=150, group_size=5, routes=2, seed=10, **SMALL)
    path = tmp_path / f"episodes{suffix}"
    write_episodes(t, path)
    assert read_episodes(str(path)).equals(t)
    if suffix == ".arrow":
        with pa.ipc.open_file(path) as reader:
            assert reader.num_record_batches == 3
    else:
        assert pq.ParquetFile(path).num_row_groups == 3


def test_write_rejects_unknown_suffix(tmp_path):
    t = synth_episodes(episodes=2, **SMALL)
    with pytest.raises(ValueError, match="arrow"):
        write_episodes(t, tmp_path / "episodes.csv")


@pytest.mark.parametrize("kwargs", [
    dict(episodes=0), dict(group_size=0), dict(turns=(0, 3)), dict(turns=(5, 3)),
    dict(system_tokens=0), dict(completion_tokens=(0, 5)), dict(branch_prob=1.5),
    dict(vocab_size=1), dict(routes=-1), dict(routes=129),
])
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        synth_episodes(**kwargs)


def test_default_sizes():
    t = synth_episodes(episodes=16, seed=11)
    lens = [len(c[0]) for calls in _calls(t) for c in calls]
    per_episode = sum(lens) / 16
    assert 5_000 < per_episode < 30_000


@settings(max_examples=25, deadline=None)
@given(episodes=st.integers(1, 12), group_size=st.integers(1, 5), t_lo=st.integers(1, 4),
       t_extra=st.integers(0, 3), branch=st.sampled_from([0.0, 0.3, 1.0]),
       routes=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_property_valid_for_any_arguments(episodes, group_size, t_lo, t_extra, branch, routes, seed):
    t = synth_episodes(episodes=episodes, group_size=group_size, turns=(t_lo, t_lo + t_extra),
                       branch_prob=branch, routes=routes, seed=seed, vocab_size=50, **SMALL)
    assert validate_episodes(t, vocab_size=50).equals(t)
    episodes_calls = _calls(t)
    assert len(episodes_calls) == episodes
    for calls in episodes_calls:
        assert t_lo <= len(calls) <= t_lo + t_extra
        for tokens, start, c in calls:
            assert 3 <= len(tokens) - start <= 15
            if routes:
                assert all(len(r) == routes for r in c["routed_experts"])
            else:
                assert c["routed_experts"] is None
    if branch == 0.0:
        assert all(_is_strict_prefix(a, b) for a, b in _pairs(episodes_calls))


def test_routes_like_reads_a_moe_checkpoints_shape(tmp_path):
    """routes_like (synth --routes-from): the route options of a MoE config's shape; a dense
    model is refused naming the directory."""
    from transformers import LlamaConfig

    from tests.models.moe_helpers import hf_model
    from treeflow.tools import routes_like

    hf_model("qwen3_moe").config.save_pretrained(tmp_path / "moe")
    routes = routes_like(str(tmp_path / "moe"))
    assert routes == dict(routes=2, route_layers=2, num_experts=6)  # layer 1 is dense
    eps = synth_episodes(episodes=2, group_size=2, turns=(1, 2), vocab_size=61, **routes)
    width = {len(r) for r in eps.column("calls").to_pylist()[0][0]["routed_experts"]}
    assert width == {4}
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=61).save_pretrained(tmp_path / "dense")
    with pytest.raises(ValueError, match=r"--routes-from .*dense: the model has no experts"):
        routes_like(str(tmp_path / "dense"))
