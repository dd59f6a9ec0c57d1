"""Flax layers and model tools; importing the package registers the built-in blocks.

`plumbing.quiet` is set up first: registering the blocks imports JAX, and with the CUDA
plugin installed (the gpu-aot and test extras) JAX's import prints the plugin's native
"no CUDA driver" lines unless quiet's filter is in place.
"""
from plumbing import quiet

quiet.setup()  # before the blocks below import JAX

from model import blocks as _blocks  # noqa: E402,F401  # pylint: disable=unused-import,wrong-import-position
