"""Batch indexing: a pure function of (seed, step), sharded over processes."""
import numpy as np
import pytest

from pretrain.data import DataError, indexing


@pytest.mark.parametrize("num_rows", [1, 2, 3, 7, 64, 100, 1023, 5000])
def test_permutation_is_a_bijection(num_rows):
  for seed, epoch in [(0, 0), (1, 5), (-3, 2)]:
    perm = indexing.permute(np.arange(num_rows), num_rows, seed, epoch)
    np.testing.assert_array_equal(np.sort(perm), np.arange(num_rows))


def test_permutation_depends_on_seed_and_epoch_and_shuffles():
  n = 1000
  base = indexing.permute(np.arange(n), n, 0, 0)
  assert not np.array_equal(base, indexing.permute(np.arange(n), n, 1, 0))
  assert not np.array_equal(base, indexing.permute(np.arange(n), n, 0, 1))
  np.testing.assert_array_equal(base, indexing.permute(np.arange(n), n, 0, 0))
  # Not close to the identity or a shift: few fixed points, neighbours spread out.
  assert np.sum(base == np.arange(n)) < 10
  assert np.median(np.abs(np.diff(base))) > n / 10


def test_batches_are_a_pure_function_of_seed_and_step():
  kwargs = dict(seed=3, batch_size=8, num_rows=37)
  first = [indexing.batch_rows(s, **kwargs) for s in range(20)]
  again = [indexing.batch_rows(s, **kwargs) for s in reversed(range(20))][::-1]
  for a, b in zip(first, again):
    np.testing.assert_array_equal(a, b)
  other_seed = indexing.batch_rows(0, seed=4, batch_size=8, num_rows=37)
  assert not np.array_equal(first[0], other_seed)


@pytest.mark.parametrize("process_count", [1, 2, 4, 8])
def test_union_over_processes_is_the_single_process_batch(process_count):
  for step in (0, 1, 9, 123):
    whole = indexing.batch_rows(step, seed=1, batch_size=16, num_rows=50)
    parts = [indexing.batch_rows(step, seed=1, batch_size=16, num_rows=50,
                                 process_index=p, process_count=process_count)
             for p in range(process_count)]
    assert all(len(p) == 16 // process_count for p in parts)
    np.testing.assert_array_equal(np.concatenate(parts), whole)


@pytest.mark.parametrize("num_rows,batch_size", [(48, 8), (50, 8), (7, 4),
                                                 (5, 16)])
def test_each_epoch_visits_every_row_exactly_once(num_rows, batch_size):
  steps = 3 * num_rows // batch_size + 2
  stream = np.concatenate([
      indexing.batch_rows(s, seed=11, batch_size=batch_size, num_rows=num_rows)
      for s in range(steps)])
  for epoch in range(len(stream) // num_rows):
    rows = stream[epoch * num_rows:(epoch + 1) * num_rows]
    np.testing.assert_array_equal(np.sort(rows), np.arange(num_rows))
  # Consecutive epochs use different orders.
  assert not np.array_equal(stream[:num_rows], stream[num_rows:2 * num_rows]) or (
      num_rows < 3)


def test_batch_size_must_divide_by_process_count():
  with pytest.raises(DataError, match="not divisible by the 3 processes"):
    indexing.batch_rows(0, seed=0, batch_size=8, num_rows=10, process_index=0,
                        process_count=3)
  with pytest.raises(DataError, match="process_index=2"):
    indexing.batch_rows(0, seed=0, batch_size=8, num_rows=10, process_index=2,
                        process_count=2)
