"""A local GCS emulator for tests and for `launch.chaos --gcs_emulator`: a real HTTP
server speaking the GCS JSON API (gcp-storage-emulator, from the `test` extra), patched
where it differs from GCS in ways the project's clients notice (`serve`), and the
environment variables that point every client at it (`environment`).

  python -m launch.gcs_emulator PORT [DATA_DIR]

serves `gs://bucket` on 127.0.0.1:PORT until stopped (SIGINT lets it finish the request
it is serving), its objects in memory or under DATA_DIR. SIGUSR2 prints every thread's
stack to stderr (as the other commands do, see `plumbing.cli`).
"""
from __future__ import annotations

import faulthandler
import signal
import sys

from launch.faults import gcs_emulator


if __name__ == "__main__":
  faulthandler.register(signal.SIGUSR2, all_threads=True)
  gcs_emulator.serve(int(sys.argv[1]), *sys.argv[2:3])
