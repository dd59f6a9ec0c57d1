"""Straggler rows: which process is slowest, and by how much, every `log_every` steps.

In a synchronous step every process waits for the slowest one inside the step's
collectives, so their wall times per step are equal and say nothing about who is slow.
What differs is each process's own host work before it joins the collectives: loading
its part of the batch and dispatching the step (`Watchdog.host_seconds`). A process with
a slow input pipeline, a slow or oversubscribed host CPU or long pauses shows there; a
slow accelerator shows as everyone's step time instead (the device work is not split by
process here).

Every `every` steps each process's mean host seconds per step since the last row are
gathered (one small all-gather), and process 0 appends
`{"kind": "straggler", "step", "host_step_s": [per process], "slowest_process",
"slowest_s", "median_s", "deviation_s", "deviation"}` to `metrics.jsonl`
(`deviation` = slowest / median - 1). Only runs of several processes write them.
"""
from __future__ import annotations

import statistics
from typing import Any, Optional, Sequence

import numpy as np
from jax.experimental import multihost_utils

from pretrain.hooks import Hook
from pretrain.metrics import MetricsWriter
from pretrain.steps import TrainState
from pretrain.watchdog import Watchdog

STRAGGLER = "straggler"


def straggler_row(step: int, host_step_s: Sequence[float]) -> dict[str, Any]:
  """The row of `step` from each process's host seconds per step."""
  slowest = int(np.argmax(host_step_s))
  median = statistics.median(host_step_s)
  deviation_s = host_step_s[slowest] - median
  return {"kind": STRAGGLER, "step": int(step),
          "host_step_s": [float(s) for s in host_step_s], "slowest_process": slowest,
          "slowest_s": float(host_step_s[slowest]), "median_s": float(median),
          "deviation_s": float(deviation_s),
          "deviation": float(deviation_s / median) if median > 0 else 0.0}


class StragglerHook(Hook):
  """Gathers every process's host time per step every `every` steps; process 0 writes
  a straggler row (see the module docstring)."""
  drains_metrics = False
  goodput_category = "other"

  def __init__(self, watchdog: Watchdog, writer: MetricsWriter, *, every: int):
    self.every = every
    self._watchdog = watchdog
    self._writer = writer
    # (step, host seconds) of the previous row; the first due step only sets it, so
    # that no row includes the first step's tracing and compilation.
    self._since: Optional[tuple[int, float]] = None

  def on_step(self, step: int, state: TrainState) -> None:
    del state
    now_s = self._watchdog.host_seconds()
    since, self._since = self._since, (step, now_s)
    if since is None:
      return
    first_step, first_s = since
    mine = np.float64((now_s - first_s) / (step - first_step))
    everyone = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1)
    self._writer.log_record(straggler_row(step, everyone.tolist()))
