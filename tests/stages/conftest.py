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


@st.composite
def branching_groups(draw, max_groups=2, max_group_size=3, max_calls=3, vocab=5):
    """GRPO-like groups that share a prompt and diverge, with sampled tokens after the branch.

    In every group the first two episodes' first completions share a (possibly
    empty) sampled stem, then take different tokens and go on for at least one
    more sampled token, so the group's tree has a branch node with sampled
    descendants in a later branch, where a node's DFS index exceeds its depth.
    Later calls append a tool result and a completion, restart from a fresh
    prompt, or repeat the previous call (duplicate samples); masks are random.
    """
    tok = st.integers(0, vocab - 1)
    rows = []
    for g in range(draw(st.integers(1, max_groups))):
        prompt = draw(st.lists(tok, min_size=1, max_size=6))
        stem = draw(st.lists(tok, min_size=0, max_size=3))
        size = draw(st.integers(2, max_group_size))
        split = draw(st.lists(tok, min_size=2, max_size=2, unique=True))
        split += draw(st.lists(tok, min_size=size - 2, max_size=size - 2))
        for e in range(size):
            first = prompt + stem + [split[e]] + draw(st.lists(tok, min_size=1, max_size=4))
            seqs = [(first, len(prompt))]
            for _ in range(draw(st.integers(0, max_calls - 1))):
                prev = seqs[-1][0]
                kind = draw(st.sampled_from(["append", "append", "fresh", "dup"]))
                if kind == "append":
                    ctx = prev + draw(st.lists(tok, min_size=1, max_size=3))
                    seqs.append((ctx + draw(st.lists(tok, min_size=1, max_size=4)), len(ctx)))
                elif kind == "fresh":
                    ctx = draw(st.lists(tok, min_size=1, max_size=5))
                    seqs.append((ctx + draw(st.lists(tok, min_size=1, max_size=4)), len(ctx)))
                else:
                    seqs.append(seqs[-1])
            calls = []
            for toks, start in seqs:
                n_s = len(toks) - start
                calls.append({"token_ids": toks, "sampled_start": start,
                              "generation_logprobs": [-0.5] * n_s,
                              "loss_mask": draw(st.lists(st.booleans(), min_size=n_s, max_size=n_s))})
            rows.append({"episode_id": f"g{g}e{e}", "group_id": f"g{g}",
                         "advantage": float(draw(st.integers(-2, 2))), "calls": calls})
    return validate_episodes(pa.Table.from_pylist(rows))


def edges_after_a_branch(layouts: pa.Table) -> int:
    """Loss edges whose source lies in a later branch of some branch node (index > depth there).

    In DFS pre-order a node's first child is the next node, so node i is a later
    sibling exactly when parents[i] >= 0 and parents[i] != i - 1; a node lies
    after a branch when it or one of its ancestors is a later sibling.
    """
    count = 0
    for lay in layouts.to_pylist():
        par = lay["parents"]
        after = [False] * len(par)
        for i, p in enumerate(par):
            after[i] = p >= 0 and (p != i - 1 or after[p])
        count += sum(after[par[c]] for c in lay["edge_nodes"] if par[c] >= 0)
    return count
