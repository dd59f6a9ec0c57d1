"""Peak resident memory of this process over a block of code.

A compiler's host memory is what decides whether a big program can be built on a
workstation at all (XLA:TPU once ran a 24 GiB host out of memory on an 8K-token
Griffin step), so compile reports give it. `ru_maxrss` cannot: it is the high-water
mark of the process's whole life, so in a process that compiled something bigger
before (a test session, a sweep) it says nothing about this compile. A thread samples
the resident set instead, every few milliseconds, while the block runs.
"""
from __future__ import annotations

import contextlib
import os
import resource
import threading
from typing import Iterator

_STATM = "/proc/self/statm"
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
  """This process's resident set now; where /proc is missing (macOS), its high-water
  mark so far (the best the OS offers)."""
  try:
    with open(_STATM) as statm:
      return int(statm.read().split()[1]) * _PAGE_BYTES
  except OSError:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS


class ResidentPeak:
  """The largest resident set sampled while the `watch()` block ran (`peak_bytes`)."""

  def __init__(self, interval_s: float = 0.01):
    self.interval_s = interval_s
    self.peak_bytes = 0

  @contextlib.contextmanager
  def watch(self) -> Iterator["ResidentPeak"]:
    done = threading.Event()

    def sample() -> None:
      while not done.wait(self.interval_s):
        self.peak_bytes = max(self.peak_bytes, resident_bytes())

    self.peak_bytes = resident_bytes()
    sampler = threading.Thread(target=sample, name="resident-peak", daemon=True)
    sampler.start()
    try:
      yield self
    finally:
      done.set()
      sampler.join()
      self.peak_bytes = max(self.peak_bytes, resident_bytes())
