r"""Does μP's one tuned rate forecast better than the size rule? Two scaling studies of
each family on the same sizes, forks and budgets, each scored at 4x its largest fit run.

  nice -n 10 python benchmarks/mup_study.py --workdir=/tmp/mup_study   # the recorded run
  python benchmarks/mup_study.py --workdir=DIR --families=griffin,mqa --dry_run

Per family, two `python -m launch.sweep` studies with the same forked (WSD) design
(`SHARED`, `DESIGN`; one run at a time each, the two side by side, each followed by
its ladder):

- **size rule** (today's study): `--lr_sweep` probes at the family's two smallest sizes,
  every run at the fitted lr(N) = c·N^k (launch.sweeps.size_rule);
- **μP**: `--parametrization=mup --mup_base_width=32` (the smallest width, so the
  probed model is its own proxy) and the same `--lr_sweep` probed at the smallest size
  alone; every run at that one rate (launch.sweeps.study).

Then each study's ladder (`--train_optimum`) trains approach 3's compute-optimal model
for C = 4x the largest fit run's FLOPs (the same C for both: the studies plan the same
runs) and scores the forecast made before it trained. Printed and written to
`--output`: one row per (family, study) with the rates, the probes' and fit runs'
compute, the held-out run, forecast [95%], measured loss and error. Resumable: every
step is a `launch.sweep` command, which never redoes finished runs.
"""
from __future__ import annotations

import argparse
from concurrent import futures
import csv
import json
import os
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
# pylint: disable=wrong-import-position
from launch.sweeps import ladder  # noqa: E402
from launch.sweeps import sweep_design  # noqa: E402

SHARED = ["--batch_size=16", "--sequence_length=64", "--vocab_size=259",
          "--gin_file=configs/base/trainer.gin", "--gin_file=configs/base/optimizer.gin",
          "--gin_file=configs/data/text_files.gin",
          "--gin_param=TRAIN_FILES='{stdlib}/**/*.py'", "--gin_param=EVAL_EVERY=0",
          "--gin_param=LOG_EVERY=100", "--gin_param=CHECKPOINT_EVERY=1000",
          "--gin_param=TrainConfig.eval_batches=32", "--parallel=1"]
# Three sizes, two widths (32 and 64: μP's multiplier is 1 and 2), three forks each.
DESIGN = ["--design=wsd", "--sizes=49k,85k,174k", "--aspect_tolerance=12",
          "--cooldown_tokens_per_param=2,3,4", "--cooldown_fraction=0.2",
          "--lr_sweep=3e-3,1e-2,3e-2", "--lr_sweep_tokens_per_param=4"]
STUDIES = {"size rule": ["--lr_sweep_sizes=2"],
           "mup": ["--parametrization=mup", "--mup_base_width=32"]}
LADDER_FACTOR = 4.0
REPLICATES = 200


def study_dir(workdir: str, family: str, study: str) -> str:
  return os.path.join(workdir, family, study.replace(" ", "_"))


def sweep_command(workdir: str, family: str, study: str, *extra: str) -> List[str]:
  """The `launch.sweep` command of one study (or, with `--train_optimum`, its ladder)."""
  return [sys.executable, "-m", "launch.sweep", f"--families={family}",
          f"--workdir={study_dir(workdir, family, study)}", *DESIGN, *STUDIES[study],
          *SHARED, *extra]


def run_logged(command: List[str], log: str) -> None:
  """Runs `command` to its end with its output appended to `log`.

  Raises:
    RuntimeError: the command failed (its log named).
  """
  os.makedirs(os.path.dirname(log), exist_ok=True)
  with open(log, "a", encoding="utf-8") as out:
    if subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT).returncode:
      raise RuntimeError(f"{command[2:4]} failed; see {log}")


def study_then_ladder(workdir: str, family: str, study: str) -> float:
  """One study, then its ladder at C (returned): the two studies plan the same runs, so
  each reads the same C from its own `sweep.csv` and need not wait for the other."""
  log = os.path.join(study_dir(workdir, family, study), "benchmark.log")
  run_logged(sweep_command(workdir, family, study), log)
  budget = ladder_budget(study_dir(workdir, family, study))
  run_logged(sweep_command(workdir, family, study, f"--train_optimum={budget:g}",
                           f"--replicates={REPLICATES}"), log)
  return budget


def ladder_budget(directory: str) -> float:
  """C: LADDER_FACTOR x the largest fit run's FLOPs (its end point's, in `sweep.csv`),
  to 3 significant digits (the ladder run's name holds it)."""
  with open(os.path.join(directory, "sweep.csv"), encoding="utf-8") as f:
    largest = max(float(r["flops"]) for r in csv.DictReader(f) if r["role"] != "stable")
  return float(f"{LADDER_FACTOR * largest:.3g}")


