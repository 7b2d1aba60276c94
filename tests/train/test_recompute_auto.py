"""`--recompute auto` (the default): the cheapest mode whose memory plan fits the card with
the planner's margin (train/memory_plan.py choose_recompute, AUTO_MARGIN 25%).

The chooser is checked against hand-built plans, among them the one the margin exists for:
the 4-layer Qwen3-30B-A3B shape on an H100 (none 96.4, selective 65.8 -- out of memory on the
card --, full 58.0 planned GiB; 79.2 GiB usable) gets full. Through the CLI on CPU with
--device-memory (the tiny model at --max-tokens 4096 in float32 plans none 757 MB, selective
608 MB, full 589 MB): the run JSON's `recompute` says the choice and stderr says why; without a
card size auto is none and says nothing; an explicit mode (--recompute, or --tuning's
recompute=) is never overridden. Plants tried: AUTO_MARGIN 0 (the H100 case picks selective),
the order reversed (full first), auto_recompute left out of cmd_train (the JSON says none).
"""

from __future__ import annotations

import json

import pytest

from treeflow.cli import main
from treeflow.train.memory_plan import AUTO_MARGIN, GIB, choose_recompute


def _gib(**modes) -> dict:
    return {m: int(v * GIB) for m, v in modes.items()}


def test_the_chooser_takes_the_cheapest_mode_that_fits_with_the_margin():
    assert AUTO_MARGIN == 0.25
    plans = _gib(none=100.0, selective=70.0, full=60.0)
    assert choose_recompute(plans, 200 * GIB)[0] == "none"
    assert choose_recompute(plans, 100 * GIB)[0] == "selective"   # 70 x 1.25 = 87.5
    assert choose_recompute(plans, 80 * GIB)[0] == "full"         # 75 <= 80 < 87.5
    assert choose_recompute(plans, 125 * GIB)[0] == "none"        # the bound is inclusive
    assert choose_recompute(plans, 125 * GIB - 1)[0] == "selective"
    mode, why = choose_recompute(plans, 100 * GIB)
    assert "70.0 GiB" in why and "25% margin" in why and "none plans 100.0" in why


def test_the_margin_covers_the_moe_selective_miss_on_the_h100():
    """Planned 65.8 GiB under selective ran out of memory on 79.2 GiB: auto must not pick it."""
    h100 = int(79.2 * GIB)
    assert choose_recompute(_gib(none=96.4, selective=65.8, full=58.0), h100)[0] == "full"
    # Nemotron-H 1.3B at 32768 tokens: selective planned 54.4, measured 50.2 on the H100
    assert choose_recompute(_gib(none=275.0, selective=54.4, full=40.0), h100)[0] == "selective"


def test_where_nothing_fits_the_least_is_taken_and_only_usable_modes_count():
    mode, why = choose_recompute(_gib(none=100.0, selective=90.0, full=85.0), 80 * GIB)
    assert mode == "full" and "no mode fits" in why
    assert choose_recompute(_gib(none=10.0), 1 * GIB)[0] == "none"  # context parallelism
    with pytest.raises(ValueError, match="no plan for any of"):
        choose_recompute({"mlp": 1}, GIB)


@pytest.fixture(scope="module")
def episodes(tmp_path_factory):
    from treeflow.tools import synth_episodes, write_episodes

    path = tmp_path_factory.mktemp("auto") / "e.arrow"
    write_episodes(synth_episodes(episodes=4, group_size=2, turns=(2, 3), system_tokens=20,
                                  user_tokens=(3, 6), completion_tokens=(3, 6),
                                  tool_tokens=(3, 6), seed=1), path)
    return str(path)


def _train(capsys, episodes, *extra):
    rc = main(["replay", episodes, "--mode", "train", "--episodes-per-step", "2", "--loss",
               "nll", "--max-tokens", "4096", "--json", *extra])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out.strip().splitlines()[-1])["recompute"], err


@pytest.mark.parametrize("card,want", [("800MiB", "selective"), ("2GiB", "none"),
                                       ("700MiB", "full")])
def test_train_at_the_default_runs_the_mode_chosen_and_says_it(capsys, episodes, card, want):
    ran, err = _train(capsys, episodes, "--device-memory", card)
    assert ran == want, err
    assert f"--recompute auto: {want}" in err


def test_without_a_card_size_auto_is_none_and_silent(capsys, episodes):
    ran, err = _train(capsys, episodes)
    assert ran == "none" and "--recompute auto" not in err


@pytest.mark.parametrize("explicit,ran", [(["--recompute", "none"], "none"),
                                          (["--tuning", "plain,recompute=mlp"], "mlp"),
                                          (["--tuning", "plain,recompute=none"], "none")])
def test_an_explicit_mode_is_never_overridden(capsys, episodes, explicit, ran):
    got, err = _train(capsys, episodes, "--device-memory", "800MiB", *explicit)
    assert got == ran and "--recompute auto" not in err, err


def test_plan_memory_says_what_auto_picks(capsys):
    """(plan's kernel is flex: at 65536 tokens none 1199 MB, selective 963 MB, full 659 MB)"""
    assert main(["plan", "--memory", "--model", "tiny", "--max-tokens", "65536", "--dtype",
                 "float32", "--recompute", "auto", "--device-memory", "1200MiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["recompute"] == "selective" and out["recompute_auto"].startswith("selective (")


def test_a_context_parallel_hybrid_is_planned_with_the_scan_it_runs():
    """Under context parallelism a rank's Mamba-2 heads run the torch scan (ssm/cp.py's
    SsmShard), so the plan on CUDA takes the torch scan's kept tensors there and the fused
    scan's without it (on CPU the torch scan's). Plant: plan the fused scan under CP (the
    planner did until a review found it): fails."""
    import argparse

    from treeflow.cli.memory import memory_knobs

    base = dict(max_tokens=8192, num_ranks=1, device="cuda", precision="mixed", dtype="bfloat16")
    one = memory_knobs(argparse.Namespace(**base, context_parallel=1), recompute="full")
    two = memory_knobs(argparse.Namespace(**base, context_parallel=2), recompute="full")
    assert one["ssm_kernel"] == "triton"
    assert two["ssm_kernel"] == "torch"
    cpu = memory_knobs(argparse.Namespace(**{**base, "device": "cpu"}, context_parallel=1),
                       recompute="full")
    assert cpu["ssm_kernel"] == "torch"
