"""Meshes, partition rules and multi-process start-up. `plumbing.quiet` is set up first,
as in every package: these modules load JAX."""
from plumbing import quiet

quiet.setup()
