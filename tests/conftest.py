"""Every test sees 8 simulated CPU devices, so sharding tests run the real partitioner."""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# Object-storage fixtures (`gcs_bucket`, `s3_bucket`): real local servers, started on use.
from storage_servers import gcs_bucket, s3_bucket  # pylint: disable=unused-import,wrong-import-position  # noqa: E402,F401
