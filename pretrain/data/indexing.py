"""Which stored rows make up the global batch at a step: a pure function of (seed, step).

The global batch at step s holds the rows at stream positions s*B ... s*B + B - 1 of
an endless stream that visits every row once per epoch, in an order given by a seeded
per-epoch permutation. Process p of P takes the contiguous slice p*B/P ... (p+1)*B/P of
that batch. A resumed run (even with another number of processes) therefore needs
only the step, and within an epoch no row repeats or is skipped.

The permutation is a keyed Feistel network with cycle walking: `permute(i)` costs O(1)
per index and no memory, so it scales to stores with billions of rows, unlike
materialising `np.random.permutation(N)` per epoch.
"""
from __future__ import annotations

import numpy as np

from pretrain.data.errors import DataError

_ROUNDS = 6
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
  """SplitMix64 finaliser: a fast, well-mixing bijection on uint64."""
  x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return x ^ (x >> np.uint64(31))


def _round_keys(seed: int, epoch: int) -> np.ndarray:
  seed %= 2**64  # any Python int, negative included
  return np.random.SeedSequence([seed & 0xFFFFFFFF, seed >> 32, epoch]).generate_state(
      _ROUNDS, np.uint64)


def permute(indices: np.ndarray, num_rows: int, seed: int, epoch: int) -> np.ndarray:
  """Applies the (seed, epoch) permutation of [0, num_rows) to `indices`."""
  if num_rows < 1:
    raise ValueError("cannot permute an empty range")
  half_bits = max(1, (int(num_rows - 1).bit_length() + 1) // 2)
  half_mask = np.uint64((1 << half_bits) - 1)
  shift = np.uint64(half_bits)
  keys = _round_keys(seed, epoch)

  def encrypt(x):
    left, right = x >> shift, x & half_mask
    for key in keys:
      left, right = right, left ^ (_mix(right ^ key) & half_mask)
    return (left << shift) | right

  with np.errstate(over="ignore"):
    out = encrypt(np.asarray(indices, np.uint64))
    outside = out >= np.uint64(num_rows)
    while outside.any():  # cycle walking back into [0, num_rows)
      out[outside] = encrypt(out[outside])
      outside = out >= np.uint64(num_rows)
  return out.astype(np.int64)


def check_batch_split(batch_size: int, process_count: int) -> int:
  """Rows per process; a clear error when the global batch does not split evenly."""
  if batch_size < 1:
    raise DataError(f"BATCH_SIZE={batch_size} must be >= 1")
  if process_count < 1 or batch_size % process_count:
    raise DataError(
        f"BATCH_SIZE={batch_size} is not divisible by the {process_count} "
        "processes; set --gin_param=BATCH_SIZE=<a multiple of the process count>")
  return batch_size // process_count


def batch_rows(step: int, *, seed: int, batch_size: int, num_rows: int,
               process_index: int = 0, process_count: int = 1) -> np.ndarray:
  """Store rows of this process's slice of the global batch at `step`."""
  per_process = check_batch_split(batch_size, process_count)
  if not 0 <= process_index < process_count:
    raise DataError(
        f"process_index={process_index} is outside [0, {process_count})")
  if step < 0:
    raise DataError(f"step={step} must be >= 0")
  stream = (step * batch_size + process_index * per_process
            + np.arange(per_process, dtype=np.int64))
  epochs, offsets = np.divmod(stream, num_rows)
  rows = np.empty(per_process, np.int64)
  for epoch in np.unique(epochs):
    selected = epochs == epoch
    rows[selected] = permute(offsets[selected], num_rows, seed, int(epoch))
  return rows
