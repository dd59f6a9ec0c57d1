"""`pretrain.evaluate` and `pretrain.sample` on a trained workdir: the commands, exact
chunked text-file scoring, and cached decoding that never re-runs the prefix."""
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pretrain
from model import decoding
import seqio

from model.config import ModelConfig
from plumbing.errors import UserError
from pretrain import evaluate as evaluate_lib
from pretrain.evaluation import loss as evaluation
from pretrain.evaluation import generation
from pretrain.checkpoints import metadata
from pretrain.data.vocabularies import token_byte_lengths
from pretrain.losses import token_losses
from pretrain.runtime import Runtime
from sharding.mesh import MeshConfig
from trainer_helpers import (assert_ok, read_metrics,  # pylint: disable=unused-import
                             trained_workdir, trainer_env)

TEXT = "def items(self):\n    return [value for value in self]\n" * 3


@pytest.fixture(scope="module")
def loaded(trained_workdir):
  return pretrain.load(trained_workdir[0])


@pytest.mark.slow
def test_evaluate_command_on_validation_split(trainer_env, trained_workdir, tmp_path):
  workdir, _ = trained_workdir
  printed = trainer_env.evaluate(workdir, tmp_path / "eval.json")
  assert printed["step"] == 24 and printed["tokens"] > 0
  # The training run's own evaluations covered part of the same split: same ballpark.
  final_eval = [r for r in read_metrics(workdir) if "eval_loss" in r][-1]
  assert abs(printed["loss"] - final_eval["eval_loss"]) < 0.5
  assert abs(printed["bits_per_byte"] - final_eval["eval_bits_per_byte"]) < 0.8



@pytest.mark.slow
def test_text_file_loss_equals_one_pass_over_the_document(loaded):
  # Chunks of 16 tokens carrying the caches must score exactly like one long row.
  loss, tokens = evaluation.text_loss(loaded.config, loaded.params, loaded.vocabulary,
                                      TEXT, chunk_length=16)
  vocabulary = loaded.vocabulary
  targets = np.asarray(list(vocabulary.encode(TEXT)) + [vocabulary.eos_id], np.int32)
  inputs = np.concatenate([[0], targets[:-1]]).astype(np.int32)
  positions = np.arange(len(targets), dtype=np.int32)
  logits = loaded.logits(inputs[None], positions[None])
  nll, _ = token_losses(logits, jnp.asarray(targets[None]))
  assert tokens == len(targets)
  np.testing.assert_allclose(loss, float(jnp.mean(nll)), rtol=1e-5)


@pytest.mark.slow
def test_evaluate_main_on_a_text_file_and_an_older_step(trained_workdir, tmp_path, capsys):
  from absl import flags  # pylint: disable=g-import-not-at-top
  text_file = tmp_path / "doc.txt"
  text_file.write_text(TEXT)
  output = tmp_path / "out.json"
  if "text_file" not in flags.FLAGS:
    evaluate_lib.define_flags()
  flags.FLAGS(["evaluate", f"--workdir={trained_workdir[0]}", "--step=22",
               f"--text_file={text_file}", f"--output={output}"])
  try:
    evaluate_lib.main(["evaluate"])
  finally:
    flags.FLAGS.unparse_flags()
  scored = json.loads(output.read_text())
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == scored
  assert scored["step"] == 22 and scored["tokens"] == len(TEXT.encode()) + 1
  # Every scored token's nats (the closing EOS, no byte, included) over the text's bytes.
  assert scored["bits_per_byte"] == pytest.approx(
      scored["loss"] * scored["tokens"] / (math.log(2) * len(TEXT.encode())), rel=1e-12)
  assert 0 < scored["loss"] < 10


@pytest.mark.slow
def test_cached_greedy_decoding_matches_rerunning_the_prefix(loaded, monkeypatch):
  prompt = np.asarray(loaded.vocabulary.encode("def "), np.int32)
  shapes = []
  for name in ("prefill", "decode_step"):
    original = getattr(decoding, name)
    def recording(config, params, tokens, positions, cache, _original=original,
                  _name=name):
      shapes.append((_name, tokens.shape))
      return _original(config, params, tokens, positions, cache)
    monkeypatch.setattr(decoding, name, recording)
  new = generation.generate(loaded.config, loaded.params, prompt, max_new_tokens=10,
                            temperature=0.0)
  # One prefill of the prompt, then single-token steps only (traced once in the scan).
  assert shapes == [("prefill", (1, len(prompt))), ("decode_step", (1, 1))]

  # Reference: re-run the whole prefix for every token. The row is padded to its final
  # length (the model is causal, so padding after position i cannot change logit i) to
  # compile one shape.
  total = len(prompt) + 10
  sequence = np.zeros(total, np.int32)
  sequence[:len(prompt)] = prompt
  positions = np.arange(total, dtype=np.int32)[None]
  for i in range(len(prompt), total):
    logits = loaded.logits(sequence[None], positions)
    sequence[i] = int(jnp.argmax(logits[0, i - 1]))
  assert new == list(sequence[len(prompt):])


@pytest.mark.slow
def test_sample_command(trainer_env, trained_workdir):
  workdir, _ = trained_workdir
  result = trainer_env.run(trainer_env.command(
      "pretrain.sample", f"--workdir={workdir}", "--prompt=def ", "--max_new_tokens=12",
      "--temperature=0.7", "--seed=1"))
  assert_ok(result)
  assert result.stdout.startswith("def ")
  assert len(result.stdout.rstrip("\n")) > len("def ")


