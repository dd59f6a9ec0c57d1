"""Checkpoints: the run's state on disk, in tiers, and everything that keeps it safe.

  checkpointer.py  `Checkpointer` (the persistent tier, Orbax) and `CheckpointConfig`
  tier.py          the `CheckpointTier` interface every tier implements
  local.py         the local tier: each host's own disk, saved between persistent saves
  integrity.py     the checksum manifest written with every step and checked on read
  outage.py        riding out an unreachable bucket (`StorageConfig`, uploads that wait)
  metadata.py      the metadata item: ModelConfig fields, vocabulary, sequence length
  loading.py       `pretrain.load`: a restored model from a run directory
  run_directory.py `RunDirectory`: where each part of a run directory lives
  saving.py        `CheckpointHook`: when the loop saves, and retries and outages of saves

Imports only the centre's lower half (runtime, steps) and the layers below `pretrain`.
"""
