"""Config of a Griffin whose RG-LRU gates have their own number of blocks.

Written by griffin-pretrain's `pretrain.export`. Identical to transformers'
RecurrentGemmaConfig plus `num_gate_blocks`: the paper's Griffin presets split the
RG-LRU gates into 16 blocks whatever their attention head count, while RecurrentGemma
ties the two. A distinct `model_type` keeps the stock class from loading these weights
with the wrong gate shapes.
"""
from transformers import RecurrentGemmaConfig


class GriffinConfig(RecurrentGemmaConfig):
  """RecurrentGemmaConfig with `num_gate_blocks` (block-diagonal RG-LRU gate blocks)."""
  model_type = "griffin_gate_blocks"
