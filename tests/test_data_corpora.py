"""Corpora in the formats they ship in (Parquet, .jsonl[.gz|.zst], `datasets` directories)
and weighted Gin mixtures: same ids as plain JSONL, one-line errors, exact shares."""
import gzip
import json
import os
import subprocess

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import seqio
import zstandard

from pretrain.data import DataError, materialize, mixing, pipeline, tasks
from trainer_helpers import trainer_env  # pylint: disable=unused-import  # noqa: F401

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]


def documents(count=40, seed=0, prefix="doc"):
  rng = np.random.default_rng(seed)
  return [f"<{prefix}{i}> " + " ".join(rng.choice(WORDS, size=int(rng.integers(3, 40))))
          for i in range(count)]


def write_jsonl(path, texts, field="text", opener=open):
  with opener(path, "wt", encoding="utf-8") as f:
    for text in texts:
      f.write(json.dumps({field: text, "id": 1}) + "\n")


def write_zst(path, texts, field="text"):
  data = "".join(json.dumps({field: t}) + "\n" for t in texts).encode()
  # Two frames: readers must go on past the first.
  half = len(data) // 2
  compressor = zstandard.ZstdCompressor()
  path.write_bytes(compressor.compress(data[:half]) + compressor.compress(data[half:]))


def write_parquet(path, texts, field="text", row_group_size=7):
  table = pa.table({"id": list(range(len(texts))), field: texts})
  pq.write_table(table, path, row_group_size=row_group_size)


def tokens_of(task_name, split="train"):
  provider = materialize.get_provider(task_name)
  ds = provider.get_dataset(sequence_length={"targets": 1 << 16}, split=split,
                            shuffle=False, num_epochs=1, trim_output_features=False)
  return [list(ex["targets"]) for ex in ds.as_numpy_iterator()]


def test_every_format_tokenizes_like_plain_jsonl(tmp_path):
  texts = documents(40)
  shards = [texts[:15], texts[15:31], texts[31:]]
  (tmp_path / "plain").mkdir()
  for i, part in enumerate(shards):
    write_jsonl(tmp_path / "plain" / f"part{i}.jsonl", part)
  (tmp_path / "pq").mkdir()
  for i, part in enumerate(shards):
    write_parquet(tmp_path / "pq" / f"part{i}.parquet", part, field="content")
  (tmp_path / "gz").mkdir()
  for i, part in enumerate(shards):
    write_jsonl(tmp_path / "gz" / f"part{i}.jsonl.gz", part, opener=gzip.open)
  (tmp_path / "zst").mkdir()
  for i, part in enumerate(shards):
    write_zst(tmp_path / "zst" / f"part{i}.jsonl.zst", part)
  datasets = pytest.importorskip("datasets")
  datasets.Dataset.from_dict({"text": texts, "n": list(range(len(texts)))}).save_to_disk(
      str(tmp_path / "hf"), num_shards=3)

  reference = tokens_of(tasks.corpus_task(str(tmp_path / "plain")))
  assert len(reference) == 40
  expected = [list(seqio.ByteVocabulary().encode(t)) + [1] for t in texts]
  assert reference == expected
  for location, field in [(tmp_path / "pq", "content"),            # a directory
                          (f"{tmp_path}/gz/*.jsonl.gz", "text"),  # a glob
                          (tmp_path / "zst", "text"), (tmp_path / "hf", "text")]:
    name = tasks.corpus_task(str(location), text_field=field)
    assert tokens_of(name) == reference, location
    assert materialize.num_shards(materialize.get_provider(name), "train") == 3
  # Parquet files cut at row groups (7 rows each) into more input shards: same documents.
  name = tasks.corpus_task(str(tmp_path / "pq"), text_field="content", shard_bytes=300)
  assert tokens_of(name) == reference
  assert materialize.num_shards(materialize.get_provider(name), "train") > 3


