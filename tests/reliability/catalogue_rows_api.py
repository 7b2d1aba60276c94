"""The catalogue's rows for the library API (treeflow.train.Policy, issue 50): the CLI rows'
contract in Python terms. Each row is one mistake a trainer's author makes calling Policy; it
must raise exactly the row's ValueError or TypeError (no other class, no traceback from deep
inside), with a message that names the argument or field and the fix; the caller's module must
be as before (every parameter's values, no `.grad`; an FSDP2 module back to its shards), and
nothing may be written to the working directory.

ROWS run in the test's process. The group rows need a process group (DDP, FSDP1, FSDP2 wrap a
module only inside one): `group_results()` runs them all in one spawned process (a world of
one, gloo) and returns what each raised and whether the module was unchanged.
"""

from __future__ import annotations

import functools

import torch

from tests.deps import require
from treeflow.stages import Forward, Fragment, Loss
from treeflow.train import Policy

transformers = require("transformers")


def model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=53, hidden_size=16, intermediate_size=24,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).eval()


def rows(generation_logprobs: bool = True):
    calls = [{"token_ids": [3, 5, 7, 9, 11, 2], "sampled_start": 3,
              **({"generation_logprobs": [-1.0, -2.0, -1.5]} if generation_logprobs else {})}]
    return [{"episode_id": "a", "advantage": 1.0, "calls": calls},
            {"episode_id": "b", "advantage": -1.0, "calls": calls}]


def state(module) -> dict:
    """What a refusal must leave alone: every parameter's values (gathered, for an FSDP2 one),
    whether it is still sharded, whether any has a gradient."""
    from torch.distributed.tensor import DTensor

    return {"values": {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                       for n, p in module.named_parameters()},
            "sharded": [isinstance(p, DTensor) for p in module.parameters()],
            "grads": [p.grad is not None for p in module.parameters()]}


def same(a: dict, b: dict) -> bool:
    return (a["sharded"] == b["sharded"] and a["grads"] == b["grads"]
            and all(torch.equal(v, b["values"][n]) for n, v in a["values"].items()))


def _policy(m):
    return Policy(m, fragment=Fragment(max_tokens=16))


def _scalar_not(t):
    return t.logprobs  # a vector, not the scalar train_step needs


# name: (what the caller does to its module, the class, the needles its message must hold)
ROWS = {
    "api-model-type": (lambda m: Policy(3), TypeError,
                       ["Policy(model=...)", "checkpoint directory or a transformers module"]),
    "api-not-transformers": (lambda m: Policy(torch.nn.Linear(2, 2)), TypeError,
                             ["not a transformers model"]),
    "api-model-twice": (lambda m: Policy("tiny", forward=Forward(model="other")), ValueError,
                        ["Forward(model='other')", "give the model in one place"]),
    "api-device": (lambda m: Policy(m, device="meta"), ValueError,
                   ["device='meta'", "move the module"]),
    "api-episodes-type": (lambda m: _policy(m).logprobs("episodes.arrow"), TypeError,
                          ["pyarrow Table or a list of dicts", "str"]),
    "api-episodes-not-dicts": (lambda m: _policy(m).logprobs([[3, 5, 7]]), TypeError,
                               ["one dict per episode"]),
    "api-unknown-field": (lambda m: _policy(m).logprobs([{**rows()[0], "turns": []}]),
                          ValueError, ["['turns']", "not in EPISODE_SCHEMA"]),
    "api-vocab": (lambda m: _policy(m).logprobs(
        [{"episode_id": "x", "calls": [{"token_ids": [1, 99, 2], "sampled_start": 1}]}]),
        ValueError, ["'x'", "99"]),
    "api-advantages-shape": (lambda m: _policy(m).loss(rows(), advantages=[1.0, 2.0, 3.0]),
                             ValueError, ["advantages has shape (3,)", "one per episode (2)"]),
    "api-loss-twice": (lambda m: _policy(m).loss(rows(), loss=Loss(), loss_fn=_scalar_not),
                       ValueError, ["loss=", "loss_fn=", "not both"]),
    "api-loss-fn-ref": (lambda m: _policy(m).loss(rows(), loss_fn=_scalar_not,
                                                  ref_logprobs=object()),
                        ValueError, ["ref_logprobs=", "read reference logprobs in your loss_fn"]),
    "api-kl-no-ref": (lambda m: _policy(m).loss(rows(), loss=Loss(kl_coef=0.1)), ValueError,
                      ["kl_coef > 0", "needs ref_logprobs"]),
    "api-no-old-logprobs": (lambda m: _policy(m).loss(rows(False), loss=Loss(kind="pg")),
                            ValueError, ["'a'", "old_logprobs is missing",
                                         "give generation_logprobs (or old_logprobs=)"]),
    "api-loss-fn-not-scalar": (lambda m: _policy(m).train_step(rows(), loss_fn=_scalar_not),
                               TypeError, ["loss_fn must return a scalar tensor"]),
}


