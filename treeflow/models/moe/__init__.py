"""Mixture of experts: the MoE block with routing replay (block.py routes), the expert path
(experts.py: dispatch, grouped matmuls, combine), on-disk expert tensor names (disk.py) and the
router's near-tie band (ties.py).

The trade-off: routing and computing apart, so a new router family touches block.py only and
the expert path is profiled and tested on its own.
"""