def test_validation_split_is_disjoint_and_stable(tmp_path):
  texts = documents(200)
  write_parquet(tmp_path / "a.parquet", texts)
  name = tasks.corpus_task(str(tmp_path / "a.parquet"), validation_fraction=0.1)
  train, validation = tokens_of(name, "train"), tokens_of(name, "validation")
  assert len(train) + len(validation) == 200 and 5 <= len(validation) <= 40
  assert not {tuple(t) for t in train} & {tuple(v) for v in validation}
  assert tokens_of(name, "validation") == validation
  # A document's split does not depend on how the file is cut into input shards.
  cut = tasks.corpus_task(str(tmp_path / "a.parquet"), validation_fraction=0.1,
                          shard_bytes=500)
  assert materialize.num_shards(materialize.get_provider(cut), "train") > 1
  assert tokens_of(cut, "validation") == validation


def one_line(error):
  """The message's line (Gin may add a second, naming the configurable it was in)."""
  lines = str(error.value).splitlines()
  assert len(lines) == 1 or lines[1].strip().startswith("In call to configurable"), lines
  assert "Traceback" not in lines[0]
  return lines[0]


def test_missing_column_and_empty_glob_are_one_line(tmp_path):
  write_parquet(tmp_path / "a.parquet", documents(5))
  with pytest.raises(DataError) as error:
    tasks.corpus_task(str(tmp_path / "a.parquet"), text_field="body")
  message = one_line(error)
  assert "a.parquet has no column 'body'" in message and "text_field" in message
  write_jsonl(tmp_path / "b.jsonl", documents(3))
  name = tasks.corpus_task(str(tmp_path / "b.jsonl"), text_field="body")
  with pytest.raises(DataError) as error:
    tokens_of_store(tmp_path, name)
  assert "b.jsonl:1 has no string 'body' field" in one_line(error)
  with pytest.raises(DataError) as error:
    tasks.corpus_task(f"{tmp_path}/nothing/*.parquet")
  assert "matched no .parquet files" in one_line(error)


def tokens_of_store(tmp_path, task, **kwargs):
  defaults = dict(sequence_length=32, batch_size=4, cache_dir=str(tmp_path / "cache"))
  defaults.update(kwargs)
  return pipeline.DataPipeline(task=task, **defaults)


