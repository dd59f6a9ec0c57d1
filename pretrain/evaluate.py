r"""Scores a checkpoint: next-token loss, or lm-evaluation-harness tasks.

  python -m pretrain.evaluate --workdir=DIR [--step=N] [--text_file=PATH] [--output=JSON]
  python -m pretrain.evaluate --workdir=DIR --tasks=hellaswag,arc_easy \
      [--include_path=DIR] [--num_fewshot=K] [--limit=N] [--batch_size=B] [--output=JSON]

Without --tasks: the mean next-token negative log-likelihood (nats/token). Without
--text_file it reads the run's validation split, as configured by `DIR/config.gin` (the
operative config the trainer wrote). With --text_file the file is one document, scored
exactly as in training through the decoding caches (`pretrain.evaluation.loss.text_loss`).
Prints and writes {"step", "loss", "tokens", "bits_per_byte"}: bits per byte (total
nats / (ln 2 · UTF-8 bytes of the scored text)) compare runs whatever their vocabulary. For a run trained on a synthetic task
(`pretrain.data.synthetic`) the validation loss counts the answer positions only and the
result has their arg-max "accuracy" instead of bits per byte (the ids are no text).

With --tasks: `lm_eval.simple_evaluate` on the tasks with this model as its backend
(`pretrain.evaluation.downstream`, `pretrain.evaluation.lm_eval_backend`; needs the `eval` extra); prints
lm_eval's results table, and --output writes lm_eval's results JSON.
"""
from __future__ import annotations

import contextlib
import json
from typing import Any, Sequence

from absl import flags
from etils import epy

from plumbing import cli
from plumbing import storage
from plumbing.errors import UserError, usage_error
from pretrain.evaluation import downstream
from pretrain.evaluation import loss as evaluation
from pretrain import gin_config
from pretrain.observability import metrics as metrics_lib
from pretrain.data import synthetic
from pretrain.data import hf_vocabulary
from pretrain.data.vocabularies import token_byte_lengths
from pretrain.checkpoints.loading import LoadedModel, load
from pretrain.train_config import TrainConfig
from pretrain.run_directory import RunDirectory

# SeqIO and TensorFlow load on first use (about 6 s): commands that only parse
# configs, print help or plan memory never touch them.
with epy.lazy_imports():
  import seqio

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_string("workdir", None, "Run directory holding checkpoints/.")
  flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).", lower_bound=0)
  flags.DEFINE_string("text_file", None, "Score this text file instead of the validation "
                      "split.")
  flags.DEFINE_string("output", None, "Also write the result as JSON to this path.")
  flags.DEFINE_list("tasks", [], "lm-evaluation-harness tasks or groups to run instead "
                    "of the loss, comma-separated (e.g. hellaswag,arc_easy).")
  flags.DEFINE_string("include_path", None, "With --tasks: a directory of lm_eval YAML "
                      "tasks, as lm_eval's --include_path.")
  flags.DEFINE_integer("num_fewshot", None, "With --tasks: few-shot examples per "
                       "question (default: each task's own).", lower_bound=0)
  flags.DEFINE_integer("limit", None, "With --tasks: score at most this many examples "
                       "of each task.", lower_bound=1)
  flags.DEFINE_integer("batch_size", 16, "With --tasks: sequences per batch.",
                       lower_bound=1)
  flags.mark_flag_as_required("workdir")

_TASK_FLAGS = ("include_path", "num_fewshot", "limit", "batch_size")


def text_file_metrics(model: LoadedModel, path: str) -> dict[str, float]:
  """{"loss", "tokens", "bits_per_byte"} of the file at `path`, scored as one document.

  Bits per byte divide the summed NLL of every scored token (the closing EOS included,
  which stands for no text) by the exact UTF-8 length of the file's text.
  """
  try:
    text = storage.read_text(path)
  except OSError as error:
    raise UserError(f"Cannot read --text_file {path}: {error.strerror or error}") from None
  loss, tokens = evaluation.text_loss(model.config, model.params, model.vocabulary, text,
                                      model.sequence_length)
  return {"loss": loss, "tokens": tokens,
          "bits_per_byte": evaluation.bits_per_byte(loss * tokens, len(text.encode()))}


