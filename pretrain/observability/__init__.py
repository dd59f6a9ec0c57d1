"""Observability: what a run reports about itself while it runs, and after.

  metrics.py    the metrics writer (metrics.jsonl, console lines, step timing)
  goodput.py    where the wall time went (productive steps, restores, stalls, ...)
  stragglers.py which process is slow, from per-process step times
  watchdog.py   a hung process dumps its stacks and exits so the launcher restarts it
  flops.py      model FLOPs and MFU
  report.py     plots of runs' metrics and goodput

Experiment trackers (W&B, MLflow) go in `trackers/`. Imports checkpoints (the storage
outage handling its uploads share), never the trainer.
"""
