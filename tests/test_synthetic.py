"""Synthetic memory probes: task definitions, determinism, SeqIO and pipeline wiring."""
import gin
import numpy as np
import pytest

from pretrain.data import materialize, synthetic
from pretrain.data.pipeline import DataPipeline
from trainer_helpers import assert_ok, trainer_env  # pylint: disable=unused-import


def brute_force_memory_targets(tokens, modulus=50):
  """Recomputes every memory-horizon answer from the interleaved document, slowly."""
  reset_id = modulus + 1
  inputs, answers = tokens[0::2], tokens[1::2] - 1
  expected, since_reset = [], []
  for x in inputs:
    if x == reset_id:
      since_reset = []
      expected.append(None)
    else:
      since_reset.append(int(x) - 1)
      expected.append(synthetic.memory_compression(since_reset) % modulus)
  return expected, answers


def test_memory_compression_hand_examples():
  assert synthetic.memory_compression([]) == 0
  assert synthetic.memory_compression([3]) == 3
  assert synthetic.memory_compression([2, 4]) == 8              # 2*4
  assert synthetic.memory_compression([1, 2, 3]) == 1 * 3 - 2   # middle takes the next sign
  assert synthetic.memory_compression([4, 1, 2, 3]) == 4 * 3 - 1 * 2
  assert synthetic.memory_compression([1, 2, 3, 4, 0]) == 1 * 0 - 2 * 4 + 3
  assert synthetic.memory_compression([1, 2, 3, 4, 0]) % 50 == 45


def test_memory_horizon_examples_match_brute_force():
  spec = synthetic.spec_of(synthetic.memory_horizon_task(length=40, resets=3, num_train=4,
                                                         num_validation=2))
  tokens, mask = spec.examples("train")
  assert tokens.shape == (4, 80) and spec.vocab_size == 52
  for row, row_mask in zip(tokens, mask):
    inputs = row[0::2]
    assert np.sum(inputs == 51) == 3 and inputs[0] != 51
    assert set(inputs[inputs != 51] - 1) <= set(range(5))
    expected, answers = brute_force_memory_targets(row)
    for n, value in enumerate(expected):
      assert row_mask[2 * n] == 0
      if value is None:
        assert row_mask[2 * n + 1] == 0
      else:
        assert row_mask[2 * n + 1] == 1 and answers[n] == value
  # Long spans exercise the modulus (products reach far past 50).
  assert tokens[:, 1::2].max() > 20


def test_selective_copying_answer_is_the_data_in_order():
  tokens, mask = synthetic.selective_copying_examples(
      np.random.default_rng(0), count=5, length=64, num_data=6, vocab_size=16)
  for row, row_mask in zip(tokens, mask):
    prompt, separator, answer = row[:57], row[57], row[58:]
    assert separator == 2 and np.all(row_mask[58:] == 1) and row_mask[:58].sum() == 0
    data = prompt[prompt != 1]
    assert len(data) == 6 and np.array_equal(data, answer)
    assert np.all((answer >= 3) & (answer < 19))


def test_induction_heads_answer_follows_the_first_trigger():
  tokens, mask = synthetic.induction_heads_examples(np.random.default_rng(1), count=50,
                                                   length=32, vocab_size=16)
  for row, row_mask in zip(tokens, mask):
    triggers = np.flatnonzero(row == 1)
    assert len(triggers) == 2 and triggers[1] == 30 and triggers[0] < 28
    assert row[31] == row[triggers[0] + 1] and row_mask.sum() == 1 and row_mask[31] == 1


def test_phonebook_answer_is_the_queried_number():
  tokens, mask = synthetic.phonebook_examples(np.random.default_rng(2), count=10,
                                              num_entries=7, name_length=2,
                                              number_length=3, num_letters=5)
  entry = 2 + 1 + 3 + 1
  for row, row_mask in zip(tokens, mask):
    book = row[:7 * entry].reshape(7, entry)
    names = [tuple(e[:2]) for e in book]
    assert len(set(names)) == 7 and np.all(book[:, 2] == 1) and np.all(book[:, -1] == 2)
    query = row[7 * entry:]
    assert query[0] == 3 and query[3] == 1
    asked = names.index(tuple(query[1:3]))
    assert np.array_equal(query[4:], book[asked, 3:6])
    assert np.array_equal(np.flatnonzero(row_mask), np.arange(len(row) - 3, len(row)))


