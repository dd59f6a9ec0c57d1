"""lm-evaluation-harness with our model as its backend: the three request kinds against
direct computations on a tiny model (batch sharded over the 8 simulated devices), the
task plumbing, `pretrain.evaluate --tasks` on a trained workdir, and agreement with
lm_eval's own `hf` backend on that workdir's Hugging Face export."""
import json

import jax
import numpy as np
import pytest

from lm_eval import evaluator
from lm_eval.api.instance import Instance

from model.config import ModelConfig
from model.lm import LanguageModel
from plumbing.errors import EXIT_USAGE, UserError
from pretrain.evaluation import downstream
from pretrain.evaluation import loss as evaluation
from pretrain.interchange import hf_export as export
from pretrain import extras
from pretrain.evaluation import generation
import pretrain
from pretrain.evaluation.lm_eval_backend import JaxLM, bucket_lengths
from pretrain.runtime import Runtime
from trainer_helpers import (LM_EVAL_TASKS as TASKS,  # pylint: disable=unused-import
                             assert_ok, trained_workdir, trainer_env)

MAX_LENGTH = 32
CONFIG = ModelConfig(vocab_size=259, width=32, rnn_width=32, num_heads=2, depth=3,
                     attention_window=8, scan_impl="lax")
CONFIG_MODEL = LanguageModel(CONFIG)


class Bytes:
  """SeqIO's byte vocabulary (ids = bytes + 3, EOS 1) without importing SeqIO."""
  eos_id = 1

  def encode(self, text):
    return [b + 3 for b in text.encode()]

  def decode(self, ids):
    return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", "replace")


@pytest.fixture(scope="module")
def tiny():
  runtime = Runtime.create(CONFIG)
  params = runtime.init_params(0)
  return params, JaxLM(runtime, params, Bytes(), max_length=MAX_LENGTH, batch_size=3)


def _requests(kind, arguments):
  return [Instance(request_type=kind, doc={}, arguments=args, idx=0) for args in arguments]


@jax.jit
def _forward_log_softmax(params, tokens, positions):
  logits, _ = CONFIG_MODEL.apply({"params": params}, tokens, positions)
  return jax.nn.log_softmax(logits, axis=-1)


def _log_softmax(params, rows, length=MAX_LENGTH + 1):
  """log-softmax [len(rows), length, V] of token rows, directly from the model (causal:
  padding after a row's end leaves its logits alone, so one shape serves every row)."""
  tokens = np.zeros((len(rows), length), np.int32)
  for i, row in enumerate(rows):
    tokens[i, :len(row)] = row
  positions = np.tile(np.arange(length, dtype=np.int32), (len(rows), 1))
  return np.asarray(_forward_log_softmax(params, tokens, positions))


def test_buckets_and_batch_rounding(tiny):
  assert bucket_lengths(32) == (16, 24, 32)
  assert bucket_lengths(100) == (16, 24, 32, 48, 64, 96, 100)
  assert tiny[1].batch_size == 8      # 3 rounded up to the 8 data shards


def test_loglikelihood_is_the_summed_log_softmax_of_the_continuation(tiny):
  params, lm = tiny
  vocabulary = Bytes()
  pairs = [("def items(self):", " return"), ("", "hello"), ("a", "b"),
           ("x" * 40, " tail"),              # longer than the model: left-truncated
           ("for value in items", ":\n    print(value)"), ("import ", "os"),
           ("return", " self"), ("print(", "value)"), ("class", " Value:"),
           ("if", " value"), ("else", ":")]  # 11 requests: two batches of 8 rows
  got = lm.loglikelihood(_requests("loglikelihood", pairs))
  rows, scored = [], []
  for context, continuation in pairs:
    # As lm_eval splits a pair: a context's trailing spaces go to the continuation.
    stripped = context.rstrip()
    context_ids = vocabulary.encode(stripped)
    continuation_ids = vocabulary.encode(context[len(stripped):] + continuation)
    rows.append([0] + (context_ids + continuation_ids)[-MAX_LENGTH:])
    scored.append(len(continuation_ids))
  log_probs = _log_softmax(params, rows)
  for (logprob, greedy), row, n, log_p in zip(got, rows, scored, log_probs):
    targets = np.asarray(row[1:])
    steps = np.arange(len(targets))[-n:]
    np.testing.assert_allclose(logprob, log_p[steps, targets[-n:]].sum(), rtol=1e-5)
    assert greedy == bool(np.all(log_p[steps].argmax(-1) == targets[-n:]))
  # A context's arg-max next byte is a greedy continuation (where it is printable text).
  contexts = ["def ", "for ", "x", "import", "class", "self", "a", "("]
  rows = [[0] + vocabulary.encode(context) for context in contexts]
  log_probs = _log_softmax(params, rows)
  best = [int(log_p[len(row) - 1].argmax()) - 3 for row, log_p in zip(rows, log_probs)]
  greedy_pairs = [(context, chr(byte)) for context, byte in zip(contexts, best)
                  if 32 <= byte < 127]
  assert greedy_pairs
  assert all(greedy for _, greedy in lm.loglikelihood(_requests("loglikelihood",
                                                                  greedy_pairs)))


