r"""Plots of one or more runs' metrics and goodput: the library of
`python -m pretrain.report`.
"""
from __future__ import annotations

import json
import os
from typing import Any, Sequence

from plumbing import storage
from plumbing.errors import usage_error
from pretrain.observability import goodput
from pretrain.run_directory import RunDirectory


_DPI = 120


def _pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top  (optional heavy dependency)
  matplotlib.use("Agg")
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
  return pyplot


def read_run(workdir: str) -> list[dict]:
  """The rows of `workdir/metrics.jsonl`; a usage error when there are none."""
  path = RunDirectory(workdir).metrics
  rows = []
  if storage.exists(path):  # local, gs:// or s3://
    rows = [json.loads(line) for line in storage.read_text(path).splitlines(True)
            if line.endswith("\n")]
  if not rows:
    raise usage_error(f"no metrics in {path}: pass the --workdir of a training run "
                      "(python -m pretrain.train ... --workdir=DIR)")
  return rows


def goodput_over_time(rows: Sequence[dict]) -> tuple[list[float], dict[str, list[float]]]:
  """(run wall time at each goodput row, {category: run-level seconds at each row}):
  earlier sessions' totals plus the current session's running totals."""
  times: list[float] = []
  series: dict[str, list[float]] = {name: [] for name in goodput.BREAKDOWN}
  finished: list[dict] = []
  for row in rows:
    if row.get("kind") != goodput.GOODPUT:
      continue
    finished = [r for r in finished if r["session"] != row["session"]]
    totals = goodput.run_totals(finished + [row])
    times.append(totals["wall"])
    for name in goodput.BREAKDOWN:
      series[name].append(totals[name])
    finished.append(row)
  return times, series


def _line_panel(plt, runs: dict[str, list[dict]], field: str, ylabel: str, path: str,
                empty_note: str) -> str:
  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  drawn = False
  for label, rows in runs.items():
    points = [(row["step"], row[field]) for row in rows
              if "kind" not in row and row.get(field) is not None]
    if points:
      ax.plot(*zip(*points), label=label, marker="." if len(points) < 30 else None)
      drawn = True
  if drawn:
    ax.legend(fontsize=8)
  else:
    ax.text(0.5, 0.5, empty_note, ha="center", va="center", transform=ax.transAxes)
  ax.set_xlabel("step")
  ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3)
  return _save(plt, fig, path)


def _goodput_panel(plt, runs: dict[str, list[dict]], path: str) -> str:
  fig, axes = plt.subplots(1, len(runs), figsize=(5.2 * len(runs), 4.2), squeeze=False)
  for ax, (label, rows) in zip(axes[0], runs.items()):
    times, series = goodput_over_time(rows)
    totals = goodput.run_totals(rows)
    if not times:
      ax.text(0.5, 0.5, "no goodput rows", ha="center", va="center",
              transform=ax.transAxes)
    else:
      names = [name for name in goodput.BREAKDOWN if max(map(abs, series[name])) > 0]
      ax.stackplot(times, *[[max(0.0, v) for v in series[name]] for name in names],
                   labels=names)
      ax.legend(fontsize=7, loc="upper left")
      ax.set_title(f"{label}: goodput {100 * totals['goodput']:.1f}%", fontsize=9)
    ax.set_xlabel("wall time of the run (s)")
    ax.set_ylabel("seconds")
  return _save(plt, fig, path)


def _save(plt, fig, path: str) -> str:
  fig.tight_layout()
  fig.savefig(path, dpi=_DPI)
  plt.close(fig)
  return path


def _labels(workdirs: Sequence[str]) -> list[str]:
  """Short distinct names: the basename, or the whole path when two share one."""
  names = [os.path.basename(os.path.normpath(w)) for w in workdirs]
  return names if len(set(names)) == len(names) else list(workdirs)


def write_report(workdirs: Sequence[str], out: str) -> list[str]:
  """Writes the five PNGs for `workdirs` into `out`; returns their paths."""
  runs: dict[str, Any] = {label: read_run(w) for label, w in zip(_labels(workdirs),
                                                                  workdirs)}
  os.makedirs(out, exist_ok=True)
  plt = _pyplot()
  unknown_peak = "no MFU logged: the device's peak FLOP/s is unknown (e.g. CPU)"
  return [
      _line_panel(plt, runs, "loss", "training loss", os.path.join(out, "loss.png"),
                  "no training rows"),
      _line_panel(plt, runs, "eval_loss", "validation loss",
                  os.path.join(out, "eval_loss.png"), "no evaluation rows"),
      _line_panel(plt, runs, "tokens_per_second", "tokens / s",
                  os.path.join(out, "throughput.png"), "no training rows"),
      _line_panel(plt, runs, "mfu", "MFU", os.path.join(out, "mfu.png"), unknown_peak),
      _goodput_panel(plt, runs, os.path.join(out, "goodput.png")),
  ]
