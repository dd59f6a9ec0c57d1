"""Runs whose workdir is a bucket, on real local servers (a GCS emulator, moto's S3).

Per server, one tiny run (the shared tiny config, with a profiler trace of steps 2-3,
uploaded to the bucket) trains into `<bucket>/runs/tiny`, is
killed with SIGKILL mid-run (async saves in flight) and rerun with the same command;
its losses must equal the uninterrupted local run's step for step. Then `evaluate`,
`sample` and `pretrain.load` read that bucket workdir. Bad storage (an unreachable
endpoint, one that accepts and never answers, a missing bucket, refused credentials) is
one line and costs nothing saved; an unreachable GCS endpoint fails in seconds, not
after gcsfs's ~36 s of retries, and a silent one of either scheme in 5 s.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from plumbing import cli, storage
from plumbing.errors import UserError
import pretrain
from pretrain.checkpoints.persistent import complete_steps
from pretrain.run_directory import RunDirectory
from pretrain.evaluate import text_file_metrics
from pretrain.evaluation.generation import sample_text
from storage_servers import environment, free_port, s3_environment, server
import tracker_tools
from trainer_helpers import (REPO, assert_ok, bucket_rows,  # pylint: disable=unused-import
                             storage_env, train_losses, trained_workdir, trainer_env)

pytestmark = pytest.mark.slow

STEPS = 24          # as in the shared tiny config
KILL_AFTER = 10     # kill once this many steps are logged
def run(trainer_env, command, env, timeout=300):
  return subprocess.run(command, env=env, cwd=REPO, capture_output=True,
                        text=True, timeout=timeout)


@pytest.fixture(scope="module", params=["gcs", "s3"])
def bucket_run(request, trainer_env):
  """(workdir URL, stdout of the rerun, resumed step) of a killed-and-rerun bucket run."""
  workdir = request.getfixturevalue(f"{request.param}_bucket") + "/runs/tiny"
  env = storage_env(trainer_env.env)
  # Saves every 4 steps, not 2: each save is many objects, and half as many still leave
  # one in flight at the kill more often than not.
  command = trainer_env.train_command(workdir, "TrainConfig.profile_steps=(2, 3)",
                                      "CHECKPOINT_EVERY=4")
  process = subprocess.Popen(command, env=env, cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 240
  while time.time() < deadline and len(bucket_rows(workdir)) < KILL_AFTER:
    if process.poll() is not None:
      break
    time.sleep(0.2)
  assert process.poll() is None, "the run ended before it could be killed"
  os.kill(process.pid, signal.SIGKILL)
  process.wait(timeout=60)
  assert max(row["step"] for row in bucket_rows(workdir)) < STEPS
  resumable = complete_steps(RunDirectory(workdir).checkpoints)
  result = run(trainer_env, command, env)
  assert_ok(result)
  return workdir, result.stdout, (resumable[-1] if resumable else 0)


def test_killed_bucket_run_reruns_to_the_uninterrupted_losses(bucket_run, trained_workdir):
  workdir, stdout, resumed = bucket_run
  if resumed:
    assert f"Resuming from the checkpoint of step {resumed} in {workdir}" in stdout
  reference = train_losses(trained_workdir[0])
  rows = bucket_rows(workdir)
  assert [row["step"] for row in rows] == list(range(1, STEPS + 1))  # no duplicates
  for row in rows:
    assert abs(row["loss"] - reference[row["step"]]) <= 1e-6, (row, resumed)
  assert complete_steps(RunDirectory(workdir).checkpoints)[-1] == STEPS
  assert "TRAIN_STEPS = 24" in storage.read_text(storage.join(workdir, "config.gin"))
  events = storage.listdir(storage.join(workdir, "tensorboard"))
  assert events and all(name.startswith("events.out.tfevents") for name in events)
  # JAX traces to local disk only; the trace of steps 2-3 was uploaded when it stopped.
  assert list(storage.as_path(storage.join(workdir, "profile")).glob(
      "plugins/profile/*/*.xplane.pb"))


def test_evaluate_sample_and_load_read_the_bucket(bucket_run, trainer_env, trained_workdir):
  workdir, _, _ = bucket_run
  output = storage.join(workdir, "eval.json")
  result = run(trainer_env, trainer_env.command(
      "pretrain.evaluate", f"--workdir={workdir}", f"--output={output}"),
      storage_env(trainer_env.env))
  assert_ok(result)
  evaluated = json.loads(result.stdout.strip().splitlines()[-1])
  assert evaluated == json.loads(storage.read_text(output))
  assert evaluated["step"] == STEPS and np.isfinite(evaluated["loss"])

  model = pretrain.load(workdir)
  local = pretrain.load(trained_workdir[0])
  assert model.step == local.step == STEPS
  for ours, theirs in zip(jax_leaves(model.params), jax_leaves(local.params)):
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)
  text = storage.join(workdir, "prompt.txt")
  storage.write_text(text, "def items(self):\n    return self.value\n")
  scored = text_file_metrics(model, text)
  assert scored == text_file_metrics(local, text)
  continuation = sample_text(model.config, model.params, model.vocabulary, "def ",
                             max_new_tokens=8, temperature=0.8, seed=1)
  assert continuation == sample_text(local.config, local.params, local.vocabulary, "def ",
                                     max_new_tokens=8, temperature=0.8, seed=1)


def jax_leaves(tree):
  return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


def _one_line_error(result, *fragments):
  assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
  for fragment in fragments:
    assert fragment in lines[0], lines[0]
  return lines[0]


def test_bad_storage_is_one_line_and_keeps_the_saved_run(bucket_run, trainer_env):
  workdir, _, _ = bucket_run
  bucket = workdir.split("/")[2]
  saved = complete_steps(RunDirectory(workdir).checkpoints)
  metrics = storage.read_text(storage.join(workdir, "metrics.jsonl"))
  command = trainer_env.train_command(workdir, "TRAIN_STEPS=30")

  # A bucket that does not exist (same server): checked in-process, before any compute.
  missing = workdir.replace(f"//{bucket}/", "//no-such-bucket/")
  with pytest.raises(UserError, match="does bucket 'no-such-bucket' exist"):
    cli.prepare_workdir(missing)

  # An endpoint that accepts connections and never answers: the start-up check gives up
  # after storage.STARTUP_PROBE_S, where the clients would wait minutes with their retries.
  variable = "STORAGE_EMULATOR_HOST" if workdir.startswith("gs://") else "AWS_ENDPOINT_URL"
  with tracker_tools.silent_server() as silent, environment(**{variable: silent}):
    started = time.monotonic()
    with pytest.raises(UserError, match=f"cannot reach the storage of {re.escape(workdir)} "
                       r"\(ConnectionError: 127.0.0.1:\d+: no answer in 5 s\).*"
                       f"{variable}") as raised:
      cli.prepare_workdir(workdir)
  assert time.monotonic() - started < storage.STARTUP_PROBE_S + 1
  assert "\n" not in str(raised.value)

  if workdir.startswith("gs://"):
    # Nothing listening at the endpoint: gcsfs alone would retry for ~36 s.
    started = time.monotonic()
    with environment(STORAGE_EMULATOR_HOST=f"http://127.0.0.1:{free_port()}"):
      with pytest.raises(UserError, match="cannot reach the storage of gs://.*"
                         "STORAGE_EMULATOR_HOST") as raised:
        cli.prepare_workdir(workdir)
    assert time.monotonic() - started < 5 and "\n" not in str(raised.value)

  if workdir.startswith("s3://"):
    # Nothing listening at the endpoint.
    dead = f"http://127.0.0.1:{free_port()}"
    _one_line_error(run(trainer_env, command, storage_env(
        trainer_env.env, AWS_ENDPOINT_URL=dead)), "cannot reach the storage", workdir)
    # A server that refuses the credentials (moto with authentication on).
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    refusing = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with server(refusing, endpoint, env=dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="0")):
      _one_line_error(run(trainer_env, command, storage_env(
          trainer_env.env, **s3_environment(endpoint))), "permission denied", workdir)

  assert complete_steps(RunDirectory(workdir).checkpoints) == saved
  assert storage.read_text(storage.join(workdir, "metrics.jsonl")) == metrics


_LIST_UNDER_A_PATH = """
import tensorstore as ts
bucket = ts.KvStore.open({"driver": "gcs", "bucket": "bucket"}).result()
bucket.write("short", b"0").result()
path = "listing_test/a_directory_whose_name_is_long/"
bucket.write(path + "shard_0", b"1").result()
print(ts.KvStore.open({"driver": "gcs", "bucket": "bucket", "path": path}).result()
      .list().result())
"""


def test_gcs_emulator_lists_only_the_requested_range(gcs_bucket):
  """tensorstore lists a path as the key range [startOffset, endOffset) and strips the
  path from every returned name; the emulator ignored the range, so a shorter name
  elsewhere in the session's bucket made tensorstore abort (SIGABRT in CI). The
  fixture's emulator now answers like GCS."""
  del gcs_bucket  # its environment points tensorstore at the emulator
  listed = subprocess.run([sys.executable, "-c", _LIST_UNDER_A_PATH], capture_output=True,
                          text=True, timeout=120)
  assert listed.returncode == 0, listed.stderr[-2000:]
  assert listed.stdout.strip() == "[b'shard_0']"
