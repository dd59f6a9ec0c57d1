"""Files copied into a Hugging Face export that transformers' stock class cannot express.

`configuration_griffin.py` and `modeling_griffin.py` are loaded by transformers with
`trust_remote_code=True` from the exported directory (`pretrain.export`), never imported
by this framework: they need torch and transformers, which the base install lacks.
"""