def test_generation_is_deterministic_per_seed_and_split():
  name = synthetic.induction_heads_task(length=16, num_train=8, num_validation=4, seed=3)
  spec = synthetic.spec_of(name)
  again = synthetic.spec_of(synthetic.induction_heads_task(length=16, num_train=8,
                                                           num_validation=4, seed=3))
  np.testing.assert_array_equal(spec.examples("train")[0], again.examples("train")[0])
  assert not np.array_equal(spec.examples("train")[0][:4], spec.examples("validation")[0])
  other = synthetic.spec_of(synthetic.induction_heads_task(length=16, num_train=8,
                                                           num_validation=4, seed=4))
  assert not np.array_equal(spec.examples("train")[0], other.examples("train")[0])


@pytest.mark.parametrize("family, kwargs, multiple, longer", [
    ("induction_heads", dict(length=16), 4, 64),
    ("selective_copying", dict(length=32, num_data=4), 2, 64),
    ("memory_horizon", dict(length=12, resets=2), 2, 48),
    ("phonebook", dict(num_entries=3), 2, 6 * 9 + 9),
])
def test_length_multiples_make_longer_documents(family, kwargs, multiple, longer):
  task_fn = getattr(synthetic, f"{family}_task")
  spec = synthetic.spec_of(task_fn(num_train=2, num_validation=2, **kwargs))
  tokens, mask = spec.examples("validation", length_multiple=multiple)
  assert tokens.shape == (2, longer) and mask.shape == tokens.shape and mask.sum() > 0


def test_bad_sizes_name_the_problem():
  with pytest.raises(ValueError, match="selective_copying"):
    synthetic.selective_copying_task(length=20, num_data=16)
  with pytest.raises(ValueError, match="distinct names"):
    synthetic.phonebook_task(num_entries=30, name_length=1, num_letters=26)
  with pytest.raises(ValueError, match="not a registered synthetic task"):
    synthetic.spec_of("no_such_task")


def test_default_tasks_are_registered_with_paper_sizes():
  for name in ("memory_horizon", "selective_copying", "induction_heads", "phonebook"):
    assert materialize.get_provider(name).name == name
  assert synthetic.spec_of("induction_heads").kwargs == {"length": 256, "vocab_size": 16}
  assert synthetic.spec_of("memory_horizon").kwargs["length"] == 1024


def test_pipeline_batches_weight_only_the_answers(tmp_path):
  name = synthetic.induction_heads_task(length=16, num_train=12, num_validation=4)
  pipeline = DataPipeline(task=name, sequence_length=16, batch_size=4,
                          cache_dir=str(tmp_path))
  assert pipeline.vocab_size == 18
  batch = pipeline.batch(0)
  assert np.array_equal(batch["weights"].sum(1), np.ones(4))
  assert np.all(batch["weights"][:, -1] == 1)
  # The input at the answer is the trigger; the answer follows the first trigger.
  for inputs, targets in zip(batch["inputs"], batch["targets"]):
    assert inputs[-1] == 1
    first = np.flatnonzero(inputs == 1)[0]
    assert targets[-1] == inputs[first + 1]


def test_pipeline_carries_the_memory_horizon_loss_mask(tmp_path):
  name = synthetic.memory_horizon_task(length=8, resets=1, num_train=8, num_validation=2)
  pipeline = DataPipeline(task=name, sequence_length=16, batch_size=4,
                          cache_dir=str(tmp_path))
  batch = pipeline.batch(0)
  for inputs, targets, weights in zip(batch["inputs"], batch["targets"], batch["weights"]):
    assert np.all(weights[0::2] == 0)                      # number/reset inputs: no loss
    answered = np.flatnonzero(weights)
    assert len(answered) == 7                               # 8 inputs, one is the reset
    assert np.all(inputs[answered] != 51) and np.all(inputs[answered] >= 1)
    expected, answers = brute_force_memory_targets(targets)
    assert [a for a, e in zip(answers, expected) if e is not None] == [
        e for e in expected if e is not None]