def _json(path: str) -> Optional[dict]:
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def study_row(workdir: str, family: str, study: str, budget: float) -> Dict[str, object]:
  """One table row from a finished study's `size_rule.json`, `sweep.csv` and ladder."""
  directory = study_dir(workdir, family, study)
  rule = _json(os.path.join(directory, "size_rule.json"))["families"][family]
  with open(os.path.join(directory, "sweep.csv"), encoding="utf-8") as f:
    rows = list(csv.DictReader(f))
  name = f"{family}_optimum_C{sweep_design.budget_label(budget)}"
  forecast = _json(os.path.join(ladder.run_dir(directory, name), ladder.FORECAST)) or {}
  return {"family": family, "study": study, "budget": budget,
          "rule": {"coefficient": rule["coefficient"], "exponent": rule["exponent"]},
          "probed_sizes": [p["params"] for p in rule["sizes"]],
          "fit_flops": sum(float(r["own_flops"]) for r in rows),
          "largest_fit_flops": max(float(r["flops"]) for r in rows if r["role"] != "stable"),
          "forecast": forecast}


def _rate(row: Dict[str, object]) -> str:
  rule = row["rule"]
  if rule["exponent"] == 0:
    return f"{rule['coefficient']:.3g} (one rate)"
  return f"{rule['coefficient']:.3g}·N^{rule['exponent']:+.3f}"


def table(rows: Sequence[Dict[str, object]]) -> str:
  """The comparison as markdown, a row per (family, study); a ladder not yet finished
  shows its forecast without a measurement."""
  out = ["| family | study | learning rate | probed N | C (x largest fit run) | held-out N, "
         "tokens | peak LR | forecast [95%] | measured | error |",
         "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for row in rows:
    f = row["forecast"]
    ratio = row["budget"] / row["largest_fit_flops"]
    probed = ", ".join(f"{n:,}" for n in row["probed_sizes"])
    if not f:
      out.append(f"| {row['family']} | {row['study']} | {_rate(row)} | {probed} | "
                 f"{row['budget']:.3g} ({ratio:.1f}x) | — | — | — | — | — |")
      continue
    p = f["predicted"]
    measured = f"{f['measured']:.4f}" if "measured" in f else "—"
    error = (f"{f['error']:+.4f} ({100 * f['relative_error']:+.2f}%), "
             f"{'inside' if f['inside_interval'] else 'outside'}" if "error" in f else "—")
    out.append(f"| {row['family']} | {row['study']} | {_rate(row)} | {probed} | "
               f"{row['budget']:.3g} ({ratio:.1f}x) | {f['params']:,}, {f['tokens']:,} | "
               f"{f['peak_learning_rate']:.3g} | {p['value']:.4f} [{p['low']:.4f}, "
               f"{p['high']:.4f}] | {measured} | {error} |")
  return "\n".join(out)


def compare_family(workdir: str, family: str) -> List[Dict[str, object]]:
  """Both studies side by side (two cores serve two one-run-at-a-time studies better than
  one: much of a run is its single-threaded start-up), each followed by its ladder; the
  family's rows."""
  with futures.ThreadPoolExecutor(max_workers=len(STUDIES)) as pool:
    budgets = list(pool.map(lambda s: study_then_ladder(workdir, family, s), STUDIES))
  if len(set(budgets)) != 1:
    raise RuntimeError(f"the studies planned different runs: ladder budgets {budgets}")
  return [study_row(workdir, family, s, budgets[0]) for s in STUDIES]


def main(argv: Optional[Sequence[str]] = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--workdir", required=True, help="The studies' directories.")
  parser.add_argument("--families", default="griffin", help="Comma-separated families.")
  parser.add_argument("--output", default=None,
                      help="JSON of the rows (default: WORKDIR/mup_study.json).")
  parser.add_argument("--dry_run", action="store_true",
                      help="Print both studies' commands and plan; train nothing.")
  args = parser.parse_args(argv)
  families = [f for f in args.families.split(",") if f]
  if args.dry_run:
    for family in families:
      for study in STUDIES:
        command = sweep_command(args.workdir, family, study, "--dry_run")
        print(f"# {family}, {study}: {' '.join(command[1:])}", flush=True)
        subprocess.run(command, cwd=REPO, check=True)
    return
  rows = [row for family in families for row in compare_family(args.workdir, family)]
  output = args.output or os.path.join(args.workdir, "mup_study.json")
  with open(output, "w", encoding="utf-8") as f:
    json.dump(rows, f, indent=2)
  print(table(rows))


if __name__ == "__main__":
  main()
