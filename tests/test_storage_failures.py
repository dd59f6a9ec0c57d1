"""Object storage that refuses or stalls, on loopback servers, in-process where the
product's own code is the point (docs/contracts.md, "Outside services", Object storage).

At start-up (`cli.prepare_workdir`, what every command runs before any compute): a GCS
that refuses the credentials (401) or the permission (403), answered by a small server
in GCS's error JSON (the emulator checks no credentials), and a storage of either scheme
that answers the connection check and then stalls. Mid-run and at exit: a bucket behind
a `StorageProxy` that stalls, seen by the final checkpoint save, by the metric uploads
and by a session's end with rows queued; or that refuses (403 in the storage's own
format, a revoked permission), seen by the checkpoint saves. Each: one line, within
its bound, nothing from the client libraries on the console, and the data there once
the storage answers again.
"""
import contextlib
import json
import logging
import subprocess
import time

import jax
import jax.numpy as jnp
import pytest

from plumbing import cli, storage
from plumbing.errors import StorageOutageError, UserError
from pretrain.checkpoints.checkpointer import CheckpointConfig, Checkpointer
from pretrain.checkpoints import outage
from pretrain.checkpoints.outage import StorageConfig
from pretrain.checkpoints.persistent import PersistentTier, complete_steps
from pretrain.checkpoints.policies import Essential, Snapshot
from pretrain.observability import metrics as metrics_lib
from pretrain.observability.metrics import MetricsWriter
from pretrain.run_directory import RunDirectory, UNSENT_METRICS
from storage_servers import (answering_storage, environment, forget_clients,  # pylint: disable=unused-import
                             fsspec_options, gcs_environment, proxied_bucket, s3_environment)
from trainer_helpers import REPO, storage_env, trainer_env  # pylint: disable=unused-import

WRITE_S = 2.0   # `storage.STARTUP_WRITE_S` in these tests (10 s in a command)


@contextlib.contextmanager
def _clients_at(scheme: str, endpoint: str):
  """Points this process's clients of `scheme` at `endpoint` for the block; gcsfs and
  s3fs cache their file systems, each bound to the endpoint it was made with."""
  variables = gcs_environment(endpoint) if scheme == "gs" else s3_environment(endpoint)
  forget_clients()
  with environment(**variables), fsspec_options(("gs", "gcs"), token="anon"):
    yield
  forget_clients()


def _refused_at_start_up(url: str, capfd) -> tuple[str, float]:
  """(the one-line error of `cli.prepare_workdir(url)`, seconds it took); nothing may
  reach the console meanwhile."""
  capfd.readouterr()
  started = time.monotonic()
  with pytest.raises(UserError) as raised:
    cli.prepare_workdir(url)
  took = time.monotonic() - started
  message = str(raised.value)
  assert "\n" not in message, message
  assert capfd.readouterr() == ("", ""), "client libraries wrote to the console"
  return message, took


GCS_REFUSALS = [
    # A token GCS does not take: gcsfs retries it 6 times (about 35 s), as an expired one.
    ("401, wrong token", 401, "Invalid Credentials",
     "refused the credentials (HTTP 401: Invalid Credentials, 401; retried for 2 s)"),
    ("401, anonymous", 401, "Anonymous caller does not have storage.objects.create "
     "access to the Google Cloud Storage object.", "refused the credentials (HTTP 401: "
     "Anonymous caller does not have storage.objects.create access"),
    ("403, no permission", 403, "tester@project.iam.gserviceaccount.com does not have "
     "storage.objects.create access to the Google Cloud Storage object. Permission "
     "'storage.objects.create' denied on resource (or it may not exist).",
     "(HTTP 403): the credentials in use may not write bucket 'bucket' (Forbidden: "),
]


@pytest.mark.parametrize("case, status, message, expected", GCS_REFUSALS,
                         ids=[case[0] for case in GCS_REFUSALS])
def test_refused_gcs_credentials_are_one_line_before_compute(
    case, status, message, expected, gcs_bucket, tmp_path, capfd, monkeypatch):
  """GCS refusing the caller: one line naming the URL, the status and what to check,
  within the start-up bound also when gcsfs retries the refusal; the same check passes
  against a storage that takes the credentials."""
  del case
  monkeypatch.setattr(storage, "STARTUP_WRITE_S", WRITE_S)
  url = f"gs://bucket/refused/{tmp_path.name}"
  with answering_storage(status, message) as endpoint, _clients_at("gs", endpoint):
    line, took = _refused_at_start_up(url, capfd)
  assert line.startswith(f"--workdir {url} is not writable: "), line
  assert expected in line, line
  assert "GOOGLE_APPLICATION_CREDENTIALS" in line, line
  assert took < WRITE_S + 4, took   # the bound, and the probe and imports on loaded cores
  cli.prepare_workdir(f"{gcs_bucket}/refused/{tmp_path.name}")   # the emulator's


