"""Experiment trackers (`pretrain.observability.trackers`), fed by the real trainer on a
tiny model: a tracker of our own is one registered class; W&B (offline) and MLflow (a
real `mlflow server` on a loopback port, SQLite store) each hold one run for a run
restarted twice, with every step once, read back with their own tools (`wandb leet
inspect`, `MlflowClient`); a tracker that cannot be reached costs one line, the run goes
on, and the tracker gets what it missed once it answers. An MLflow server that is down
or accepts and never answers (a real socket on loopback), or refuses the client's
password or a write it has no permission for (the server's basic authentication), costs
one line at a session's end, which waits for it at most `delivery.EXIT_WAIT_S`, and
keeps its client's retry warnings in the workdir's `clients.log`; the reported case (the
trainer, a closed port) end to end in a subprocess. W&B's server gone mid-run (a loopback
stand-in for its HTTP API, `wandb_server`, closing its port or holding every request)
costs one line and a bounded `finish`, and the next session sends it every row."""
import base64
import contextlib
import glob
import json
import logging
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

from model import counting
from plumbing import quiet
from pretrain.checkpoints import outage
from pretrain.observability import trackers as trackers_lib
from pretrain.observability.trackers import (DOWNSTREAM, EVAL, TRAIN, Row, RunInfo,
                                             TrackerContext)
from pretrain.observability.trackers import delivery
from pretrain.observability.trackers import rows as rows_lib
from pretrain.observability.trackers import run_info
from pretrain.run_directory import CLIENT_LOG, RunDirectory
from pretrain.train_config import TrainConfig
from inprocess_trainer import TINY_MODEL, train_in_process
from storage_servers import free_port
from tiers import slow_after_first
from trainer_helpers import REPO, trainer_env  # pylint: disable=unused-import
import tracker_tools
import wandb_server

# The in-process model (its train step from the shared JAX cache) and schedule.
MODEL = TINY_MODEL
STEPS = 6
# The most a process with a W&B server that does not answer takes, imports and W&B's own
# exit handlers included, with WANDB_INIT_TIMEOUT=3 (measured on 2 shared cores: 26 s, 10 s
# since the tracker turns W&B's telemetry off).
WANDB_PROCESS_S = 45


class _Crash(Exception):
  pass


def _session(workdir, trackers, crash_at=None, hooks=(), exit_wait_s=delivery.EXIT_WAIT_S):
  """One session of the 6-step run (checkpoints every 2 steps, an evaluation every 2),
  ended by an exception after step `crash_at`, as a crash would end it; its end waits
  up to `exit_wait_s` for a tracker call without an answer."""
  def crash(info):
    if info.step == crash_at:
      raise _Crash
  config = TrainConfig(train_steps=STEPS, batch_size=4, sequence_length=32,
                       checkpoint_every=2, eval_every=2, eval_batches=1, log_every=1,
                       seed=1, trackers=trackers, tracker_exit_wait_s=exit_wait_s)
  try:
    train_in_process(str(workdir), MODEL, config, hooks=[*hooks, crash])
  except _Crash:
    pass


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def _losses(workdir):
  return {row["step"]: row["loss"] for row in _rows(workdir)
          if "loss" in row and "kind" not in row}


def _tracker_state(workdir):
  with open(RunDirectory(workdir).trackers_state, encoding="utf-8") as f:
    return json.load(f)


@pytest.fixture(scope="module")
def mlflow_process(tmp_path_factory):
  """The module's MLflow server, started by the first test that asks for it (the toy
  tracker's, which does not use it), so that its start-up (several seconds of CPU)
  overlaps that test's training."""
  root = str(tmp_path_factory.mktemp("mlflow"))
  port = free_port()
  process = tracker_tools.start_mlflow(root, port)
  yield process, f"http://127.0.0.1:{port}", os.path.join(root, "server.log")
  tracker_tools.stop(process)


