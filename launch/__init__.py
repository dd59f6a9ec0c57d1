"""Launchers (`python -m launch.<command>`): local processes, SLURM, GKE, TPU VMs, sweeps,
chaos runs. `plumbing.quiet` is set up first, before a command loads JAX."""
from plumbing import quiet

quiet.setup()