def test_data_configs_parse_and_register(tmp_path):
  for family in ("memory_horizon", "selective_copying", "induction_heads", "phonebook"):
    gin.clear_config()
    try:
      gin.parse_config([f"include 'configs/data/synthetic_{family}.gin'",
                        "BATCH_SIZE = 2", "SEED = 0",
                        f"{family}_task.num_train = 2", f"{family}_task.num_validation = 2"])
      name = gin.query_parameter("DataPipeline.task").scoped_configurable_fn()
      spec = synthetic.spec_of(name)
      assert spec.vocab_size == gin.query_parameter("%VOCAB_SIZE")
      assert spec.document_length <= gin.query_parameter("%SEQUENCE_LENGTH")
    finally:
      gin.clear_config()


def test_target_accuracy_counts_only_weighted_positions():
  targets = np.array([[1, 2, 3, 0]])
  logits = np.eye(4)[[[1, 0, 3, 0]]] * 5.0       # right at 0 and 2, wrong at 1
  weights = np.array([[1.0, 1.0, 0.0, 0.0]])
  assert synthetic.target_accuracy(logits, targets, weights) == pytest.approx(0.5)
  assert synthetic.target_accuracy(logits, targets, [[0, 0, 1, 0]]) == pytest.approx(1.0)
  with pytest.raises(ValueError, match="no position"):
    synthetic.target_accuracy(logits, targets, np.zeros((1, 4)))


# -- length extrapolation ---------------------------------------------------------------
def induction_oracle(inputs, positions):
  """Solves induction heads from the inputs alone: the value after the first trigger."""
  del positions
  inputs = np.asarray(inputs)
  logits = np.zeros(inputs.shape + (18,), np.float32)
  for row, tokens in enumerate(inputs):
    first = np.flatnonzero(tokens == 1)[0]
    logits[row, :, tokens[first + 1]] = 30.0
  return logits


def test_extrapolation_metrics_of_an_exact_solver_and_a_uniform_guess():
  from pretrain.evaluation import extrapolation
  spec = synthetic.spec_of(synthetic.induction_heads_task(length=16, num_train=2,
                                                          num_validation=2))
  results = extrapolation.evaluate_multiples(induction_oracle, spec, [1, 4],
                                             num_examples=6, tokens_per_batch=40)
  assert [r["length"] for r in results] == [16, 64]
  for r in results:
    assert r["accuracy"] == 1.0 and r["exact_match"] == 1.0 and r["loss"] < 1e-6
  uniform = lambda inputs, positions: np.zeros(np.shape(inputs) + (18,), np.float32)
  (r,) = extrapolation.evaluate_multiples(uniform, spec, [2], num_examples=3)
  assert r["loss"] == pytest.approx(np.log(18), rel=1e-5) and r["accuracy"] == 0.0
  table = extrapolation.format_table(results)
  assert "| 4x | 64 |" in table


@pytest.mark.slow
def test_extrapolation_runs_a_real_model_on_longer_sequences():
  import jax
  from model import lm
  from model.config import ModelConfig
  from pretrain.evaluation import extrapolation
  config = ModelConfig(vocab_size=18, width=16, rnn_width=16, num_heads=2, depth=2,
                       block_pattern=("recurrent", "attention"), attention_window=8)
  params = lm.init_params(config, jax.random.PRNGKey(0))
  model = lm.LanguageModel(config)
  logits_fn = jax.jit(lambda t, p: model.apply({"params": params}, t, p)[0])
  spec = synthetic.spec_of(synthetic.induction_heads_task(length=16, num_train=2,
                                                          num_validation=2))
  results = extrapolation.evaluate_multiples(logits_fn, spec, [1, 2], num_examples=4)
  for r in results:
    assert np.isfinite(r["loss"]) and 0.0 <= r["accuracy"] <= 1.0