@pytest.fixture
def mlflow_url(mlflow_process, monkeypatch):  # pylint: disable=redefined-outer-name
  """The server's URL once it answers; the test's MLflow clients log in to it."""
  tracker_tools.wait_until_up(*mlflow_process)
  for name, value in tracker_tools.CREDENTIALS.items():
    monkeypatch.setenv(name, value)
  return mlflow_process[1]


class ToyTracker:
  """A tracker of our own: keeps what it is given, unreachable until `up` is set."""
  name = "toy"
  where = "toy run 1"
  made: list = []

  def __init__(self, context):
    self.workdir = context.workdir
    self.up = threading.Event()
    self.answered = threading.Event()
    self.opened = self.closed = None
    self.rows = []
    ToyTracker.made.append(self)

  def _reach(self):
    if not self.up.is_set():
      raise ConnectionError("toy server unreachable")
    self.answered.set()

  def open(self, run, run_id, last_step):
    self._reach()
    self.opened = (run, run_id, last_step)
    return run_id or "toy-1"

  def log(self, rows):
    self._reach()
    self.rows.extend(rows)

  def close(self, summary, failed):
    self.closed = (summary, failed)


@pytest.mark.slow   # one short in-process run (CI runs it)
def test_a_tracker_is_one_registered_class_and_a_dead_one_costs_one_line(
    tmp_path, monkeypatch, capfd, mlflow_process):  # pylint: disable=redefined-outer-name
  del mlflow_process   # started now for the next test
  monkeypatch.setattr(delivery, "FIRST_BACKOFF_S", 0.05)
  monkeypatch.setattr(delivery, "MAX_BACKOFF_S", 0.1)
  ToyTracker.made.clear()
  trackers_lib.register(ToyTracker)
  try:
    with pytest.raises(ValueError, match="unknown tracker 'tyo'.*did you mean 'toy'"):
      TrainConfig(trackers=("tensorboard", "tyo"))

    def server_returns(info):
      """At step 3 the toy server answers again (the loop waits until it has)."""
      if info.step == 3:
        ToyTracker.made[-1].up.set()
        assert ToyTracker.made[-1].answered.wait(30)
    _session(tmp_path, ("toy",), hooks=[server_returns])
  finally:
    trackers_lib.unregister("toy")
  out, err = capfd.readouterr()
  toy, = ToyTracker.made
  assert toy.workdir == str(tmp_path)
  warnings = [line for line in err.splitlines() if "toy" in line]
  assert len(warnings) == 1, err
  assert warnings[0].startswith("warning: toy tracker: no answer from the toy service: "
                                "toy server unreachable; the run goes on"), warnings
  assert "toy: toy run 1\n" in out and "toy: answers again" in out
  # Every row of metrics.jsonl, once and in order, whether it was written while the
  # tracker was down or after.
  assert toy.rows == [rows_lib.from_json(row) for row in _rows(tmp_path)]
  assert [row.step for row in toy.rows if row.kind == TRAIN] == list(range(1, STEPS + 1))
  assert [row.step for row in toy.rows if row.kind == EVAL] == [2, 4, 6]
  assert {row.kind for row in toy.rows} == {TRAIN, EVAL, "goodput"}
  run, run_id, last_step = toy.opened
  assert (run.name, run_id, last_step, run.group) == (tmp_path.name, None, 0, None)
  assert run.config["TrainConfig.train_steps"] == STEPS   # no config.gin: the dataclasses
  assert run.config["ModelConfig.width"] == 32
  assert run.facts["model/params"] == counting.count_params(MODEL).total
  summary, failed = toy.closed
  assert not failed and summary["run/steps"] == STEPS
  assert summary["final/loss"] == _losses(tmp_path)[STEPS]
  assert summary["run/tokens"] == STEPS * 4 * 32
  assert _tracker_state(tmp_path)["toy"] == {   # records: each step's goodput, the end's
      "run_id": "toy-1", "sent": {"train": 6, "eval": 6}, "records": 7, "unsent_rows": 0}


