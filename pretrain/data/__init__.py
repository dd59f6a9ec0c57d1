"""Data pipeline: SeqIO tasks -> packed token stores -> deterministic batches.

`DataPipeline` (pipeline.py) is what the trainer uses; `text_files_task`, `c4_task`
and `wikitext103_task` (tasks.py) register SeqIO tasks. Those names are imported
lazily, so TensorFlow-free tools (the tokenizer CLI, `DataError` handlers) do not pay
for importing TensorFlow. Gin files import `pretrain.data.pipeline` and
`pretrain.data.tasks` to register the configurables.
"""
import importlib

from pretrain.data.errors import DataError

_LAZY = {
    "DataPipeline": "pretrain.data.pipeline",
    "text_files_task": "pretrain.data.tasks",
    "c4_task": "pretrain.data.tasks",
    "wikitext103_task": "pretrain.data.tasks",
    "get_vocabulary": "pretrain.data.vocabularies",
}

__all__ = ["DataError", *_LAZY]


def __getattr__(name):
  if name in _LAZY:
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'pretrain.data' has no attribute '{name}'")
