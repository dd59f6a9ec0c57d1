"""Checkpoints: the run's state on disk, in tiers, and everything that keeps it safe.

  checkpointer.py  `Checkpointer`: the run's tiers as peers (save, restore, prune), and
                   `CheckpointConfig`, the tiers a run has (`Checkpointer.for_run`)
  tier.py          the `CheckpointTier` interface every tier implements, and the
                   capability a tier may declare (`ModelCheck`)
  persistent.py    the persistent tier: Orbax in `workdir/checkpoints`, bucket-capable
  local.py         the local tier: each host's own disk, saved between persistent saves
  orbax_manager.py the Orbax manager every tier opens, kept from the preemption sync
  policies.py      what a tier's failed save means: retried and waited for (`Essential`)
                   or the tier turned off (`BestEffort`)
  integrity.py     the checksum manifest written with every step and checked on read
  outage.py        riding out an unreachable bucket (`StorageConfig`, uploads that wait)
  metadata.py      the metadata item: ModelConfig fields, vocabulary, sequence length
  loading.py       `pretrain.load`: a restored model from a run directory
  saving.py        `CheckpointHook`: the loop's side of the Checkpointer

The run directory's layout, the tiers' directories included, is
`pretrain.run_directory.RunDirectory`'s.

Imports only the centre's lower half (runtime, steps, run_directory) and the layers below
`pretrain`.
"""
