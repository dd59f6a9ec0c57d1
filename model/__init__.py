"""Flax layers and model tools; importing the package registers the built-in blocks."""
from model import blocks as _blocks  # noqa: F401  # pylint: disable=unused-import