@pytest.mark.slow   # three short in-process runs and an MLflow server (CI runs it)
def test_a_run_restarted_twice_is_one_wandb_and_one_mlflow_run_with_every_step_once(
    tmp_path, mlflow_url, monkeypatch, capfd):  # pylint: disable=redefined-outer-name
  from mlflow.tracking import MlflowClient  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv("WANDB_MODE", "offline")
  for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
    monkeypatch.setenv(name, str(tmp_path / "wandb_home"))
  monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "restarts")
  workdir = tmp_path / "run"
  trackers = ("wandb", "mlflow")

  monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_url)
  # Trackers that answer, however slowly: a session's end leaves a call unanswered for
  # `EXIT_WAIT_S` (10 s) to its thread, and on CI's loaded cores W&B's first offline
  # `init` took longer. The abandoned call still delivers, after trackers.json was
  # written, so the next session sent those steps again. The bound has tests of its own
  # (a server that never answers); this one is about what each restart sends, so its
  # sessions wait as long as the run's other writes (`tracker_exit_wait_s`).
  _session(workdir, trackers, crash_at=3, exit_wait_s=outage.FLUSH_TIMEOUT_S)
  _, err = capfd.readouterr()
  assert "mlflow" not in err and "wandb" not in err, err
  # The second session finds no MLflow server: one line, and it trains on.
  monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
  _session(workdir, trackers, crash_at=5, exit_wait_s=outage.FLUSH_TIMEOUT_S)
  _, err = capfd.readouterr()
  lines = [line for line in err.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith("warning: mlflow tracker: "), err
  # The third finds it again: it gets the rows the second session logged.
  monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_url)
  _session(workdir, trackers, exit_wait_s=outage.FLUSH_TIMEOUT_S)
  _, err = capfd.readouterr()
  assert "mlflow" not in err and "wandb" not in err, err

  losses = _losses(workdir)
  assert sorted(losses) == list(range(1, STEPS + 1))
  state = _tracker_state(workdir)
  assert state["mlflow"]["unsent_rows"] == state["wandb"]["unsent_rows"] == 0

  # W&B: the three sessions are three offline files of one run, which W&B's own reader
  # reads back: every training step once, at its step; the restarts on their own axis.
  run_id = state["wandb"]["run_id"]
  run_dirs = sorted(glob.glob(str(workdir / "wandb" / "offline-run-*")))
  assert len(run_dirs) == 3 and all(d.endswith(f"-{run_id}") for d in run_dirs), run_dirs
  records = [record for run_dir in run_dirs for record in tracker_tools.wandb_records(run_dir)]
  history = [r["history"]["item"] for r in records if r["type"] == "history"]
  train = [(item["_step"], item["train/loss"]) for item in history if "train/loss" in item]
  assert [step for step, _ in train] == list(range(1, STEPS + 1))
  for step, loss in train:   # a redone step keeps the values first sent (the same here)
    assert loss == pytest.approx(losses[step], rel=1e-6)
  assert [item["_step"] for item in history if "eval/loss" in item] == [2, 4, 6]
  assert [item["restart/step"] for item in history if "restart/step" in item] == [2, 4]
  assert [item["goodput/session"] for item in history if "goodput/session" in item
          ][-1] == 3
  runs = [r["run"] for r in records if r["type"] == "run"]
  assert {r["run_id"] for r in runs} == {run_id}
  assert all(r["config"]["update"]["TrainConfig.train_steps"] == STEPS for r in runs)
  summary = {}
  for record in records:
    if record["type"] == "summary":
      summary.update(record["summary"]["update"])
  assert summary["model/params"] == counting.count_params(MODEL).total
  assert summary["final/loss"] == pytest.approx(losses[STEPS])
  assert [r["exit"]["exit_code"] for r in records if r["type"] == "exit"] == [1, 1, 0]

  # MLflow: one run in the experiment, read back from the server.
  client = MlflowClient(mlflow_url)
  experiment = client.get_experiment_by_name("restarts")
  runs = client.search_runs([experiment.experiment_id])
  assert [run.info.run_id for run in runs] == [state["mlflow"]["run_id"]]
  run = runs[0]
  history = client.get_metric_history(run.info.run_id, "train/loss")
  assert sorted(metric.step for metric in history) == list(range(1, STEPS + 1))
  for metric in history:
    assert metric.value == pytest.approx(losses[metric.step], rel=1e-6)
  assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "eval/loss")
                ) == [2, 4, 6]
  assert sorted(m.value for m in client.get_metric_history(run.info.run_id, "restart/step")
                ) == [2, 4]
  assert run.data.params["TrainConfig.train_steps"] == str(STEPS)
  assert run.data.params["ModelConfig.block_pattern"] == "('recurrent', 'attention')"
  assert run.data.tags["model/params"] == str(counting.count_params(MODEL).total)
  assert float(run.data.tags["final/loss"]) == pytest.approx(losses[STEPS])
  assert run.info.status == "FINISHED" and run.info.run_name == "run"


