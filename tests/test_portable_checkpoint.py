"""A checkpoint carries its SentencePiece model: the workdir moved to another place, or
copied into a bucket, still loads, tokenises, scores and samples after the original
`.model` file is deleted."""
import os
import shutil

import jax
import numpy as np
import pytest

from model.config import ModelConfig
from plumbing import storage
from plumbing.errors import UserError
from pretrain.checkpoints import metadata
import pretrain
from pretrain.checkpoints.persistent import PersistentTier
from pretrain.data.vocabularies import get_vocabulary
from pretrain.evaluate import text_file_metrics
from pretrain.evaluation.generation import sample_text
from pretrain.run_directory import RunDirectory
from pretrain.runtime import Runtime
from pretrain.interchange.tokenizer import train_sentencepiece

TEXT = "def items(self):\n    return [value for value in self.values if value]\n"


def _corpus(directory):
  directory.mkdir()
  for i in range(8):
    lines = [f"    value_{j} = items[{i + j}] + self.count  # {j}" for j in range(40)]
    (directory / f"m{i}.py").write_text("def f(self, items):\n" + "\n".join(lines) + "\n")


@pytest.mark.slow
def test_workdir_moved_or_in_a_bucket_keeps_its_sentencepiece_vocabulary(tmp_path,
                                                                          s3_bucket):
  _corpus(tmp_path / "corpus")
  model_file = train_sentencepiece(f"{tmp_path}/corpus/*.py", 300, str(tmp_path / "spm"))
  vocabulary = get_vocabulary(model_file)
  config = ModelConfig(vocab_size=320, width=16, rnn_width=16, num_heads=2, depth=2,
                       block_pattern=("recurrent", "attention"), attention_window=8,
                       scan_impl="lax")
  runtime = Runtime.create(config)
  params = runtime.init_params(0)
  workdir = str(tmp_path / "run")
  spec = metadata.vocabulary_spec(vocabulary, workdir)  # what the trainer records
  checkpointer = PersistentTier(RunDirectory(workdir))
  checkpointer.save(3, params=params, opt_state=None, rng=jax.random.key(0),
                    metadata=metadata.RunMetadata(config, spec, 64).to_json())
  checkpointer.close()
  with open(model_file, "rb") as f:
    original = f.read()
  original_ids = vocabulary.encode(TEXT)

  moved = str(tmp_path / "elsewhere" / "run")
  shutil.move(workdir, moved)
  os.remove(model_file)
  bucket_workdir = f"{s3_bucket}/portable/run"
  storage.upload_tree(moved, bucket_workdir)
  # Every file arrived whole (CI once read this copy's params as an empty OCDBT
  # database: this tells a missing upload from a failed read).
  assert storage.list_files(bucket_workdir) == storage.list_files(moved)

  expected_scores = None
  for place in (moved, bucket_workdir):
    model = pretrain.load(place)
    assert model.step == 3 and model.vocabulary_spec == spec
    assert spec.startswith("sentencepiece:")
    with open(model.vocabulary.sentencepiece_model_file, "rb") as f:
      assert f.read() == original
    assert model.vocabulary.encode(TEXT) == original_ids
    assert model.vocabulary.decode(original_ids) == TEXT
    for ours, saved in zip(jax.tree.leaves(model.params), jax.tree.leaves(params)):
      np.testing.assert_array_equal(np.asarray(ours), np.asarray(saved))
    text_file = storage.join(place, "text.txt")
    storage.write_text(text_file, TEXT)
    scores = text_file_metrics(model, text_file)
    assert scores["tokens"] >= len(original_ids) - 1 and np.isfinite(scores["loss"])
    expected_scores = expected_scores or scores
    assert scores == expected_scores
    continuation = sample_text(model.config, model.params, model.vocabulary, "def ",
                               max_new_tokens=4, seed=0)
    assert isinstance(continuation, str)

  # Without its vocabulary/ folder the workdir says what is missing, in one line.
  shutil.rmtree(os.path.join(moved, metadata.VOCABULARY_DIR))
  with pytest.raises(UserError, match="SentencePiece model .* is missing: copy the whole "
                     "workdir"):
    _ = pretrain.load(moved).vocabulary
