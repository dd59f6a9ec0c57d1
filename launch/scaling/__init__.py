"""Scaling laws: fits of loss against compute, parameters and tokens, and their plots.

  scaling_laws.py   the three Chinchilla approaches, with bootstrap intervals
  scaling_fit.py    a study's (or any runs') fits and report: `python -m launch.scaling_fit`
  scaling_plots.py  the figures

Imports nothing else of `launch`; `launch.sweeps` and `benchmarks/` use it.
"""
