"""Weights & Biases (`pip install -e ".[wandb]"`): one W&B run per training run.

The run's config is the operative Gin config, its history every row under the stable
names of `rows` (W&B's step is the training step), its summary the model card's facts
and the final losses. Its id is kept in `workdir/trackers.json`, and a restarted run
resumes it (`resume="allow"`), never starting a new one. W&B's own settings apply:
`WANDB_MODE=offline` writes the run under `workdir/wandb/` with no network (upload it
later with `wandb sync`), `WANDB_PROJECT` and `WANDB_ENTITY` place it (project
"griffin-pretrain" by default), `wandb login` or `WANDB_API_KEY` authenticate. The
sweep's study is the run's group.

W&B's step only moves forward, and only step rows move it: a train, eval or downstream
row is logged at its step, a record (goodput, restart, straggler) at W&B's current step,
charted against its own `<kind>/step` (`define_metric`); a resumed run starts one step
past the newest step row it has got. W&B's console capture is off (the trainer's output
is its own) and so are its banners: one line says where the run is.

Unless set, `WANDB_INIT_TIMEOUT` is 30 s (W&B's default: 90 s) and `WANDB_SILENT` true
(its login line too): a process whose W&B server does not answer cannot exit before
W&B's `init` gives up, whatever the trainer's own bound on its tracker threads.

`log` only hands rows to W&B's service, which uploads them in the background and
retries a server that has gone for as long as it is let: `finish` waits for the upload
at most `FINISH_SHARE` of the session end's bound (W&B's `finish_timeout`, which also
bounds W&B's own end of the run at the process's exit), then raises, and the rows count
as unsent until a session's `finish` confirms them (`confirms_at_close`). W&B's
telemetry of its own use is off: at the process's exit it asks the server whether it
takes telemetry, waiting up to 10 s for a server that does not answer.
"""
from __future__ import annotations

import os
import secrets
from typing import Any, Mapping, Optional, Sequence

from plumbing import storage
from pretrain.observability.trackers import (EXIT_WAIT_S, RECORD_KINDS, STEP_KINDS, Row,
                                             RunInfo, TrackerContext)
from pretrain.observability.trackers.rows import metric_names

DEFAULT_PROJECT = "griffin-pretrain"
# The client's settings when the user has not set them (see the module docstring).
CLIENT_DEFAULTS = {"WANDB_INIT_TIMEOUT": "30", "WANDB_SILENT": "true"}
# The part of the session end's bound W&B's `finish` may take to upload what it holds:
# the rest is for the summary and for the tracker's thread to report in time.
FINISH_SHARE = 0.8


class WandbTracker:
  """The `wandb` tracker."""
  name = "wandb"
  confirms_at_close = True
  exit_wait_s = EXIT_WAIT_S   # the session end's bound (`delivery` sets the run's)

  def __init__(self, context: TrackerContext):
    # W&B writes its files to a local directory: the workdir's when it is local.
    self._dir = None if storage.is_url(context.workdir) else context.workdir
    self._run: Any = None
    self._step = 0
    self.where = ""
    for name, value in CLIENT_DEFAULTS.items():
      os.environ.setdefault(name, value)
    self.service = (f"W&B at {os.environ.get('WANDB_BASE_URL') or 'https://api.wandb.ai'}"
                    " (WANDB_BASE_URL, WANDB_API_KEY)")

  def open(self, run: RunInfo, run_id: Optional[str], last_step: int) -> Optional[str]:
    import wandb  # pylint: disable=import-outside-toplevel  # the optional `wandb` extra
    # Before `init`, which would start it (see the module docstring); `import wandb`
    # loads the module.
    wandb.analytics.opentelemetry.opentelemetry_proxy.disable()
    if self._dir is not None:
      os.makedirs(self._dir, exist_ok=True)
    self._run = wandb.init(
        project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
        id=run_id or secrets.token_hex(6), resume="allow", name=run.name, group=run.group,
        dir=self._dir, config=dict(run.config), allow_val_change=True,
        reinit="create_new",
        settings=wandb.Settings(console="off", silent=True,
                                finish_timeout=FINISH_SHARE * self.exit_wait_s,
                                finish_timeout_raises=True))
    for kind in RECORD_KINDS:
      self._run.define_metric(f"{kind}/*", step_metric=f"{kind}/step")
    self._run.summary.update(dict(run.facts))
    self._step = max(self._step, self._run.step, last_step + 1 if last_step else 0)
    if self._run.settings.mode == "offline":
      self.where = (f"offline run {self._run.id} in {self._run.settings.sync_dir} "
                    f"(wandb sync uploads it)")
    else:
      self.where = f"run {self._run.url}"
    return self._run.id

  def log(self, rows: Sequence[Row]) -> None:
    for row in rows:
      values = metric_names(row)
      if row.kind in STEP_KINDS:
        if row.step < self._step:   # behind W&B's step (not seen): keep the true one
          values[f"{row.kind}/step"] = row.step
        self._step = max(self._step, row.step)
      self._run.log(values, step=self._step)

  def close(self, summary: Mapping[str, Any], failed: bool) -> None:
    self._run.summary.update(dict(summary))
    try:
      self._run.finish(exit_code=1 if failed else 0)
    except TimeoutError as error:   # W&B's own text says only "Timed out finishing run."
      error.args = (f"the run's data was not all uploaded after "
                    f"{FINISH_SHARE * self.exit_wait_s:.0f} s",)
      raise