def test_the_run_config_is_the_operative_gin_config_with_macros_resolved():
  text = ("import model.config\n\n# Macros:\nTRAIN_STEPS = 300\n\n"
          "# Parameters for TrainConfig:\nTrainConfig.train_steps = %TRAIN_STEPS\n"
          "TrainConfig.trackers = ('tensorboard', 'wandb')\n"
          "OptimizerConfig.no_decay_patterns = \\\n    ('bias', '.*norm.*')\n"
          "evaluation/TrainConfig.eval_batches = 2\n"
          "DataPipeline.vocabulary = @get_vocabulary()\n")
  assert run_info.parse_gin(text) == {
      "TRAIN_STEPS": 300, "TrainConfig.train_steps": 300,
      "TrainConfig.trackers": ("tensorboard", "wandb"),
      "OptimizerConfig.no_decay_patterns": ("bias", ".*norm.*"),
      "evaluation/TrainConfig.eval_batches": 2,
      "DataPipeline.vocabulary": "@get_vocabulary()"}


def test_rows_keep_stable_names_in_wandb_and_mlflow():
  assert rows_lib.metric_names(Row(TRAIN, 3, {"loss": 2.0, "mfu": None})) == {
      "train/loss": 2.0}
  assert rows_lib.metric_names(Row(EVAL, 4, {"eval_loss": 1.5, "eval_tokens": 128.0})) == {
      "eval/loss": 1.5, "eval/tokens": 128.0}
  downstream = rows_lib.from_json({"step": 4, "downstream/tiny_mc/acc": 0.5})
  assert downstream.kind == DOWNSTREAM
  assert rows_lib.metric_names(downstream) == {"downstream/tiny_mc/acc": 0.5}
  straggler = rows_lib.from_json({"kind": "straggler", "step": 5, "host_step_s": [0.1, 0.3],
                                  "slowest_process": 1, "deviation": float("nan")})
  assert rows_lib.metric_names(straggler) == {
      "straggler/host_step_s/0": 0.1, "straggler/host_step_s/1": 0.3,
      "straggler/slowest_process": 1.0, "straggler/step": 5.0}
  restart = rows_lib.from_json({"kind": "restart", "step": 2, "tier": "persistent",
                                "lost_steps": 1})
  assert rows_lib.metric_names(restart) == {"restart/lost_steps": 1.0, "restart/step": 2.0}


@pytest.fixture
def client_log(tmp_path, monkeypatch):
  """The client libraries' records go to `tmp_path/clients.log` during the test, as the
  trainer sends them to its workdir's; the loggers are restored afterwards."""
  for name in quiet.CLIENT_LOGGERS:
    logger = logging.getLogger(name)
    monkeypatch.setattr(logger, "handlers", list(logger.handlers))
    monkeypatch.setattr(logger, "propagate", logger.propagate)
  monkeypatch.setattr(quiet, "_client_log", None)
  path = tmp_path / CLIENT_LOG
  quiet.keep_client_logs(str(path))
  yield path
  quiet._client_log.close()  # pylint: disable=protected-access


_ROWS = [{"step": step, "loss": 3.0 - step / 10} for step in (1, 2, 3)]


