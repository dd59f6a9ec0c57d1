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


# The modules that take longest (seconds of one CI run on 2 cores, from --durations),
# longest first. `--dist loadfile` hands whole modules to the two workers in collection
# order, so these start first and the many short modules fill in around them; last,
# the SLURM module alone (about 14 minutes) would leave one worker idle at the end.
LONGEST_MODULES = (
    "test_slurm_cluster.py",      # ~850 s
    "test_multihost_train.py",    # ~750 s
    "test_readme.py",             # ~650 s
    "test_object_storage.py",     # ~350 s
    "test_gpu_compile.py",        # ~250 s
    "test_storage_outage.py",     # ~200 s
    "test_sweep_wsd.py",          # ~190 s
    "test_train_e2e.py",          # ~170 s
    "test_benchmarks.py",         # ~170 s
    "test_data_corpora.py",       # ~160 s
    "test_failures.py",           # ~160 s
)


def pytest_configure(config):
  """xdist would order modules by their number of tests (its `--loadscope-reorder`
  default), which puts the few long end-to-end modules last; `_longest_first` orders
  them instead."""
  if hasattr(config.option, "loadscopereorder"):
    config.option.loadscopereorder = False


def _longest_first(items):
  """`items` with the `LONGEST_MODULES` first, in that order; the rest keep theirs."""
  rank = {name: i for i, name in enumerate(LONGEST_MODULES)}
  def key(item):
    return rank.get(os.path.basename(str(item.fspath)), len(rank))
  items[:] = sorted(items, key=key)   # stable: a module's tests keep their order


def pytest_collection_modifyitems(session, config, items):
  """Orders the modules longest first (`_longest_first`), then checks the storage
  fixtures: session fixtures that start a server and point the environment at it must be
  defined once, here: a test module importing one would start a second server in
  whichever worker runs it (see storage_servers). Fails the collection, in every run,
  naming the modules."""
  del session, config
  _longest_first(items)
  importers = sorted({
      item.module.__name__ for item in items
      if getattr(item, "module", None) is not None
      and any(getattr(item.module, name, None) is fixture
              for name, fixture in (("gcs_bucket", gcs_bucket), ("s3_bucket", s3_bucket)))})
  if importers:
    raise pytest.UsageError(
        f"{', '.join(importers)} import gcs_bucket/s3_bucket from storage_servers; "
        "conftest.py provides them: remove the import")
