"""MetricsWriter: a resumed or rerun run never leaves two rows of one kind for a step."""
import json
import sys

from plumbing import storage
from pretrain import hooks
from pretrain.observability.metrics import MetricsWriter
from pretrain.run_directory import UNSENT_METRICS
from pretrain.steps import TrainState


def _rows(path):
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def _train_row(loss):
  return dict(loss=loss, learning_rate=0.1, grad_norm=1.0, param_norm=1.0,
              tokens_per_second=10.0, step_time_s=0.1, mfu=None)


def test_rewind_drops_later_rows_and_a_torn_line(tmp_path):
  writer = MetricsWriter(str(tmp_path), 10, trackers=())
  for step in range(1, 6):
    writer.log_train(step, _train_row(float(step)))
    writer.log_record({"kind": "mixture", "step": step, "share/web": 0.5})
  writer.log_eval(2, 3.0, 100)
  writer.log_eval(4, 2.0, 100)
  writer.log_record({"kind": "goodput", "step": 5})
  writer.close()
  with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as f:
    f.write('{"step": 6, "lo')   # killed mid-write

  writer = MetricsWriter(str(tmp_path), 10, trackers=())
  writer.rewind(3)   # restored from the checkpoint of step 3
  # A session's record stays; a mixture's share record belongs to its step.
  assert [(r["kind"], r["step"]) for r in writer.read_rows() if "kind" in r] == [
      ("mixture", 1), ("mixture", 2), ("mixture", 3), ("goodput", 5)]
  for step in range(4, 6):
    writer.log_train(step, _train_row(step + 0.5))
  writer.log_eval(2, 3.0, 100)   # already in the file: not appended again
  writer.log_eval(4, 2.5, 100)
  writer.close()
  rows = _rows(tmp_path / "metrics.jsonl")
  assert [(r["step"], r["loss"]) for r in rows if "loss" in r] == [
      (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.5), (5, 5.5)]
  assert [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r] == [
      (2, 3.0), (4, 2.5)]


def test_rewind_to_zero_starts_the_file_again(tmp_path):
  writer = MetricsWriter(str(tmp_path), 10, trackers=())
  writer.log_train(1, _train_row(1.0))
  writer.rewind(0)
  writer.log_train(1, _train_row(2.0))
  writer.close()
  assert [r["loss"] for r in _rows(tmp_path / "metrics.jsonl")] == [2.0]


def test_downstream_hook_writes_one_row_per_step_also_when_rerun(tmp_path):
  scored = []

  def evaluate(params):
    scored.append(params)
    return {"downstream/tiny_mc/acc": 0.5 + len(scored) / 10}

  def run():
    writer = MetricsWriter(str(tmp_path), 4, trackers=())
    writer.rewind(4)
    hook = hooks.DownstreamHook(evaluate, writer, every=2, final_eval=True, train_steps=4)
    for step in (1, 2, 3, 4):
      if hook.is_due(step):
        hook.on_step(step, TrainState(step, f"params{step}", None))
    hook.on_end(4, TrainState(4, "params4", None), False)
    writer.close()

  run()          # step 2 periodically; step 4 once, after the last step
  assert scored == ["params2", "params4"]
  run()          # a rerun of the finished run evaluates again but writes no second row
  rows = _rows(tmp_path / "metrics.jsonl")
  assert [(r["step"], r["downstream/tiny_mc/acc"]) for r in rows] == [(2, 0.6), (4, 0.7)]


def _kept(path, rows):
  path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_rows_kept_by_an_outage_stop_are_sent_by_the_next_run(gcs_bucket, tmp_path, capsys):
  """A bucket run stopped by an outage keeps its unsent rows locally (`unsent_path`);
  the next run sends them when they continue the bucket's file, and sets them aside,
  unmerged and with one line, when the bucket's file has changed since."""
  workdir = f"{gcs_bucket}/unsent/{tmp_path.name}"
  storage.write_text(storage.join(workdir, "metrics.jsonl"),
                     json.dumps({"step": 1, "loss": 3.0}) + "\n")
  unsent = tmp_path / "local" / UNSENT_METRICS
  unsent.parent.mkdir()
  _kept(unsent, [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5},
                 {"step": 3, "loss": 2.0}])
  writer = MetricsWriter(workdir, 3, trackers=(), unsent_path=str(unsent),
                         stream=sys.stdout)   # capsys's
  assert [row["step"] for row in writer.read_rows()] == [1, 2, 3]
  writer.close()
  assert "2 row(s) the last run logged while the storage was down" in capsys.readouterr().out
  assert not unsent.exists()
  assert [json.loads(line)["step"] for line in storage.read_text(
      storage.join(workdir, "metrics.jsonl")).splitlines()] == [1, 2, 3]

  _kept(unsent, [{"step": 1, "loss": 9.0}, {"step": 2, "loss": 8.0}])  # another history
  writer = MetricsWriter(workdir, 3, trackers=(), unsent_path=str(unsent))
  assert [row["loss"] for row in writer.read_rows()] == [3.0, 2.5, 2.0]
  writer.close()
  (line,) = capsys.readouterr().err.splitlines()
  assert line.startswith("warning: ") and "set aside as" in line and "not merged" in line
  assert not unsent.exists() and (unsent.parent / f"{UNSENT_METRICS}.unmerged").exists()
