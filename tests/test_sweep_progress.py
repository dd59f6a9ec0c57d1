"""launch.sweeps.sweep_progress: the local study's progress line and its ETA, with a fake clock,
and run_local writing it as real (tiny) jobs start and end."""
import io
import os
import sys

import pytest

from launch.dispatch import sweep_dispatch
from launch.sweeps import sweep_local
from launch.sweeps import sweep_progress


class FakeClock:
  def __init__(self):
    self.now = 1000.0

  def __call__(self):
    return self.now


def _progress(work, parallel=1, **before):
  clock, stream = FakeClock(), io.StringIO()
  progress = sweep_progress.Progress(work, parallel, clock=clock, stream=stream, **before)
  return progress, clock, stream


@pytest.mark.parametrize("a, b", [(30.0, 2e-9), (0.0, 5e-10), (12.5, 0.0)])
def test_duration_model_recovers_an_affine_cost(a, b):
  works = [1e10, 4e10, 2.5e11, 7e11]
  model = sweep_progress.duration_model([(w, a + b * w) for w in works])
  assert model == pytest.approx((a, b), rel=1e-9, abs=1e-9)


def test_duration_model_falls_back_to_seconds_per_work():
  assert sweep_progress.duration_model([]) is None
  # One finished run, or runs of equal work: proportional to work.
  assert sweep_progress.duration_model([(2.0, 10.0)]) == (0.0, 5.0)
  assert sweep_progress.duration_model([(2.0, 10.0), (2.0, 14.0)]) == (0.0, 6.0)
  # Works within a factor 1.5 (one isoFLOP budget) say nothing about the fixed cost.
  assert sweep_progress.duration_model([(2.0, 10.0), (2.1, 30.0)]) == (
      0.0, pytest.approx(40.0 / 4.1))
  # A negative fixed cost (bigger runs relatively faster) is not extrapolated.
  a, b = sweep_progress.duration_model([(1.0, 1.0), (3.0, 9.0)])
  assert (a, b) == (0.0, pytest.approx(10.0 / 4.0))


def test_eta_from_finished_runs_for_pending_and_running_runs():
  progress, clock, _ = _progress({"r1": 1.0, "r2": 3.0, "r3": 2.0, "r4": 4.0}, parallel=2)
  progress.started("r1")
  progress.started("r2")
  assert progress.eta_s() is None                      # nothing finished yet
  clock.now += 15.0                                    # r1: 10 + 5·1
  progress.ended("r1", "finished")
  progress.started("r3")
  clock.now += 10.0                                    # r2 at 25 s: 10 + 5·3
  progress.ended("r2", "finished")
  progress.started("r4")
  assert progress.counts() == (2, 2, 0, 0)
  # Model 10 + 5·w; r3 has run 10 of its 20 s, r4 0 of its 30 s: max(40 / 2, 30).
  assert progress.eta_s() == pytest.approx(30.0)
  clock.now += 5.0
  assert progress.eta_s() == pytest.approx(25.0)


def test_line_counts_runs_from_before_and_failures():
  progress, clock, stream = _progress({"a": 1.0, "b": 1.0, "c": 1.0}, parallel=1,
                                      finished=4, running=1, failed=1)
  progress.started("a")
  clock.now += 65.0
  progress.ended("a", "retry")                         # failed, to be retried: pending
  assert progress.counts() == (4, 1, 3, 1)
  progress.started("a")
  clock.now += 10.0
  progress.ended("a", "failed")                        # given up
  progress.started("b")
  clock.now += 20.0
  progress.ended("b", "finished")
  assert progress.line() == ("[sweep] progress: 5/9 finished, 1 running, 1 pending, "
                             "2 failed; elapsed 1m35s; ETA 20s")


def test_nothing_left_to_run_is_eta_zero():
  progress, _, stream = _progress({}, finished=11)
  progress.tick()
  assert stream.getvalue() == ("[sweep] progress: 11/11 finished, 0 running, 0 pending, "
                               "0 failed; elapsed 0s; ETA 0s\n")


def test_tick_writes_on_every_change_and_at_most_every_interval():
  progress, clock, stream = _progress({"a": 1.0, "b": 1.0})
  assert progress.tick()                               # the first line
  assert not progress.tick()                           # nothing changed, too soon
  progress.started("a")
  assert progress.tick()                               # a state change: at once
  clock.now += 9.0
  assert not progress.tick()
  clock.now += 1.0
  assert progress.tick()                               # 10 s of silence
  progress.ended("a", "finished")
  progress.started("b")
  assert progress.tick()
  lines = stream.getvalue().splitlines()
  assert len(lines) == 4 and all(l.startswith("[sweep] progress: ") for l in lines)
  assert lines[0].endswith("0/2 finished, 0 running, 2 pending, 0 failed; elapsed 0s; "
                           "ETA unknown until a run finishes")
  assert lines[-1] == ("[sweep] progress: 1/2 finished, 1 running, 0 pending, 0 failed; "
                       "elapsed 10s; ETA 10s")


def test_run_local_reports_progress_to_stderr(tmp_path, capfd):
  """Real jobs (python -c, through launch.sweep_job): a line when each starts and ends,
  the last one all finished with nothing left."""
  jobs = [sweep_dispatch.Job(name, str(tmp_path / name), [
      sys.executable, "-c", f"open({str(tmp_path / name / 'done')!r}, 'w').write('1')"],
      work=float(i + 1)) for i, name in enumerate(("one", "two"))]
  given_up = sweep_local.run_local(
      jobs, parallel=1, max_retries=0,
      is_finished=lambda job: os.path.exists(os.path.join(job.run_dir, "done")),
      log=lambda _: None)
  assert given_up == []
  lines = [l for l in capfd.readouterr().err.splitlines() if l.startswith("[sweep] progress")]
  assert lines[0].startswith("[sweep] progress: 0/2 finished, 1 running, 1 pending, 0 failed")
  assert any(l.startswith("[sweep] progress: 1/2 finished, 1 running, 0 pending") for l in lines)
  assert lines[-1].startswith("[sweep] progress: 2/2 finished, 0 running, 0 pending, 0 failed")
  assert lines[-1].endswith("ETA 0s")
