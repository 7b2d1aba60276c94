"""The command line's argument groups, declared once and shared by the commands that take them.

`model_options` (replay, stream), `add_train_options` with `add_rl_options` and
`add_logger_options` (replay and stream in --mode train), `queue_options` (stream, rollout,
gate), `add_sampling_options` (rollout, gate). Each flag is the name of the stage field it fills
(treeflow/cli/configs.py builds the stages) and sits in one option group (treeflow/cli/groups.py:
its --help heading and its --config key); help lines for flags declared without one come from
treeflow/cli/help.py.
"""

from __future__ import annotations

from treeflow.cli.groups import group
from treeflow.cli.names import LOGPROBS_EPISODES_PER_STEP
from treeflow.compile_cache import add_option as add_compile_cache_option
from treeflow.engines import ENGINES
from treeflow.steps import GROUP_WINDOW

__all__ = ["add_logger_options", "add_rl_options", "add_sampling_options", "add_train_options",
           "group_window_option", "layout_options",
           "model_options",
           "queue_options"]


def layout_options(p) -> None:
    """How episodes become layouts (Pack's options): replay, stream and plan share them."""
    s = group(p, "layout")
    s.add_argument("--layout", choices=("tree", "chain", "exact"), default="tree")
    s.add_argument("--scope", choices=("episode", "group"), default=None)
    s.add_argument("--share-rules", choices=("default", "nrl"), default="default",
                   help="prefix sharing: default (every token whose recomputation is identical) "
                        "or nrl (NeMo RL's exact-call rules: replica, weight-version and "
                        "KV-page cuts from the calls' execution metadata)")


