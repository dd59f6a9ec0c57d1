"""The hang watchdog and the straggler rows, alone. A real hang of a multi-process run,
recovered by `launch.local --max_restarts`, is in tests/test_multihost_train.py."""
import threading
import time

import pytest

from pretrain.observability import stragglers
from pretrain.observability import watchdog as watchdog_lib


def _watchdog(tmp_path, timeout_s=None, **kwargs):
  return watchdog_lib.Watchdog(timeout_s, stacks_dir=str(tmp_path / "hangs"), **kwargs)


def test_allowance_is_long_until_the_first_step_then_derived_from_step_times(tmp_path):
  dog = _watchdog(tmp_path, long_s=600.0, floor_s=5.0, factor=10.0)
  assert dog.allowance("step") == 600.0            # restore and compilation
  for step in range(1, 12):
    dog.step_done(step)
  assert dog.allowance("data") == 5.0              # steps of ~0 s: the floor
  dog._step_times.extend([2.0] * 50)              # pylint: disable=protected-access
  assert dog.allowance("collective") == pytest.approx(20.0)   # 10 x the median
  assert dog.allowance("eval") == 600.0 and dog.allowance("checkpoint") == 600.0


def test_an_explicit_timeout_applies_after_the_first_step(tmp_path):
  dog = _watchdog(tmp_path, timeout_s=3.0, long_s=60.0)
  assert dog.allowance("data") == 60.0
  dog.step_done(1)
  assert dog.allowance("data") == 3.0 and dog.allowance("eval") == 60.0
  now = time.monotonic()
  with dog.phase("data"):
    assert dog.check(now + 2.0) is None
    line = dog.check(now + 10.0)
  assert line.startswith("process 0 hung: no progress for 10 s (allowed 3 s) in phase "
                         "data; newest completed step 1")


def test_a_hung_phase_is_reported_with_every_thread_stack(tmp_path):
  """A real thread watching a real stall: the line names the phase, the stack file
  holds the stalled frame, and nothing fires for a phase that ends in time."""
  reported = []
  done = threading.Event()
  dog = _watchdog(tmp_path, timeout_s=0.5, long_s=0.5, process_index=1,
                  on_hang=lambda line: (reported.append(line), done.set()))
  dog.start()
  try:
    with dog.phase("data"):
      time.sleep(0.2)                 # in time
    dog.step_done(1)
    assert not reported
    with dog.phase("data"):
      assert done.wait(10)            # the input pipeline stalls here
  finally:
    dog.stop()
  (line,) = reported
  assert line.startswith("process 1 hung: no progress for ") and "in phase data" in line
  path = line.split("Python stacks in ")[1].split(";")[0]
  assert path.startswith(str(tmp_path / "hangs" / "process_1-"))
  with open(path, encoding="utf-8") as f:
    stacks = f.read()
  assert "test_a_hung_phase_is_reported_with_every_thread_stack" in stacks
  assert "_watch" in stacks           # every thread, the watchdog's own too


def test_host_seconds_count_data_and_dispatch_only(tmp_path):
  dog = _watchdog(tmp_path)
  with dog.phase("data"):
    time.sleep(0.05)
  with dog.phase("collective"):
    time.sleep(0.1)
  with dog.phase("step"):
    time.sleep(0.05)
  assert 0.1 <= dog.host_seconds() < 0.14


def test_straggler_row_names_the_slowest_process_and_its_deviation():
  row = stragglers.straggler_row(40, [0.10, 0.12, 0.50, 0.11])
  assert row["kind"] == "straggler" and row["step"] == 40
  assert row["slowest_process"] == 2 and row["slowest_s"] == 0.50
  assert row["median_s"] == pytest.approx(0.115)
  assert row["deviation_s"] == pytest.approx(0.385)
  assert row["deviation"] == pytest.approx(0.385 / 0.115)
