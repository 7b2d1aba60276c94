"""Tree attention: the kernels (dense mask, FlexAttention block masks, ancestor runs), their
plan per bin, and context parallelism (a bin over C ranks, each fetching only its queries'
ancestors' K/V).

The trade-off: several kernels behind one AttentionPlan, picked per device and layout, instead
of one kernel that is slow somewhere; tree.py holds the plan and the choice.
"""