def _group_rows(dp, mesh):
    """{name: (wrap, action, class, needles)}: `wrap` makes the caller's module from a fresh
    one (the state compared is the wrapped module's), `action` calls Policy on it."""
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    def fsdp2(m, root: bool = True):
        for layer in m.model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(m, mesh=mesh) if root else m

    return {
        "api-ddp": (DistributedDataParallel, Policy, TypeError,
                    ["DistributedDataParallel", "Pass ddp.module"]),
        "api-fsdp1": (lambda m: FullyShardedDataParallel(m, device_id=torch.device("cpu")),
                      Policy, TypeError, ["FullyShardedDataParallel (FSDP1", "fully_shard"]),
        "api-fsdp2-dp": (fsdp2, lambda m: Policy(m, dp=dp), ValueError,
                         ["Policy(fsdp_module, dp=...)", "drop dp="]),
        "api-fsdp2-root": (lambda m: fsdp2(m, root=False), Policy, TypeError,
                           ["not sharded", "apply fully_shard to the root module too"]),
        "api-fsdp2-train-step": (fsdp2, lambda m: _policy(m).train_step(rows()), ValueError,
                                 ["Policy.train_step on an FSDP2 module",
                                  "reduce_gradients() and your own optimizer"]),
        "api-fsdp2-reduce-first": (fsdp2, lambda m: _policy(m).reduce_gradients(), ValueError,
                                   ["reduce_gradients()", "call it after loss(...).backward()"]),
        "api-dp-device": (lambda m: m, lambda m: Policy(m, device="meta", dp=dp), ValueError,
                          ["device='meta'", "a rank runs on dp.device"]),
    }


def _group_rank() -> dict:
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    from treeflow.train import DataParallel

    warnings.simplefilter("ignore")  # FSDP1 says it runs NO_SHARD on a world of one
    dp = DataParallel.from_env()
    rows_ = _group_rows(dp, init_device_mesh("cpu", (1,)))
    return {name: run_row(wrap(model()), action) for name, (wrap, action, _, _) in rows_.items()}


def run_row(m, action) -> tuple:
    """(the exception's class name or None, its message, whether `m` is as before): plain
    values, so a spawned process can return them and the parent test asserts."""
    before = state(m)
    try:
        action(m)
    except Exception as e:  # noqa: BLE001 -- the row's class is checked by the caller
        return type(e).__name__, str(e), same(before, state(m))
    return None, "nothing raised", same(before, state(m))


def group_needles() -> dict:
    """{name: (class, needles)} of the group rows, read without a process group."""
    return {name: (cls, needles) for name, (_, _, cls, needles) in _group_rows(None, None).items()}


@functools.cache
def group_results() -> dict:
    from treeflow.train.launch import spawn

    return spawn(_group_rank, 1, timeout_s=240, threads=1)[0]
