"""Orbax's CheckpointManager, kept away from JAX's preemption sync service.

Orbax asks the sync service `reached_preemption(step)` on its own: when a save starts,
in `should_save`, and from its background finalize thread once an async save has
committed. The service remembers only the last number it was asked about (its "call
counter") and, when a notice arrives, agrees on the largest counter of all processes
plus one. A finalize thread reporting an older step (the save of step 4 committing while
training is at step 6) lowers that counter, so the agreed step can be one the process has
already passed: it never stops, and a preemption is lost. The trainer's `PreemptionHook`
is the only caller, once per step (see docs/contracts.md, "Preemption on SLURM and
locally"); every tier opens its manager here.
"""
from __future__ import annotations

import orbax.checkpoint as ocp


class CheckpointManager(ocp.CheckpointManager):
  """`ocp.CheckpointManager` that never queries the preemption sync service."""

  def reached_preemption(self, step: int) -> bool:
    del step
    return False
