"""Flax layers and model tools; importing the package registers the built-in blocks.

`pretrain.quiet` comes first: registering the blocks imports JAX, and with the CUDA
plugin installed (the gpu-aot and test extras) JAX's import prints the plugin's native
"no CUDA driver" lines unless quiet's filter is in place (`python -m model.summary`
runs this before its own first import).
"""
from pretrain import quiet  # noqa: F401  # pylint: disable=unused-import  # first
from model import blocks as _blocks  # noqa: F401  # pylint: disable=unused-import
