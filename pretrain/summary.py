r"""`python -m pretrain.summary`: the size and cost of a model preset, without building it.

    python -m pretrain.summary --gin_file=F [--gin_file=G ...] [--gin_param='a.b=1' ...]
        [--seq=T] [--json] [--platform=tpu|gpu|cpu]
        [--mesh=data:2,fsdp:4,tensor:1 --batch=B [--device_memory_gb=G]]

Prints the total and non-embedding parameter counts, the training FLOPs per token at
sequence length T (`model.counting`, docs/model.md) and the decoding state per sequence.
With `--mesh`, also the per-device memory of training with a global batch of B rows of T
tokens (`pretrain.compilation.memory_plan.plan_memory`). With `--json` it prints one JSON object instead:
`params_total`, `params_non_embedding`, `params_embedding`, `flops_per_token`,
`flops_breakdown`, `seq`, `decode_state_bytes`, `flops_estimated` (block types that
declare no FLOP terms, counted as 6 x their parameters), `model` (the resolved
ModelConfig as checkpoints record it, `model.config.model_config_to_dict`) and, with a mesh,
`per_device_bytes: {params, optimizer, gradients, activations, workspace, total}` (total
counts the larger of activations and the optimizer update's workspace, never live
together; `model.memory`), `memory_fits` (null without
`--device_memory_gb`), `memory_method`, `memory_estimated` (block types that declare no
memory terms, estimated), `mesh` and `batch`. Either estimate adds a line to the text.
`attention` says what training calls of T tokens run on each platform (XLA's softmax or a
fused kernel, and why; docs/model.md, "Which attention runs where"). `--platform` plans
the memory for that platform's choices (a fused kernel keeps no scores); without it,
this host's.

Everything is computed from shapes (`jax.eval_shape`), so the 14B presets take seconds.
The Gin files are read by `pretrain.gin_config` like the trainer's, so a full training
config (trainer, data and model bindings) works as well as a model preset. Bad input
ends the program with one `error: ...` line on stderr and exit status 2.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Sequence

from absl import flags

from plumbing import cli
from plumbing.errors import usage_error
from pretrain.compilation.summary import DEFAULT_SEQ, format_text, load_model_config, summarize

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Command-line flags, defined only when run as a program (see tests/test_entry_points)."""
  cli.define_gin_flags()
  flags.DEFINE_integer("seq", DEFAULT_SEQ, "Sequence length T for FLOPs and memory.",
                       lower_bound=1)
  flags.DEFINE_bool("json", False, "Print one JSON object.")
  flags.DEFINE_string("mesh", None,
                      "Device mesh, e.g. 'data:2,fsdp:4,tensor:1': adds per-device memory.")
  flags.DEFINE_integer("batch", None, "Global batch in sequences (with --mesh).",
                       lower_bound=1)
  flags.DEFINE_enum("platform", None, ["tpu", "gpu", "cpu"],
                    "Plan for this platform's kernels (fused attention keeps no scores); "
                    "default: this host's.")
  flags.DEFINE_float("device_memory_gb", None,
                     "Device memory in GB to check the plan against (with --mesh).")
  flags.register_multi_flags_validator(
      ["mesh", "batch", "device_memory_gb"],
      lambda values: values["mesh"] is not None or (
          values["batch"] is None and values["device_memory_gb"] is None),
      message="--batch and --device_memory_gb need --mesh")
  flags.register_multi_flags_validator(
      ["mesh", "batch"], lambda values: values["mesh"] is None or values["batch"] is not None,
      message="--mesh needs --batch (the global batch in sequences)")


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  if not FLAGS.gin_file:
    raise usage_error("--gin_file is required, e.g. --gin_file=configs/models/griffin_100m.gin")
  config = load_model_config(FLAGS.gin_file, FLAGS.gin_param)
  if FLAGS.platform is not None:
    config = config.replace(scan=dataclasses.replace(config.scan,
                                                     lowering_platform=FLAGS.platform))
  summary = summarize(config, FLAGS.seq, FLAGS.mesh, FLAGS.batch, FLAGS.device_memory_gb)
  print(json.dumps(summary, sort_keys=True) if FLAGS.json else format_text(summary))


if __name__ == "__main__":
  define_flags()
  cli.run(main)
