"""The reference PyTorch decoders over one tree bin: the Llama/Qwen2/Qwen3 decoder and each
family's (Mamba-2 hybrids, DeepSeek-V3/GLM-4.5, Gemma 3, gpt-oss, Qwen3-Next), with RoPE from
tree depths and bypassed MTP layers.

They are the embedded default and the readable definition of what a backend computes; the
trade-off is one module per family (shared pieces live in attention/, ssm/, moe/, heads/)
rather than one configurable decoder with branches per family.
"""