def test_loglikelihood_rolling_equals_the_text_loss_without_eos(tiny):
  params, lm = tiny
  vocabulary = Bytes()
  long = "for value in items:\n    print(value)\n" * 3   # 111 tokens: 4 chunks of 32
  short = "def items(self):\n    return value\n"         # one chunk
  got = lm.loglikelihood_rolling(_requests("loglikelihood_rolling",
                                           [(long,), (short,), ("",)]))
  mean, count = evaluation.text_loss(CONFIG, params, vocabulary, long, chunk_length=16)
  rows = [[0] + vocabulary.encode(text) for text in (long, short)]
  log_probs = _log_softmax(params, rows, length=len(rows[0]))
  # text_loss also scores the EOS after the text, given the whole text.
  eos = log_probs[0, len(rows[0]) - 1, vocabulary.eos_id]
  np.testing.assert_allclose(got[0], -mean * count - eos, rtol=1e-5)
  targets = np.asarray(rows[1][1:])
  np.testing.assert_allclose(got[1], log_probs[1, np.arange(len(targets)), targets].sum(),
                             rtol=1e-5)
  assert got[2] == 0.0


def test_generate_until_is_greedy_decoding_cut_at_the_stop_sequence(tiny):
  params, lm = tiny
  vocabulary = Bytes()
  prompts = ["def items(self):", "for value in ite", "class Value(obj)"]  # 16 bytes each
  references = []
  for prompt in prompts:
    ids = generation.generate(CONFIG, params, [0] + vocabulary.encode(prompt),
                              max_new_tokens=20, temperature=0.0,
                              stop_id=vocabulary.eos_id)
    references.append(vocabulary.decode([i for i in ids if i != vocabulary.eos_id]))
  # Stop at a character from the middle of each reference (cut at its first occurrence),
  # and generate the last prompt without a stop sequence.
  stops = [[reference[10]] for reference in references[:-1]] + [[]]
  got = lm.generate_until(_requests("generate_until", [
      (prompt, {"until": stop, "max_gen_toks": 20}) for prompt, stop in zip(prompts, stops)]))
  expected = [reference.split(stop[0])[0] if stop else reference
              for reference, stop in zip(references, stops)]
  assert got == expected
  assert any(0 < len(text) < len(reference) for text, reference in zip(got, references))


def test_metric_values_name_task_metric_and_filter():
  results = {"results": {"tiny_mc": {"alias": "tiny_mc", "acc,none": 0.5,
                                     "acc_stderr,none": 0.1, "acc_norm,none": 0.25},
                         "gsm8k": {"exact_match,strict-match": 0.125,
                                   "exact_match_stderr,strict-match": "N/A"}}}
  assert downstream.metric_values(results) == {
      "downstream/tiny_mc/acc": 0.5, "downstream/tiny_mc/acc_norm": 0.25,
      "downstream/gsm8k/exact_match/strict-match": 0.125}


def test_unknown_task_is_a_usage_error_naming_the_nearest():
  with pytest.raises(UserError, match="Unknown lm_eval task 'tiny_mcq'.*tiny_mc") as error:
    downstream.task_manager(["tiny_mcq"], TASKS)
  assert error.value.exit_code == EXIT_USAGE
  # A task of the include path loads without indexing lm_eval's built-in tasks.
  assert downstream.task_manager(["tiny_mc"], TASKS).all_tasks == ["tiny_mc"]