@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_a_storage_that_stalls_after_the_probe_fails_at_start_up_within_the_bound(
    scheme, gcs_bucket, s3_bucket, tmp_path, capfd, monkeypatch):
  """A storage that answers the connection check (`STARTUP_PROBE_S`) and then never
  answers the probe file's write: one line within `STARTUP_WRITE_S`, where the
  clients would wait minutes (gcsfs: aiohttp's 300 s a request; botocore: 60 s a
  read, retried); then the same check passes against a storage that answers."""
  monkeypatch.setattr(storage, "STARTUP_WRITE_S", WRITE_S)
  url = f"{scheme}://bucket/stalled/{tmp_path.name}"
  variable = "STORAGE_EMULATOR_HOST" if scheme == "gs" else "AWS_ENDPOINT_URL"
  with answering_storage(None) as endpoint, _clients_at(scheme, endpoint):
    line, took = _refused_at_start_up(url, capfd)
  assert line.startswith(f"--workdir {url} is not writable: cannot reach the storage of "
                         f"{url}/.write_test-"), line
  assert f"(TimeoutError: {endpoint.split('//')[1]}: no answer in 2 s); check the " \
      f"network, the credentials and {variable}" in line, line
  assert took < WRITE_S + 4, took   # the bound, and the probe and imports on loaded cores
  bucket = gcs_bucket if scheme == "gs" else s3_bucket
  cli.prepare_workdir(f"{bucket}/stalled/{tmp_path.name}")


def _snapshot() -> Snapshot:
  return Snapshot(params={"w": jnp.arange(8, dtype=jnp.float32)}, opt_state=None,
                  rng=jax.random.key(0), metadata={"note": "stalled"})


@pytest.mark.slow   # about 6 s
@pytest.mark.parametrize("proxied_bucket", ["gs"], indirect=True)
def test_a_storage_that_stalls_during_the_final_save_is_an_outage(proxied_bucket, capfd):
  """The storage stalls once the final save has started: waiting for it is waiting
  for an outage (the save's probe, 2 s), one line, `StorageOutageError` after
  `outage_s` (the trainer then saves its local tier and stops, exit 1), instead of
  waiting for the clients' own timeouts and retries; once the storage answers, the
  save in flight ends and the step is there."""
  url, proxy = proxied_bucket
  tier = PersistentTier(RunDirectory(f"{url}/runs/final"))
  policy = Essential(tier, every=100, outage_s=2)
  policy.started(0, None)
  real_save = tier.save

  def save_then_stall(*args, **kwargs):
    real_save(*args, **kwargs)
    proxy.stall()

  tier.save = save_then_stall
  lines = []
  capfd.readouterr()
  started = time.monotonic()
  with pytest.raises(StorageOutageError, match="writing checkpoint 1 has failed for"):
    policy.save_final(1, _snapshot(), lines.append)
  took = time.monotonic() - started
  (warning,) = capfd.readouterr().err.splitlines()
  assert warning.startswith(f"warning: checkpoint 1 deferred: cannot reach the storage of "
                            f"{url}/runs/final/checkpoints"), warning
  # A 2 s probe sees the stall, then 2 s of outage (a 1 s backoff and a second probe).
  assert took < 2 + 2 + 2 + 3, took
  proxy.resume()
  policy.save_final(1, _snapshot(), lines.append)
  assert lines == [f"The storage of {url}/runs/final/checkpoints answers again after "
                   f"{lines[0].split(' after ')[1].split()[0]} s: saving step 1"], lines
  assert complete_steps(tier.directory) == [1]
  policy.close()


