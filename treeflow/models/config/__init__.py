"""Model shapes read from a Hugging Face `config.json`: the dense/MoE decoder's (model.py) and
each family's (hybrid, gdn, gemma3, gpt_oss, deepseek), plus what an MoE checkpoint says (moe/block.py).

Plain Python, no torch: `treeflow plan` and the support table read shapes without loading a
model. Each family registers with `ModelConfig.from_hf_dict` when treeflow.models imports it;
the trade-off is that registration is an import side effect, in exchange for model.py naming
no family.
"""
