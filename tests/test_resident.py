"""plumbing.resident: the peak resident memory of a block, sampled while it runs."""
import time

import numpy as np

from plumbing.resident import ResidentPeak, resident_bytes


def test_a_block_that_allocates_and_frees_is_seen_at_its_peak():
  before = resident_bytes()
  size = 256 * 2**20
  with ResidentPeak().watch() as resident:
    block = np.ones(size // 8)  # touched, so resident
    time.sleep(0.1)
    del block
  after = resident_bytes()
  assert resident.peak_bytes >= before + 0.9 * size
  assert after < before + 0.5 * size  # freed: the end alone would not show it


def test_an_idle_block_peaks_at_what_the_process_holds():
  with ResidentPeak().watch() as resident:
    time.sleep(0.05)
  assert 0 < resident.peak_bytes < resident_bytes() + 64 * 2**20
