"""Recurrent layers over a prefix tree: the Mamba-2 mixer and its chunked scan run segment by
segment with forked states (torch and Triton), Gated DeltaNet on the same segment plan, and
Mamba-2 under context parallelism (head parallelism around the mixer).

The trade-off: two scan implementations (torch everywhere, Triton on CUDA) that must agree,
checked against each other and against transformers.
"""
