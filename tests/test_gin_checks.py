"""Config mistakes are one-line usage errors: a macro or binding nothing reads (with the
nearest known name), a macro read but never set, and a missing model, trainer or data
config (naming the Gin file to add)."""
import glob
import os

import gin
import pytest

from plumbing.errors import EXIT_USAGE, UserError
from pretrain import gin_config
from pretrain.checkpoints.checkpointer import CheckpointConfig
from pretrain.train_config import TrainConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER = ["configs/base/trainer.gin", "configs/base/optimizer.gin"]
MODEL = ["configs/models/tiny_griffin.gin"]
TEXT = ["configs/data/text_files.gin"]
FILES = ["TRAIN_FILES='corpus/*.txt'"]


@pytest.fixture(autouse=True)
def _clear_gin():
  yield
  gin.clear_config()


def _training_error(files, bindings):
  with pytest.raises(UserError) as raised:
    gin_config.parse(files, bindings)
    gin_config.check_training_config()
  assert raised.value.exit_code == EXIT_USAGE
  message = str(raised.value)
  assert "\n" not in message
  return message


@pytest.mark.parametrize("bindings,expected", [
    (["TRAIN_STEP=20"], "Gin macro TRAIN_STEP is set but nothing reads it; did you mean "
     "TRAIN_STEPS?"),
    (["BATCHSIZE=4"], "did you mean BATCH_SIZE?"),
    (["ModelConfig.widht=64"], "did you mean width?"),
    (["ModelConfg.width=64"], "did you mean ModelConfig?"),
    (["c4_task.tfds_data_dir='/data'"], "Gin bindings of c4_task are set but this "
     "command never reads them"),
])
def test_typos_and_leftovers_name_the_nearest_known_name(bindings, expected):
  message = _training_error(["configs/quickstart.gin"], bindings)
  assert expected in message, message


def test_macro_read_but_never_set():
  message = _training_error(TRAINER + MODEL + TEXT, [])
  assert message.startswith("Gin macro TRAIN_FILES is read but never set"), message


@pytest.mark.parametrize("files,expected", [
    (MODEL + ["configs/mesh/fsdp_tensor4.gin"], "No trainer configuration: add "
     "--gin_file=configs/base/trainer.gin"),
    (TRAINER + MODEL + ["configs/mesh/fsdp.gin"], "No data configuration: add one of "
     "configs/data/*.gin, e.g. --gin_file=configs/data/text_files.gin"),
    (TRAINER + TEXT, "No model configuration: add a preset"),
])
def test_missing_part_names_the_gin_file_to_add(files, expected):
  message = _training_error(files, FILES)
  assert message.startswith(expected), message


def test_binding_the_caller_overrides_is_unused_once_built():
  gin_config.parse([], ["import pretrain.trainer", "import pretrain.checkpoints.checkpointer",
                        "TrainConfig.train_steps = 3", "CheckpointConfig.keep_last = 2"])
  gin_config.build(TrainConfig)
  with pytest.raises(UserError, match="Gin binding CheckpointConfig.keep_last is set but "
                     "this run never reads it"):
    gin_config.check_bindings_used()
  gin_config.build(CheckpointConfig)
  gin_config.check_bindings_used()


@pytest.mark.parametrize("data", sorted(
    os.path.relpath(path, REPO) for path in glob.glob(os.path.join(REPO, "configs/data/*.gin"))))
def test_every_data_config_completes_a_training_config(data):
  # The file-based data configs leave their files to the run (a macro it must set).
  sources = {"text_files.gin": FILES, "corpus.gin": ["CORPUS='corpus/*.parquet'"]}
  gin_config.parse(TRAINER + MODEL + [data], sources.get(os.path.basename(data), []))
  gin_config.check_training_config()


@pytest.mark.parametrize("config", ["configs/quickstart.gin",
                                    "configs/demos/memory_horizon.gin"])
def test_shipped_training_configs_pass(config):
  gin_config.parse([config], [])
  gin_config.check_training_config()
