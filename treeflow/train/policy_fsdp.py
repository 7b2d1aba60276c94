"""An FSDP2-wrapped module used in place by Policy: unsharded around treeflow's forward, its
gradients averaged into the shards afterwards, through FSDP2's public API only.

    policy = Policy(fsdp_module)             # fully_shard(...) already applied, any nesting
    policy.loss(my_batch, loss_fn=f).backward()
    policy.reduce_gradients()                # the sharded DTensor .grad, averaged over the mesh
    optimizer.step()                         # the caller's, on the sharded parameters

FSDP2 gathers a module's parameters in the pre-forward hook of `module.forward` and wires the
gradient reduce-scatter in the hooks that forward registers; treeflow runs its own layers
(tree attention, edge selection) and never calls that forward. So: `FSDPModule.unshard()` on
every FSDP module gathers the whole model, `models/adopt.rebind` points treeflow's decoder at
the gathered tensors, the tree forward and the caller's backward run on them, and `reduce()`
sums each gathered gradient over the mesh (every mesh dimension: FSDP's and HSDP's ranks),
divides by the mesh size as FSDP2 does by default, keeps this rank's slice with the
parameter's own placements (`distribute_tensor(..., src_data_rank=None)`: no scatter), adds it
to the sharded `.grad` (accumulation works as FSDP2's does) and reshards.

The trade-offs: the whole model stays gathered from the forward until `reduce_gradients()`
(the parameter memory DDP holds), where FSDP2 gathers one wrapped layer at a time -- doing
that needs treeflow's layers to fire FSDP's per-module hooks, which exist only around the
wrapped module's own forward; and an all-reduce then a local slice moves twice the bytes of
FSDP2's reduce-scatter. FSDP2's custom divide factors, reduce dtypes and all-reduce hooks are
not applied (the average is taken in the sharded parameter's dtype).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

__all__ = ["FSDPBinding", "fsdp_binding"]


def fsdp_binding(module: torch.nn.Module, dp=None) -> "FSDPBinding | None":
    """The binding of an FSDP2-wrapped `module`, unsharded (for adopt_module), or None when
    nothing in it is wrapped. `dp` (Policy's) is refused: the mesh is the data parallelism."""
    from torch.distributed.fsdp import FSDPModule

    wrapped = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not wrapped:
        return None
    if dp is not None:
        raise ValueError("Policy(fsdp_module, dp=...): an FSDP2 module's data parallelism is "
                         "its mesh (each rank scores its own batch; reduce_gradients() "
                         "averages as FSDP2 does); drop dp=")
    binding = FSDPBinding(module, wrapped)
    binding.unshard()
    return binding


class FSDPBinding:
    """The FSDP modules of one caller's module and its sharded parameters, by name."""

    def __init__(self, module: torch.nn.Module, wrapped: list):
        from torch.distributed.tensor import DTensor

        self.module, self.wrapped = module, wrapped
        self.sharded = dict(module.named_parameters())
        plain = [n for n, p in self.sharded.items() if not isinstance(p, DTensor)]
        if plain:
            raise TypeError(f"Policy: {type(module).__name__} is FSDP2-wrapped but parameter(s) "
                            f"{plain[:3]} are not sharded (outside every fully_shard); apply "
                            "fully_shard to the root module too")
        self.gathered = False  # parameters unsharded and gradients pending (after a loss)

    def unshard(self) -> None:
        for m in self.wrapped:
            m.unshard()

    def gather(self, decoder, keep: bool) -> bool:
        """Unshard and re-bind `decoder` to the gathered tensors (unless a loss's gradients are
        pending: then they are gathered already); `keep`: stay gathered until `reduce()`.
        Whether the caller reshards after its forward."""
        if self.gathered:
            return False
        from treeflow.models.adopt import rebind

        self.unshard()
        rebind(decoder, self.module)
        self.gathered = keep
        return not keep

    @contextlib.contextmanager
    def resharded_on_error(self):
        """Around a loss's forward: if it raises, reshard what it gathered, so the model is not
        left whole until a reduce() that will not come. Gradients of an earlier loss still
        waiting for reduce() keep the model gathered (resharding would drop them)."""
        pending = self.gathered
        try:
            yield
        except BaseException:
            if not pending and self.gathered:
                self.reshard()
            raise

    def reshard(self) -> None:
        for m in self.wrapped:
            m.reshard()
        self.gathered = False

    def reduce(self) -> None:
        """Average the gathered gradients over the mesh into the sharded `.grad`; reshard.
        Every rank of the mesh must call it (a gradient a rank's batch never reached sums a
        zero)."""
        from torch.distributed.tensor import distribute_tensor

        if not self.gathered:
            raise ValueError("Policy.reduce_gradients(): no loss() of this FSDP2 module is "
                             "waiting; call it after loss(...).backward()")
        full = dict(self.module.named_parameters())
        for name, p in self.sharded.items():
            if not p.requires_grad:
                continue
            g_full = full[name].grad
            g = (torch.zeros(p.shape, dtype=p.dtype, device=full[name].device) if g_full is None
                 else g_full.detach().to(p.dtype, copy=True))
            mesh = p.device_mesh
            for dim in range(mesh.ndim):
                dist.all_reduce(g, group=mesh.get_group(dim))
            g /= mesh.size()
            mine = distribute_tensor(g, mesh, p.placements, src_data_rank=None)
            p.grad = mine if p.grad is None else p.grad + mine
            full[name].grad = None
        self.reshard()
