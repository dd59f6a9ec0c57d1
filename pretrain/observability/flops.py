"""Model FLOPs utilisation: training FLOPs per token and peak FLOP/s per device kind.

MFU = (tokens/s × training FLOPs per token) ÷ (devices × peak FLOP/s per device),
docs/model.md#mfu. Peaks are the vendors' dense bf16 numbers (no sparsity); a device kind not in
the table (CPU, unknown GPUs) has no peak and MFU is reported as "n/a".
"""
from __future__ import annotations

from typing import Optional

import jax
from model import counting

# Dense bf16 peak FLOP/s per JAX device, matched by substring of `device.device_kind`
# (lower-case), most specific first. TPU v4 exposes one device per chip (megacore).
PEAK_FLOPS_BY_DEVICE_KIND = (
    ("tpu v6 lite", 918e12),   # v6e (Trillium)
    ("tpu v6e", 918e12),
    ("tpu v5 lite", 197e12),   # v5e
    ("tpu v5e", 197e12),
    ("tpu v5p", 459e12),
    ("tpu v5", 459e12),
    ("tpu v4", 275e12),
    ("h200", 989e12),          # SXM, dense
    ("h100", 989e12),          # SXM, dense (PCIe parts are slower: 756e12)
    ("a100", 312e12),
)


def peak_flops_per_device(device_kind: str) -> Optional[float]:
  """Peak dense bf16 FLOP/s of one device of this kind, or None when unknown."""
  kind = device_kind.lower()
  if "h100" in kind and "pcie" in kind:
    return 756e12
  for key, peak in PEAK_FLOPS_BY_DEVICE_KIND:
    if key in kind:
      return peak
  return None


def training_flops_per_token(config, sequence_length: int) -> float:
  """FLOPs of one training token (forward + backward) of the model `config` describes.

  Uses the model's own counting (`model.counting`), which follows docs/model.md#training-flops.
  """
  return float(counting.training_flops_per_token(config, sequence_length))


def mfu(tokens_per_second: float, flops_per_token: float,
        devices: Optional[list] = None) -> Optional[float]:
  """Fraction of the devices' peak reached, or None when the device peak is unknown."""
  devices = jax.devices() if devices is None else devices
  peak = peak_flops_per_device(devices[0].device_kind)
  if peak is None:
    return None
  return tokens_per_second * flops_per_token / (len(devices) * peak)
