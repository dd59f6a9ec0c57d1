"""Packing documents into fixed-length rows, and the model features derived from rows.

Packing rule (next-fit, in document order):
- A document that fits in a row (length <= T, EOS included) is never split: if it does
  not fit in the free space of the current row, that space is padded and the document
  starts the next row.
- A longer document starts in the free space of the current row and continues over as
  many rows as it needs. Each row's piece is its own segment, whose positions restart
  at 0 (the model sees the continuation as a fresh document start, without the earlier
  context); this wastes no space on long documents.
- Empty documents take no space and get no segment.

A packed row is stored as `targets` and `segment_ids` (1, 2, ... per piece in the row,
0 = padding), plus an optional 0/1 `loss_mask` for tasks where only part of each
document is predicted (prefix-LM tasks with `inputs` and `targets`). Everything the
model needs (`inputs`, `positions`, `weights`) derives from them in
`features_from_rows`.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import numpy as np


@dataclasses.dataclass(frozen=True)
class PackedRows:
  """Rows of packed documents, all arrays `[rows, T]`."""
  targets: np.ndarray       # int32
  segment_ids: np.ndarray   # int32
  loss_mask: Optional[np.ndarray] = None  # uint8; None = every real token counts

  @property
  def num_rows(self) -> int:
    return self.targets.shape[0]


def _document_starts(lengths: np.ndarray, sequence_length: int) -> np.ndarray:
  """Offset of each document in the row-major buffer `[rows * T]` (next-fit rule)."""
  starts = np.empty(len(lengths) + 1, np.int64)
  position = 0
  for i, length in enumerate(lengths.tolist()):
    if 0 < length <= sequence_length:
      room = sequence_length - position % sequence_length
      if length > room:
        position += room
    starts[i] = position
    position += length
  starts[-1] = position  # end of the used buffer
  return starts


def pack_documents(tokens: np.ndarray, lengths: np.ndarray, sequence_length: int,
                   loss_mask: Optional[np.ndarray] = None) -> PackedRows:
  """Packs documents given as one flat token array and their lengths.

  Args:
    tokens: int `[sum(lengths)]`, the documents (EOS included) back to back.
    lengths: int `[documents]`; zeros are allowed (empty documents).
    sequence_length: T, the row length.
    loss_mask: optional `[sum(lengths)]` of 0/1, aligned with `tokens`.

  Returns:
    The packed rows; the last row is padded.
  """
  if sequence_length < 1:
    raise ValueError(f"sequence_length={sequence_length} must be >= 1")
  tokens = np.asarray(tokens)
  lengths = np.asarray(lengths, np.int64)
  if lengths.sum() != tokens.size:
    raise ValueError(
        f"lengths sum to {lengths.sum()} but there are {tokens.size} tokens")
  starts = _document_starts(lengths, sequence_length)
  num_rows = -(-int(starts[-1]) // sequence_length)
  size = num_rows * sequence_length
  # Destination of every token: its document's start plus its offset in the document.
  first_token = np.cumsum(lengths) - lengths
  offset_in_document = np.arange(tokens.size) - np.repeat(first_token, lengths)
  destination = np.repeat(starts[:-1], lengths) + offset_in_document

  targets = np.zeros(size, np.int32)
  targets[destination] = tokens
  piece_start = np.zeros(size, np.int32)
  piece_start[destination[(offset_in_document == 0)
                          | (destination % sequence_length == 0)]] = 1
  occupied = np.zeros(size, bool)
  occupied[destination] = True
  shape = (num_rows, sequence_length)
  segment_ids = (np.cumsum(piece_start.reshape(shape), axis=1, dtype=np.int32)
                 * occupied.reshape(shape))
  packed_mask = None
  if loss_mask is not None:
    packed_mask = np.zeros(size, np.uint8)
    packed_mask[destination] = np.asarray(loss_mask, np.uint8)
    packed_mask = packed_mask.reshape(shape)
  return PackedRows(targets.reshape(shape), segment_ids.astype(np.int32),
                    packed_mask)


def positions_from_segment_ids(segment_ids: np.ndarray) -> np.ndarray:
  """Each token's index within its segment (0 at every segment start and padding)."""
  rows, length = segment_ids.shape
  column = np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length))
  starts = np.ones_like(segment_ids, bool)
  starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
  start_column = np.maximum.accumulate(np.where(starts, column, 0), axis=1)
  return np.where(segment_ids > 0, column - start_column, 0).astype(np.int32)


def features_from_rows(targets: np.ndarray, segment_ids: np.ndarray,
                       loss_mask: Optional[np.ndarray] = None
                       ) -> Dict[str, np.ndarray]:
  """The model's batch (see docs/INTERNALS.md) from stored rows."""
  targets = np.asarray(targets, np.int32)
  segment_ids = np.asarray(segment_ids, np.int32)
  positions = positions_from_segment_ids(segment_ids)
  inputs = np.zeros_like(targets)
  inputs[:, 1:] = targets[:, :-1]
  inputs[positions == 0] = 0
  weights = segment_ids > 0
  if loss_mask is not None:
    weights &= np.asarray(loss_mask) > 0
  return {
      "inputs": inputs,
      "targets": np.where(segment_ids > 0, targets, 0).astype(np.int32),
      "positions": positions,
      "segment_ids": segment_ids,
      "weights": weights.astype(np.float32),
  }
