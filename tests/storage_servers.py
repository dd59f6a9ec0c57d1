"""Real object-storage servers for tests: a GCS emulator and an S3-compatible server.

`gcs_bucket` runs `gcp-storage-emulator` (the GCS JSON API) and `s3_bucket` runs moto in
server mode, each as a subprocess on a free loopback port, with one bucket created. While
a fixture is active the process environment points every client the project uses at the
server: fsspec's gcsfs / s3fs (behind `etils.epath`, hence Orbax's directory handling),
google-cloud-storage (Orbax's bucket probe), tensorstore's gcs and s3 kvstores (via
`plumbing.storage.kvstore_spec`), and subprocesses started by the test inherit it. Both
are session-scoped: a server starts once per test process and is stopped at its end.
"""
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Iterator

import boto3  # moto's own dependency: creates the S3 bucket
import fsspec
import fsspec.config
import pytest

BUCKET = "bucket"


def free_port() -> int:
  """A currently unused loopback TCP port."""
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def _wait_until_serving(url: str, process: subprocess.Popen, timeout_s: float = 60) -> None:
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if process.poll() is not None:
      raise RuntimeError(f"storage server exited with {process.returncode} before serving {url}")
    try:
      urllib.request.urlopen(url, timeout=2).close()
      return
    except urllib.error.HTTPError:  # any HTTP answer means it is serving
      return
    except OSError:
      time.sleep(0.1)
  raise RuntimeError(f"storage server at {url} did not start in {timeout_s} s")


@contextlib.contextmanager
def server(command: list[str], url: str, env: dict | None = None
           ) -> Iterator[subprocess.Popen]:
  """Runs a server command until the block ends; waits until `url` answers first."""
  process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env=env)
  try:
    _wait_until_serving(url, process)
    yield process
  finally:
    process.terminate()
    try:
      process.wait(timeout=10)
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
  """Sets environment variables for the block and restores the previous values after."""
  previous = {name: os.environ.get(name) for name in values}
  os.environ.update(values)
  try:
    yield
  finally:
    for name, value in previous.items():
      if value is None:
        os.environ.pop(name, None)
      else:
        os.environ[name] = value


def gcs_environment(endpoint: str) -> dict[str, str]:
  """The variables that point gcsfs, google-cloud-storage and tensorstore at `endpoint`."""
  return {
      "STORAGE_EMULATOR_HOST": endpoint,       # gcsfs and google-cloud-storage
      "TENSORSTORE_GCS_HTTP_URL": endpoint,    # tensorstore's gcs kvstore
      "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",  # tensorstore: no credential lookup
      "FSSPEC_GCS_TOKEN": "anon",              # gcsfs (in subprocesses): no credential lookup
      # google-auth never probes a metadata server off this machine.
      "NO_GCE_CHECK": "True",
      "GCE_METADATA_HOST": "127.0.0.1:9",
      "GCE_METADATA_IP": "127.0.0.1:9",
      # gcsfs's zonal/HNS probe speaks gRPC to the real service; the emulator has none.
      "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
  }


def s3_environment(endpoint: str) -> dict[str, str]:
  """The variables that point botocore (s3fs) and tensorstore's s3 kvstore at `endpoint`."""
  return {
      "AWS_ENDPOINT_URL": endpoint,
      "AWS_ACCESS_KEY_ID": "testing",
      "AWS_SECRET_ACCESS_KEY": "testing",
      "AWS_DEFAULT_REGION": "us-east-1",
      "AWS_REGION": "us-east-1",
      "AWS_EC2_METADATA_DISABLED": "true",
      "AWS_MAX_ATTEMPTS": "2",  # a wrong endpoint fails in seconds, not after 5 tries
  }


@contextlib.contextmanager
def fsspec_options(protocols: tuple[str, ...], **options) -> Iterator[None]:
  """fsspec reads its `FSSPEC_*` variables once, at import: set this process's copy."""
  saved = {protocol: dict(fsspec.config.conf.get(protocol, {})) for protocol in protocols}
  for protocol in protocols:
    fsspec.config.conf.setdefault(protocol, {}).update(options)
  try:
    yield
  finally:
    for protocol, values in saved.items():
      fsspec.config.conf[protocol] = values


@pytest.fixture(scope="session")
def gcs_bucket() -> Iterator[str]:
  """`gs://bucket` on a local gcp-storage-emulator."""
  port = free_port()
  endpoint = f"http://127.0.0.1:{port}"
  command = [sys.executable, os.path.abspath(__file__), "gcs", str(port)]
  with (server(command, endpoint + "/storage/v1/b"), environment(**gcs_environment(endpoint)),
        fsspec_options(("gs", "gcs"), token="anon")):
    yield f"gs://{BUCKET}"


@pytest.fixture(scope="session")
def s3_bucket() -> Iterator[str]:
  """`s3://bucket` on a local moto server."""
  port = free_port()
  endpoint = f"http://127.0.0.1:{port}"
  command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
  with server(command, endpoint), environment(**s3_environment(endpoint)):
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    yield f"s3://{BUCKET}"


