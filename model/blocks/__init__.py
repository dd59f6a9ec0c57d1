"""The built-in temporal blocks, registered with `model.block_registry`.

One module per block type holds its registry entry (`BlockSpec`); this list is where
the built-ins are registered. `model/__init__.py` imports this package, so importing
any model module registers them. A block defined elsewhere registers itself (see
docs/INTERNALS.md, "How to add a block").
"""
from model import block_registry
from model.blocks.attention import AttentionSpec
from model.blocks.gateloop import GateLoopSpec
from model.blocks.recurrent import RecurrentSpec

for _spec in (RecurrentSpec(), AttentionSpec(), GateLoopSpec()):
  block_registry.register(_spec)
