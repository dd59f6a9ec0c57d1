"""plumbing.resident: the peak resident memory of a block, sampled while it runs.

Each case runs in a fresh interpreter: in a test worker, other threads (checkpoint
writers, servers of earlier tests) allocate and free at the same time, and the resident
set would measure them too.
"""
import json

from trainer_helpers import last_line_of_fresh_python

MIB = 2**20


def _measure(block: str) -> dict:
  """Runs `block` under ResidentPeak in a fresh process; returns the resident bytes
  before it, the peak during it and after it."""
  code = ("import json, time\n"
          "import numpy as np\n"
          "from plumbing.resident import ResidentPeak, resident_bytes\n"
          "before = resident_bytes()\n"
          "with ResidentPeak().watch() as resident:\n"
          + "".join(f"  {line}\n" for line in block.splitlines()) +
          "after = resident_bytes()\n"
          "print(json.dumps({'before': before, 'peak': resident.peak_bytes, "
          "'after': after}))\n")
  return json.loads(last_line_of_fresh_python(code))


def test_a_block_that_allocates_and_frees_is_seen_at_its_peak():
  size = 256 * MIB
  seen = _measure(f"block = np.ones({size // 8})  # touched, so resident\n"
                  "time.sleep(0.1)\n"
                  "del block")
  assert seen["peak"] >= seen["before"] + 0.9 * size
  assert seen["after"] < seen["before"] + 0.5 * size  # freed: the end alone misses it


def test_an_idle_block_peaks_at_what_the_process_holds():
  seen = _measure("time.sleep(0.05)")
  assert seen["before"] <= seen["peak"] < seen["after"] + 16 * MIB
