"""Task registration, corpus files, the WikiText article joiner and the Gin configs."""
import os
import sysconfig

import gin
import numpy as np
import pytest
import seqio
import tensorflow as tf

from pretrain import gin_config
from pretrain.data import DataError, corpus_files, materialize, pipeline, tasks

CONFIGS = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "data")


def test_tfds_tasks_are_registered_with_byte_vocabulary():
  for name, tfds_name, splits in [
      ("c4_en", "c4/en:3.1.0", {"train", "validation"}),
      ("wikitext103", "wikitext/wikitext-103-raw-v1:1.0.0",
       {"train", "validation", "test"})]:
    task = materialize.get_provider(name)
    assert isinstance(task.source, seqio.TfdsDataSource)
    assert task.source.tfds_dataset.name == tfds_name
    assert set(task.splits) == splits
    assert isinstance(task.output_features["targets"].vocabulary,
                      seqio.ByteVocabulary)
    assert task.output_features["targets"].add_eos


def test_wikitext_lines_are_joined_into_articles():
  lines = [" \n", " = Alpha = \n", " \n", " a1 \n", " = = Part = = \n", " a2 \n",
           " = B = \n", " b1\n", " \n", " = Gamma Delta = \n", " g1 \n"]
  articles = [x["text"].decode() for x in tasks.join_wikitext_articles(
      tf.data.Dataset.from_tensor_slices({"text": lines})).as_numpy_iterator()]
  assert articles == [" = Alpha = \n \n a1 \n = = Part = = \n a2 \n",
                      " = B = \n b1\n \n", " = Gamma Delta = \n g1 \n"]


def test_stdlib_placeholder_and_default_exclusions():
  stdlib = sysconfig.get_paths()["stdlib"]
  assert corpus_files.expand_pattern("{stdlib}/json/*.py") == f"{stdlib}/json/*.py"
  files = corpus_files.match_files("{stdlib}/json/*.py")
  assert os.path.join(stdlib, "json", "decoder.py") in files
  assert not any("site-packages" in f for f in corpus_files.match_files(
      "{stdlib}/**/__init__.py"))
  assert corpus_files.glob_root("/a/b/**/c*/*.py") == "/a/b"


def test_validation_assignment_is_stable_and_respects_the_fraction():
  keys = [f"dir/file{i}.py" for i in range(4000)]
  flags = corpus_files.assign_validation(keys, 0.1)
  assert flags == corpus_files.assign_validation(keys, 0.1)
  assert 0.08 < np.mean(flags) < 0.12
  # Growing the fraction only moves documents into validation.
  wider = corpus_files.assign_validation(keys, 0.2)
  assert all(w for f, w in zip(flags, wider) if f)
  assert corpus_files.assign_validation(["a", "b"], 0.01).count(True) == 1
  assert corpus_files.assign_validation(["a", "b"], 0.0) == [False, False]


def test_split_depends_on_relative_paths_only(tmp_path):
  for root in ("one", "two"):
    for i in range(40):
      path = tmp_path / root / "sub" / f"f{i}.txt"
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(f"text {i}")
  splits = []
  for root in ("one", "two"):
    source = tasks.sources.TextFilesDataSource(
        str(tmp_path / root / "**" / "*.txt"), 0.3)
    paths, _ = source._documents_by_split()["validation"]
    splits.append(sorted(os.path.relpath(p, tmp_path / root) for p in paths))
  assert splits[0] == splits[1] and splits[0]


def test_text_files_gin_config_builds_a_pipeline(tmp_path):
  (tmp_path / "corpus").mkdir()
  for i in range(5):
    (tmp_path / "corpus" / f"{i}.txt").write_text(f"document {i} " * 20)
  try:
    gin_config.parse([os.path.join(CONFIGS, "text_files.gin")],
                     [f"TRAIN_FILES = '{tmp_path}/corpus/*.txt'",
                      f"DataPipeline.cache_dir = '{tmp_path}/cache'"])
    data = gin_config.build(pipeline.DataPipeline, sequence_length=32, batch_size=4,
                            seed=1, process_index=1, process_count=2)
    assert (data.sequence_length, data.batch_size, data.seed) == (32, 4, 1)
    assert data.batch(0)["targets"].shape == (2, 32)
    assert data.vocab_size == 259
  finally:
    gin.clear_config()


@pytest.mark.parametrize("config,task", [("c4.gin", "c4_task"),
                                         ("wikitext103.gin", "wikitext103_task")])
def test_tfds_gin_configs_parse(config, task):
  try:
    gin_config.parse(["configs/base/trainer.gin", "configs/models/tiny_griffin.gin",
                      os.path.join(CONFIGS, config)], ["SEQUENCE_LENGTH = 32"])
    gin_config.check_training_config()
    reference = gin.query_parameter("DataPipeline.task")
    assert reference.selector.endswith(task)
  finally:
    gin.clear_config()


def test_missing_tfds_data_is_a_clear_error(tmp_path):
  name = tasks.wikitext103_task(tfds_data_dir=str(tmp_path / "no_tfds"))
  try:
    with pytest.raises(DataError, match=r"could not load TFDS dataset 'wikitext/"
                       r"wikitext-103-raw-v1:1.0.0' for task 'wikitext103'"):
      pipeline.DataPipeline(task=name, sequence_length=64, batch_size=4,
                            cache_dir=str(tmp_path / "cache"))
  finally:
    tasks.wikitext103_task()  # restore the default registration
