"""Griffin with `num_gate_blocks` RG-LRU gate blocks, on transformers' RecurrentGemma.

Written by griffin-pretrain's `pretrain.export`. The only difference from
RecurrentGemmaForCausalLM is the RG-LRU's block-diagonal gates: the stock layer reads its
block count from `num_attention_heads`, so each recurrent layer's RG-LRU is rebuilt
from a copy of the config whose head count is `num_gate_blocks`. Everything else (the
forward pass, caches, generation) is transformers' own code.
"""
import copy

from transformers import RecurrentGemmaForCausalLM
from transformers.models.recurrent_gemma import modeling_recurrent_gemma as rg

try:
  from .configuration_griffin import GriffinConfig
except ImportError:  # loaded as a plain module
  from configuration_griffin import GriffinConfig


class GriffinForCausalLM(RecurrentGemmaForCausalLM):
  """RecurrentGemmaForCausalLM whose RG-LRU gates have `config.num_gate_blocks` blocks."""
  config_class = GriffinConfig

  def __init__(self, config: GriffinConfig):
    super().__init__(config)
    gate_config = copy.copy(config)
    gate_config.num_attention_heads = config.num_gate_blocks
    for layer in self.model.layers:
      if isinstance(layer.temporal_block, rg.RecurrentGemmaRecurrentBlock):
        layer.temporal_block.rg_lru = rg.RecurrentGemmaRglru(gate_config)
    self.post_init()
