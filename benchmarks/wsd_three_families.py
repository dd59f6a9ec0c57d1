r"""Tables of the three-family WSD study (docs/scaling.md, benchmarks/RESULTS.md).

  python benchmarks/wsd_three_families.py [--results=benchmarks/results/wsd_three_families]

Reads, per family, the study's `sweep.csv`, `design.json`, `size_rule.json` and the
ladder's `forecast.json` (copied from the study directories into
`RESULTS/<family>/`) and prints markdown: the runs, the learning-rate rule, the fit and
forecast per family, and the compute. Trains nothing; a family whose ladder has not
finished shows its forecast without a measurement.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
from typing import Dict, List, Optional

FAMILIES = ("griffin", "hawk", "mqa")
COSINE_STUDY_FLOPS = 9.2e12   # the isoFLOP forecast study's 11 fit runs


def _load(path: str) -> Optional[object]:
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f) if path.endswith(".json") else list(csv.DictReader(f))


def _interval(e: Dict[str, float], fmt: str = ".3g") -> str:
  return f"{e['value']:{fmt}} [{e['low']:{fmt}}, {e['high']:{fmt}}]"


def runs_table(family: str, rows: List[dict], rule: Optional[dict]) -> List[str]:
  """Final validation loss per size (rows) and fork (columns: tokens per parameter)."""
  forks = sorted({r["run"].rsplit("_wsd", 1)[1] for r in rows if "_wsd" in r["run"]},
                 key=float)
  out = [f"**{family}**: final validation loss (nats per byte) of each fork, by tokens "
         "per parameter; the stable run's at its last step (no cooldown)", "",
         "| N (width x depth) | peak LR | " + " | ".join(forks) + " | stable |",
         "| --- | --- |" + " --- |" * (len(forks) + 1)]
  by_size: Dict[int, Dict[str, str]] = {}
  shape = {}
  for r in rows:
    n = int(r["params"])
    shape[n] = f"{r['width']}x{r['depth']}"
    key = r["run"].rsplit("_wsd", 1)[1] if "_wsd" in r["run"] else "stable"
    by_size.setdefault(n, {})[key] = f"{float(r['loss']):.4f}"
  for n in sorted(by_size):
    cells = [by_size[n].get(k, "") for k in forks + ["stable"]]
    out.append(f"| {n:,} ({shape[n]}) | {_rate(rule, family, n)} | " + " | ".join(cells) + " |")
  return out


def _rate(rule: Optional[dict], family: str, params: int) -> str:
  if not rule:
    return "—"
  f = rule["families"][family]
  return f"{f['coefficient'] * params ** f['exponent']:.3g}"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--results", default=os.path.join(
      os.path.dirname(os.path.abspath(__file__)), "results", "wsd_three_families"))
  args = parser.parse_args()
  summary = ["| family | sizes N (width x depth) | LR rule | E | A | B | α | β | N_opt at C |",
             "| --- |" + " --- |" * 8]
  held = ["| family | held-out run: N, tokens (per N), C (x largest fit run) | peak LR | "
          "forecast [95%] | measured | error | inside? |", "| --- |" + " --- |" * 6]
  probes = ["| family | N | loss at 3e-3 | 1e-2 | 3e-2 | best rate |",
            "| --- | --- | --- | --- | --- | --- |"]
  cost = ["| family | fit runs (stable once + cooldowns) | LR probes | cosine grid of the "
          "same runs | ratio |", "| --- | --- | --- | --- | --- |"]
  totals = [0.0, 0.0, 0.0]
  tables = []
  for family in FAMILIES:
    d = os.path.join(args.results, family)
    rows = _load(os.path.join(d, "sweep.csv"))
    design = _load(os.path.join(d, "design.json"))
    rule = _load(os.path.join(d, "size_rule.json"))
    forecast = _load(os.path.join(d, "forecast.json"))
    if not rows:
      summary.append(f"| {family} | not run |" + " |" * 7)
      continue
    fits = [r for r in rows if r["role"] != "stable"]
    tables += runs_table(family, rows, rule) + [""]
    sizes = sorted({(int(r["params"]), int(r["width"]), int(r["depth"])) for r in rows})
    largest = max(float(r["flops"]) for r in fits)
    f = rule["families"][family] if rule else None
    rule_text = f"{f['coefficient']:.3g}·N^{f['exponent']:+.3f}" if f else "—"
    if rule:
      for s in f["sizes"]:
        probes.append(f"| {family} | {s['params']:,} | " + " | ".join(
            f"{l:.4f}" for l in s["losses"]) + f" | {s['best_learning_rate']:.3g}"
            f"{'' if s['bracketed'] else ' (not bracketed)'} |")
    probe_flops = 0.0
    if rule:  # probes: each of the rule's sizes at each rate, to tokens_per_param
      for s in f["sizes"]:
        per_token = next(float(r["flops_per_token"]) for r in rows
                         if int(r["params"]) == s["params"])
        tokens = -(-int(rule["tokens_per_param"] * s["params"]) // 1024) * 1024
        probe_flops += len(s["rates"]) * per_token * tokens
    c = design["cost"][family]
    totals[0] += c["flops"]
    totals[1] += probe_flops
    totals[2] += c["cosine_grid_flops"]
    cost.append(f"| {family} | {c['flops']:.3g} | {probe_flops:.3g} | "
                f"{c['cosine_grid_flops']:.3g} | {c['ratio']:.2f} |")
    size_text = ", ".join(f"{n:,} ({w}x{dep})" for n, w, dep in sizes)
    if not forecast:
      summary.append(f"| {family} | {size_text} | {rule_text} | ladder not run |" + " |" * 5)
      continue
    fit = forecast["fit"]
    p = forecast["predicted"]
    measured = forecast.get("measured")
    summary.append(
        f"| {family} | {size_text} | {rule_text} | {_interval(fit['E'])} | "
        f"{_interval(fit['A'])} | {_interval(fit['B'])} | {_interval(fit['alpha'])} | "
        f"{_interval(fit['beta'])} | {_interval(forecast['n_opt'], '.3g')} |")
    held.append(
        f"| {family} | {forecast['params']:,}, {forecast['tokens']:,} "
        f"({forecast['tokens'] / forecast['params']:.0f}), {forecast['flops']:.3g} "
        f"({forecast['flops'] / largest:.1f}x) | {forecast['peak_learning_rate']:.3g} | "
        f"{_interval(p, '.4f')} | " +
        (f"{measured:.4f} | {forecast['error']:+.4f} ({100 * forecast['relative_error']:+.2f}%)"
         f" | {'yes' if forecast['inside_interval'] else 'no'} |" if measured is not None
         else "not finished | | |"))
  cost.append(f"| total | {totals[0]:.3g} | {totals[1]:.3g} | {totals[2]:.3g} | "
              f"{totals[0] / totals[2]:.2f} (fit runs + probes: "
              f"{totals[0] + totals[1]:.3g}, {(totals[0] + totals[1]) / COSINE_STUDY_FLOPS:.2f}"
              f" of the cosine forecast study's {COSINE_STUDY_FLOPS:.2g}) |")
  print("\n".join(summary + [""] + held + [""] + probes + [""] + cost + [""] + tables))


if __name__ == "__main__":
  main()