def model_options(p) -> None:
    """Options shared by replay and stream, so the two run the same episodes the same way."""
    s = group(p, "model")
    s.add_argument("--model", default="tiny", help="'tiny' (built-in) or a local HF checkpoint dir")
    s.add_argument("--backend", choices=("reference", "megatron"), default="reference",
                   help="model backend: treeflow's PyTorch decoder or megatron-core's GPTModel "
                        "(pip install 'treeflow[megatron]')")
    layout_options(p)
    group(p, "layout").add_argument("--max-tokens", type=int, default=16384)
    s.add_argument("--device", default="cpu")
    s.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    s.add_argument("--kernel", choices=("auto", "dense", "flex", "causal", "runs"),
                   default="auto")
    s.add_argument("--chunk-size", type=int, default=1024, help="edges per vocabulary chunk")
    s.add_argument("--tuning", default="auto",
                   help="speed levers of the reference backend: a preset (plain: the reference "
                        "path; fast: compiled layers, fused edge loss, tuned flex tiles; lean: "
                        "fast + MLP recomputation; auto: fast on a Hopper GPU, else plain, said "
                        "on stderr) and/or name=value,... e.g. fast,recompute=attention or "
                        "compile_layers=1,flex.BLOCK_N=64 (treeflow.models.Tuning)")
    add_compile_cache_option(s)
    s.add_argument("--routing", choices=("auto", "replay", "recompute"), default="auto",
                   help="MoE experts: replay the episodes' routed_experts on every tree node "
                        "(combine weights from the current router), or let the router recompute "
                        "them; auto = replay when the episodes carry routes and the model has "
                        "experts")
    s.add_argument("--recompute", choices=("auto", "none", "selective", "full", "mlp",
                                           "attention"), default="auto",
                   help="activation recomputation in training (reference backend): full "
                        "checkpoints each layer (+~33%% FLOPs, activations ~ one [tokens, hidden] "
                        "per layer); selective keeps matmul and attention outputs, recomputes "
                        "norms, activations and the Mamba-2 scan's chunk tensors; mlp/attention: "
                        "that part of each attention-decoder layer; auto (default): --tuning's "
                        "if it sets one, else where the card's size is known (CUDA, "
                        "--device-memory) the cheapest of none/selective/full whose memory plan "
                        "fits it with a 25%% margin (said on stderr), elsewhere none. "
                        "docs/how-to/memory.md")
    s.add_argument("--ssm-fork", choices=("exact", "chunk"), default=None,
                   help="Mamba-2 and Gated DeltaNet hybrids: fork a branch's recurrent state at "
                        "the branch token "
                        "(exact) or at the last scan-chunk boundary, replaying the tail (chunk); "
                        "default: chunk")
    s.add_argument("--ssm-state-dtype", choices=("float32", "bfloat16"), default=None,
                   help="Mamba-2 hybrids: dtype of the materialised inter-chunk states in "
                        "forward and backward (default float32), whatever --dtype is; Gated "
                        "DeltaNet: of the states handed to branches")
    s.add_argument("--ssm-kernel", choices=("auto", "torch", "triton"), default=None,
                   help="Mamba-2 hybrids: the tree scan's implementation: torch (the reference) "
                        "or triton (fused kernels, CUDA; pip install 'treeflow[triton]'); "
                        "default auto: triton on CUDA, torch elsewhere")
    s.add_argument("--ssm-precision", choices=("auto", "ieee", "tf32x3", "bf16"), default=None,
                   help="Mamba-2 hybrids, triton scan: its products' precision: ieee (float32), "
                        "tf32x3 (three TF32 passes, about float32) or bf16 (bf16 operands, "
                        "float32 accumulate and states, as mamba_ssm); default auto: ieee for "
                        "--dtype float32, bf16 for bfloat16 (docs/how-to/hybrid.md)")
    s.add_argument("--entropy", action="store_true", help="also write per-token entropies")
    s.add_argument("--allow-nonfinite", action="store_true",
                   help="write (train on) NaN/inf logprobs and losses with a warning instead of "
                        "stopping; a non-finite gradient never steps")
    group(p, "data").add_argument("--episodes-per-step", type=int, default=None,
                   help="episodes planned and run together: an optimizer step in --mode train "
                        "(whole groups; required there), a window of results in --mode logprobs "
                        f"(default {LOGPROBS_EPISODES_PER_STEP})")
    group_window_option(p)
    par = group(p, "parallel")
    par.add_argument("--engine", choices=tuple(ENGINES), default="local",
                     help="local: one process; ray: a Ray Data graph (RAY_ADDRESS or a local "
                          "cluster)")
    par.add_argument("--prefetch", type=int, default=2, help="windows prepared ahead (engine local)")
    group(p, "train").add_argument("--mode", choices=("logprobs", "train"), default="logprobs")
    out = group(p, "output")
    out.add_argument("-o", "--output", default=None,
                     help="result file, .arrow (Arrow IPC) or .parquet (logprobs mode)")
    out.add_argument("--json", action="store_true")
    out.add_argument("--quiet", action="store_true", help="no progress bar, no summary")


def group_window_option(p) -> None:
    """--group-window: the look-ahead in which a step gathers a group (treeflow/steps.py)."""
    group(p, "data").add_argument(
        "--group-window", type=int, default=GROUP_WINDOW, metavar="N",
        help="a step holds whole groups, taken in the order they complete in the input; a "
             "group's episodes must lie within N consecutive episodes (else it is refused)")


