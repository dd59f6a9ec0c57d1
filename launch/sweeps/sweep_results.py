"""A study's results: each run's final evaluation read from its metrics, then the table,
the fits and the plots of the finished runs.

A run is finished when its metrics hold the evaluation of its last step (`final_eval`);
that, not any record of the dispatcher, is what a resumed study trusts, wherever the
run trained. `write_results` turns the runs into `sweep.csv` (what `launch.scaling_fit`
reads), `fit.json`, `scaling.png` and `scaling.md`.
"""
from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from typing import Callable, Dict, Optional, Sequence

from launch.scaling import scaling_fit
from launch.sweeps import wsd_design
from launch.sweeps.sweep_design import CSV_FIELDS, Run, non_embedding_params
from plumbing import storage


def final_eval(run: Run) -> Optional[dict]:
  """The evaluation row logged at the run's last step (`eval_loss` and, where the
  vocabulary has text, `eval_bits_per_byte`), or None if the run is not finished."""
  path = storage.join(run.workdir, "metrics.jsonl")
  if not storage.exists(path):
    return None
  final = None
  for line in storage.read_text(path).splitlines():
    line = line.strip()
    if not line:
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      continue  # a line cut short by a kill
    if row.get("step") == run.train_steps and row.get("eval_loss") is not None:
      final = row
  return final


def collect(run: Run) -> bool:
  """Sets the run's final `eval_loss` and `eval_bits_per_byte` from its metrics (None
  while unfinished); returns whether it finished."""
  row = final_eval(run) or {}
  run.eval_loss = row.get("eval_loss")
  run.eval_bits_per_byte = row.get("eval_bits_per_byte")
  return run.eval_loss is not None


def write_results(runs: Sequence[Run], workdir: str,
                  log: Callable[[str], None] = print) -> Dict[str, object]:
  """sweep.csv, fit.json, scaling.png and scaling.md from finished runs."""
  table_csv = io.StringIO(newline="")
  writer = csv.DictWriter(table_csv, fieldnames=CSV_FIELDS)
  writer.writeheader()
  for run in runs:
    writer.writerow(run.row())
  storage.write_text(storage.join(workdir, "sweep.csv"), table_csv.getvalue())
  if any(run.flop_budget is not None for run in runs):
    log("[sweep] isoFLOP design: fit the three approaches with "
        f"`python -m launch.scaling_fit --runs={workdir} --plots={workdir}/plots`")
  points, fits, fit_json = {}, {}, {}
  for family in dict.fromkeys(run.family for run in runs):
    # A stable run's end point is not cooled down: the forks are the (N, D) points.
    done = [r for r in runs if r.family == family and r.eval_loss is not None
            and r.role != wsd_design.STABLE]
    points[family] = ([r.flops for r in done], [r.eval_loss for r in done])
    if len({r.flops for r in done}) >= 2:
      fits[family] = scaling_fit.fit_scaling_law(*points[family])
      fit_json[family] = fits[family].to_json()
    else:
      fit_json[family] = {"error": "fewer than 2 finished runs at distinct compute"}
  storage.write_text(storage.join(workdir, "fit.json"), json.dumps(fit_json, indent=2))
  with tempfile.TemporaryDirectory() as staging:  # matplotlib writes local files
    if not any(losses for _, losses in points.values()):
      points = {}   # nothing finished (every run given up): an empty figure
    scaling_fit.plot_scaling(points, fits, os.path.join(staging, "scaling.png"))
    storage.copy(os.path.join(staging, "scaling.png"), storage.join(workdir, "scaling.png"))
  table = runs_table_markdown(runs) + "\n\n" + scaling_fit.fit_table_markdown(fits) + "\n"
  if any(run.role for run in runs):
    table += "\n" + wsd_design.cost_markdown(wsd_design.study_cost(runs)) + "\n"
  storage.write_text(storage.join(workdir, "scaling.md"), table)
  log(table)
  return fit_json


def runs_table_markdown(runs: Sequence[Run]) -> str:
  rows = ["| family | size | non-embedding params | D | depth | heads | steps | tokens | "
          "FLOPs | eval loss | bits/byte |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in runs:
    loss = "—" if r.eval_loss is None else f"{r.eval_loss:.4f}"
    per_byte = "—" if r.eval_bits_per_byte is None else f"{r.eval_bits_per_byte:.4f}"
    rows.append(f"| {r.family} | {r.size} | {non_embedding_params(r.config):,} | "
                f"{r.config.width} | {r.config.depth} | {r.config.num_heads} | "
                f"{r.train_steps} | {r.tokens:,} | {r.flops:.3g} | {loss} | {per_byte} |")
  return "\n".join(rows)