def test_extrapolation_finds_the_training_task_in_the_run_config(tmp_path):
  from pretrain import extrapolation
  (tmp_path / "config.gin").write_text(
      "import pretrain.data.pipeline\nimport pretrain.data.synthetic\n"
      "DataPipeline.task = @induction_heads_task()\n"
      "induction_heads_task.length = 24\ninduction_heads_task.num_train = 3\n"
      "SomeTrainerOnlyConfigurable.value = 1\n")
  name = extrapolation.resolve_task(str(tmp_path), None)
  assert synthetic.spec_of(name).kwargs["length"] == 24
  assert extrapolation.resolve_task(str(tmp_path), "induction_heads") == name
  assert extrapolation.resolve_task(str(tmp_path), "phonebook") == "phonebook"
  with pytest.raises(Exception, match="not a synthetic task"):
    extrapolation.resolve_task(str(tmp_path), "c4_en")


# -- training on a synthetic task, end to end --------------------------------------------
SYNTHETIC_RUN_GIN = """
include 'configs/base/trainer.gin'
include 'configs/base/optimizer.gin'
import model.config

TRAIN_STEPS = 8
BATCH_SIZE = 8
SEQUENCE_LENGTH = 256     # one default induction-heads document per row
CHECKPOINT_EVERY = 4
EVAL_EVERY = 0
LOG_EVERY = 4

ModelConfig.vocab_size = 18
ModelConfig.width = 32
ModelConfig.rnn_width = 32
ModelConfig.num_heads = 2
ModelConfig.depth = 2
ModelConfig.block_pattern = ("recurrent", "attention")
ModelConfig.attention_window = 16
ModelConfig.scan_impl = "lax"
OptimizerConfig.warmup_steps = 2
TrainConfig.final_eval = False
DataPipeline.max_train_documents = 64
DataPipeline.max_validation_documents = 16
"""


@pytest.mark.slow
def test_cli_trains_checkpoints_loads_and_evaluates_a_synthetic_task(trainer_env,
                                                                     tmp_path):
  """`DataPipeline.task='induction_heads'` needs no data config; the checkpoint records
  the pass-through vocabulary; `pretrain.evaluate` reports the answers' accuracy."""
  import pretrain
  from pretrain.evaluation import extrapolation
  from pretrain.checkpoints.persistent import complete_steps
  config = tmp_path / "synthetic.gin"
  config.write_text(SYNTHETIC_RUN_GIN)
  workdir = tmp_path / "run"
  assert_ok(trainer_env.run(trainer_env.train_command(
      workdir, "DataPipeline.task='induction_heads'", gin_files=[str(config)])))
  model = pretrain.load(str(workdir))
  assert model.step == 8 and model.vocabulary_spec == "passthrough:18"
  assert model.vocabulary.vocab_size == 18
  assert complete_steps(workdir / "checkpoints") == [4, 8]

  printed = trainer_env.evaluate(workdir, tmp_path / "eval.json")
  assert set(printed) == {"step", "loss", "tokens", "accuracy"}
  assert printed["step"] == 8 and printed["tokens"] == 16   # one answer per document

  # The same numbers from the loaded model on the first 16 validation documents.
  tokens, mask = synthetic.spec_of("induction_heads").examples("validation")
  batch = extrapolation.document_batch(tokens[:16], mask[:16])
  logits = np.asarray(model.logits(batch["inputs"], batch["positions"]))[:, -1]
  answers = batch["targets"][:, -1]
  log_probs = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)),
                                     -1, keepdims=True)) - logits.max(-1, keepdims=True)
  np.testing.assert_allclose(printed["loss"], -np.mean(log_probs[np.arange(16), answers]),
                             rtol=1e-4)
  assert printed["accuracy"] == pytest.approx(np.mean(logits.argmax(-1) == answers))
