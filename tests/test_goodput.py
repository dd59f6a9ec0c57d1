"""Goodput accounting: a session's categories sum to its wall time, a resumed session is
charged the redone steps and the downtime, and the run's totals add up across sessions.
(The goodput rows and `pretrain.report` plots of a real run are checked in
test_train_e2e.py, on the session's trained run.)"""
import time

import pytest

from plumbing.errors import UserError
from pretrain.observability import goodput
from pretrain.observability import report


def _train_row(step, step_time=0.5):
  return {"step": step, "loss": 3.0, "step_time_s": step_time}


def test_session_categories_sum_to_its_wall_time():
  clock = goodput.GoodputClock()
  with clock.timed("compile"):
    time.sleep(0.05)
  with clock.timed("data"):
    time.sleep(0.02)
  time.sleep(0.03)   # untimed: training
  before = time.perf_counter()
  row = clock.row(step=3)
  parts = row["productive_s"] + sum(row[f"{name}_s"] for name in goodput.TIMED)
  assert abs(parts - row["wall_s"]) < 1e-9
  assert 0.05 <= row["compile_s"] < 0.05 + 0.5 and 0.02 <= row["data_s"] < 0.52
  assert row["productive_s"] >= 0.03
  assert row["wall_s"] <= time.perf_counter() - before + parts + 1e-6


def test_resumed_session_is_charged_redone_steps_and_downtime():
  first = goodput.GoodputClock()
  earlier = [_train_row(s) for s in (1, 2)] + [first.row(2) | {"time": time.time() - 30}]
  dropped = [_train_row(3, 0.4), _train_row(4, 0.5), _train_row(5, 9.0),
             {"step": 4, "eval_loss": 2.0}]
  clock = goodput.GoodputClock()
  restart = clock.resume(2, "local", earlier, dropped)
  assert clock.session == 2
  assert restart["kind"] == goodput.RESTART and restart["tier"] == "local"
  assert (restart["redone_from"], restart["redone_to"], restart["lost_steps"]) == (3, 5, 3)
  assert abs(restart["lost_s"] - 3 * 0.5) < 1e-9   # the median: robust to a compile
  assert 29 < restart["downtime_s"] < 60
  assert goodput.GoodputClock().resume(0, None, [_train_row(1)], []) is None  # first


def test_one_dropped_step_that_paid_a_compile_is_priced_at_the_runs_step_time():
  """A session killed right after its first logged step: that row's time includes the
  compilation, so the run's other step rows price the redone step."""
  first = goodput.GoodputClock()
  earlier = [_train_row(s, 0.5) for s in (1, 2, 3)] + [first.row(3) | {"time": time.time()}]
  restart = goodput.GoodputClock().resume(3, "persistent", earlier, [_train_row(4, 20.0)])
  assert restart["lost_steps"] == 1 and abs(restart["lost_s"] - 0.5) < 1e-9


def test_run_totals_add_sessions_and_move_lost_time_out_of_productive():
  rows = [
      {"kind": "goodput", "session": 1, "time": 0, "wall_s": 50.0, "productive_s": 30.0,
       **{f"{n}_s": 2.0 for n in goodput.TIMED}, "lost_s": 0.0, "lost_steps": 0,
       "downtime_s": 0.0},
      {"kind": "goodput", "session": 1, "time": 0, "wall_s": 100.0, "productive_s": 86.0,
       **{f"{n}_s": 2.0 for n in goodput.TIMED}, "lost_s": 0.0, "lost_steps": 0,
       "downtime_s": 0.0},
      {"kind": "goodput", "session": 2, "time": 0, "wall_s": 40.0, "productive_s": 26.0,
       **{f"{n}_s": 2.0 for n in goodput.TIMED}, "lost_s": 10.0, "lost_steps": 5,
       "downtime_s": 20.0},
  ]
  totals = goodput.run_totals(rows)
  assert totals["wall"] == 160.0 and totals["sessions"] == 2
  assert totals["productive"] == 86.0 + 26.0 - 10.0
  assert abs(sum(totals[name] for name in goodput.BREAKDOWN) - totals["wall"]) < 1e-9
  assert abs(totals["goodput"] - 102.0 / 160.0) < 1e-12
  assert goodput.format_totals(totals).startswith(
      "goodput 63.7% of 2m40s over 2 sessions: productive 1m42s, lost 10s, downtime 20s")
  times, series = report.goodput_over_time(rows)
  assert times == [50.0, 100.0, 160.0]
  assert series["productive"][-1] == totals["productive"]


def test_report_of_a_workdir_without_metrics_is_a_usage_error(tmp_path):
  with pytest.raises(UserError, match="no metrics in .*metrics.jsonl") as error:
    report.write_report([str(tmp_path)], str(tmp_path / "plots"))
  assert error.value.exit_code == 2
  assert "\n" not in str(error.value)
