"""How a decoder layer is executed fast: compiled and recomputed layers (layer_ops.py,
recompute.py), compiled graphs kept whole in the compile cache (precompiled.py, graph_key.py)
and ahead-of-time graphs (aoti.py, built side by side by build_pool.py); which Triton kernels a
run builds after its warm-up (jit_watch.py).

None of it changes what is computed (tests compare against eager); the trade-off is
machinery that saves start-up seconds at the price of cache keys that must name everything a
graph depends on.
"""
