"""The built-in temporal blocks, registered with `model.block_registry`.

Each block type is one package here holding all of it: its Flax layer and decoding
cache (`layer.py`, with any parts of its own beside it) and its registry entry
(`spec.py`). Blocks do not import each other; what two of them share sits at the
model's centre (`model.recurrence`, `model.time_shift`, `model.rope`). This list is where
the built-ins are registered; `model/__init__.py` imports this package, so importing
any model module registers them. A block defined elsewhere registers itself (see
docs/INTERNALS.md, "How to add a block").
"""
from model import block_registry
from model.blocks.attention.spec import AttentionSpec
from model.blocks.gateloop.spec import GateLoopSpec
from model.blocks.recurrent.spec import RecurrentSpec

for _spec in (RecurrentSpec(), AttentionSpec(), GateLoopSpec()):
  block_registry.register(_spec)