def _tracker_session(workdir, exit_wait_s=None, name="mlflow"):
  """One session of tracker `name` alone (no trainer): two rows already in the file, a
  third logged, then the session's end; returns the seconds the end took."""
  trackers = delivery.Trackers([name], TrackerContext(str(workdir)),
                               exit_wait_s=exit_wait_s)
  trackers.start(RunInfo("outage"), _ROWS[:2])
  trackers.log(rows_lib.from_json(_ROWS[2]))
  began = time.monotonic()
  trackers.close(60)
  return time.monotonic() - began


# A second user of the test's MLflow server, who may only read the experiment.
READER = {"MLFLOW_TRACKING_USERNAME": "reader",
          "MLFLOW_TRACKING_PASSWORD": "reader-password"}


def _reader_of(url, experiment):
  """Makes `READER` a user of the server at `url` with READ permission on `experiment`
  (created by the admin if missing): authenticated, refused any write (403). Through
  the auth app's REST API with the admin's credentials (its Python client would import
  the server); a second call finds the user there."""
  from mlflow.tracking import MlflowClient  # pylint: disable=import-outside-toplevel
  client = MlflowClient(url)
  found = client.get_experiment_by_name(experiment)
  experiment_id = found.experiment_id if found else client.create_experiment(experiment)
  admin = ":".join(tracker_tools.CREDENTIALS.values()).encode()
  user = READER["MLFLOW_TRACKING_USERNAME"]

  def post(path, body):
    request = urllib.request.Request(
        f"{url}{path}", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json",
                 "Authorization": "Basic " + base64.b64encode(admin).decode()})
    try:
      urllib.request.urlopen(request, timeout=10).close()
    except urllib.error.HTTPError as error:
      if not (path.endswith("/users/create") and error.code == 400):  # made already
        raise

  post("/api/2.0/mlflow/users/create",
       {"username": user, "password": READER["MLFLOW_TRACKING_PASSWORD"]})
  post("/api/3.0/mlflow/users/permissions/grant",
       {"username": user, "resource_type": "experiment", "resource_id": experiment_id,
        "permission": "READ"})


@pytest.mark.parametrize("server", slow_after_first(
    [("closed port",), ("never answers",), ("never answers, client retrying",),
     ("wrong password",), ("no permission",)]))
def test_mlflow_down_silent_or_refusing_costs_one_line_a_bounded_end_and_gets_its_rows_later(
    server, tmp_path, monkeypatch, capfd, client_log, mlflow_url):  # pylint: disable=redefined-outer-name
  from mlflow.tracking import MlflowClient  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "outages")
  with contextlib.ExitStack() as stack:
    if server == "closed port":
      url = f"http://127.0.0.1:{free_port()}"
    elif server == "wrong password":   # the real server, refusing with 401
      url = mlflow_url
      monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "not-the-password")
    elif server == "no permission":   # the real server, refusing a reader's writes: 403
      url = mlflow_url
      _reader_of(url, "outages")
      for name, value in READER.items():
        monkeypatch.setenv(name, value)
    else:
      url = stack.enter_context(tracker_tools.silent_server())
    if server.endswith("client retrying"):   # 4 attempts of 5 s: longer than the bound
      monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    waited_s = _tracker_session(tmp_path)
  err = capfd.readouterr().err
  lines = err.splitlines()
  assert len(lines) == 1, err   # the project's line; no client library's
  service = f"the MLflow server at {url} (MLFLOW_TRACKING_URI)"
  if server == "wrong password":   # the service, and MLflow's text: the status, the fix
    assert lines[0].startswith(f"warning: mlflow tracker: error from {service}: "), err
    assert "error code 401" in lines[0] and "not authenticated" in lines[0], err
  elif server == "no permission":
    assert lines[0].startswith(f"warning: mlflow tracker: error from {service}: "), err
    assert "error code 403" in lines[0] and "Permission denied" in lines[0], err
  else:
    assert lines[0].startswith(f"warning: mlflow tracker: no answer from {service}"), err
  assert waited_s <= delivery.EXIT_WAIT_S + 1, waited_s
  assert _tracker_state(tmp_path)["mlflow"]["unsent_rows"] == len(_ROWS)
  if server.endswith("client retrying"):
    assert "Retrying (Retry(" in client_log.read_text()
    assert lines[0].endswith(f"its client's log: {client_log}"), err

  # The server answers again (and takes the credentials): the next session in the
  # workdir sends what was kept.
  monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_url)
  for name, value in tracker_tools.CREDENTIALS.items():
    monkeypatch.setenv(name, value)
  _tracker_session(tmp_path)
  assert capfd.readouterr().err == ""
  state = _tracker_state(tmp_path)["mlflow"]
  assert state["unsent_rows"] == 0
  history = MlflowClient(mlflow_url).get_metric_history(state["run_id"], "train/loss")
  assert sorted((m.step, m.value) for m in history) == [
      (row["step"], pytest.approx(row["loss"])) for row in _ROWS]