def test_missing_lm_eval_is_one_line_naming_the_extra(monkeypatch):
  find_spec = extras.importlib.util.find_spec
  monkeypatch.setattr(extras.importlib.util, "find_spec",
                      lambda name: None if name == "lm_eval" else find_spec(name))
  with pytest.raises(UserError, match=r'pip install -e "\.\[eval\]"') as error:
    downstream.task_manager(["tiny_mc"], TASKS)
  assert error.value.exit_code == EXIT_USAGE


@pytest.mark.slow
def test_tasks_loaded_before_the_checkpoint_score_as_their_names_do(tiny):
  """`pretrain.evaluate` loads the tasks' data before the checkpoint (a Hub that does not
  answer is one line before any load: tests/test_hub_outage.py) and hands lm_eval the
  loaded tasks: the same results as lm_eval loading them by name."""
  _, lm = tiny
  manager = downstream.task_manager(["tiny_mc"], TASKS)
  loaded = downstream.top_level(downstream.load_tasks(manager, ["tiny_mc"]))
  assert [task.task_name for task in loaded] == ["tiny_mc"]
  by_name = downstream.simple_evaluate(lm, ["tiny_mc"], manager, limit=6)
  preloaded = downstream.simple_evaluate(lm, loaded, manager, limit=6)
  assert downstream.metric_values(preloaded) == downstream.metric_values(by_name)
  assert "downstream/tiny_mc/acc" in downstream.metric_values(preloaded)


@pytest.mark.slow   # fast tier under 5 min: trains a run first (100 s); the backend's own tests stay fast
def test_evaluate_command_runs_a_local_task_and_prints_lm_evals_table(
    trainer_env, trained_workdir, tmp_path):
  workdir, _ = trained_workdir
  output = tmp_path / "results.json"
  result = trainer_env.run(trainer_env.command(
      "pretrain.evaluate", f"--workdir={workdir}", "--tasks=tiny_mc",
      f"--include_path={TASKS}", "--batch_size=8", f"--output={output}"))
  assert_ok(result)
  lines = result.stdout.splitlines()
  assert "| Tasks |Version|Filter|n-shot| Metric |   |Value|   |Stderr|" in lines
  assert any(line.startswith("|tiny_mc|") and "|acc " in line for line in lines)
  results = json.loads(output.read_text())
  assert 0 <= results["results"]["tiny_mc"]["acc,none"] <= 1


def _per_choice_loglikelihoods(lm, manager):
  """{doc_id: [log-likelihood of each choice]} and the accuracy of `lm` on tiny_mc, from
  lm_eval's own evaluator."""
  results = evaluator.simple_evaluate(model=lm, tasks=["tiny_mc"], task_manager=manager,
                                      log_samples=True, bootstrap_iters=0)
  samples = {sample["doc_id"]: [resp[0][0] for resp in sample["resps"]]
             for sample in results["samples"]["tiny_mc"]}
  return samples, results["results"]["tiny_mc"]["acc,none"]


@pytest.mark.slow
def test_our_backend_agrees_with_lm_evals_hf_backend_on_the_export(trained_workdir,
                                                                     tmp_path):
  # (torch and transformers load only for this test)
  from lm_eval.models.huggingface import HFLM  # pylint: disable=g-import-not-at-top
  workdir, _ = trained_workdir
  exported = str(tmp_path / "hf")
  export.export(workdir, exported)
  manager = downstream.task_manager(["tiny_mc"], TASKS)
  model = pretrain.load(workdir)
  ours, our_accuracy = _per_choice_loglikelihoods(
      downstream.backend(model.runtime, model.params, model.vocabulary,
                         max_length=model.sequence_length, batch_size=8), manager)
  # logits_cache=False: HFLM's cache shares one forward pass between requests whose
  # context + continuation[:-1] agree, and returns a wrong score for one of them here
  # ("return se" + "lf" shares with "return" + " self": -8.85 instead of the -4.14 that
  # transformers' own forward pass gives for the export, as our backend does).
  theirs, their_accuracy = _per_choice_loglikelihoods(
      HFLM(pretrained=exported, dtype="float32", device="cpu", batch_size=8,
           logits_cache=False), manager)
  assert sorted(ours) == sorted(theirs) == list(range(20))
  for doc_id, choices in ours.items():
    np.testing.assert_allclose(choices, theirs[doc_id], atol=1e-4, rtol=0,
                               err_msg=f"doc {doc_id}")
  assert our_accuracy == their_accuracy
