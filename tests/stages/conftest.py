import pyarrow as pa
from hypothesis import strategies as st

from treeflow.schemas import validate_episodes


@st.composite
def episode_tables(draw, max_episodes=5, max_calls=5, vocab=4, routes=None):
    """Random episodes over a tiny vocabulary so that prefixes, duplicates and branches collide."""
    n_ep = draw(st.integers(1, max_episodes))
    use_routes = draw(st.booleans()) if routes is None else routes
    n_groups = draw(st.integers(1, n_ep))
    rows = []
    for e in range(n_ep):
        calls = []
        prev = None
        for _ in range(draw(st.integers(1, max_calls))):
            kind = draw(st.sampled_from(["append", "append", "fresh", "dup"])) if prev else "fresh"
            if kind == "append":
                toks = prev + draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=4))
            elif kind == "dup":
                toks = list(prev)
            else:
                toks = draw(st.lists(st.integers(0, vocab - 1), min_size=2, max_size=8))
            start = draw(st.integers(1, len(toks)))
            n_s = len(toks) - start
            call = {"token_ids": toks, "sampled_start": start,
                    "generation_logprobs": [-0.5] * n_s,
                    "loss_mask": draw(st.lists(st.booleans(), min_size=n_s, max_size=n_s))}
            if use_routes:
                call["routed_experts"] = [[t % 2, draw(st.integers(0, 1))] for t in toks]
            calls.append(call)
            prev = toks
        group = None if draw(st.integers(0, 4)) == 0 else f"g{e % n_groups}"  # some ungrouped
        rows.append({"episode_id": f"e{e}", "group_id": group,
                     "advantage": float(e), "calls": calls})
    return validate_episodes(pa.Table.from_pylist(rows))


def occurrences(episodes: pa.Table):
    """{(sample_index, call, offset): (prefix tokens, sampled token, prefix routes)}."""
    out = {}
    for row in episodes.to_pylist():
        for k, c in enumerate(row["calls"]):
            t = c["token_ids"]
            r = c.get("routed_experts")
            for off, pos in enumerate(range(c["sampled_start"], len(t))):
                out[(row["sample_index"], k, off)] = (
                    tuple(t[:pos]), t[pos], None if r is None else tuple(map(tuple, r[:pos])))
    return out


def check_bins(episodes: pa.Table, bins: pa.Table, max_tokens: int | None = None):
    """Every occurrence is in exactly one bin; its edge spells its context; positions are depths."""
    want = occurrences(episodes)
    seen = {}
    all_edges = [e for ids in bins.column("edge_ids").to_pylist() for e in ids]
    assert len(all_edges) == len(set(all_edges)), "an edge is owned by two bins"
    for b in bins.to_pylist():
        toks, par, pos = b["tokens"], b["parents"], b["positions"]
        if max_tokens is not None:
            assert len(toks) <= max_tokens
        for i, p in enumerate(par):
            assert p < i
            assert pos[i] == (0 if p < 0 else pos[p] + 1)
        assert len(set(b["edge_ids"])) == len(b["edge_ids"])
        for j in range(len(b["occ_edge"])):
            key = (b["occ_sample_index"][j], b["occ_call"][j], b["occ_offset"][j])
            assert key not in seen, f"occurrence {key} in two bins"
            e = b["occ_edge"][j]
            src = b["edge_sources"][e]
            path = []
            rpath = []
            n = src
            while n >= 0:
                path.append(toks[n])
                if b["routes"] is not None:
                    rpath.append(tuple(b["routes"][n]))
                n = par[n]
            prefix, target, routes = want[key]
            assert tuple(reversed(path)) == prefix, key
            assert b["edge_targets"][e] == target, key
            if routes is not None:
                assert tuple(reversed(rpath)) == routes, key
            seen[key] = b["edge_ids"][e]
    assert set(seen) == set(want), set(want) ^ set(seen)
    return seen