class HandingTracker:
  """A tracker whose client sends in the background, as W&B's does: `log` hands rows
  over, `close` delivers them to `server`, or raises while `up` is false."""
  name = "handing"
  confirms_at_close = True
  exit_wait_s = 0.0   # set by `delivery`
  server: list = []
  up = False
  told_s = 0.0   # the bound `open` was told

  def __init__(self, context):
    del context
    self.where = ""
    self.handed = []

  def open(self, run, run_id, last_step):
    del run, last_step
    HandingTracker.told_s = self.exit_wait_s
    return run_id or "handing-1"

  def log(self, rows):
    self.handed.extend(rows)

  def close(self, summary, failed):
    del summary, failed
    if not HandingTracker.up:
      raise TimeoutError("the run's data was not all uploaded")
    HandingTracker.server.extend(self.handed)


def test_rows_a_client_took_count_unsent_until_its_close_confirms_them(tmp_path, capfd):
  """A tracker that `confirms_at_close` took every row and failed to deliver them at
  the session's end: all are counted unsent, one line says so, and the next session
  sends every one of them again; the tracker was told the end's bound."""
  trackers_lib.register(HandingTracker)
  try:
    _tracker_session(tmp_path, exit_wait_s=3.0, name="handing")
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 1 and "not all uploaded" in lines[0], lines
    assert _tracker_state(tmp_path)["handing"]["unsent_rows"] == len(_ROWS)
    assert HandingTracker.told_s == 3.0
    HandingTracker.up = True
    _tracker_session(tmp_path, name="handing")
  finally:
    trackers_lib.unregister("handing")
  assert capfd.readouterr().err == ""
  assert _tracker_state(tmp_path)["handing"]["unsent_rows"] == 0
  assert [(row.step, row.values["loss"]) for row in HandingTracker.server] == [
      (row["step"], row["loss"]) for row in _ROWS]


def test_the_session_end_waits_for_an_unanswered_call_as_long_as_the_run_sets(
    tmp_path, monkeypatch, capfd):
  """`TrainConfig.tracker_exit_wait_s` is the bound: a server that never answers holds
  the end 1 s when the run sets 1 s (the default's 10 s has the tests above), and its
  line says so."""
  monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "outages")
  with tracker_tools.silent_server() as url:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    waited_s = _tracker_session(tmp_path, exit_wait_s=1.0)
  lines = capfd.readouterr().err.splitlines()
  assert len(lines) == 1 and lines[0].startswith(
      f"warning: mlflow tracker: no answer from the MLflow server at {url} "
      "(MLFLOW_TRACKING_URI) in 1 s at the end of the session; 3 row(s) not sent"), lines
  assert 0.5 <= waited_s <= 2.0, waited_s
  assert _tracker_state(tmp_path)["mlflow"]["unsent_rows"] == len(_ROWS)


