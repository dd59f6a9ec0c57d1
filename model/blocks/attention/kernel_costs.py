"""What each fused-attention launch computes and moves, for estimates that count them.

JAX's splash attention declares no `pl.CostEstimate`, so XLA's cost model sees its three
launches (forward, dq, dkv) as opaque custom calls: it counts the bytes of their
operands and results and no FLOPs. An estimate that stopped there would count the
kernel as nearly free. This module states each launch's work from the kernel's own
block arithmetic, the blocks its grid visits: a (query block, key block) pair is
visited when the causal / window mask leaves any of its entries (segment ids depend
on the data and only ever skip more, so this is an upper bound the kernel reaches on a
row of one document).

Per visited block of bq × bkv scores and head dimension d, per head and row:
- forward: QKᵀ and PV, 2 matmuls = 4·bq·bkv·d FLOPs, bq·bkv exponentials;
- dq: QKᵀ again, dO·Vᵀ, dS·K: 6·bq·bkv·d, bq·bkv exponentials;
- dkv: QKᵀ again, Pᵀ·dO, dO·Vᵀ, dSᵀ·Q: 8·bq·bkv·d, bq·bkv exponentials.
Bytes: the tiles the grid streams per visited block (keys and values for the forward
and dq launches, queries and output gradients for dkv) plus the resident operands
and the results once, in the compute dtype, and float32 log-sum-exp rows.
`pretrain.compilation.aot` multiplies these by the launches in the compiled program
and adds their roofline time to XLA's estimate, labelled as declared here.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

# Matmul FLOPs per visited score of each launch (module docstring).
_MATMULS = {"fwd": 2, "dq": 3, "dkv": 4}


@dataclasses.dataclass(frozen=True)
class LaunchCost:
  """One launch's work on one device."""
  flops: float
  transcendentals: float
  bytes: float


def visited_blocks(length: int, window: Optional[int], block_q: int,
                   block_kv: int) -> int:
  """(query block, key block) pairs with any score the mask keeps, for one head."""
  q_first = np.arange(0, length, block_q)[:, None]
  k_first = np.arange(0, length, block_kv)[None, :]
  q_last, k_last = q_first + block_q - 1, k_first + block_kv - 1
  visited = k_first <= q_last                       # some key at or before some query
  if window is not None:
    visited &= q_first - k_last <= window          # the nearest pair within the window
  return int(visited.sum())


def splash_launch_costs(rows: int, heads: int, length: int, head_dim: int,
                        window: Optional[int], block_q: int, block_kv: int,
                        itemsize: int) -> dict[str, LaunchCost]:
  """{"fwd", "dq", "dkv": LaunchCost} of splash MQA on one device's shard.

  Args:
    rows: batch rows on the device; heads: query heads on the device.
    length: tokens per row; head_dim: d.
    window: the local window (None = causal).
    block_q, block_kv: the kernel's block rows.
    itemsize: bytes per element of the compute dtype.
  """
  blocks = visited_blocks(length, window, block_q, block_kv) * heads * rows
  scores = blocks * block_q * block_kv
  tile_q, tile_kv = block_q * head_dim * itemsize, block_kv * head_dim * itemsize
  per_head = rows * heads * length * head_dim * itemsize   # queries, outputs, gradients
  shared = rows * length * head_dim * itemsize             # the one key or value head
  lse = rows * heads * length * 4
  moved = {
      "fwd": 2 * blocks * tile_kv + 2 * per_head + lse,               # q in, o out
      "dq": 2 * blocks * tile_kv + 3 * per_head + 2 * lse,            # q, dO in; dq out
      "dkv": 2 * blocks * tile_q + 4 * shared + 2 * lse,              # k, v in; dk, dv out
  }
  return {kind: LaunchCost(flops=2.0 * matmuls * scores * head_dim,
                           transcendentals=float(scores),
                           bytes=float(moved[kind]))
          for kind, matmuls in _MATMULS.items()}