def test_corrupt_parquet_shard_is_one_line_and_can_be_skipped(tmp_path):
  for i in range(3):
    write_parquet(tmp_path / f"part{i}.parquet", documents(10, seed=i))
  data = (tmp_path / "part1.parquet").read_bytes()
  (tmp_path / "part1.parquet").write_bytes(data[:len(data) // 2])
  with pytest.raises(DataError) as error:
    tasks.corpus_task(str(tmp_path))
  message = one_line(error)
  assert "shard " + str(tmp_path / "part1.parquet") in message
  assert "skip_bad_shards=True" in message
  name = tasks.corpus_task(str(tmp_path), skip_bad_shards=True)
  assert len(tokens_of(name)) == 20


def test_truncated_zst_is_one_line(tmp_path):
  write_zst(tmp_path / "good.jsonl.zst", documents(50))
  write_zst(tmp_path / "cut.jsonl.zst", documents(400, seed=1))
  data = (tmp_path / "cut.jsonl.zst").read_bytes()
  (tmp_path / "cut.jsonl.zst").write_bytes(data[:len(data) - 100])
  name = tasks.corpus_task(str(tmp_path))
  with pytest.raises(DataError) as error:
    tokens_of_store(tmp_path, name)
  message = one_line(error)
  assert f"shard {tmp_path / 'cut.jsonl.zst'}" in message and "truncated" in message
  assert not os.path.exists(tmp_path / "cache") or not any(
      "metadata.json" in files for _, _, files in os.walk(tmp_path / "cache"))


def three_sources(tmp_path, documents_each=300):
  names = {}
  for k, key in enumerate(["web", "code", "math"]):
    write_parquet(tmp_path / f"{key}.parquet", documents(documents_each, seed=k,
                                                         prefix=key))
    names[key] = tasks.corpus_task(str(tmp_path / f"{key}.parquet"))
  return names


def test_mixture_token_shares_follow_weights(tmp_path):
  names = three_sources(tmp_path)
  weights = {"web": 0.6, "code": 0.3, "math": 0.1}
  mix = mixing.mixture(tasks=names, weights=weights)
  data = tokens_of_store(tmp_path, mix, batch_size=64, seed=3)
  for step in range(50):   # 3200 rows
    data.batch(step)
  record = data.mixture_record(50)
  assert record["kind"] == "mixture" and record["rows"] == 3200
  for key, weight in weights.items():
    assert abs(record[f"share/{key}"] - weight) < 0.01, record
    assert record[f"weight/{key}"] == pytest.approx(weight)
  # A run resumed at step 45 with records every 4 steps recounts batches 44 before its
  # first record (step 48), which then equals the uninterrupted run's.
  for step in range(44, 48):
    data.batch(step)
  uninterrupted = data.mixture_record(48)
  resumed = tokens_of_store(tmp_path, mix, batch_size=64, seed=3)
  resumed.recount_mixture_batches(range(44, 45))
  for step in range(45, 48):
    resumed.batch(step)
  assert resumed.mixture_record(48) == uninterrupted
  # A pure function of (seed, step, weights): any process count, any order.
  halves = [tokens_of_store(tmp_path, mix, batch_size=64, seed=3, process_count=2,
                            process_index=p) for p in range(2)]
  for step in (37, 2, 49):
    whole = data.batch(step)
    for name, array in whole.items():
      np.testing.assert_array_equal(
          np.concatenate([h.batch(step)[name] for h in halves]), array)


def test_weight_schedule_switches_at_its_step():
  spec = mixing.MixtureSpec("m", ("a", "b"), ("ta", "tb"),
                            ((0, (1.0, 0.0)), (5, (0.25, 0.75)), (9, (0.0, 1.0))))
  mixer = mixing.Mixer(spec, batch_size=8, tokens_per_row=[10.0, 10.0])
  owners = [mixer.assign(np.arange(s * 8, s * 8 + 8))[0] for s in range(12)]
  assert all((owners[s] == 0).all() for s in range(5))
  assert all((owners[s] == 1).sum() == 6 for s in range(5, 9))
  assert all((owners[s] == 1).all() for s in range(9, 12))
  # Each task's stream continues across phases: no row index is skipped or repeated.
  _, index = mixer.assign(np.arange(12 * 8))
  task, _ = mixer.assign(np.arange(12 * 8))
  for k in (0, 1):
    assert sorted(index[task == k]) == list(range((task == k).sum()))


MIXTURE_GIN = """
include 'configs/base/trainer.gin'
include 'configs/base/optimizer.gin'
include 'configs/data/corpus.gin'
CORPUS = 'unused'
TRAIN_STEPS = 4
BATCH_SIZE = 8
SEQUENCE_LENGTH = 32
SEED = 3
web/corpus_task.files = '{root}/web'
web/corpus_task.validation_fraction = 0.1
web/corpus_task.shard_bytes = 2000
code/corpus_task.files = '{root}/code/*.jsonl.zst'
code/corpus_task.text_field = 'content'
code/corpus_task.validation_fraction = 0.1
DataPipeline.task = @mixture()
mixture.tasks = {{'web': @web/corpus_task(), 'code': @code/corpus_task()}}
mixture.weights = {{'web': 0.7, 'code': 0.3}}
mixture.schedule = {{2: {{'web': 0.2, 'code': 0.8}}}}
"""


@pytest.mark.slow
def test_beam_prepares_a_gin_mixture_the_trainer_reads(tmp_path):
  """Web is one Parquet file of 18 row groups, cut into several input shards (2000
  bytes of text each), so Beam packs one file in parallel; code is two .jsonl.zst files,
  a shard each. The prepared stores hold the trainer's own rows."""
  import gin  # pylint: disable=import-outside-toplevel
  from pretrain.data import prepare  # pylint: disable=import-outside-toplevel
  from test_prepare import IN_PROCESS, all_rows, trainer_pipeline  # pylint: disable=import-outside-toplevel
  (tmp_path / "web").mkdir()
  (tmp_path / "code").mkdir()
  write_parquet(tmp_path / "web" / "0.parquet", documents(120, prefix="w"))
  for i in range(2):
    write_zst(tmp_path / "code" / f"{i}.jsonl.zst", documents(60, seed=9 + i, prefix="c"),
              field="content")
  config = tmp_path / "mix.gin"
  config.write_text(MIXTURE_GIN.format(root=tmp_path))
  stores = prepare.prepare(str(tmp_path / "prepared"), [str(config)], [], IN_PROCESS)
  gin.clear_config()
  assert sorted(s.metadata["split"] for s in stores) == [
      "train", "train", "validation", "validation"]
  built = trainer_pipeline(str(config), str(tmp_path / "built"))
  prepared = trainer_pipeline(str(config), str(tmp_path / "prepared"))
  assert all(s.path.startswith(str(tmp_path / "prepared")) for s in prepared.train_stores)
  assert prepared.train_stores[0].metadata["num_shards"] >= 4
  for own, store in zip(built.train_stores, prepared.train_stores):
    assert store.metadata["prepared_by"]["runner"] == "apache_beam"
    for name, rows in all_rows(own).items():
      np.testing.assert_array_equal(all_rows(store)[name], rows)
  for step in range(4):
    for name, array in built.batch(step).items():
      np.testing.assert_array_equal(prepared.batch(step)[name], array)
  assert "mixture mixture_" in prepared.describe()


def tiny_mixture_config(trainer_env, path, files, weights, steps, schedule=None):
  """A Gin file training the trainer tests' tiny model for `steps` steps on a mixture of
  the corpora `files` ({name: location}), with the tiny text-files tests' shapes (so
  the compiled step comes from the session's compilation cache)."""
  from trainer_helpers import TINY_GIN  # pylint: disable=import-outside-toplevel
  tiny = (TINY_GIN.replace("include 'configs/data/text_files.gin'",
                           "import pretrain.data.mixing\nimport pretrain.data.pipeline\n"
                           "import pretrain.data.tasks")
          .replace("TRAIN_FILES = '{corpus}/*.txt'", "")
          .replace("text_files_task.validation_fraction = 0.25", "")
          .replace("TRAIN_STEPS = 24", f"TRAIN_STEPS = {steps}")
          .format(cache=trainer_env.cache))
  tasks_text = ", ".join(f"'{key}': @{key}/corpus_task()" for key in files)
  path.write_text(
      tiny + "".join(f"{key}/corpus_task.files = '{location}'\n"
                     for key, location in files.items())
      + "DataPipeline.task = @mixture()\n"
      f"mixture.tasks = {{{tasks_text}}}\n"
      f"mixture.weights = {weights!r}\n"
      + (f"mixture.schedule = {schedule!r}\n" if schedule else ""))
  return str(path)


@pytest.mark.slow
def test_run_killed_mid_mixture_resumes_to_the_same_losses(trainer_env, tmp_path):
  """A tiny model on a 3-source mixture with a phase change at step 6: killed with
  SIGKILL after step 8 or so and restarted, it logs the uninterrupted run's losses."""
  from trainer_helpers import (assert_ok, kill_after_steps, read_metrics,  # pylint: disable=import-outside-toplevel
                               train_losses)
  for k, key in enumerate(["web", "code", "math"]):
    write_parquet(tmp_path / f"{key}.parquet", documents(80, seed=k, prefix=key))
  config = tiny_mixture_config(
      trainer_env, tmp_path / "mixture.gin",
      {key: f"{tmp_path}/{key}.parquet" for key in ("web", "code", "math")},
      {"web": 0.5, "code": 0.3, "math": 0.2}, steps=14,
      schedule={6: {"web": 0.1, "code": 0.1, "math": 0.8}})
  reference_dir, killed_dir = str(tmp_path / "reference"), str(tmp_path / "killed")
  assert_ok(trainer_env.run(trainer_env.train_command(reference_dir,
                                                      gin_files=[config])))
  reference = train_losses(reference_dir)
  assert sorted(reference) == list(range(1, 15))
  shares = [row for row in read_metrics(reference_dir) if row.get("kind") == "mixture"]
  assert [row["step"] for row in shares] == list(range(1, 15))
  assert shares[0]["weight/web"] == 0.5 and shares[-1]["weight/math"] == 0.8
  command = trainer_env.train_command(killed_dir, gin_files=[config])
  kill_after_steps(trainer_env, command, killed_dir, 8)
  assert_ok(trainer_env.run(command))
  restarted = train_losses(killed_dir)
  assert sorted(restarted) == list(range(1, 15))
  for step in range(1, 15):
    assert restarted[step] == reference[step], (step, restarted[step], reference[step])
  # The redone steps' share records replace the killed session's: one per step, the
  # uninterrupted run's.
  assert [row for row in read_metrics(killed_dir) if row.get("kind") == "mixture"] == shares


def _uploaded_corpora(datasets, tmp_path, remote):
  """Parquet shards, .jsonl.zst shards and a `datasets` directory written locally and
  uploaded to `remote`; checks each source reads the same ids from the bucket as from
  the local copy, and returns the bucket locations by corpus name."""
  from plumbing import storage  # pylint: disable=import-outside-toplevel
  local = tmp_path / "corpora"
  (local / "web").mkdir(parents=True)
  (local / "code").mkdir()
  for i in range(2):
    write_parquet(local / "web" / f"{i}.parquet", documents(30, seed=i, prefix="w"))
    write_zst(local / "code" / f"{i}.jsonl.zst", documents(30, seed=5 + i, prefix="c"))
  datasets.Dataset.from_dict({"text": documents(40, seed=7, prefix="b")}).save_to_disk(
      str(local / "books"), num_shards=2)
  storage.upload_tree(str(local), remote)
  files = {"web": f"{remote}/web", "code": f"{remote}/code/*.jsonl.zst",
           "books": f"{remote}/books"}
  for key, location in files.items():
    assert tokens_of(tasks.corpus_task(location)) == tokens_of(
        tasks.corpus_task(location.replace(remote, str(local)))), key
  return files


def test_each_format_reads_the_same_ids_from_an_s3_bucket(s3_bucket, tmp_path):
  """The three formats on a real S3 API server (moto): the ids of their local copies."""
  datasets = pytest.importorskip("datasets")
  files = _uploaded_corpora(datasets, tmp_path, f"{s3_bucket}/corpora-{tmp_path.name}")
  assert sorted(files) == ["books", "code", "web"]


@pytest.mark.slow
def test_each_format_and_a_mixture_train_from_the_gcs_emulator(gcs_bucket, trainer_env,
                                                                 tmp_path):
  """Parquet shards, .jsonl.zst shards and a `datasets` directory, uploaded to the
  project's GCS emulator: each source reads the ids it reads from the local copy, and a
  tiny model trains 3 steps on a Gin mixture of the three gs:// corpora."""
  datasets = pytest.importorskip("datasets")
  from trainer_helpers import (REPO, assert_ok, read_metrics, storage_env,  # pylint: disable=import-outside-toplevel
                               train_losses)
  files = _uploaded_corpora(datasets, tmp_path, f"{gcs_bucket}/corpora-{tmp_path.name}")
  config = tiny_mixture_config(trainer_env, tmp_path / "gcs.gin", files,
                               {"web": 0.5, "code": 0.3, "books": 0.2}, steps=3)
  workdir = str(tmp_path / "run")
  # The session's trainer environment, pointed at the emulator.
  assert_ok(subprocess.run(trainer_env.train_command(workdir, gin_files=[config]),
                           env=storage_env(trainer_env.env), cwd=REPO,
                           capture_output=True, text=True, timeout=300))
  assert sorted(train_losses(workdir)) == [1, 2, 3]
  shares = [row for row in read_metrics(workdir) if row.get("kind") == "mixture"]
  assert [row["step"] for row in shares] == [1, 2, 3]
  for key in files:   # 12 rows: each corpus served some
    assert sum(row[f"tokens/{key}"] for row in shares) > 0, key
