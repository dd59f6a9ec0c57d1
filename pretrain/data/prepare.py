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
from typing import List, Sequence

from absl import flags

from plumbing import cli
from pretrain import gin_config
from pretrain.data import beam_stores, preparation, token_store
from pretrain.train_config import TrainConfig

FLAGS = flags.FLAGS


def register_task(gin_files: Sequence[str], gin_bindings: Sequence[str]) -> str:
  """Parses the Gin config and registers its SeqIO task; returns the task's name. Beam
  workers call it (through a pickled partial) before packing."""
  gin_config.parse(gin_files, gin_bindings)
  return gin_config.data_bindings()["task"]


def plans_of(output: str, gin_files: Sequence[str], gin_bindings: Sequence[str]
             ) -> List[beam_stores.StorePlan]:
  """The stores the config's data needs, from its Gin config."""
  gin_config.parse(gin_files, gin_bindings)
  sequence_length = gin_config.build(TrainConfig).sequence_length
  return preparation.store_plans(output, gin_config.data_bindings(), sequence_length)


def prepare(output: str, gin_files: Sequence[str], gin_bindings: Sequence[str],
            beam_args: Sequence[str] = ()) -> List[token_store.TokenStore]:
  """Prepares every split's store under `output`; returns them, committed."""
  plans = plans_of(output, gin_files, gin_bindings)
  register = functools.partial(register_task, tuple(gin_files), tuple(gin_bindings))
  return preparation.write_stores(output, plans, register, beam_args)


def define_flags() -> None:
  cli.define_gin_flags()
  flags.DEFINE_string("output", None, "Directory or gs:// / s3:// URL to write the "
                      "token stores into (the trainer's DataPipeline.cache_dir).")
  flags.mark_flag_as_required("output")
  cli.require_gin_files()


def main(argv: Sequence[str]) -> None:
  stores = prepare(FLAGS.output, FLAGS.gin_file, FLAGS.gin_param + gin_config.extra_bindings(),
                   beam_args=argv[1:])
  for store in stores:
    meta = store.metadata
    print(f"{meta['split']}: {meta['num_documents']} documents, {meta['num_tokens']} "
          f"tokens in {meta['num_rows']} rows of {meta['sequence_length']}: {store.path}")
  print(f"train from them with --gin_param=\"DataPipeline.cache_dir='{FLAGS.output}'\"")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