@pytest.mark.slow   # about 4 s, 5 on a loaded machine
@pytest.mark.parametrize("proxied_bucket", ["gs"], indirect=True)
def test_metric_rows_of_a_storage_that_stalls_are_kept_and_sent_when_it_answers(
    proxied_bucket, tmp_path, capfd):
  """The storage stalls under the metric uploads: the upload in flight for longer than
  `outage_s` is an outage (`StorageOutageError` at the next row, as the trainer sees
  it); the writer's close as an outage stop waits for nothing and keeps the rows the
  bucket lacks, in one line; the next run's writer sends them once the storage answers."""
  url, proxy = proxied_bucket
  workdir = f"{url}/runs/metrics"
  metrics = storage.join(workdir, "metrics.jsonl")
  unsent = str(tmp_path / "local" / UNSENT_METRICS)
  config = StorageConfig(outage_s=2)
  writer = MetricsWriter(workdir, 100, trackers=(), storage_config=config,
                         unsent_path=unsent, stream=open(tmp_path / "stdout", "w"))
  writer.log_train(1, _row(3.0))
  _wait_for(lambda: storage.exists(metrics))
  proxy.stall()
  capfd.readouterr()
  stalled = time.monotonic()
  step = 1
  with pytest.raises(StorageOutageError, match=f"cannot reach the storage of {metrics} "
                     r"\(ConnectionError: 127.0.0.1:\d+: no answer in 2 s\); .*; writing "
                     f"{metrics} has failed for"):
    while time.monotonic() - stalled < 20:
      step += 1
      writer.log_train(step, _row(3.0 - step / 100))
      time.sleep(0.1)
  assert time.monotonic() - stalled < config.outage_s + 2 + 4   # the 2 s probe, loaded cores
  closing = time.monotonic()
  writer.close(0.0, failed=True)   # as the trainer closes it after an outage stop
  assert time.monotonic() - closing < 2
  (warning,) = capfd.readouterr().err.splitlines()
  assert warning == (f"warning: metrics and TensorBoard writes still queued did not reach "
                     f"the storage; the metric rows are kept in {unsent}: the next run "
                     "sends them"), warning
  with open(unsent, encoding="utf-8") as f:
    # Every row logged, the one whose upload met the outage too.
    assert [json.loads(line)["step"] for line in f] == list(range(1, step + 1))

  proxy.resume()
  # The write held by the stall lands first (an older version of the file).
  _wait_for(lambda: len(storage.read_text(metrics).splitlines()) > 1)
  writer = MetricsWriter(workdir, 100, trackers=(), storage_config=config,
                         unsent_path=unsent, stream=open(tmp_path / "stdout", "w"))
  writer.close()
  assert [json.loads(line)["step"] for line in storage.read_text(metrics).splitlines()
          ] == list(range(1, step + 1))


REVOKED = ("tester@project.iam.gserviceaccount.com does not have storage.objects.create "
           "access to the Google Cloud Storage object.")
CLIENT_LOGGERS = ("gcsfs", "google", "aiohttp", "botocore", "boto3", "s3fs", "urllib3")


def _state(step: int) -> Snapshot:
  """The snapshot of `step`, its parameters telling the step apart."""
  return Snapshot(params={"w": jnp.arange(8, dtype=jnp.float32) + step}, opt_state=None,
                  rng=jax.random.key(step), metadata={"step": step})


def _checkpointer(url: str, tmp_path) -> Checkpointer:
  """The tiers of a run in `url/runs/refused`: the persistent one every 2 steps, a
  local one every step."""
  config = CheckpointConfig(local_dir=str(tmp_path / "local"), local_every=1)
  return Checkpointer.for_run(RunDirectory(f"{url}/runs/refused", config.local_dir),
                              config, every=2)


def _train(checkpointer: Checkpointer, steps: range, lines: list) -> None:
  """The trainer's saves at each of `steps`: the saves in flight polled, the tiers due
  saved."""
  for step in steps:
    checkpointer.poll()
    if checkpointer.is_due(step):
      checkpointer.save(step, _state(step), lines.append)


def _refused(proxy, dialect: str, stop, capfd, caplog) -> tuple[str, str, float]:
  """(the one warning line, the error that stopped the run, seconds it took) of
  `stop()` run while the storage refuses every request with 403 in its own format;
  nothing else may reach the console, and no client library may log a warning."""
  with answering_storage(403, REVOKED, dialect) as refuser:
    proxy.divert(refuser)
    capfd.readouterr()
    caplog.clear()
    started = time.monotonic()
    with pytest.raises(UserError) as raised:
      stop()
    took = time.monotonic() - started
    out, err = capfd.readouterr()
  assert out == "", out
  (warning,) = err.splitlines()
  assert not [record for record in caplog.records if record.levelno >= logging.WARNING
              and record.name.startswith(CLIENT_LOGGERS)], caplog.records
  return warning, str(raised.value), took


