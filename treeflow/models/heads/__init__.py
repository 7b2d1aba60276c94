"""The output heads: log-probabilities of selected targets without [rows, vocab] logits, and
the fused linear + log-softmax the trainer uses.

Hidden states are gathered at the edges' parents before the vocabulary projection, so memory
grows with edges, not tokens x vocabulary; the trade-off is a chunked loop instead of one
matmul.
"""
