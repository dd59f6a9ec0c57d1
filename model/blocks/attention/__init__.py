"""The MQA attention block (local or global), in one place.

  layer.py    AttentionBlock and its ring-buffer AttentionCache
  spec.py     AttentionSpec, its `model.block_registry` entry (counts, memory terms,
              the transformers mapping)
"""
