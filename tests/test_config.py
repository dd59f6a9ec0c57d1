"""ModelConfig: derived sizes, and a ValueError naming the field for each bad setting."""
import pytest

from model.config import AUTO_UNROLL_MAX_DEPTH, ModelConfig
from model.scan.options import ScanOptions


@pytest.mark.parametrize("changes,field", [
    (dict(width=100, num_heads=3), "width=100 must be divisible by num_heads=3"),
    (dict(rnn_width=100, num_heads=3, width=96), "rnn_width=100 must be divisible"),
    (dict(rnn_width=100, num_gate_blocks=8), "rnn_width=100 must be divisible"),
    (dict(block_pattern=("recurrent", "mamba")), "unknown block type 'mamba'"),
    (dict(block_pattern=()), "block_pattern must name at least one"),
    (dict(attention_window=0), "attention_window must be >= 1"),
    (dict(width=6, num_heads=1), "must be divisible by 4"),    # odd half: RoPE pairs
    (dict(width=10, num_heads=2), "must be divisible by 4"),   # odd head dimension
    (dict(lru_variant="complex", rnn_width=6, num_heads=2, width=8),
     "divisible by 2 x gate blocks"),
    (dict(lru_variant="quaternion"), "lru_variant"),
    (dict(remat="sometimes"), "remat"),
    (dict(dtype="int8"), "dtype"),
    (dict(scan_impl="cuda"), "scan_impl"),
    (dict(logits_soft_cap=0.0), "logits_soft_cap"),
    (dict(depth=0), "depth must be a positive integer"),
    (dict(depth_scan_unroll=0), "depth_scan_unroll must be a positive integer"),
])
def test_bad_settings_raise_value_error_naming_the_field(changes, field):
  with pytest.raises(ValueError, match=field.replace("(", r"\(").replace(")", r"\)")):
    ModelConfig(**changes)


def test_odd_head_dim_is_fine_without_attention():
  ModelConfig(width=6, num_heads=1, rnn_width=6, block_pattern=("recurrent",))


def test_depth_is_split_into_scanned_units_and_a_remainder():
  cfg = ModelConfig(depth=8, block_pattern=("recurrent", "recurrent", "attention"))
  assert cfg.num_scanned_units == 2
  assert cfg.remainder_block_types == ("recurrent", "recurrent")
  assert cfg.block_types == ("recurrent", "recurrent", "attention") * 2 + (
      "recurrent", "recurrent")
  assert ModelConfig(depth=2).num_scanned_units == 0
  assert ModelConfig(depth=6).remainder_block_types == ()


def test_derived_sizes():
  cfg = ModelConfig(width=256, num_heads=4, rnn_width=96, mlp_expansion=3)
  assert (cfg.head_dim, cfg.gate_blocks, cfg.mlp_width) == (64, 4, 768)
  assert cfg.replace(num_gate_blocks=16).gate_blocks == 16


@pytest.mark.parametrize("platform", [None, "cpu", "tpu", "gpu", "cuda", "rocm"])
@pytest.mark.parametrize("remat", ["none", "full", "save_matmuls"])
def test_default_depth_unroll_unrolls_all_of_a_deep_model_only_on_gpu_without_remat(
    platform, remat):
  """Beyond AUTO_UNROLL_MAX_DEPTH layers the default scans one unit per iteration,
  except on GPU without remat, where it unrolls the whole depth (a looped depth makes
  XLA:GPU keep 2.1-2.9x the planned activations: `ModelConfig.depth_scan_unroll`).
  None is this host's default backend, CPU here; an explicit setting always wins."""
  deep = ModelConfig(depth=24, remat=remat, scan=ScanOptions(lowering_platform=platform))
  gpu_without_remat = platform in ("gpu", "cuda", "rocm") and remat == "none"
  assert deep.num_scanned_units == 8
  assert deep.depth_unroll == (8 if gpu_without_remat else 1)
  assert deep.replace(depth_scan_unroll=2).depth_unroll == 2
  assert deep.replace(depth_scan_unroll=100).depth_unroll == 8
  shallow = deep.replace(depth=AUTO_UNROLL_MAX_DEPTH)
  assert shallow.depth_unroll == shallow.num_scanned_units == 4
