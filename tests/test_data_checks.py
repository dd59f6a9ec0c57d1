"""What the data pipeline checks before the first training step: a split with no tokens
(a held-out fraction too small for the corpus, a held-out document that is empty, a
mixture component with no text) and a vocabulary larger than the model's, each one line
naming the task's own setting, exit code 2."""
import os
import random

import gin
import pytest

from pretrain.data import corpus_files, pipeline, tasks
from pretrain.data.errors import DataError
from test_data_corpora import write_zst
from trainer_helpers import trainer_env  # pylint: disable=unused-import  # noqa: F401

WORDS = ("def", "return", "class", "self", "import", "for", "in", "if")


def texts(count, seed=0):
  rng = random.Random(seed)
  return [" ".join(rng.choice(WORDS) for _ in range(50)) for _ in range(count)]


def open_pipeline(task, cache_dir):
  return pipeline.DataPipeline(task=task, sequence_length=32, batch_size=4,
                               cache_dir=str(cache_dir), open_validation=True)


def test_a_corpus_too_small_for_its_held_out_fraction_names_that_fraction(tmp_path):
  """5 documents at 2% hold out none: the message names corpus_task's own fraction and
  does not blame empty documents (there are none)."""
  write_zst(tmp_path / "five.jsonl.zst", texts(5))
  task = tasks.corpus_task(files=str(tmp_path / "five.jsonl.zst"), validation_fraction=0.02)
  with pytest.raises(DataError) as raised:
    open_pipeline(task, tmp_path / "cache")
  message = str(raised.value).splitlines()[0]   # then Gin's call context, in-process
  assert "'validation' split" in message and "corpus_task.validation_fraction=0.02" in message
  assert "CORPUS" in message and "empty" not in message
  assert "text_files_task" not in message and "TRAIN_FILES" not in message
  assert raised.value.exit_code == 2
  # The train store was built before the check and is reused: nothing is lost.
  assert any(name.startswith(task) for name in os.listdir(tmp_path / "cache"))


def test_an_empty_held_out_file_names_text_files_task_fraction(tmp_path):
  """29 files whose one held-out file is an empty `__init__.py`-like document."""
  names = [f"mod{i:02d}.py" for i in range(29)]
  held_out = corpus_files.assign_validation(names, 0.02)
  assert sum(held_out) == 1
  for name, text, empty in zip(names, texts(29), held_out):
    (tmp_path / name).write_text("" if empty else text)
  task = tasks.text_files_task(train_files=str(tmp_path / "*.py"), validation_fraction=0.02)
  with pytest.raises(DataError, match=r"text_files_task\.validation_fraction=0\.02 held "
                     r"out no document with text from TRAIN_FILES") as raised:
    open_pipeline(task, tmp_path / "cache")
  assert "corpus_task" not in str(raised.value)


def test_a_mixture_component_without_text_names_its_scoped_files(tmp_path):
  (tmp_path / "web").mkdir()
  (tmp_path / "code").mkdir()
  write_zst(tmp_path / "web" / "0.jsonl.zst", texts(20))
  write_zst(tmp_path / "code" / "0.jsonl.zst", [""] * 20)
  config = tmp_path / "mix.gin"
  config.write_text(f"""
include 'configs/data/corpus.gin'
CORPUS = 'unused'
web/corpus_task.files = '{tmp_path}/web'
code/corpus_task.files = '{tmp_path}/code'
DataPipeline.task = @mixture()
mixture.tasks = {{'web': @web/corpus_task(), 'code': @code/corpus_task()}}
mixture.weights = {{'web': 0.5, 'code': 0.5}}
DataPipeline.cache_dir = '{tmp_path}/cache'
""")
  from pretrain import gin_config  # pylint: disable=import-outside-toplevel
  gin_config.parse([str(config)], [])
  try:
    with pytest.raises(DataError, match=r"'train' split .* no document of "
                       r"code/corpus_task\.files has text"):
      gin_config.build(pipeline.DataPipeline, sequence_length=32, batch_size=4)
  finally:
    gin.clear_config()


@pytest.mark.slow
def test_train_stops_before_step_1_on_an_empty_split_or_a_small_vocabulary(
    trainer_env, tmp_path):
  """The issue's run: `configs/data/corpus.gin` on 5 documents. Before, it trained every
  step and failed at the final evaluation; now no step runs. Likewise a model whose
  vocabulary is smaller than the data's."""
  write_zst(tmp_path / "five.jsonl.zst", texts(5))
  config = tmp_path / "corpus.gin"
  tiny = open(trainer_env.gin, encoding="utf-8").read().splitlines()
  config.write_text("\n".join(
      line.replace("configs/data/text_files.gin", "configs/data/corpus.gin")
      for line in tiny if not line.startswith(("TRAIN_FILES", "text_files_task")))
      + f"\nCORPUS = '{tmp_path}/five.jsonl.zst'\nTrainConfig.final_eval = True\n")
  result = trainer_env.run(trainer_env.train_command(
      str(tmp_path / "run"), "TRAIN_STEPS = 1", gin_files=[str(config)]))
  assert result.returncode == 2, result.stderr[-2000:]
  assert result.stderr.strip().splitlines()[-1].startswith(
      "error: the 'validation' split of SeqIO task 'corpus_jsonl_bytes_"), result.stderr
  assert "corpus_task.validation_fraction=0.02" in result.stderr
  assert "step 1" not in result.stdout + result.stderr

  result = trainer_env.run(trainer_env.train_command(
      str(tmp_path / "run2"), "TRAIN_STEPS = 1", "ModelConfig.vocab_size = 100",
      "corpus_task.validation_fraction = 0", "TrainConfig.final_eval = False",
      gin_files=[str(config)]))
  assert result.returncode == 2, result.stderr[-2000:]
  assert result.stderr.strip().splitlines()[-1] == (
      "error: ModelConfig.vocab_size=100 is smaller than the data's vocabulary (259 ids); "
      "set ModelConfig.vocab_size >= 259")
  assert "step 1" not in result.stdout
