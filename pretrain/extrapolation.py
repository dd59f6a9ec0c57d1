r"""Length extrapolation: a trained model on a synthetic task at multiples of its length.

  python -m pretrain.extrapolation --workdir=DIR --task=NAME --multiples=1,2,4,8,32 \
      [--examples=64] [--tokens_per_batch=16384] [--step=N] [--output=JSON]

Griffin §6.2 trains copy and retrieval models at one length and evaluates them on longer
sequences: recurrent models (Hawk, Griffin) keep solving induction heads far beyond the
training length, global MQA does not (RoPE positions it never saw). This command
measures that: for each multiple m it generates held-out examples of the task m times as
long (`SyntheticSpec.examples(length_multiple=m)`: longer sequences for copying and
induction heads, more entries for the phonebook, more inputs and resets for memory
horizon) and reports the mean loss and accuracy over the answer positions only, and the
fraction of examples answered entirely right.

The task defaults to the one the model was trained on, read from DIR/config.gin (so a
model trained on a shortened variant is evaluated on that variant); --task may name it
(or its family, e.g. induction_heads) or any other registered synthetic task.
"""
from __future__ import annotations

import json
from typing import Optional, Sequence

from absl import flags
import gin

from plumbing import cli
from plumbing import storage
from plumbing.errors import usage_error
from pretrain import gin_config
from pretrain.checkpoints.loading import load
from pretrain.data import synthetic
from pretrain.evaluation.extrapolation import evaluate_multiples, format_table
from pretrain.run_directory import RunDirectory

FLAGS = flags.FLAGS


def training_task(workdir: str) -> Optional[str]:
  """Registers and names the synthetic task DIR/config.gin trained on (None if none)."""
  path = RunDirectory(workdir).config
  if not storage.exists(path):
    return None
  gin_config.parse([storage.local_copy(path)], [], skip_unknown=True)
  try:
    try:
      reference = gin.query_parameter("DataPipeline.task")
    except ValueError:
      return None
    if isinstance(reference, str):
      return reference if reference in synthetic.SPECS else None
    if getattr(reference, "configurable", None) is None:
      return None
    name = reference.scoped_configurable_fn()
    return name if name in synthetic.SPECS else None
  finally:
    gin.clear_config()


def resolve_task(workdir: str, task: Optional[str]) -> str:
  """The task to evaluate: the training task unless --task names another one."""
  trained = training_task(workdir)
  if task is None:
    if trained is None:
      raise usage_error(f"{workdir}/config.gin names no synthetic training task; "
                            "pass --task (one of " + ", ".join(sorted(synthetic.SPECS)) + ")")
    return trained
  if trained is not None and task in (trained, synthetic.SPECS[trained].family):
    return trained
  if task not in synthetic.SPECS:
    raise usage_error(f"--task={task} is not a synthetic task; known: "
                          + ", ".join(sorted(synthetic.SPECS)))
  return task


def define_flags() -> None:
  """Command-line flags, defined only when run as a program so that importing this
  module next to other entry points (tests, notebooks) cannot clash."""
  flags.DEFINE_string("workdir", None, "Run directory of the trained model.")
  flags.DEFINE_string("task", None, "Synthetic task (default: the training task).")
  flags.DEFINE_list("multiples", ["1", "2", "4", "8", "32"], "Length multiples.")
  flags.DEFINE_integer("examples", 64, "Held-out examples per multiple.", lower_bound=1)
  flags.DEFINE_integer("tokens_per_batch", 16384, "Tokens per forward pass.", lower_bound=1)
  flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).", lower_bound=0)
  flags.DEFINE_string("output", None, "Also write the results as JSON here.")
  flags.mark_flag_as_required("workdir")


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  try:
    multiples = [int(m) for m in FLAGS.multiples]
  except ValueError:
    raise usage_error(f"--multiples must be integers, got {FLAGS.multiples}") from None
  if any(m < 1 for m in multiples):
    raise usage_error(f"--multiples must be >= 1, got {multiples}")
  workdir = storage.resolve(FLAGS.workdir)
  if not storage.isdir(workdir):
    raise usage_error(f"--workdir {workdir} does not exist; point it at a trained run")
  task = resolve_task(workdir, FLAGS.task)
  spec = synthetic.spec_of(task)
  model = load(workdir, FLAGS.step)
  if model.config.vocab_size < spec.vocab_size:
    raise usage_error(f"task {task} has {spec.vocab_size} token ids but the model's "
                          f"vocabulary is {model.config.vocab_size}")
  results = evaluate_multiples(model.logits, spec, multiples, FLAGS.examples,
                               FLAGS.tokens_per_batch)
  print(format_table(results, f"{task} (trained at length {spec.document_length}), "
                              f"{workdir} step {model.step}"))
  if FLAGS.output:
    storage.write_text(FLAGS.output, json.dumps(
        {"task": task, "workdir": workdir, "step": model.step, "results": results},
        indent=2))


if __name__ == "__main__":
  define_flags()
  cli.run(main)
