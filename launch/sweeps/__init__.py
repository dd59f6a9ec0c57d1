"""Sweeps: scaling studies, from their design to the runs' results.

  study.py           a study from its options (`python -m launch.sweep`'s library)
  sweep_design.py    the fixed-ratio and isoFLOP designs: sizes, budgets, each run's Gin
  wsd_design.py      the forked (WSD) design: stable runs and their cooldown forks
  size_rule.py       the learning rate of each size, from probe runs
  ladder.py          the compute-optimal model at a larger budget, and its forecast
  sweep_execute.py   runs a study's runs on a backend (registers the built-in backends)
  sweep_local.py     the local backend (N runs at a time on this machine)
  sweep_progress.py  the local study's progress line and ETA
  sweep_results.py   the results table, final evaluations and the study's fit
  fork.py            seeds a cooldown fork with its stable run's checkpoint

The contract of the backends that run a study's runs (their registry, the runs' states,
the wrapper every run starts through) is `launch.dispatch`; the cluster backends live
with their launchers in `launch.clusters`. Both wings sit below this one.
"""
