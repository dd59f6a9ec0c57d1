"""The GateLoop block, in one place.

  layer.py    GateLoopBlock; its decoding cache is the complex state itself
  spec.py     GateLoopSpec, its `model.block_registry` entry (counts, memory terms)
"""
