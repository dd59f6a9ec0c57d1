"""Every test sees 8 simulated CPU devices, so sharding tests run the real partitioner."""
import os
import tempfile

import pytest

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# JAX's persistent compilation cache, shared by the two xdist workers and every trainer
# subprocess they start: the suite trains the same tiny configs many times (restarts,
# references, multi-process runs), and a cache hit halves such a run's CPU time. Entries
# are keyed by the program and the compile options, so a hit runs the same executable.
# A size bound turns on the cache's file lock (the `filelock` test dependency), so
# concurrent writers never expose a half-written entry.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), "griffin-pretrain-test-jax-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 * 2**30))

# Object-storage fixtures (`gcs_bucket`, `s3_bucket`): real local servers, started on use.
from storage_servers import gcs_bucket, s3_bucket  # pylint: disable=unused-import,wrong-import-position  # noqa: E402,F401


def pytest_collection_modifyitems(session, config, items):
  """Session fixtures that start a server and point the environment at it must be
  defined once, here: a test module importing one would start a second server in
  whichever worker runs it (see storage_servers). Fails the collection, in every run,
  naming the modules."""
  del session, config
  importers = sorted({
      item.module.__name__ for item in items
      if getattr(item, "module", None) is not None
      and any(getattr(item.module, name, None) is fixture
              for name, fixture in (("gcs_bucket", gcs_bucket), ("s3_bucket", s3_bucket)))})
  if importers:
    raise pytest.UsageError(
        f"{', '.join(importers)} import gcs_bucket/s3_bucket from storage_servers; "
        "conftest.py provides them: remove the import")