def _assert_refusal_lines(warning: str, error: str, url: str, step: int) -> None:
  """The retry's warning and the stop's error name the URL, the status and the fix."""
  checkpoints = f"{url}/runs/refused/checkpoints"
  fix = ("GOOGLE_APPLICATION_CREDENTIALS" if url.startswith("gs://")
         else "AWS_ACCESS_KEY_ID")
  assert warning.startswith(f"warning: checkpoint {step} failed: permission denied on "
                            f"{checkpoints} (HTTP 403): the credentials in use may not "
                            "write bucket 'bucket' ("), warning
  assert f"; check their permissions ({fix}" in warning, warning
  assert warning.endswith(f"; retrying with step {step}"), warning
  assert error.startswith(f"checkpoint {step} failed: permission denied on {checkpoints}"
                          " (HTTP 403)"), error
  assert error.endswith(f"(retried once); stopped. The complete checkpoints in "
                        f"{checkpoints} are kept"), error
  assert "\n" not in error and fix in error, error


def _restored(url: str, tmp_path) -> tuple[int, str, list]:
  """(the step a rerun resumes from, its tier's name, its parameters) once the storage
  answers again."""
  abstract = {"w": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=jax.sharding
                                        .SingleDeviceSharding(jax.devices()[0]))}
  checkpointer = _checkpointer(url, tmp_path)
  restored, skipped = checkpointer.restore_newest(abstract_params=abstract,
                                                  abstract_opt_state=None)
  checkpointer.close()
  assert skipped == []
  return restored.step, restored.tier.name, restored.params["w"].tolist()


@pytest.mark.parametrize("proxied_bucket", ["gs", "s3"], indirect=True)
def test_a_storage_that_refuses_mid_run_stops_after_one_retry_and_keeps_what_was_saved(
    proxied_bucket, tmp_path, capfd, caplog):
  """The bucket's permission is revoked mid-run (a `StorageProxy` whose every request
  is answered 403 in the storage's own error format: GCS's JSON, S3's `AccessDenied`
  XML): the next persistent save fails in its synchronous part, one line, and is
  retried once; the retry fails too and the run stops (a UserError: exit 1) naming the
  URL, the status and the fix, as soon as the storage has answered (no outage wait, no
  client retries). Every step saved before stays restorable: the persistent one and
  the local tier's newer one, which the rerun resumes from."""
  url, proxy = proxied_bucket
  checkpointer, lines = _checkpointer(url, tmp_path), []
  _train(checkpointer, range(1, 4), lines)   # persistent: 2; local: 1, 3
  checkpointer.wait()
  warning, error, took = _refused(proxy, url[:2],
                                  lambda: _train(checkpointer, range(4, 7), lines),
                                  capfd, caplog)
  _assert_refusal_lines(warning, error, url, 4)
  assert took < 5, took   # measured: under 0.2 s
  checkpointer.close()
  proxy.resume()
  assert lines == []
  assert complete_steps(f"{url}/runs/refused/checkpoints") == [2]
  assert _restored(url, tmp_path) == (3, "local", list(range(3, 11)))


@pytest.mark.parametrize("proxied_bucket", ["gs", "s3"], indirect=True)
def test_a_storage_that_refuses_the_final_save_stops_at_once_and_keeps_what_was_saved(
    proxied_bucket, tmp_path, capfd, caplog):
  """The final save refused (403): one line, one retry, the stop's line, within
  seconds (the final save waits for a storage that does not answer, up to
  `outage_s`; one that refuses has answered); the persistent steps saved before stay
  restorable once the storage takes the credentials again."""
  url, proxy = proxied_bucket
  checkpointer, lines = _checkpointer(url, tmp_path), []
  _train(checkpointer, range(1, 5), lines)   # persistent: 2, 4; local: 1, 3
  checkpointer.wait()
  warning, error, took = _refused(
      proxy, url[:2], lambda: checkpointer.save_final(5, _state(5), lines.append),
      capfd, caplog)
  _assert_refusal_lines(warning, error, url, 5)
  assert took < 5, took   # measured: under 0.2 s
  closing = time.monotonic()
  checkpointer.close()
  assert time.monotonic() - closing < 2
  proxy.resume()
  assert complete_steps(f"{url}/runs/refused/checkpoints") == [2, 4]
  assert _restored(url, tmp_path) == (4, "persistent", list(range(4, 12)))


