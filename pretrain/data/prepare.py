r"""Prepares the packed token stores of a training config's data with Apache Beam.

  python -m pretrain.data.prepare --gin_file=configs/quickstart.gin --output=DIR_OR_URL
  python -m pretrain.data.prepare --gin_file=F ... --output=gs://BUCKET/tokens -- \
      --runner=DataflowRunner --project=P --region=R --temp_location=gs://BUCKET/tmp

Takes the same Gin files and bindings as `pretrain.train` (the data config names any
registered SeqIO task or mixture; `SEQUENCE_LENGTH` and the document caps come from
there too) and writes one token store per split (`DataPipeline.train_split` and
`validation_split`) under the output directory or `gs://` / `s3://` URL, named exactly
as the trainer names its cached stores. Train from them with
`--gin_param="DataPipeline.cache_dir='DIR_OR_URL'"`: the trainer opens a prepared store as
if it had built it (same layout, same rows, same batch at every step).

Arguments after `--` go to Beam unchanged. Without them the pipeline runs here on
Beam's DirectRunner in multi-process mode, one worker per core
(`--direct_num_workers=N` to choose). A store is committed by its manifest
(`metadata.json`, written last); rerunning the command after a crash skips the finished
shards, and rerunning it after success does nothing. Exit codes: 0 prepared, 1 the data
is unusable (e.g. every document empty) or the output not writable, 2 bad command line
or config (e.g. an unknown task).
"""
from __future__ import annotations

import functools
import os
import re
from typing import Any, List, Optional, Sequence

import apache_beam as beam
from absl import flags
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.options.pipeline_options import StandardOptions
from apache_beam.runners.portability.fn_api_runner import fn_runner

from plumbing import cli, storage
from plumbing.errors import usage_error
from pretrain import gin_config
from pretrain.data import beam_stores, kvstore, materialize, token_store
from pretrain.data.errors import DataError
from pretrain.train import EXTRA_BINDINGS_ENV
from pretrain.trainer import TrainConfig

FLAGS = flags.FLAGS

DEFAULT_BEAM_ARGS = ("--runner=DirectRunner", "--direct_running_mode=multi_processing",
                     "--direct_num_workers=0")


def define_flags() -> None:
  cli.define_gin_flags()
  flags.DEFINE_string("output", None, "Directory or gs:// / s3:// URL to write the "
                      "token stores into (the trainer's DataPipeline.cache_dir).")
  flags.mark_flag_as_required("output")
  cli.require_gin_files()


def register_task(gin_files: Sequence[str], gin_bindings: Sequence[str]) -> str:
  """Parses the Gin config and registers its SeqIO task; returns the task's name. Beam
  workers call it (through a pickled partial) before packing."""
  gin_config.parse(gin_files, gin_bindings)
  return gin_config.data_bindings()["task"]


def plans_of(output: str, gin_files: Sequence[str], gin_bindings: Sequence[str]
           ) -> List[beam_stores.StorePlan]:
  """The stores the config's data needs, from its Gin config."""
  gin_config.parse(gin_files, gin_bindings)
  data = gin_config.data_bindings()
  sequence_length = gin_config.build(TrainConfig).sequence_length
  try:
    provider = materialize.get_provider(data["task"])
  except DataError as error:
    raise usage_error(str(error)) from None
  splits = [(data.get("train_split", "train"), data.get("max_train_documents")),
            (data.get("validation_split", "validation"),
             data.get("max_validation_documents"))]
  plans = []
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
    raise usage_error(f"SeqIO task '{provider.name}' has none of the splits "
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


def prepare(output: str, gin_files: Sequence[str], gin_bindings: Sequence[str],
            beam_args: Sequence[str] = ()) -> List[token_store.TokenStore]:
  """Prepares every split's store under `output`; returns them, committed."""
  plans = plans_of(output, gin_files, gin_bindings)
  storage.check_writable(output, "--output")
  todo = [plan for plan in plans
          if kvstore.read_json(plan.path, token_store.METADATA) is None]
  if todo:
    options = PipelineOptions([*DEFAULT_BEAM_ARGS, *beam_args])
    register = functools.partial(register_task, tuple(gin_files), tuple(gin_bindings))
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


def main(argv: Sequence[str]) -> None:
  extra = os.environ.get(EXTRA_BINDINGS_ENV, "").splitlines()
  stores = prepare(FLAGS.output, FLAGS.gin_file,
                   FLAGS.gin_param + [binding for binding in extra if binding.strip()],
                   beam_args=argv[1:])
  for store in stores:
    meta = store.metadata
    print(f"{meta['split']}: {meta['num_documents']} documents, {meta['num_tokens']} "
          f"tokens in {meta['num_rows']} rows of {meta['sequence_length']}: {store.path}")
  print(f"train from them with --gin_param=\"DataPipeline.cache_dir='{FLAGS.output}'\"")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
