"""Checkpoint integrity without a model: manifests and their check, what a failed read or
write means, the files a failed save leaves, and the checkpoint hook's answer to a
failed save (retry once, then stop)."""
import errno
import json
import os
import time

import pytest

from plumbing.errors import CheckpointSaveError, StorageOutageError, UserError
from pretrain.checkpoints import policies
from pretrain.checkpoints import saving
from pretrain.checkpoints.checkpointer import Checkpointer
from pretrain.checkpoints import integrity

FILES = {"params/_METADATA": b"{}" * 10, "params/ocdbt.process_0/d/abc": bytes(range(256)) * 8,
         "params/ocdbt.process_0/d/def": b"\1" * 300, "opt_state/d/xyz": b"\2" * 500,
         "train/metadata": b'{"step": 4}'}


@pytest.fixture
def step_dir(tmp_path):
  """A step directory like Orbax's, with its manifest."""
  for name, data in FILES.items():
    os.makedirs(os.path.dirname(tmp_path / name), exist_ok=True)
    (tmp_path / name).write_bytes(data)
  integrity.write_manifest(str(tmp_path))
  return tmp_path


def _flip(path):
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x10
  path.write_bytes(bytes(data))


def test_a_manifest_covers_every_file_but_orbax_commit_files(step_dir):
  listed = json.loads((step_dir / integrity.MANIFEST).read_text())["files"]
  assert sorted(listed) == sorted(FILES)
  # Orbax writes these after the manifest: they do not count.
  (step_dir / integrity.COMMIT_MARKER).write_text("committed")
  (step_dir / "_CHECKPOINT_METADATA").write_text("{}")
  assert integrity.verify(str(step_dir)) is None


@pytest.mark.parametrize("damage, kind", [
    (lambda path: os.truncate(path, 100), "size"),
    (_flip, "checksum"),            # same size: only the checksum tells
    (os.remove, "missing")])
def test_each_kind_of_damage_is_found_and_named(step_dir, damage, kind):
  damage(step_dir / "params/ocdbt.process_0/d/abc")
  problem = integrity.verify(str(step_dir))
  assert problem.kind == kind
  assert "params/ocdbt.process_0/d/abc" in problem.detail and "\n" not in problem.detail


def test_only_the_items_read_and_this_process_share_are_checked(step_dir):
  _flip(step_dir / "opt_state/d/xyz")
  assert integrity.verify(str(step_dir), items=("params", "train")) is None
  assert integrity.verify(str(step_dir), items=("opt_state",)).kind == "checksum"
  # Processes split the files: exactly one share holds the damaged one.
  found = [integrity.verify(str(step_dir), share=(index, 3)) for index in range(3)]
  assert [problem.kind for problem in found if problem] == ["checksum"]


def test_a_step_without_manifest_is_unverified_and_a_damaged_manifest_is_a_problem(
    step_dir):
  (step_dir / integrity.MANIFEST).write_text('{"files": {"params/_METADATA": ')
  assert integrity.verify(str(step_dir)).kind == "manifest"
  (step_dir / integrity.MANIFEST).unlink()
  _flip(step_dir / "params/ocdbt.process_0/d/abc")
  assert integrity.verify(str(step_dir)) is None   # written before manifests existed


def _raised(error, cause=None):
  """`error` as raised (from `cause`, if given)."""
  try:
    raise error from cause
  except Exception as raised:   # pylint: disable=broad-except
    return raised


@pytest.mark.parametrize("error, bad_bytes", [
    # A truncated data file, as Orbax raises it (the tensorstore error is the cause).
    (_raised(Exception("Encountered error while reading array index"), ValueError(
        'OUT_OF_RANGE: Error reading "w/0.0" in OCDBT database at local file "/w/": '
        "Requested byte range [42182, 44126) is not valid for value of size 36395")),
     True),
    (_raised(json.JSONDecodeError("Expecting ','", '{"a": 1', 7)), True),
    (_raised(KeyError("tree_metadata")), True),
    # The storage did not answer or refused: the bytes may be fine.
    (_raised(ValueError("UNAVAILABLE: HTTP response code: 503")), False),
    (_raised(Exception("reading failed"), PermissionError(13, "Permission denied")), False),
    (_raised(TypeError("our own bug")), False),
    (_raised(UserError("a checkpoint of another model")), False)])
