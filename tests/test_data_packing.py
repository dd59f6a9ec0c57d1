"""Packing and feature derivation against a plain-Python reference packer."""
import numpy as np
import pytest

from pretrain.data import packing


def reference_pack(documents, length, masks=None):
  """Row-by-row packer written for clarity, implementing the documented rule."""
  rows, row = [], None

  def new_row():
    return {k: [] for k in ("targets", "inputs", "positions", "segment_ids",
                            "weights")}

  def flush():
    if row is not None and row["targets"]:
      pad = length - len(row["targets"])
      for k in row:
        row[k] += [0] * pad
      rows.append(row)

  row = new_row()
  for d, doc in enumerate(documents):
    doc = list(doc)
    mask = list(masks[d]) if masks is not None else [1] * len(doc)
    if not doc:
      continue
    if len(doc) <= length and len(doc) > length - len(row["targets"]):
      flush()
      row = new_row()
    i = 0
    while i < len(doc):
      if len(row["targets"]) == length:
        flush()
        row = new_row()
      segment = (row["segment_ids"][-1] if row["segment_ids"] else 0) + 1
      take = min(length - len(row["targets"]), len(doc) - i)
      piece = doc[i:i + take]
      row["targets"] += piece
      row["inputs"] += [0] + piece[:-1]
      row["positions"] += list(range(take))
      row["segment_ids"] += [segment] * take
      row["weights"] += [float(m) for m in mask[i:i + take]]
      i += take
  flush()
  return {k: np.array([r[k] for r in rows]).reshape(len(rows), length)
          for k in ("inputs", "targets", "positions", "segment_ids", "weights")}


def random_documents(rng, count, max_length):
  lengths = rng.integers(0, max_length + 1, size=count)
  lengths[rng.random(count) < 0.15] = 0  # plenty of empty documents
  return [rng.integers(3, 300, size=n) for n in lengths]


def pack_and_derive(documents, length, masks=None):
  lengths = np.array([len(d) for d in documents])
  flat = np.concatenate(documents) if documents else np.zeros(0, np.int32)
  flat_mask = np.concatenate(masks) if masks is not None else None
  packed = packing.pack_documents(flat, lengths, length, flat_mask)
  return packing.features_from_rows(packed.targets, packed.segment_ids,
                                    packed.loss_mask)


@pytest.mark.parametrize("length,max_doc", [(1, 3), (4, 3), (8, 30), (16, 16),
                                            (32, 100), (64, 20)])
def test_packer_matches_reference(length, max_doc):
  rng = np.random.default_rng(length * 1000 + max_doc)
  documents = random_documents(rng, 60, max_doc)
  got = pack_and_derive(documents, length)
  want = reference_pack(documents, length)
  assert set(got) == set(want)
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  assert got["weights"].dtype == np.float32
  assert all(got[k].dtype == np.int32 for k in
             ("inputs", "targets", "positions", "segment_ids"))


def test_prefix_loss_mask_matches_reference():
  rng = np.random.default_rng(7)
  documents = random_documents(rng, 40, 24)
  masks = [(np.arange(len(d)) >= len(d) // 3).astype(np.uint8) for d in documents]
  got = pack_and_derive(documents, 16, masks)
  want = reference_pack(documents, 16, masks)
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_every_token_kept_once_and_short_documents_never_split():
  rng = np.random.default_rng(3)
  length = 32
  lengths = rng.integers(0, 80, size=150)
  unique_tokens = rng.permutation(lengths.sum()) + 3  # identifies each token
  documents = np.split(unique_tokens, np.cumsum(lengths)[:-1])
  feats = pack_and_derive(documents, length)
  real = feats["segment_ids"] > 0
  np.testing.assert_array_equal(np.sort(feats["targets"][real]),
                                np.sort(unique_tokens))
  where = {int(t): divmod(i, length)
           for i, t in enumerate(feats["targets"].ravel()) if real.ravel()[i]}
  for doc in documents:
    rows = [where[int(t)][0] for t in doc]
    if 0 < len(doc) <= length:
      row, column = where[int(doc[0])]
      assert rows == [row] * len(doc)
      np.testing.assert_array_equal(feats["targets"][row, column:column + len(doc)],
                                    doc)
      np.testing.assert_array_equal(
          feats["positions"][row, column:column + len(doc)], np.arange(len(doc)))
      assert len(set(feats["segment_ids"][row, column:column + len(doc)])) == 1
    elif len(doc) > length:
      # Consecutive rows; each piece restarts positions at 0.
      assert sorted(set(rows)) == list(range(rows[0], rows[-1] + 1))
      assert sum(feats["positions"][where[int(t)]] == 0 for t in doc) == len(
          set(rows))
  # Padding only at row ends: once a row reaches segment 0 it stays 0.
  padding = ~real
  assert np.all(np.diff(padding.astype(int), axis=1) >= 0)


def test_hand_example():
  documents = [np.array([5, 6, 7]), np.array([], int), np.array([8, 9, 10, 11, 12]),
               np.array([20, 21])]
  feats = pack_and_derive(documents, 4)
  np.testing.assert_array_equal(
      feats["targets"], [[5, 6, 7, 8], [9, 10, 11, 12], [20, 21, 0, 0]])
  np.testing.assert_array_equal(
      feats["segment_ids"], [[1, 1, 1, 2], [1, 1, 1, 1], [1, 1, 0, 0]])
  np.testing.assert_array_equal(
      feats["positions"], [[0, 1, 2, 0], [0, 1, 2, 3], [0, 1, 0, 0]])
  np.testing.assert_array_equal(
      feats["inputs"], [[0, 5, 6, 0], [0, 9, 10, 11], [0, 20, 0, 0]])
  np.testing.assert_array_equal(
      feats["weights"], [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]])


def test_no_documents_gives_no_rows():
  packed = packing.pack_documents(np.zeros(0, np.int32), np.array([0, 0]), 8)
  assert packed.num_rows == 0


def test_length_mismatch_is_an_error():
  with pytest.raises(ValueError, match="lengths sum"):
    packing.pack_documents(np.arange(5), np.array([2, 2]), 4)
