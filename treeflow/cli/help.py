"""The same conventions on every subcommand: --debug, --quiet, groups, defaults, a line of help.

Applied once to the built parser (`finish_parser`), so each command's own parser code stays as
it is: every subcommand gets `--debug` and `--quiet` where it has none, the options every
command shares (-h, --debug, --verbose, --quiet) join the `output` group and the groups are
listed in one order (cli/groups.py), `--help` shows each option's default once
(groups.HelpFormatter), an option declared without help gets its line from `_HELP` (one meaning
per flag name across commands), and a removed old flag name fails naming the new one
(names.py).
"""

from __future__ import annotations

import argparse

_HELP = {
    "files": "episode files (.arrow/.parquet), directories or globs",
    "--output": "output file (.arrow Arrow IPC or .parquet)",
    "--episodes": "episodes to write",
    "--group-size": "episodes per group (sharing a prompt)",
    "--min-turns": "fewest calls per episode",
    "--max-turns": "most calls per episode",
    "--vocab-size": "token ids are drawn from [1, vocab-size)",
    "--branch-prob": "chance that a call starts a new root (compaction or sub-agent)",
    "--seed": "random seed",
    "--format": "line format: openai (vLLM/SGLang responses), chat (messages + --tokenizer), "
                "nemo-rl (message_log)",
    "--advantage-field": "dotted path of the episode advantage in each line",
    "--weight-version-field": "dotted path of the policy version that sampled the episode",
    "--layout": "tree: prefix tree; chain: merge calls that are prefixes of a later call; "
                "exact: every call on its own",
    "--scope": "tree sharing across a group or within an episode (default: group when the "
               "episodes have group ids)",
    "--max-tokens": "physical tokens per bin (micro-batch)",
    "--device": "cpu, cuda or cuda:N",
    "--dtype": "compute dtype",
    "--kernel": "attention kernel (auto: the fastest the layout and device allow)",
    "--mode": "logprobs: write per-token logprobs; train: optimizer steps",
    "--json": "print one JSON object on stdout and nothing else there",
    "--lr": "peak learning rate (AdamW)",
    "--warmup-episodes": "linear warm-up length, in episodes",
    "--loss": "nll: negative log-likelihood of the sampled tokens; pg: clipped policy gradient "
              "with the episodes' advantages",
    "--norm": "loss normalisation: token mean over the step, per-sequence mean, per-sequence sum",
    "--clip-low": "pg: ratio clip below 1 - clip-low",
    "--clip-high": "pg: ratio clip above 1 + clip-high",
    "--tis-cap": "truncated importance sampling against the generation logprobs, capped here",
    "--max-grad-norm": "clip the gradient norm to this (after the all-reduce)",
    "--connect-timeout": "seconds to wait for the queue to answer",
    "--groups": "groups to sample",
    "--turns": "calls per episode",
    "--prompt-tokens": "tokens of the shared prompt",
    "--completion-tokens": "most tokens sampled per call",
    "--tool-tokens": "tokens of each synthetic tool output",
    "--temperature": "sampling temperature",
    "--num-ranks": "data-parallel ranks",
}


def finish_parser(parser: argparse.ArgumentParser) -> None:
    from treeflow.cli.config import subparsers
    from treeflow.cli.groups import GROUPS, HelpFormatter, group, regroup
    from treeflow.cli.names import add_old_names

    for sub in subparsers(parser).values():
        add_old_names(sub)
        sub.formatter_class = HelpFormatter
        have = {o for a in sub._actions for o in a.option_strings}
        out = group(sub, "output")
        if "--debug" not in have:
            out.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="show tracebacks (or TREEFLOW_DEBUG=1)")
        if "--quiet" not in have:
            out.add_argument("--quiet", action="store_true", help="print nothing but errors")
        regroup(sub, ("help", "debug", "verbose", "quiet"), "output")
        # the usage line names the positionals; the options are listed below, group by group
        formatter = sub._get_formatter()
        sub.usage = "%(prog)s [options]" + "".join(
            " " + formatter._format_args(a, a.metavar or a.dest)
            for a in sub._actions if not a.option_strings)
        sub._action_groups.sort(key=lambda g: list(GROUPS).index(g.title)
                                if g.title in GROUPS else -1)
        for action in sub._actions:
            if action.help is None:
                key = next((o for o in action.option_strings if o.startswith("--")), action.dest)
                action.help = _HELP.get(key)


__all__ = ["finish_parser"]