@pytest.mark.slow   # one tiny training run in a subprocess (CI runs it)
def test_the_trainer_with_mlflow_down_prints_one_line_and_exits_at_once(
    trainer_env, tmp_path):  # pylint: disable=redefined-outer-name
  """The reported case: the trainer with MLflow on a closed port. One line on stderr,
  the client's retries nowhere on the console, the exit as prompt as without MLflow."""
  env = dict(trainer_env.env, MLFLOW_TRACKING_URI=f"http://127.0.0.1:{free_port()}")
  workdir = str(tmp_path / "run")
  command = trainer_env.train_command(workdir, "TRAIN_STEPS=4",
                                      "TrainConfig.trackers=('tensorboard', 'mlflow')")
  with open(tmp_path / "stderr", "w+", encoding="utf-8") as stderr:
    process = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE,
                               stderr=stderr, text=True)
    watchdog = threading.Timer(300, process.kill)   # the loop below ends either way
    watchdog.start()
    out, done_at = [], None
    for line in process.stdout:   # until the process closes its output
      out.append(line)
      if line.startswith("Done: "):
        done_at = time.monotonic()
    watchdog.cancel()
    code = process.wait()
    stderr.seek(0)
    err = stderr.read()
  assert code == 0, "".join(out)[-3000:] + err[-3000:]
  assert done_at is not None and time.monotonic() - done_at <= delivery.EXIT_WAIT_S, out
  lines = err.splitlines()
  assert len(lines) == 1 and lines[0].startswith(
      "warning: mlflow tracker: no answer from the MLflow server at "), err
  assert _tracker_state(workdir)["mlflow"]["unsent_rows"] > 0