class StoppableGcs:
  """A GCS emulator keeping its objects on disk, which a test stops and starts again on
  the same port: a bucket that goes away mid-run and comes back with its contents.

  Attributes:
    url: `gs://bucket`.
    endpoint: the emulator's URL.
  """

  def __init__(self, data_dir: str):
    self._port = free_port()
    self.endpoint = f"http://127.0.0.1:{self._port}"
    self.url = f"gs://{BUCKET}"
    self._command = [sys.executable, os.path.abspath(__file__), "gcs", str(self._port),
                     data_dir]
    self._process: subprocess.Popen | None = None

  def start(self) -> None:
    self._process = subprocess.Popen(self._command, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_until_serving(self.endpoint + "/storage/v1/b", self._process)

  def stop(self) -> None:
    """Stops the server: connections are refused until `start`.

    Ctrl-C (SIGINT) lets it finish the request it is serving: the emulator rewrites its
    whole index (`.meta`, every object's metadata) in place after each write, and a
    SIGKILL during that left the file empty and the restarted server failing to read
    it (1 start in 3 when the bucket was stopped during a checkpoint save)."""
    if self._process is not None:
      self._process.send_signal(signal.SIGINT)
      try:
        self._process.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self._process.kill()
        self._process.wait()
      self._process = None


@pytest.fixture()
def stoppable_gcs(tmp_path) -> Iterator[StoppableGcs]:
  """A started `StoppableGcs`, the environment pointing every client at it."""
  bucket = StoppableGcs(str(tmp_path / "gcs_data"))
  bucket.start()
  try:
    with (environment(**gcs_environment(bucket.endpoint)),
          fsspec_options(("gs", "gcs"), token="anon")):
      # gcsfs (imported here, once its variables are set) caches its file systems,
      # each bound to the endpoint it was made with.
      gcs = fsspec.get_filesystem_class("gs")
      gcs.clear_instance_cache()
      yield bucket
      gcs.clear_instance_cache()
  finally:
    bucket.stop()


def _serve_gcs_emulator(port: int, data_dir: str | None = None) -> None:
  """gcp-storage-emulator, in memory, with the generation headers of real GCS.

  Its media downloads omit `x-goog-generation`, which GCS sends and tensorstore reads to
  make conditional writes (Orbax's OCDBT manifests); without it every read looks like
  generation 0 and the next conditional write fails as 'Malformed StorageGeneration'.
  The wrapper adds the object's generation headers to each successful download.

  It lists within `startOffset`/`endOffset` as GCS does (`ls` below).

  It also serves suffix byte ranges (`Range: bytes=-N`, the last N bytes), as GCS does
  with HTTP 206 and a `Content-Range`: the emulator serves `bytes=A-B` and `bytes=A-` but
  answers a suffix range with the whole object, and tensorstore reads the index at the
  end of each zarr3 shard with one ("byte range [-132, ?) was ignored by server"). The
  suffix is rewritten to the equivalent `bytes=A-` before the emulator sees it.
  """
  from gcp_storage_emulator import server as emulator  # pylint: disable=import-outside-toplevel
  from gcp_storage_emulator.handlers import objects  # pylint: disable=import-outside-toplevel
  plain_download = objects.download

  def serve_suffix_range(request, store) -> None:
    suffix = re.fullmatch(r"\s*bytes=-(\d+)\s*", request.get_header("range", "") or "")
    if not suffix:
      return
    try:
      size = len(store.get_file(request.params["bucket_name"], request.params["object_id"]))
    except objects.NotFound:
      return  # the emulator answers 404 itself
    headers = request._request_handler.headers  # pylint: disable=protected-access
    headers.replace_header("Range", f"bytes={max(0, size - int(suffix[1]))}-")

  def download(request, response, store, *args, **kwargs):
    serve_suffix_range(request, store)
    plain_download(request, response, store, *args, **kwargs)
    if response.status in (200, 206):
      obj = store.get_file_obj(request.params["bucket_name"], request.params["object_id"])
      response["x-goog-generation"] = str(obj["generation"])
      response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))

  plain_ls = objects.ls

  def ls(request, response, store, *args, **kwargs):
    """Lists as GCS does, within [startOffset, endOffset): tensorstore lists a key range
    with these parameters (not `prefix`) and strips its path from every returned name,
    and the emulator ignores them. Then any shorter name elsewhere in the bucket made
    tensorstore's C++ abort the process (`basic_string_view::substr`: seen in CI as a
    `pretrain.data.prepare` child dying with SIGABRT once other tests had written to the
    session's bucket)."""
    start, end = (request.query.get(name, [None])[0] for name in ("startOffset", "endOffset"))
    if start is None and end is None:
      return plain_ls(request, response, store, *args, **kwargs)
    in_range = lambda name: (start is None or name >= start) and (end is None or name < end)

    class RangedStore:  # the store, listing only the range (a proxy: requests run in threads)
      def __getattr__(self, name):
        return getattr(store, name)

      def get_file_list(self, *list_args, **list_kwargs):
        files, prefixes = store.get_file_list(*list_args, **list_kwargs)
        return [f for f in files if in_range(f["name"])], [p for p in prefixes if in_range(p)]

    return plain_ls(request, response, RangedStore(), *args, **kwargs)

  objects.download = download  # `objects.get` (?alt=media) calls it through the module
  replaced = {plain_download: download, plain_ls: ls}
  emulator.HANDLERS = tuple(
      (pattern, {method: replaced.get(handler, handler) for method, handler in handlers.items()})
      for pattern, handlers in emulator.HANDLERS)
  server = emulator.create_server("127.0.0.1", port, in_memory=data_dir is None,
                                  default_bucket=BUCKET, data_dir=data_dir)
  server.run()


if __name__ == "__main__":
  if sys.argv[1:2] == ["gcs"]:
    _serve_gcs_emulator(int(sys.argv[2]), *sys.argv[3:4])