@pytest.mark.slow
def test_load_takes_a_workdir_relative_to_the_current_directory(trained_workdir, loaded,
                                                               monkeypatch):
  workdir = trained_workdir[0]
  monkeypatch.chdir(os.path.dirname(workdir))
  relative = pretrain.load(os.path.basename(workdir))
  assert relative.step == loaded.step
  for a, b in zip(jax.tree.leaves(relative.params), jax.tree.leaves(loaded.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_load_of_missing_step_is_a_clear_error(trained_workdir):
  with pytest.raises(UserError, match="No complete checkpoint of step 7"):
    pretrain.load(trained_workdir[0], step=7)


def test_vocabulary_specs_round_trip_including_pass_through():
  for vocabulary, spec in ((seqio.PassThroughVocabulary(52), "passthrough:52"),
                           (seqio.ByteVocabulary(), "byte")):
    assert metadata.vocabulary_spec(vocabulary) == spec
    rebuilt = metadata.make_vocabulary(spec)
    assert type(rebuilt) is type(vocabulary)
    assert rebuilt.vocab_size == vocabulary.vocab_size
  with pytest.raises(UserError, match="passthrough:<positive size>"):
    metadata.make_vocabulary("passthrough:many")


def _random_batches(vocab_size, low=0, count=2, rows=8, length=12, seed=0):
  """Packed-batch dicts of random targets in [low, vocab_size), about 30% weighted, the
  last two rows padding."""
  rng = np.random.default_rng(seed)
  batches = []
  for _ in range(count):
    targets = rng.integers(low, vocab_size, size=(rows, length)).astype(np.int32)
    inputs = np.concatenate([np.zeros((rows, 1), np.int32), targets[:, :-1]], 1)
    weights = (rng.random((rows, length)) < 0.3).astype(np.float32)
    weights[-2:] = 0.0                                  # padding rows
    batches.append({"inputs": inputs, "targets": targets, "weights": weights,
                    "positions": np.tile(np.arange(length, dtype=np.int32), (rows, 1)),
                    "segment_ids": np.ones((rows, length), np.int32)})
  return batches


def _tiny_runtime(vocab_size):
  config = ModelConfig(vocab_size=vocab_size, width=16, rnn_width=16, num_heads=2, depth=2,
                       block_pattern=("recurrent", "attention"), attention_window=8,
                       scan_impl="lax")
  runtime = Runtime.create(config, MeshConfig())
  return runtime, runtime.init_params(seed=1)


def _float64_logits(runtime, params, batch):
  return np.asarray(runtime.model.apply({"params": params}, batch["inputs"],
                                        batch["positions"])[0], np.float64)


def _target_nll(logits, targets):
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  return -np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]


@pytest.mark.slow
def test_answer_metrics_count_only_weighted_positions_across_batches():
  runtime, params = _tiny_runtime(18)
  batches = _random_batches(18, low=2)
  result = evaluation.answer_metrics(runtime, params, iter(batches))

  nll, correct, count = 0.0, 0.0, 0.0
  for batch in batches:
    logits = _float64_logits(runtime, params, batch)
    nll += np.sum(_target_nll(logits, batch["targets"]) * batch["weights"])
    correct += np.sum((logits.argmax(-1) == batch["targets"]) * batch["weights"])
    count += batch["weights"].sum()
  assert result["tokens"] == count
  np.testing.assert_allclose(result["loss"], nll / count, rtol=1e-5)
  assert result["accuracy"] == pytest.approx(correct / count)
  with pytest.raises(UserError, match="no batch"):
    evaluation.answer_metrics(runtime, params, iter([]))


@pytest.mark.slow   # fast tier under 5 min: 17 s on a loaded machine
def test_eval_step_bits_per_byte_are_nats_over_ln2_bytes():
  """Over batches of byte-vocabulary targets, special ids (0 bytes) and ids past the
  vocabulary (0 bytes) included: bits per byte = weighted nats / (ln 2 · weighted bytes),
  by hand in numpy; without a byte table (pass-through ids) the field is left out."""
  runtime, params = _tiny_runtime(264)
  byte_lengths = token_byte_lengths(seqio.ByteVocabulary(), 264)
  batches = _random_batches(264)
  result = evaluation.evaluate_batches(runtime, params, iter(batches),
                                       evaluation.jit_eval_step(runtime, byte_lengths))

  nll, num_bytes = 0.0, 0.0
  for batch in batches:
    token_nll = _target_nll(_float64_logits(runtime, params, batch), batch["targets"])
    nll += np.sum(token_nll * batch["weights"])
    num_bytes += np.sum(byte_lengths[batch["targets"]] * batch["weights"])
  assert 0 < num_bytes < sum(batch["weights"].sum() for batch in batches)
  np.testing.assert_allclose(result["bits_per_byte"], nll / (math.log(2) * num_bytes),
                             rtol=1e-5)
  without_bytes = evaluation.evaluate_batches(runtime, params, iter(batches))
  assert set(without_bytes) == {"loss", "tokens"}
  np.testing.assert_allclose(without_bytes["loss"], result["loss"], rtol=1e-6)
