"""`python -m pretrain.data.prepare`: token stores written by Apache Beam workers are the
trainer's own stores (same rows, same batches), committed by a manifest, resumable."""
import os
import subprocess
import sys

import gin
import numpy as np
import pytest

from plumbing.errors import EXIT_FAILED, EXIT_USAGE, UserError
from pretrain import gin_config
from pretrain.data import beam_stores, kvstore, pipeline, prepare, token_store
from pretrain.data.errors import DataError
from pretrain.train_config import TrainConfig
from trainer_helpers import REPO, assert_ok, storage_env

GIN = """
include 'configs/base/trainer.gin'
include 'configs/base/optimizer.gin'
include 'configs/data/text_files.gin'
TRAIN_FILES = '{corpus}/*.txt'
TRAIN_STEPS = 4
BATCH_SIZE = 4
SEQUENCE_LENGTH = 32
SEED = 3
text_files_task.validation_fraction = 0.2
text_files_task.shard_bytes = 1500
"""
IN_PROCESS = ("--direct_running_mode=in_memory", "--direct_num_workers=1")
WORDS = ("def", "return", "class", "self", "(", ")", ":", "\n", "    ", "value")


def write_config(directory, documents=30, empty=False):
  rng = np.random.default_rng(0)
  corpus = directory / "corpus"
  corpus.mkdir(parents=True)
  for i in range(documents):
    text = "" if empty else " ".join(rng.choice(WORDS, size=int(rng.integers(5, 300))))
    (corpus / f"doc{i:02d}.txt").write_text(text)
  path = directory / "data.gin"
  path.write_text(GIN.format(corpus=corpus))
  return str(path)


def trainer_pipeline(gin_file, cache_dir):
  """The DataPipeline exactly as `pretrain.train` builds it from the same config."""
  gin_config.parse([gin_file], [f"DataPipeline.cache_dir = '{cache_dir}'"])
  try:
    train = gin_config.build(TrainConfig)
    return gin_config.build(pipeline.DataPipeline, sequence_length=train.sequence_length,
                            batch_size=train.batch_size, seed=train.seed)
  finally:
    gin.clear_config()


def all_rows(store):
  return store.read(np.arange(store.num_rows))


@pytest.fixture(scope="module")
def config(tmp_path_factory):
  return write_config(tmp_path_factory.mktemp("prepare"))


@pytest.mark.slow
def test_rerun_skips_finished_shards_and_commits_last(config, tmp_path):
  output = str(tmp_path / "out")
  train_plan = prepare.plans_of(output, [config], [])[0]
  gin.clear_config()
  # A crashed run left shard 1 packed (marker written) and nothing else. Its staged rows
  # are overwritten with a sentinel, which the final store shows only if shard 1 is
  # skipped rather than packed again.
  list(beam_stores.PackShard(lambda: None, [train_plan.task]).process((train_plan, 1)))
  staged = token_store.open_arrays(beam_stores.staging_path(train_plan, 1), ["targets"])
  sentinel = np.full((1, 32), 7, np.int32)
  staged["targets"][0:1].write(sentinel).result()
  assert kvstore.read_json(output, "/".join([train_plan.name, token_store.METADATA])) is None
  with pytest.raises(DataError, match="no metadata.json.*rerun"):
    trainer_pipeline(config, output)  # a half-written store is never picked up
  stores = prepare.prepare(output, [config], [], IN_PROCESS)
  rows = all_rows(stores[0])["targets"]
  assert (rows == 7).all(axis=1).sum() == 1  # the sentinel row, from the staged shard
  assert kvstore.list_names(train_plan.path, beam_stores.STAGING) == []  # cleaned up
  assert prepare.prepare(output, [config], [], IN_PROCESS)[0].metadata == stores[0].metadata


def test_store_without_manifest_is_never_opened(tmp_path):
  path = str(tmp_path / "store")
  token_store.create_arrays(path, 8, False, 4)  # arrays, but no manifest
  with pytest.raises(DataError, match="no metadata.json"):
    token_store.TokenStore(path)
  with pytest.raises(DataError, match="interrupted"):
    token_store.open_or_build(str(tmp_path), "store", 8, False, lambda writer: {})


def test_bad_input_is_one_line(config, tmp_path):
  cases = [
      ([config], ["DataPipeline.task = 'no_such_task'"], str(tmp_path / "a"),
       "no SeqIO task or mixture named 'no_such_task'", EXIT_USAGE),
      ([config], [], str(tmp_path / "file" / "below"), "--output .* is not writable",
       EXIT_FAILED),
      ([], [], str(tmp_path / "b"), "No data configuration", EXIT_USAGE),
  ]
  (tmp_path / "file").write_text("a file, not a directory")
  for files, bindings, output, message, exit_code in cases:
    with pytest.raises(UserError, match=message) as raised:
      prepare.prepare(output, files, bindings, IN_PROCESS)
    assert raised.value.exit_code == exit_code
    assert "\n" not in str(raised.value)
  gin.clear_config()


@pytest.mark.slow
def test_empty_corpus_is_one_line(tmp_path):
  config = write_config(tmp_path, documents=3, empty=True)
  with pytest.raises(DataError, match="has no tokens") as raised:
    prepare.prepare(str(tmp_path / "out"), [config], [], IN_PROCESS)
  assert raised.value.exit_code == EXIT_FAILED
  gin.clear_config()


@pytest.mark.slow
def test_two_workers_write_the_trainers_own_stores_into_a_bucket(config, s3_bucket,
                                                                   tmp_path):
  """Two Beam workers (threads of one child process; the README test runs worker
  processes) pack and write their own shards concurrently into a bucket on a local moto
  S3 server. The stores hold exactly the rows of the trainer's own local build, and the
  trainer reads them from the bucket, batch for batch. (On the GCS emulator, two workers
  prepare the C4 config's stores that the README's TPU example then trains on:
  tests/test_readme.py::test_tpu_example_trains_against_the_emulated_bucket.)

  The command runs in a child process: Beam's threaded runner leaves gRPC servers and
  their threads behind in the process that ran it, and a pytest worker carrying them
  into later tests has aborted."""
  output = f"{s3_bucket}/tokens-{tmp_path.name}"
  assert_ok(subprocess.run(
      [sys.executable, "-m", "pretrain.data.prepare", f"--gin_file={config}",
       f"--output={output}", "--", "--runner=DirectRunner",
       "--direct_running_mode=multi_threading", "--direct_num_workers=2"],
      cwd=REPO, env=storage_env(os.environ), capture_output=True, text=True, timeout=600))
  own = trainer_pipeline(config, str(tmp_path / "own"))
  assert own.train_store.metadata["num_shards"] > 2  # several shards for two workers
  for reference in (own.train_store, own.validation_store):
    path = f"{output}/{os.path.basename(reference.path)}"
    assert kvstore.list_names(path, beam_stores.STAGING) == []
    store = token_store.TokenStore(path)
    for key, value in reference.metadata.items():
      assert store.metadata[key] == value, key
    for name, rows in all_rows(reference).items():
      np.testing.assert_array_equal(all_rows(store)[name], rows)
  from_bucket = trainer_pipeline(config, output)
  assert from_bucket.train_store.path == f"{output}/{os.path.basename(own.train_store.path)}"
  for step in (0, 1, 7, 100):
    for name, value in own.batch(step).items():
      np.testing.assert_array_equal(from_bucket.batch(step)[name], value)