def test_read_failures_that_mean_bad_bytes(error, bad_bytes):
  problem = integrity.read_problem(error)
  assert (problem is not None) == bad_bytes
  if bad_bytes:
    assert problem.kind == "unreadable" and "\n" not in problem.detail


@pytest.mark.parametrize("error, reason", [
    (_raised(OSError(errno.ENOSPC, "No space left on device")), "no space left on device"),
    (_raised(ValueError('RESOURCE_EXHAUSTED: Error writing local file "/w/4.orbax-checkpoint'
                        '-tmp/_sharding": Failed to write 23093 bytes to file 9: No space '
                        "left on device [os_error_code='28']")), "no space left on device"),
    (_raised(Exception("commit failed"), PermissionError(errno.EACCES, "Permission denied")),
     "permission denied"),
    (_raised(TimeoutError("Timed out while waiting for async_write_complete barrier.")),
     "Timed out while waiting for async_write_complete barrier."),
    (_raised(AttributeError("our own bug")), None)])
def test_write_failures_are_named_in_a_few_words(error, reason):
  assert integrity.write_failure(error) == reason


def test_failed_save_leftovers_go_and_unreadable_steps_are_kept_aside(tmp_path):
  for name in ("2", "4", "6.orbax-checkpoint-tmp", "8"):
    (tmp_path / name).mkdir()
  for name in ("2", "4"):
    (tmp_path / name / integrity.COMMIT_MARKER).write_text("")
  integrity.remove_partial(str(tmp_path), 6)   # a temporary directory
  integrity.remove_partial(str(tmp_path), 8)   # a step saved in place, not committed
  integrity.remove_partial(str(tmp_path), 4)   # committed: kept
  assert sorted(os.listdir(tmp_path)) == ["2", "4"]
  assert integrity.set_aside(str(tmp_path), 4, "size") == "4.corrupt-size"
  (tmp_path / "4").mkdir()
  assert integrity.set_aside(str(tmp_path), 4, "size") == "4.corrupt-size-2"
  assert sorted(os.listdir(tmp_path)) == ["2", "4.corrupt-size", "4.corrupt-size-2"]


class _FailingCheckpointer:
  """What the essential policy sees of a tier whose saves fail: `failing` lists the
  steps whose (first) save fails in the background, reported by `poll`, `wait` and the
  next `save`, as Orbax reports it."""
  directory = "/w/checkpoints"
  name = "persistent"

  def __init__(self, failing, clock=time.monotonic):
    self.failing = list(failing)
    self.saved, self.discarded, self.committed = [], [], [2]
    self._in_flight = None
    self.down = None   # why the storage does not answer; None: it does
    self.clock = clock

  def unreachable(self):
    return self.down

  def saving(self):
    return False

  def _failure(self):
    step, self._in_flight = self._in_flight, None
    if step in self.failing:
      self.failing.remove(step)
      return CheckpointSaveError(step, "no space left on device", self.directory)
    if step is not None:
      self.committed.append(step)
    return None

  def save(self, step, **_):
    if (failure := self._failure()) is not None:
      raise failure
    self.saved.append(step)
    self._in_flight = step

  def poll(self):
    return self._failure()

  def wait(self):
    if (failure := self._failure()) is not None:
      raise failure

  def discard_failed(self, step):
    self.discarded.append(step)

  def latest_step(self):
    return self.committed[-1]


class _Writer:
  def __init__(self):
    self.lines = []

  def info(self, line):
    self.lines.append(line)


def _hook(tier):
  """The CheckpointHook of a run whose one tier, essential, is `tier`, every 4 steps;
  `hook.policy` is the tier's policy."""
  policy = policies.Essential(tier, every=4, outage_s=300, clock=tier.clock)
  policy.started(0, None)   # a fresh start
  hook = saving.CheckpointHook(Checkpointer([policy]), rng=None, metadata={},
                               writer=_Writer())
  hook.policy = policy
  return hook


class _State:
  params = opt_state = None


def _run(hook, steps):
  """The loop's calls: metrics one step late, then the hook when due."""
  for step in steps:
    hook.on_metrics(step - 1, {})
    if hook.is_due(step):
      hook.on_step(step, _State())