def _wandb_env(tmp_path, url):
  """The environment of a W&B session in a process of its own: online, at `url`, with a
  key; no .netrc, settings or W&B variables of the user's; W&B's files under
  `tmp_path`."""
  env = {name: value for name, value in os.environ.items()
         if not name.startswith("WANDB_") and name != "NETRC"}
  env.update(PYTHONPATH=REPO, WANDB_BASE_URL=url, WANDB_API_KEY="0" * 40,
             WANDB_INIT_TIMEOUT="3", WANDB_DIR=str(tmp_path), HOME=str(tmp_path / "home"),
             **{name: str(tmp_path / "wandb_home") for name in
                ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")})
  return env


@pytest.mark.slow   # a W&B session in a process of its own per case: 10-30 s
@pytest.mark.parametrize("server", ["never answers", "refuses the key", "closed port",
                                    "no API key"])
def test_wandb_silent_or_refusing_costs_one_line_and_a_bounded_end(server, tmp_path):
  """W&B online (not offline) against a loopback server that accepts and never answers,
  answers 401, or a closed port, with a key set; or with no key at all (no
  WANDB_API_KEY, a HOME without .netrc): one line on the console from the whole process
  (W&B's exit and telemetry included), the session's end within `delivery.EXIT_WAIT_S`,
  the process's within W&B's own exit, and every row kept for the next session."""
  workdir = str(tmp_path / "run")
  os.makedirs(workdir)
  with contextlib.ExitStack() as stack:
    if server in ("closed port", "no API key"):   # nothing listens: no traffic leaves
      url = f"http://127.0.0.1:{free_port()}"
    else:
      url = stack.enter_context(tracker_tools.silent_server() if server == "never answers"
                                else tracker_tools.refusing_server())
    env = _wandb_env(tmp_path, url)
    if server == "no API key":
      del env["WANDB_API_KEY"]
    began = time.monotonic()
    result = subprocess.run(tracker_tools.session_command(workdir, "wandb"), env=env,
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    took_s = time.monotonic() - began
  assert result.returncode == 0, result.stderr
  lines = result.stderr.splitlines()
  assert len(lines) == 1, result.stderr   # the project's line; no client library's
  assert lines[0].startswith(f"warning: wandb tracker: error from W&B at {url} "
                             "(WANDB_BASE_URL, WANDB_API_KEY): "), result.stderr
  if server == "refuses the key":
    assert "401" in lines[0], result.stderr
  elif server == "closed port":
    assert "connection refused" in lines[0], result.stderr
  elif server == "no API key":
    assert "No API key configured" in lines[0], result.stderr
  close_s = float(result.stdout.split("close took ")[1].split()[0])
  assert close_s <= delivery.EXIT_WAIT_S + 1, result.stdout
  assert took_s <= WANDB_PROCESS_S, took_s
  assert _tracker_state(workdir)["wandb"]["unsent_rows"] == len(tracker_tools.SESSION_ROWS)


# The session end's bound in the W&B outage cells below: W&B's `finish` then waits at
# most 0.8 x 4 = 3.2 s (`wandb_tracker.FINISH_SHARE`); the default 10 s behaves alike
# (`test_the_session_end_waits_for_an_unanswered_call_as_long_as_the_run_sets`).
WANDB_EXIT_WAIT_S = 4.0
# The most W&B's own end at the process's exit may take after the session's end: its
# run is finished or given up by then (measured: 0.7 s, 2.4 s for a server holding
# its requests: wandb-core gives its own telemetry 2 s).
WANDB_AFTER_CLOSE_S = 5.0


def _wandb_session(workdir, env):
  """One session of the W&B tracker in a process of its own (`tracker_tools._session`):
  its result, how long its end took and how long its process took after that."""
  result = subprocess.run(tracker_tools.session_command(workdir, "wandb"), env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=120)
  exited_at = time.monotonic()
  assert result.returncode == 0, result.stdout + result.stderr
  words = result.stdout.split("close took ")[1].split()
  return result, float(words[0]), exited_at - float(words[-1])


@pytest.mark.slow   # fast tier under 5 min: two W&B processes per case (10-19 s)
@pytest.mark.parametrize("outage", [wandb_server.CLOSED, wandb_server.SILENT])
def test_wandb_gone_mid_run_costs_one_line_a_bounded_exit_and_gets_its_rows_later(
    outage, tmp_path):
  """W&B's server (the loopback stand-in) answers `init`, then closes its port or holds
  every request unanswered from the run's first upload on: one line on the console,
  W&B's `finish` given up within the bound and W&B's own exit prompt, every row counted
  unsent though W&B took them; the server answers again and the next session sends
  every row, which the server gets at its step."""
  workdir = str(tmp_path / "run")
  os.makedirs(workdir)
  with wandb_server.wandb_stand_in() as server:
    env = dict(_wandb_env(tmp_path, server.url), SESSION_EXIT_WAIT_S=str(WANDB_EXIT_WAIT_S))
    server.go_down(outage, at="/files/")
    result, close_s, exit_s = _wandb_session(workdir, env)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr   # the project's line; no client library's
    assert lines[0].startswith(
        f"warning: wandb tracker: no answer from W&B at {server.url} (WANDB_BASE_URL, "
        "WANDB_API_KEY): the run's data was not all uploaded after 3 s"), result.stderr
    client_log = RunDirectory(workdir).client_log   # W&B's records, named by the line
    assert lines[0].endswith(f"its client's log: {client_log}"), result.stderr
    with open(client_log, encoding="utf-8") as f:
      assert "wandb: finishing run" in f.read()
    # The end waits for W&B's `init` too, which answers (1 to 2 s on loaded cores),
    # then 3.2 s for `finish`: 4.3 to 5.3 s measured.
    assert close_s <= WANDB_EXIT_WAIT_S + 3, result.stdout
    assert exit_s <= WANDB_AFTER_CLOSE_S, exit_s
    state = _tracker_state(workdir)["wandb"]
    assert state["unsent_rows"] == len(tracker_tools.SESSION_ROWS)
    assert server.history(state["run_id"]) == []

    server.come_back()
    result, _, _ = _wandb_session(workdir, env)
    assert result.stderr == ""
    state = _tracker_state(workdir)["wandb"]
    assert state["unsent_rows"] == 0
    assert [(row["_step"], row["train/loss"]) for row in server.history(state["run_id"])] == [
        (row["step"], pytest.approx(row["loss"])) for row in tracker_tools.SESSION_ROWS]