def add_train_options(p) -> None:
    """--mode train's options: the step, checkpoints, data-parallel ranks, loss and loggers."""
    g = group(p, "train")
    g.add_argument("--steps", type=int, default=1,
                   help="optimizer steps to train, each of --episodes-per-step episodes (stream: "
                        "at most; ends earlier, said on stderr, when the queue closes first)")
    g.add_argument("--lr", type=float, default=1e-5)
    g.add_argument("--warmup-episodes", type=int, default=0)
    g.add_argument("--decay-episodes", type=int, default=None, help="cosine decay length")
    g.add_argument("--max-grad-norm", type=float, default=1.0)
    g.add_argument("--precision", choices=("mixed", "pure"), default="mixed",
                   help="mixed: float32 weights and AdamW, --dtype is the compute dtype; "
                        "pure: everything in --dtype (for comparison)")
    g.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="the card's memory (e.g. 80GiB) for the check before the model loads: "
                        "a run whose predicted per-rank peak (treeflow plan --memory) exceeds it "
                        "is refused, naming the flag to change; default: the CUDA device's "
                        "total memory, no check on CPU")
    g.add_argument("--grad-sum", choices=("float32", "float64"), default="float32",
                   help="float64: exact gradient sums, independent of bin order and rank count")
    c = group(p, "checkpoint")
    c.add_argument("--save", default=None,
                   help="checkpoint directory: one step-NNNNNN directory per save, 'latest' names "
                        "the newest (written at the end and every --save-every steps)")
    c.add_argument("--save-every", type=int, default=0, help="also save every N steps")
    c.add_argument("--keep", type=int, default=None,
                   help="keep only the newest K checkpoints (default: all)")
    c.add_argument("--resume", default=None,
                   help="continue from the newest complete checkpoint in this directory")
    c.add_argument("--trust-checkpoint", action="store_true",
                   help="also resume a checkpoint without a manifest (an older treeflow's or a "
                        "bare DCP directory), which cannot be verified; only one you trust")
    c.add_argument("--allow-different-data", action="store_true",
                   help="resume even if the data files or step options differ from the checkpoint's")
    r = group(p, "parallel")
    r.add_argument("--num-ranks", type=int, default=1,
                   help="data-parallel ranks: training processes (one GPU each with --device "
                        "cuda); with --engine ray, forward actors")
    r.add_argument("--launcher", choices=("spawn", "ray"), default="spawn",
                   help="how --num-ranks start: spawned local processes, or a Ray actor group "
                        "(one GPU per actor with --device cuda)")
    r.add_argument("--shard-params", action="store_true",
                   help="shard parameters, gradients and AdamW state over the ranks (FSDP2)")
    r.add_argument("--offload", action="store_true",
                   help="with --shard-params: keep the float32 shards, gradients and AdamW "
                        "state in host memory, AdamW stepping on the host (FSDP2's "
                        "CPUOffloadPolicy)")
    add_rl_options(p)
    add_logger_options(p)


def add_rl_options(p) -> None:
    """The loss and the advantages it weighs (Reduce's Loss, the Advantage stage)."""
    g = group(p, "loss")
    g.add_argument("--loss", choices=("nll", "pg"), default="pg")
    g.add_argument("--norm", choices=("token", "seq-mean", "seq-sum"), default="token")
    g.add_argument("--clip-low", type=float, default=0.2)
    g.add_argument("--clip-high", type=float, default=0.28)
    g.add_argument("--tis-cap", type=float, default=None)
    g.add_argument("--advantage", choices=("grpo", "rloo", "none"), default=None,
                   help="compute each episode's advantage from 'reward' within its group: grpo "
                        "(r - mean) / (std + eps), rloo r - mean of the others, none: use the "
                        "episodes' stored 'advantage' (default: the stored one)")
    g.add_argument("--no-std-normalize", dest="std_normalize", action="store_false",
                   help="grpo without the division by the group's std (Dr. GRPO)")
    g.add_argument("--advantage-eps", type=float, default=1e-6,
                   help="grpo: eps added to the group's std")
    g.add_argument("--entropy-coef", type=float, default=0.0,
                   help="entropy bonus: the loss subtracts this times the mean entropy of the "
                        "sampled tokens' distributions (the forward also computes entropies)")
    g.add_argument("--kl-coef", type=float, default=0.0,
                   help="KL penalty: the loss adds this times the k3 estimate exp(r - p) - (r - p) "
                        "- 1 per loss token, r the --ref-model's logprob (needs --ref-model)")
    g.add_argument("--ref-model", default=None, metavar="DIR",
                   help="the frozen reference policy of the KL penalty (a local HF checkpoint "
                        "with the policy's tokenizer, e.g. the initial policy); it runs every "
                        "bin beside the policy, in --dtype, never trained")