@pytest.mark.parametrize("proxied_bucket", ["gs"], indirect=True)
@pytest.mark.parametrize("answers_the_probe", [False, True], ids=["silent", "probe only"])
def test_metric_rows_queued_when_a_session_ends_on_a_stalled_storage_are_kept_in_seconds(
    answers_the_probe, proxied_bucket, tmp_path, capfd, monkeypatch):
  """A session ends (the trainer's `close`, which waits up to `FLUSH_TIMEOUT_S` for
  its trackers) while the storage stalls under the metric uploads: the writes still
  queued are not waited for when the storage does not answer the 2 s probe, and for
  at most `EXIT_FLUSH_S` (here 1 s) when it answers the probe and takes no write,
  rather than for the clients' minutes; one line, the rows kept, and the next
  session's writer sends them once the storage answers."""
  monkeypatch.setattr(metrics_lib, "EXIT_FLUSH_S", 1.0)
  url, proxy = proxied_bucket
  workdir = f"{url}/runs/exit"
  metrics = storage.join(workdir, "metrics.jsonl")
  unsent = str(tmp_path / "local" / UNSENT_METRICS)
  writer = MetricsWriter(workdir, 100, trackers=(), unsent_path=unsent,
                         stream=open(tmp_path / "stdout", "w"))
  writer.log_train(1, _row(3.0))
  _wait_for(lambda: storage.exists(metrics))
  with answering_storage(None) as probe_only:
    if answers_the_probe:
      proxy.divert(probe_only)
    else:
      proxy.stall()
    for step in range(2, 6):
      writer.log_train(step, _row(3.0 - step / 100))
    capfd.readouterr()
    closing = time.monotonic()
    writer.close(outage.FLUSH_TIMEOUT_S)   # as the trainer closes a session that ended
    took = time.monotonic() - closing
    (warning,) = capfd.readouterr().err.splitlines()
  assert took < (1 if answers_the_probe else 2) + 3, took   # the bound, loaded cores
  assert warning == (f"warning: metrics and TensorBoard writes still queued did not reach "
                     f"the storage; the metric rows are kept in {unsent}: the next run "
                     "sends them"), warning
  with open(unsent, encoding="utf-8") as f:
    assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4, 5]

  proxy.resume()
  if not answers_the_probe:   # the write held by the stall lands first (an older version)
    _wait_for(lambda: len(storage.read_text(metrics).splitlines()) > 1)
  writer = MetricsWriter(workdir, 100, trackers=(), unsent_path=unsent,
                         stream=open(tmp_path / "stdout", "w"))
  writer.close()
  assert [json.loads(line)["step"] for line in storage.read_text(metrics).splitlines()
          ] == [1, 2, 3, 4, 5]


def _row(loss: float) -> dict:
  return dict(loss=loss, learning_rate=0.1, grad_norm=1.0, param_norm=1.0,
              tokens_per_second=10.0, step_time_s=0.1, mfu=None)


def _wait_for(condition, timeout_s: float = 30) -> None:
  deadline = time.monotonic() + timeout_s
  while not condition():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.05)


@pytest.mark.slow
def test_the_trainer_with_gcs_refusing_its_token_is_one_line_within_the_bound(
    trainer_env, tmp_path):
  """The command end to end (its own logging, its exit with the check's thread still
  retrying): exit 1 with one line on stderr and nothing else, within STARTUP_WRITE_S
  (10 s) and the command's imports. (A storage that stalls after the probe leaves the
  same thread behind, in-process above.)"""
  with answering_storage(401, "Invalid Credentials") as endpoint:
    started = time.monotonic()
    result = subprocess.run(
        trainer_env.train_command(f"gs://bucket/runs/{tmp_path.name}"),
        env=storage_env(trainer_env.env, **gcs_environment(endpoint)), cwd=REPO,
        capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
  assert result.returncode == 1, result.stderr[-3000:]
  (line,) = result.stderr.splitlines()
  assert line.startswith(f"error: --workdir gs://bucket/runs/{tmp_path.name} is not "
                         "writable: "), line
  assert "refused the credentials (HTTP 401: Invalid Credentials, 401; retried for 10 s)" \
      in line, line
  assert took < storage.STARTUP_WRITE_S + 30, took   # 10 s, and the imports
