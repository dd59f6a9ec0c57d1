"""Optional dependencies: a missing one is one line naming the pip command that adds it.

The base install is JAX-only. Hugging Face interchange needs the `hf` extra
(transformers, torch, safetensors) and downstream evaluation the `eval` extra
(lm_eval); the commands that use them check first, so a user never meets an
ImportError's traceback.
"""
from __future__ import annotations

import importlib.util

from plumbing.errors import usage_error


def require(*modules: str, extra: str, purpose: str) -> None:
  """Raises a usage error naming `pip install -e ".[extra]"` unless every module imports."""
  missing = [name for name in modules if importlib.util.find_spec(name) is None]
  if missing:
    raise usage_error(f"To {purpose}, install the {extra!r} extra: pip install -e "
                      f"\".[{extra}]\" (missing: {', '.join(missing)})")
