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


# The files whose tests took longest in a CI run (seconds of one worker, measured with
# `--durations=80`), heaviest first. They are collected first, and pyproject.toml turns
# off xdist's own order (most tests first, which put these few-test, long files last), so
# `--dist loadfile` hands out the long files while the other worker still has short ones
# left to balance against: the run no longer ends with one worker idle behind a long file.
# A file missing here only runs later; the list needs refreshing when a file's cost moves
# by minutes, not seconds.
HEAVIEST_FILES_FIRST = (
    "test_multihost_train.py",    # 904 s
    "test_readme.py",             # 344 s
    "test_gpu_compile.py",        # 336 s
    "test_object_storage.py",     # 301 s
    "test_failures.py",           # 230 s
    "test_tpu_compile.py",        # 212 s
    "test_sweep_wsd.py",          # 158 s
    "test_train_e2e.py",          # 151 s
    "test_benchmarks.py",         # 134 s
    "test_storage_outage.py",     # 129 s
    "test_evaluate_sample.py",    # 118 s
)


@pytest.hookimpl(trylast=True)  # after pytest groups parametrized fixtures, keeping that
def pytest_collection_modifyitems(items) -> None:
  """Heaviest files first (see HEAVIEST_FILES_FIRST); each file's tests keep their order."""
  rank = {name: position for position, name in enumerate(HEAVIEST_FILES_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