def add_logger_options(parser) -> None:
    """--logger and the trackers' settings (unset ones: the tracker's own default), and the
    step logs every run can write (--metrics, --tensorboard)."""
    g = group(parser, "logger")
    g.add_argument("--metrics", default=None,
                   help="one JSON line per step (a new file; on --resume, cut back to the checkpoint)")
    g.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="also log each step's metrics to TensorBoard event files in DIR")
    g.add_argument("--logger", action="append", default=None, metavar="NAME[,NAME]",
                   help="trackers each step's metrics also go to, repeatable or a comma list: "
                        "wandb (pip install 'treeflow[wandb]'; WANDB_MODE=offline to log "
                        "locally), mlflow (pip install 'treeflow[mlflow]'), console (the "
                        "progress bar and table, always on; accepted as verl's name for it)")
    g.add_argument("--logger-project", default="treeflow",
                   help="wandb project / MLflow experiment name")
    g.add_argument("--logger-run-name",
                   help="wandb run name / MLflow run name (default: the tracker's own)")
    g.add_argument("--logger-dir", metavar="DIR",
                   help="where wandb writes its run files (default: WANDB_DIR or ./wandb)")
    g.add_argument("--mlflow-tracking-uri", metavar="URI",
                   help="MLflow tracking URI, e.g. file:./mlruns or http://host:5000 "
                        "(default: MLFLOW_TRACKING_URI)")


def queue_options(s) -> None:
    """Where the queue is and how it behaves: a queue this command starts, or the one it joins."""
    g = group(s, "queue")
    g.add_argument("--queue", default=None, help="embedded: a queue name (its socket in "
                   "$XDG_RUNTIME_DIR/treeflow) or a socket path in a private directory (none: in "
                   "this process), or tcp://HOST:PORT for other hosts; transferqueue: the queue's "
                   "name on the Ray cluster")
    g.add_argument("--queue-secret", default=None, metavar="FILE",
                   help="tcp:// queues: the shared secret (64 hex digits, mode 0600; the same "
                   "file on every host; or set $TREEFLOW_QUEUE_SECRET); needed beyond loopback")
    g.add_argument("--queue-backend", choices=("embedded", "transferqueue"), default="embedded",
                   help="queue backend (transferqueue: pip install 'treeflow[tq]')")
    g.add_argument("--capacity", type=int, default=1024, help="most episodes the queue holds")
    g.add_argument("--lease-seconds", type=float, default=60.0,
                   help="a consumer silent this long is presumed dead; its step is redelivered")
    g.add_argument("--connect-timeout", type=float, default=120.0)
    g.add_argument("--close-when", default="all", metavar="all|first|N",
                   help="a queue this command starts closes when every producer has closed (all), "
                   "at the first (first), or once N have closed and none is open")
    g.add_argument("--max-attempts", type=int, default=3,
                   help="consumers that may reject a bad step before it is dead-lettered")
    g.add_argument("--rate", type=float, default=None, help="producer: episodes per second at most")


def add_sampling_options(p, *, group_size_help: str | None = None) -> None:
    """What a live producer samples (`rollout` and `gate` alike): the Rollout fields as flags."""
    s = group(p, "sampling")
    s.add_argument("--group-size", type=int, default=4, help=group_size_help)
    s.add_argument("--turns", type=int, nargs=2, default=(2, 3))
    s.add_argument("--prompt-tokens", type=int, nargs=2, default=(16, 32))
    s.add_argument("--completion-tokens", type=int, nargs=2, default=(4, 12))
    s.add_argument("--tool-tokens", type=int, nargs=2, default=(4, 12))
    s.add_argument("--temperature", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=0)
