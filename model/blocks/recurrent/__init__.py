"""The recurrent block of Hawk and Griffin, in one place.

  layer.py    RecurrentBlock (GeLU branch ⊙ RG-LRU(Conv1D) branch) and RecurrentCache
  conv1d.py   the causal depthwise Conv1D that resets at document starts
  rg_lru.py   the RG-LRU and its complex variant, the CG-LRU
  spec.py     RecurrentSpec, its `model.block_registry` entry (counts, memory terms,
              the transformers mapping)
"""
