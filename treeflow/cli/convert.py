"""`treeflow convert`: chat logs (JSON lines) to an episode file, with a report of what was read.

Parsing and display only; the converters live in `treeflow.io`.
"""

from __future__ import annotations

import json
import os

from treeflow._display import console, progress, table
from treeflow.cli.groups import group

_NONE = ("none", "")


def _field(value: str | None, default: str | None) -> str | None:
    if value is None:
        return default
    return None if value.lower() in _NONE else value


def converter_from_args(args):
    """The converter of --format; None for `episodes` (episode files read back, for an export)."""
    from treeflow.io import ATIFTrajectories, ChatTemplateTokens, FieldMap, NemoRLMessageLog, OpenAITokens

    if args.format == "episodes":
        if not args.output.endswith(".jsonl"):
            raise ValueError(f"--format episodes reads episode files to export them: give -o "
                             f"FILE.jsonl (ATIF v1.8), not {args.output!r}")
        return None
    nemo = args.format == "nemo-rl"
    eid_default = {"nemo-rl": "@line", "atif": "trajectory_id"}.get(args.format, "episode_id")
    fields = FieldMap(episode_id=_field(args.episode_id_field, eid_default) or "@line",
                      group_id=_field(args.group_id_field, None),
                      reward=_field(args.reward_field, "total_reward" if nemo else None),
                      advantage=_field(args.advantage_field, None),
                      weight_version=_field(args.weight_version_field, None))
    if args.tokenizer is not None and args.format != "chat":
        raise ValueError(f"--tokenizer is only used by --format chat (logs without token ids); the "
                         f"{args.format!r} format reads the engine's token ids as logged")
    if args.format != "openai" and (args.num_experts is not None or args.route_width is not None):
        raise ValueError(f"--num-experts and --route-width check engine route payloads, which only "
                         f"--format openai reads; drop them for --format {args.format}")
    if args.format == "openai":
        return OpenAITokens(fields=fields, calls_field=args.calls_field,
                            num_experts=args.num_experts, route_width=args.route_width)
    if args.format == "chat":
        if args.tokenizer is None:
            raise ValueError("--format chat needs --tokenizer DIR (a local Hugging Face tokenizer "
                             "with a chat template) to tokenise the messages")
        return ChatTemplateTokens(tokenizer=args.tokenizer, fields=fields,
                                  messages_field=args.messages_field)
    if args.format == "atif":
        return ATIFTrajectories(fields=fields)
    return NemoRLMessageLog(fields=fields, message_log_field=args.message_log_field,
                            require_logprobs=not args.no_logprobs)


def cmd_convert(args) -> int:
    from treeflow.io import convert

    converter = converter_from_args(args)
    from treeflow.atomic import refuse_inputs

    for p in args.files:
        if not os.path.isfile(p):
            raise ValueError(f"{p}: no such file")
    refuse_inputs(args.output, args.files)
    from treeflow.lock import claim_output

    claim_output(args.output, option="-o")
    total = sum(os.path.getsize(p) for p in args.files)
    with progress("convert", total, args.json or args.quiet, unit="bytes") as advance:
        report = convert(args.files, args.output, converter, batch_rows=args.batch_rows,
                         on_progress=lambda nbytes, eps, toks: advance(nbytes, episodes=eps, tokens=toks))
    out = report.as_dict()
    out["output"] = args.output
    if not args.quiet:
        err = console(stderr=True)
        for w in report.warnings:
            err.print(f"[bold yellow]warning:[/] {w}", highlight=False, soft_wrap=True)
    if args.json:
        print(json.dumps(out))
    elif not args.quiet:
        rows = [(k, ("yes" if v else "no") if isinstance(v, bool) else v)
                for k, v in out.items() if k not in ("warnings", "output")]
        console().print(table(f"convert: {args.format} -> {args.output}", rows))
        console().print(f"episodes written to {args.output}; next: treeflow inspect {args.output} --plot DIR")
    return 0


def add_convert_parser(sub) -> None:
    s = sub.add_parser("convert", help="chat logs (JSON lines) -> an episode file (.arrow/.parquet)",
                       description="Convert chat rollouts, one episode per JSON line, to treeflow "
                                   "episodes. Formats: openai (vLLM/SGLang responses with token ids "
                                   "and logprobs), chat (messages only, retokenised with --tokenizer), "
                                   "nemo-rl (message_log with token_ids / generation_logprobs), "
                                   "atif (ATIF v1.8 trajectories with token ids), episodes "
                                   "(treeflow files, to export as ATIF).")
    g = group(s, "data")
    g.add_argument("files", nargs="+", help="JSON-lines logs, one episode per line")
    g.add_argument("--format", choices=("openai", "chat", "nemo-rl", "atif", "episodes"), required=True,
                   help="the input: engine responses, chat messages, NeMo RL logs, ATIF v1.8 "
                        "trajectories, or treeflow episode files (to export with -o X.jsonl)")
    g.add_argument("--tokenizer", default=None, help="local HF tokenizer dir (--format chat)")
    # the fields: dotted paths into each line, 'none' to leave one unmapped
    g.add_argument("--episode-id-field", default=None,
                   help="dotted path of the episode id ('none': unmapped; default: episode_id, "
                        "nemo-rl: @line, that is FILE:LINE)")
    g.add_argument("--group-id-field", default=None,
                   help="dotted path of the GRPO group id (default: unmapped)")
    g.add_argument("--reward-field", default=None,
                   help="dotted path of the reward (default: unmapped, nemo-rl: total_reward)")
    g.add_argument("--advantage-field", default=None)
    g.add_argument("--weight-version-field", default=None)
    g.add_argument("--calls-field", default="calls", help="openai: the list of engine responses")
    g.add_argument("--messages-field", default="messages", help="chat: the message list")
    g.add_argument("--num-experts", type=int, default=None,
                   help="openai: routed experts per MoE layer; route ids outside [0, N) are "
                        "refused; N <= 255 stores routes as uint8 (else int16)")
    g.add_argument("--route-width", type=int, default=None,
                   help="openai: MoE layers x top_k; routes of another width are refused")
    g.add_argument("--message-log-field", default="message_log", help="nemo-rl: the message log")
    g.add_argument("--no-logprobs", action="store_true",
                   help="nemo-rl: take assistant messages without generation_logprobs as sampled")
    out = group(s, "output")
    out.add_argument("-o", "--output", required=True,
                     help="episode file (.arrow or .parquet) or ATIF v1.8 trajectories (.jsonl)")
    out.add_argument("--batch-rows", type=int, default=256, help="episodes per written batch")
    out.add_argument("--json", action="store_true", help="print one JSON object (the report)")
    out.add_argument("--quiet", action="store_true", help="no progress, no summary, no warnings")
    s.set_defaults(fn=cmd_convert)


__all__ = ["add_convert_parser", "cmd_convert", "converter_from_args"]
