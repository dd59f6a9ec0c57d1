"""MLflow (`pip install -e ".[mlflow]"`): one MLflow run per training run.

The run's params are the operative Gin config, its metrics every row by step under the
stable names of `rows`, its tags the model card's facts and final losses (and `group`,
`workdir`). It goes to MLflow's own tracking URI (`MLFLOW_TRACKING_URI`, e.g. a
`mlflow server` at http://127.0.0.1:8080), into the experiment named by the sweep's
study, else `MLFLOW_EXPERIMENT_NAME`, else "griffin-pretrain". Its id is kept in
`workdir/trackers.json`: a restarted run continues it (status RUNNING again), and a run
the server no longer has is started afresh and sent every row.

MLflow keeps a param's first value: a binding changed between restarts stays as it was
among the params, and its new value is the tag `param_changed/<key>`.

How long a call waits for a server that does not answer is MLflow's
`MLFLOW_HTTP_REQUEST_MAX_RETRIES` and `MLFLOW_HTTP_REQUEST_TIMEOUT`; unless set, they are
0 retries and 5 s here. MLflow's own defaults (7 retries with a backoff growing to 120 s,
each attempt waiting up to 120 s) make one call last 4 minutes against a closed port and
about 15 against a server that accepts and never answers, during which its retry
warnings pile up and the run's one warning waits; the trackers' threads retry with a
backoff of their own (`delivery`), so nothing is lost by failing fast.
"""
from __future__ import annotations

import os
import time
from typing import Any, Mapping, Optional, Sequence

from pretrain.observability.trackers import Row, RunInfo, TrackerContext
from pretrain.observability.trackers.rows import metric_names

DEFAULT_EXPERIMENT = "griffin-pretrain"
# The client's settings when the user has not set them (see the module docstring).
CLIENT_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
_BATCH = 100   # params or tags per request (MLflow's limit); metrics: 1000


def _chunks(items: list, size: int) -> list[list]:
  return [items[i:i + size] for i in range(0, len(items), size)]


class MlflowTracker:
  """The `mlflow` tracker."""
  name = "mlflow"

  def __init__(self, context: TrackerContext):
    self._workdir = context.workdir
    self._client: Any = None
    self._run_id: Optional[str] = None
    self.where = ""
    for name, value in CLIENT_DEFAULTS.items():
      os.environ.setdefault(name, value)
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    self.service = (f"the MLflow server at {uri} (MLFLOW_TRACKING_URI)" if uri else
                    "MLflow's default store (MLFLOW_TRACKING_URI is not set)")

  def open(self, run: RunInfo, run_id: Optional[str], last_step: int) -> Optional[str]:
    del last_step   # MLflow takes metrics at any step
    # pylint: disable=import-outside-toplevel  # the optional `mlflow` extra
    from mlflow.entities import Param, RunTag
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH
    client = MlflowClient()
    existing = None
    if run_id is not None:
      try:
        existing = client.get_run(run_id)
      except MlflowException as error:
        if error.error_code != "RESOURCE_DOES_NOT_EXIST":
          raise
    if existing is None:
      experiment = self._experiment(client, run.group)
      existing = client.create_run(experiment, run_name=run.name)
    else:
      client.update_run(run_id, status="RUNNING")
    self._client, self._run_id = client, existing.info.run_id
    logged = existing.data.params
    params, tags = [], []
    for key, value in run.config.items():
      text = str(value)[:MAX_PARAM_VAL_LENGTH]
      if key not in logged:
        params.append(Param(key, text))
      elif logged[key] != text:
        tags.append(RunTag(f"param_changed/{key}", text))
    tags += [RunTag(key, str(value)) for key, value in run.facts.items()]
    tags += [RunTag("workdir", self._workdir)]
    if run.group:
      tags.append(RunTag("group", run.group))
    for chunk in _chunks(params, _BATCH):
      client.log_batch(self._run_id, params=chunk)
    for chunk in _chunks(tags, _BATCH):
      client.log_batch(self._run_id, tags=chunk)
    self.where = (f"run {self._run_id} in experiment {existing.info.experiment_id} at "
                  f"{client.tracking_uri}")
    return self._run_id

  @staticmethod
  def _experiment(client: Any, group: Optional[str]) -> str:
    """The id of the experiment runs of `group` go to, created by the first of them
    (another run of the study may create it at the same moment)."""
    from mlflow.exceptions import MlflowException  # pylint: disable=import-outside-toplevel
    name = group or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
    found = client.get_experiment_by_name(name)
    if found is not None:
      return found.experiment_id
    try:
      return client.create_experiment(name)
    except MlflowException:
      found = client.get_experiment_by_name(name)
      if found is None:
        raise
      return found.experiment_id

  def log(self, rows: Sequence[Row]) -> None:
    from mlflow.entities import Metric  # pylint: disable=import-outside-toplevel
    now_ms = int(time.time() * 1000)
    metrics = [Metric(name, value, now_ms, row.step) for row in rows
               for name, value in metric_names(row).items()]
    for chunk in _chunks(metrics, 1000):
      self._client.log_batch(self._run_id, metrics=chunk)

  def close(self, summary: Mapping[str, Any], failed: bool) -> None:
    from mlflow.entities import RunTag  # pylint: disable=import-outside-toplevel
    tags = [RunTag(key, str(value)) for key, value in summary.items()]
    for chunk in _chunks(tags, _BATCH):
      self._client.log_batch(self._run_id, tags=chunk)
    self._client.update_run(self._run_id, status="FAILED" if failed else "FINISHED")
