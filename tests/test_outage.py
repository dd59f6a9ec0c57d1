"""The outage clock and the background uploads, alone (a real bucket that goes away is
in tests/test_storage_outage.py)."""
import threading
import time

import pytest

from plumbing import storage
from plumbing.errors import StorageOutageError, UserError
from pretrain.checkpoints import outage


def test_backoff_doubles_and_the_outage_ends_the_run_after_outage_s():
  now = [100.0]
  clock = outage.Outage(60.0, clock=lambda: now[0])
  error = UserError("cannot reach the storage of gs://b/run (ConnectionError: refused)")
  assert [clock.failed(error, "metrics.jsonl") for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]
  now[0] += 59
  clock.failed(error, "metrics.jsonl")
  assert clock.down_s() == 59
  now[0] += 2
  with pytest.raises(StorageOutageError) as info:
    clock.failed(error, "metrics.jsonl")
  assert str(info.value) == (
      "cannot reach the storage of gs://b/run (ConnectionError: refused); writing "
      "metrics.jsonl has failed for 61 s, longer than StorageConfig.outage_s = 60 s")
  clock.succeeded()
  assert not clock.ongoing and clock.failed(error, "x") == 1


def test_the_outage_began_when_the_failed_attempt_did():
  now = [100.0]
  clock = outage.Outage(30.0, clock=lambda: now[0])
  now[0] = 136.0   # a client retried inside one call for 36 s
  with pytest.raises(StorageOutageError):
    clock.failed(UserError("down"), "x", started=100.0)


class _Storage:
  """A store that refuses writes while `down` is set."""

  def __init__(self):
    self.down = threading.Event()
    self.files = {}
    self.attempts = 0

  def writer(self, name, text):
    def write():
      self.attempts += 1
      if self.down.is_set():
        raise UserError("cannot reach the storage")
      self.files[name] = text
    return write


def test_uploads_are_retried_until_the_storage_answers_newest_version_first(monkeypatch):
  monkeypatch.setattr(outage, "FIRST_BACKOFF_S", 0.05)
  store = _Storage()
  uploads = outage.Uploads(outage_s=30)
  store.down.set()
  uploads.submit("metrics.jsonl", store.writer("metrics.jsonl", "row 1\n"))
  time.sleep(0.3)
  uploads.submit("metrics.jsonl", store.writer("metrics.jsonl", "row 1\nrow 2\n"))
  assert store.files == {} and store.attempts >= 2   # retried, the caller never waited
  store.down.clear()
  assert uploads.flush(timeout_s=10)
  assert store.files == {"metrics.jsonl": "row 1\nrow 2\n"}
  uploads.close()


def test_uploads_raise_in_the_caller_once_the_outage_lasts_too_long(monkeypatch):
  monkeypatch.setattr(outage, "FIRST_BACKOFF_S", 0.05)
  store = _Storage()
  store.down.set()
  uploads = outage.Uploads(outage_s=0.3)
  uploads.submit("tensorboard", store.writer("tensorboard", "events"))
  assert not uploads.flush(timeout_s=10)
  with pytest.raises(StorageOutageError, match="writing tensorboard has failed for"):
    uploads.submit("metrics.jsonl", store.writer("metrics.jsonl", "row"))
  uploads.close(timeout_s=0)


def test_storage_config_rejects_a_negative_outage():
  with pytest.raises(ValueError, match="StorageConfig.outage_s must be >= 0"):
    outage.StorageConfig(outage_s=-1)


def test_a_refused_connection_is_an_outage_whatever_its_port():
  """The endpoint's port is in the error (127.0.0.1:40383): it is no HTTP 403."""
  refused = ConnectionError("127.0.0.1:40383: Connection refused")
  assert storage.describe_error("gs://b/run", refused).startswith(
      "cannot reach the storage of gs://b/run (ConnectionError: 127.0.0.1:40383")
  assert storage.describe_error("gs://b/run", OSError("HTTP 403 Forbidden")).startswith(
      "permission denied on gs://b/run")
  assert storage.describe_error("gs://b/run", OSError("404 NoSuchKey")).startswith(
      "gs://b/run: not found")
