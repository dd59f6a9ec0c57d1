"""The logical axis names: spelled once, here, for the model and the rules alike.

Parameters and key activations name their dimensions with these (docs/INTERNALS.md,
"Logical axis names"); `sharding.rules.DEFAULT_RULES` maps each to mesh axes, and the
model's layers import them through `model.partitioning`. They live in `sharding/`, the
lower layer, because the rules table must name every one of them and the model may
import from `sharding` but not the other way round.
"""
from __future__ import annotations

# Parameter axes.
VOCAB = "vocab"
EMBED = "embed"
MLP = "mlp"
RNN = "rnn"
RNN_HEADS = "rnn_heads"           # blocks of the block-diagonal RG-LRU gates
RNN_HEAD_DIM = "rnn_head_dim"
Q_HEADS = "q_heads"               # flattened query heads x head_dim
KV = "kv"                         # the single MQA key/value head's dim
CONV = "conv"                     # Conv1D taps
LAYERS = "layers"                 # the scanned depth axis
NORM = "norm"

# Activation axes.
BATCH = "batch"
LENGTH = "length"
ACT_EMBED = "act_embed"
ACT_MLP = "act_mlp"
ACT_RNN = "act_rnn"
ACT_HEADS = "act_heads"
ACT_VOCAB = "act_vocab"

# Every name above, in order; `sharding.rules.DEFAULT_RULES` has one rule for each
# (tests/test_partition.py).
ALL = (VOCAB, EMBED, MLP, RNN, RNN_HEADS, RNN_HEAD_DIM, Q_HEADS, KV, CONV, LAYERS, NORM,
       BATCH, LENGTH, ACT_EMBED, ACT_MLP, ACT_RNN, ACT_HEADS, ACT_VOCAB)
