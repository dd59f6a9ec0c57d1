r"""Tokenizes and packs a corpus into a prepared token store with Apache Beam: the
library of `python -m pretrain.data.prepare`.
"""
from __future__ import annotations

import re
from typing import Any, Callable, List, Mapping, Optional, Sequence

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.options.pipeline_options import StandardOptions
from apache_beam.runners.portability.fn_api_runner import fn_runner

from plumbing import storage
from plumbing.errors import usage_error
from pretrain.data import beam_stores, kvstore, materialize, mixing, token_store
from pretrain.data.errors import DataError


DEFAULT_BEAM_ARGS = ("--runner=DirectRunner", "--direct_running_mode=multi_processing",
                     "--direct_num_workers=0")


def store_plans(output: str, data: Mapping[str, Any], sequence_length: int
                ) -> List[beam_stores.StorePlan]:
  """The stores a data config needs: `data` holds its DataPipeline bindings (`task`,
  the splits and their document limits), `sequence_length` the trainer's."""
  spec = mixing.lookup(data["task"])   # a mixture: one store per task and split
  try:
    providers = [materialize.get_provider(name)
                 for name in (spec.tasks if spec else (data["task"],))]
  except DataError as error:
    raise usage_error(str(error)) from None
  splits = [(data.get("train_split", "train"), data.get("max_train_documents")),
            (data.get("validation_split", "validation"),
             data.get("max_validation_documents"))]
  plans = []
  for provider in providers:
    for split, max_documents in splits:
      if not materialize.has_split(provider, split):
        continue  # e.g. a text-files task with validation_fraction = 0
      name = materialize.store_name(provider, split, sequence_length, max_documents)
      plans.append(beam_stores.StorePlan(
          name=name, path=storage.join(output, name), task=provider.name, split=split,
          sequence_length=sequence_length, max_documents=max_documents,
          num_shards=materialize.num_shards(provider, split),
          with_loss_mask=materialize.has_loss_mask(provider)))
  if not plans:
    raise usage_error(f"SeqIO task '{data['task']}' has none of the splits "
                      f"{[split for split, _ in splits]}")
  return plans


def _data_error_in(error: Exception) -> Optional[str]:
  """The message of a DataError a Beam worker raised, from the runner's error text."""
  found = re.findall(r"DataError: (.+)", str(error))
  return found[-1].strip() if found else None


def _local_runner(options: PipelineOptions) -> Optional[Any]:
  """Beam's FnApiRunner where the options name the DirectRunner, else None (Beam
  resolves `--runner` itself).

  Beam's DirectRunner first tries its Prism runner, which downloads a Go binary from
  GitHub and starts a gRPC job server: offline that costs a failed download and an extra
  server's threads in every run, and online Prism would ignore `--direct_running_mode`
  and `--direct_num_workers`, which this command documents. The FnApiRunner is the
  runner DirectRunner falls back to for these batch pipelines, and honours both.
  """
  if options.view_as(StandardOptions).runner not in (None, "DirectRunner"):
    return None
  return fn_runner.FnApiRunner()


def write_stores(output: str, plans: Sequence[beam_stores.StorePlan],
                 register: Callable[[], str], beam_args: Sequence[str] = ()
                 ) -> List[token_store.TokenStore]:
  """Writes every planned store under `output` that is not there yet; returns them all,
  committed. Beam workers call `register` (picklable) before packing: it registers the
  plans' SeqIO task and returns its name."""
  storage.check_writable(output, "--output")
  todo = [plan for plan in plans
          if kvstore.read_json(plan.path, token_store.METADATA) is None]
  if todo:
    options = PipelineOptions([*DEFAULT_BEAM_ARGS, *beam_args])
    try:
      with beam.Pipeline(runner=_local_runner(options), options=options) as root:
        beam_stores.build(root, todo, register)
    except Exception as error:  # pylint: disable=broad-except
      message = _data_error_in(error)
      if message is None:
        raise
      raise DataError(message) from None
  for plan in todo:
    if kvstore.read_json(plan.path, token_store.METADATA) is None:
      if sum(m["documents"] for m in beam_stores.shard_markers(plan)) == 0:
        raise materialize.empty_split_error(materialize.get_provider(plan.task),
                                            plan.split)
      raise DataError(f"Beam finished without committing {plan.path}; rerun the "
                      "command (finished shards are kept)")
  return [token_store.TokenStore(plan.path) for plan in plans]