def test_a_failed_save_is_retried_at_the_next_step(capsys):
  checkpointer = _FailingCheckpointer(failing=[4])
  hook = _hook(checkpointer)
  _run(hook, [1, 2, 3, 4])
  hook.on_metrics(4, {})   # the failure of step 4 is noticed at step 5's boundary
  assert hook.is_due(5)
  hook.on_step(5, _State())
  warning = capsys.readouterr().err.strip()
  assert warning == ("warning: checkpoint 4 failed: no space left on device under "
                     "/w/checkpoints; retrying with step 5")
  assert checkpointer.discarded == [4] and checkpointer.saved == [4, 5]
  assert checkpointer.committed == [2, 5]   # the retry waited for its commit


def test_a_failed_retry_stops_the_run_naming_the_newest_good_checkpoint(capsys):
  checkpointer = _FailingCheckpointer(failing=[4, 5])
  hook = _hook(checkpointer)
  _run(hook, [1, 2, 3, 4])
  hook.on_metrics(4, {})
  with pytest.raises(UserError) as stopped:
    hook.on_step(5, _State())
  assert str(stopped.value) == (
      "checkpoint 5 failed: no space left on device under /w/checkpoints (retried once); "
      "stopped. The newest good checkpoint, step 2, is intact in /w/checkpoints")
  assert checkpointer.discarded == [4, 5]   # no leftovers of either save
  assert capsys.readouterr().err.count("warning: ") == 1


def test_a_failed_final_save_is_retried_before_the_run_ends():
  checkpointer = _FailingCheckpointer(failing=[8])
  hook = _hook(checkpointer)
  _run(hook, [7, 8])
  hook.on_end(8, _State(), preempted=False)
  assert checkpointer.saved == [8, 8] and checkpointer.committed == [2, 8]


def test_a_save_while_the_bucket_is_down_is_deferred_then_made_once_it_answers(
    capsys, monkeypatch):
  now = [1000.0]
  monkeypatch.setattr(policies.time, "monotonic", lambda: now[0])
  checkpointer = _FailingCheckpointer(failing=[], clock=lambda: now[0])
  hook = _hook(checkpointer)
  checkpointer.down = "cannot reach the storage of gs://b/w/checkpoints (refused)"
  _run(hook, [1, 2, 3, 4])
  assert checkpointer.saved == []   # deferred: training goes on
  assert capsys.readouterr().err.strip() == (
      "warning: checkpoint 4 deferred: cannot reach the storage of gs://b/w/checkpoints "
      "(refused); training goes on and the save is retried with backoff for up to 300 s "
      "(StorageConfig.outage_s)")
  now[0] += 0.5
  _run(hook, [5])                   # inside the backoff: not even asked
  now[0] += 10
  _run(hook, [6])                   # asked again: still down, one line only
  assert checkpointer.saved == [] and not capsys.readouterr().err
  checkpointer.down = None
  now[0] += 59.5
  _run(hook, [7])
  assert checkpointer.saved == [7]
  assert hook._writer.lines == [   # pylint: disable=protected-access
      "The storage of /w/checkpoints answers again after 70 s: saving step 7"]
  assert not hook.is_due(9) and hook.is_due(8)


def test_a_save_failing_because_the_bucket_went_away_is_deferred(capsys):
  checkpointer = _FailingCheckpointer(failing=[4])
  hook = _hook(checkpointer)
  _run(hook, [1, 2, 3, 4])
  checkpointer.down = "cannot reach the storage"
  hook.on_metrics(4, {})
  hook.on_step(5, _State())
  assert "warning: checkpoint 5 deferred: cannot reach the storage" in capsys.readouterr().err
  assert checkpointer.discarded == []     # its leftovers are in the unreachable bucket
  checkpointer.down = None
  hook.policy._retry_at = 0                # pylint: disable=protected-access
  hook.on_step(6, _State())
  assert checkpointer.discarded == [4] and checkpointer.saved == [4, 6]


def test_an_outage_longer_than_outage_s_stops_the_run(monkeypatch):
  now = [0.0]
  monkeypatch.setattr(policies.time, "monotonic", lambda: now[0])
  checkpointer = _FailingCheckpointer(failing=[], clock=lambda: now[0])
  checkpointer.down = "cannot reach the storage"
  hook = _hook(checkpointer)
  _run(hook, [4])
  now[0] = 299
  _run(hook, [5])
  now[0] = 301
  with pytest.raises(StorageOutageError, match="writing checkpoint 6 has failed for 301 s, "
                     "longer than StorageConfig.outage_s = 300 s"):
    _run(hook, [6])