def validation_metrics(model: LoadedModel, workdir: str) -> dict[str, float]:
  """{"loss", "tokens", "bits_per_byte"} over the whole validation split of the run's
  data config (bytes of the scored targets: `vocabularies.token_byte_lengths`).

  When the run trained on a synthetic task (`pretrain.data.synthetic`), whose ids are
  no text, "accuracy" at the task's answer positions instead of bits per byte: that is
  what those tasks are about.
  """
  config_path = RunDirectory(workdir).config
  if not storage.exists(config_path):
    raise UserError(f"{config_path} does not exist, so the run's validation data is "
                    "unknown (a converted checkpoint has none); pass --text_file=PATH")
  bindings = []
  if isinstance(model.vocabulary, seqio.SentencePieceVocabulary):
    # The run's config names the model file it trained with, which may be gone or on
    # another machine; the checkpoint's own copy has the same content.
    bindings.append(f"get_vocabulary.spm_path = '{model.vocabulary.sentencepiece_model_file}'")
  if isinstance(model.vocabulary, hf_vocabulary.HfTokenizerVocabulary):
    bindings.append(f"get_vocabulary.tokenizer_json = '{model.vocabulary.source}'")
  gin_config.parse([storage.local_copy(config_path)], bindings)
  pipeline = gin_config.build_pipeline(gin_config.build(TrainConfig), model.runtime)
  batches = metrics_lib.with_progress(pipeline.validation_batches(None),
                                     pipeline.validation_batch_count(None),
                                     "evaluating validation batches")
  if pipeline.task_name in synthetic.SPECS:
    return evaluation.answer_metrics(model.runtime, model.params, batches)
  byte_lengths = token_byte_lengths(model.vocabulary, model.config.vocab_size)
  return evaluation.evaluate_batches(model.runtime, model.params, batches,
                                     evaluation.jit_eval_step(model.runtime, byte_lengths))


def task_results(model: LoadedModel, tasks: Sequence[Any], manager: Any
                 ) -> dict[str, Any]:
  """lm_eval's results of the model on `tasks` (names, or tasks and groups already
  loaded: `downstream.top_level`; flags --num_fewshot, --limit, --batch_size)."""
  lm = downstream.backend(model.runtime, model.params, model.vocabulary,
                          max_length=model.sequence_length, batch_size=FLAGS.batch_size,
                          progress=True)
  with contextlib.nullcontext() if FLAGS.verbose else downstream.quiet():
    return downstream.simple_evaluate(lm, tasks, manager, num_fewshot=FLAGS.num_fewshot,
                                      limit=FLAGS.limit)


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  if FLAGS.tasks:
    if FLAGS.text_file:
      raise usage_error("--tasks and --text_file are two kinds of evaluation: give one")
    manager = downstream.task_manager(FLAGS.tasks, FLAGS.include_path)
    # The tasks' data first: a Hub that does not answer or refuses, or a dataset that
    # cannot be read, is one line before the checkpoint loads.
    loaded = downstream.top_level(downstream.load_tasks(manager, FLAGS.tasks,
                                                          verbose=FLAGS.verbose))
    results = task_results(load(FLAGS.workdir, FLAGS.step), loaded, manager)
    print(downstream.results_table(results))
    if FLAGS.output:
      storage.write_text(FLAGS.output, downstream.results_json(results))
    return
  given = [f"--{name}" for name in _TASK_FLAGS if FLAGS[name].present]
  if given:
    raise usage_error(f"{', '.join(given)} only apply with --tasks")
  model = load(FLAGS.workdir, FLAGS.step)
  if FLAGS.text_file:
    metrics = text_file_metrics(model, FLAGS.text_file)
  else:
    metrics = validation_metrics(model, FLAGS.workdir)
  result = {"step": model.step, **metrics}
  print(json.dumps(result))
  if FLAGS.output:
    storage.write_text(FLAGS.output, json.dumps(result) + "\n")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
