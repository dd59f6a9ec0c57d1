"""Object storage that refuses or stalls, on loopback servers, in-process where the
product's own code is the point (docs/contracts.md, "Outside services", Object storage).

At start-up (`cli.prepare_workdir`, what every command runs before any compute): a GCS
that refuses the credentials (401) or the permission (403), answered by a small server
in GCS's error JSON (the emulator checks no credentials), and a storage of either scheme
that answers the connection check and then stalls. Mid-run and at exit: a bucket behind
a `StorageProxy` that stalls, seen by the final checkpoint save and by the metric
uploads. Each: one line, within its bound, nothing from the client libraries on the
console, and the data there once the storage answers again.
"""
import contextlib
import json
import subprocess
import time

import jax
import jax.numpy as jnp
import pytest

from plumbing import cli, storage
from plumbing.errors import StorageOutageError, UserError
from pretrain.checkpoints.outage import StorageConfig
from pretrain.checkpoints.persistent import PersistentTier, complete_steps
from pretrain.checkpoints.policies import Essential, Snapshot
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
