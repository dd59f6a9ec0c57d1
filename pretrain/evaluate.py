r"""Mean next-token negative log-likelihood (nats/token) of a checkpoint.

  python -m pretrain.evaluate --workdir=DIR [--step=N] [--text_file=PATH] [--output=JSON]

Without --text_file it reads the run's validation split, as configured by
`DIR/config.gin` (the operative config the trainer wrote). With --text_file the file is
one document: tokens are scored exactly as in training (the first one predicted from the
document-start input 0, EOS last), in chunks of the training sequence length that carry
the decoding caches from chunk to chunk, so every token sees its whole prefix while memory
stays bounded. Prints and writes {"step", "loss", "tokens"}; for a run trained on a
synthetic task (`pretrain.data.synthetic`) the validation loss counts the answer positions
only and the result adds their arg-max "accuracy".
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional, Sequence

from absl import flags

from pretrain import cli

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_string("workdir", None, "Run directory holding checkpoints/.")
  flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).")
  flags.DEFINE_string("text_file", None, "Score this text file instead of the validation "
                      "split.")
  flags.DEFINE_string("output", None, "Also write the result as JSON to this path.")


def text_file_loss(model: Any, text: str, chunk_length: Optional[int] = None
                   ) -> tuple[float, int]:
  """(mean NLL in nats/token, token count) of `text` as one document."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from model import decoding  # pylint: disable=g-import-not-at-top
  from pretrain.trainer import token_losses  # pylint: disable=g-import-not-at-top

  vocabulary = model.vocabulary
  ids = list(vocabulary.encode(text))
  if not ids:
    raise cli.UserError("The text file is empty: nothing to score")
  targets = np.asarray(ids + [vocabulary.eos_id], np.int32)
  inputs = np.concatenate([[0], targets[:-1]]).astype(np.int32)
  length = chunk_length or model.sequence_length
  padded = -(-len(targets) // length) * length
  pad = padded - len(targets)
  weights = np.concatenate([np.ones(len(targets)), np.zeros(pad)]).astype(np.float32)
  inputs, targets = (np.pad(a, (0, pad)) for a in (inputs, targets))
  positions = np.arange(padded, dtype=np.int32)
  config = model.config
  max_length = padded if config.attention_window is None else None
  cache = decoding.init_cache(config, 1, jnp.dtype(config.dtype), max_length=max_length)

  @jax.jit
  def chunk_sums(params, cache, tokens, positions, targets, weights):
    logits, cache = decoding.prefill(config, params, tokens, positions, cache)
    nll, _ = token_losses(logits, targets)
    return jnp.sum(nll * weights), cache

  total = 0.0
  for start in range(0, padded, length):
    part = slice(start, start + length)
    nll, cache = chunk_sums(model.params, cache, inputs[None, part], positions[None, part],
                            targets[None, part], weights[None, part])
    total += float(nll)
  count = len(ids) + 1
  return total / count, count


def answer_metrics(setup: Any, params: Any, batches: Any) -> dict[str, float]:
  """{"loss", "tokens", "accuracy"} over `batches` of a synthetic task.

  The weights select the task's answer positions, so the loss and the arg-max accuracy
  (`synthetic.accuracy_sums`) both count those only; one forward pass gives both.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from pretrain import trainer  # pylint: disable=g-import-not-at-top
  from pretrain.data import synthetic  # pylint: disable=g-import-not-at-top

  def sums(params, batch):
    logits, _ = setup.model.apply({"params": params}, batch["inputs"], batch["positions"])
    nll, _ = trainer.token_losses(logits, batch["targets"])
    weights = batch["weights"].astype(jnp.float32)
    correct, total = synthetic.accuracy_sums(logits, batch["targets"], weights)
    return {"nll": jnp.sum(nll * weights), "correct": correct, "weight": total}

  features = trainer.BATCH_FEATURES
  sums_fn = jax.jit(sums, in_shardings=(setup.param_shardings,
                                        setup.batch_shardings(features)),
                    out_shardings=setup.replicated)
  totals = None
  with setup.activation_context():
    for local in batches:
      part = sums_fn(params, setup.global_batch({k: local[k] for k in features}))
      totals = part if totals is None else jax.tree.map(jnp.add, totals, part)
  if totals is None:
    raise cli.UserError("The evaluation data produced no batch")
  values = {k: trainer.host_scalar(v) for k, v in totals.items()}
  if values["weight"] == 0:
    raise cli.UserError("The evaluation data holds no answer position")
  return {"loss": values["nll"] / values["weight"], "tokens": int(values["weight"]),
          "accuracy": values["correct"] / values["weight"]}


def validation_metrics(model: Any, workdir: str) -> dict[str, float]:
  """{"loss", "tokens"} over the whole validation split of the run's data config.

  When the run trained on a synthetic task (`pretrain.data.synthetic`), also the
  "accuracy" at the task's answer positions, which is what those tasks are about.
  """
  from pretrain import trainer  # pylint: disable=g-import-not-at-top
  from pretrain.data import synthetic  # pylint: disable=g-import-not-at-top
  config_path = os.path.join(workdir, "config.gin")
  if not os.path.exists(config_path):
    raise cli.UserError(f"{config_path} does not exist, so the run's validation data is "
                        "unknown (a converted checkpoint has none); pass --text_file=PATH")
  cli.import_configurables()
  cli.parse_gin([config_path], [])
  train_config = trainer.TrainConfig()
  pipeline = trainer.build_pipeline(train_config, model.setup)
  batches = pipeline.validation_batches(None)
  if pipeline.task_name in synthetic.SPECS:
    return answer_metrics(model.setup, model.params, batches)
  loss, tokens = trainer.evaluate_batches(model.setup, model.params, batches)
  return {"loss": loss, "tokens": tokens}


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise cli.ConfigError(f"Unexpected arguments {argv[1:]}")
  if not FLAGS.workdir:
    raise cli.ConfigError("--workdir is required")
  from pretrain.load import load  # pylint: disable=g-import-not-at-top
  model = load(FLAGS.workdir, FLAGS.step)
  if FLAGS.text_file:
    try:
      with open(FLAGS.text_file, encoding="utf-8") as f:
        text = f.read()
    except OSError as error:
      raise cli.UserError(f"Cannot read --text_file {FLAGS.text_file}: "
                          f"{error.strerror or error}") from None
    loss, tokens = text_file_loss(model, text)
    metrics = {"loss": loss, "tokens": tokens}
  else:
    metrics = validation_metrics(model, FLAGS.workdir)
  result = {"step": model.step, **metrics}
  print(json.dumps(result))
  if FLAGS.output:
    with open(FLAGS.output, "w", encoding="utf-8") as f:
      json.dump(result, f)
      f.write("\n")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
