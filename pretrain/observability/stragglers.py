"""Straggler rows: which process is slowest, and by how much, every `log_every` steps.

In a synchronous step every process waits for the slowest one inside the step's
collectives, so their wall times per step are equal and say nothing about who is slow.
What differs is each process's own host work before it joins the collectives: loading
its part of the batch and dispatching the step (`Watchdog.host_seconds`). A process with
a slow input pipeline, a slow or oversubscribed host CPU or long pauses shows there; a
slow accelerator shows as everyone's step time instead (the device work is not split by
process here). Dispatch returns at once only while the device's queue has room: on a
CPU backend it waits for the previous step, so both figures include the step's device
time and the difference between processes is what tells (the 2-process quickstart on
2 CPU cores: about 1.9 s each, within 0.03 s of each other).

Every `every` steps each process publishes its mean host seconds per step since its
previous row in the key-value store of JAX's coordination service (a host-side RPC: a
device all-gather would make the loop wait for every step to finish, which it otherwise
never does), and process 0 reads every process's figures of the previous due step (all
processes have passed it: the steps in between needed all of them) and appends
`{"kind": "straggler", "step", "host_step_s": [per process], "slowest_process",
"slowest_s", "median_s", "deviation_s", "deviation"}` to `metrics.jsonl`
(`deviation` = slowest / median - 1). Only runs of several processes write them.
"""
from __future__ import annotations

import statistics
from typing import Any, Optional, Sequence

import jax
import numpy as np
from orbax.checkpoint._src.multihost import multihost

from pretrain.hook_interface import Hook
from pretrain.observability.metrics import MetricsWriter
from pretrain.steps import TrainState
from pretrain.observability.watchdog import Watchdog

STRAGGLER = "straggler"
KEY_PREFIX = "griffin_straggler"
READ_TIMEOUT_MS = 60_000   # the figures of a step every process has passed


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
    self._published: Optional[int] = None   # the due step whose figures are stored

  def on_step(self, step: int, state: TrainState) -> None:
    del state
    now_s = self._watchdog.host_seconds()
    since, self._since = self._since, (step, now_s)
    if since is None:
      return
    first_step, first_s = since
    client = multihost.get_jax_distributed_client()
    try:
      client.key_value_set(f"{KEY_PREFIX}/{step}/{jax.process_index()}",
                           repr((now_s - first_s) / (step - first_step)))
      if self._published is not None and jax.process_index() == 0:
        keys = [f"{KEY_PREFIX}/{self._published}/{i}" for i in range(jax.process_count())]
        seconds = [float(client.blocking_key_value_get(key, READ_TIMEOUT_MS))
                   for key in keys]
        for key in keys:
          client.key_value_delete(key)
        self._writer.log_record(straggler_row(self._published, seconds))
    except jax.errors.JaxRuntimeError:
      # A process left the run (it died, or its watchdog ended it): the launcher stops
      # this one too; a row is not worth a traceback.
      return
    self._published = step
