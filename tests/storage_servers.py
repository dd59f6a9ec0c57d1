"""Real object-storage servers for tests: a GCS emulator and an S3-compatible server.

`gcs_bucket` runs `gcp-storage-emulator` (the GCS JSON API) and `s3_bucket` runs moto in
server mode, each as a subprocess on a free loopback port, with one bucket created. While
a fixture is active the process environment points every client the project uses at the
server: fsspec's gcsfs / s3fs (behind `etils.epath`, hence Orbax's directory handling),
google-cloud-storage (Orbax's bucket probe), tensorstore's gcs and s3 kvstores (via
`plumbing.storage.kvstore_spec`), and subprocesses started by the test inherit it. Both
are session-scoped: a server starts once per test process and is stopped at its end.

Import them only in conftest.py. A test module that imports a fixture defines a second
one: pytest would start a second server and point the environment at it, while clients
already made in the process (s3fs and gcsfs cache theirs, endpoint included) keep
talking to the first, so a subprocess writes to one server and the test reads the other.
conftest.py fails the collection when a test module imports one.
"""
import contextlib
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Iterator

import boto3  # moto's own dependency: creates the S3 bucket
import fsspec
import fsspec.config
import pytest

from launch.faults import gcs_emulator

gcs_environment = gcs_emulator.environment

BUCKET = gcs_emulator.BUCKET


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

  def pause(self) -> None:
    """Freezes the server (SIGSTOP) until `resume`: the kernel still accepts its
    connections, and nothing answers them (a hung storage, or one behind a load
    balancer that lost its backends); what it was serving resumes where it was."""
    self._process.send_signal(signal.SIGSTOP)

  def resume(self) -> None:
    self._process.send_signal(signal.SIGCONT)

  def stop(self) -> None:
    """Stops the server: connections are refused until `start`.

    Ctrl-C (SIGINT) lets it finish the request it is serving: the emulator rewrites its
    whole index (`.meta`, every object's metadata) in place after each write, and a
    SIGKILL during that left the file empty and the restarted server failing to read
    it (1 start in 3 when the bucket was stopped during a checkpoint save)."""
    if self._process is not None:
      self.resume()   # a paused server would not see the signal
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


class StorageProxy:
  """A loopback TCP proxy in front of a storage server, which a test switches between
  forwarding (`resume`), stalling (`stall`: every connection, old or new, is accepted
  and held, and nothing is forwarded either way: a hung storage, or a load balancer
  that lost its backends; unlike a frozen server, whose listen queue fills up, it
  accepts every connection), diverted (`divert`: every request answered by another
  server, an `answering_storage` that says 403 in the storage's own format, a bucket
  whose permission was revoked or a credential that expired mid-run; or one that
  answers the connection check and never a request) and closed (`close`: connections
  refused, until `open` listens on the same port again). The server behind it keeps
  its objects throughout.

  Attributes:
    endpoint: the proxy's URL, for the clients' endpoint variables.
  """

  def __init__(self, upstream: str):
    parsed = upstream.split("://", 1)[-1]
    host, port = parsed.rsplit(":", 1)
    self._upstream = (host, int(port))
    self._diverted_to: tuple[str, int] | None = None   # where requests go while diverted
    self._port = free_port()
    self.endpoint = f"http://127.0.0.1:{self._port}"
    self._forwarding = threading.Event()
    self._forwarding.set()
    self._listener: socket.socket | None = None
    self._connections: list[socket.socket] = []
    self._lock = threading.Lock()
    self.open()

  def open(self) -> None:
    self._listener = socket.create_server(("127.0.0.1", self._port), backlog=256)
    threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

  def close(self) -> None:
    """Refuses connections, and ends the open ones, until `open`."""
    listener, self._listener = self._listener, None
    if listener is not None:
      listener.close()
    self._end_connections()

  def _end_connections(self) -> None:
    with self._lock:
      connections, self._connections = self._connections, []
    for connection in connections:
      with contextlib.suppress(OSError):
        connection.shutdown(socket.SHUT_RDWR)
      connection.close()

  def stall(self) -> None:
    self._forwarding.clear()

  def divert(self, server: str) -> None:
    """Sends every request to `server` (an `answering_storage` URL) from now on: the
    open connections are ended, so that the clients' next requests, on new ones, meet
    its answer (or its silence) rather than the storage's."""
    host, port = server.split("://", 1)[-1].rsplit(":", 1)
    self._diverted_to = (host, int(port))
    self._end_connections()

  def resume(self) -> None:
    """Forwards to the storage again (ending the connections to a server diverted to)."""
    diverted, self._diverted_to = self._diverted_to, None
    if diverted is not None:
      self._end_connections()
    self._forwarding.set()

  def _accept(self, listener: socket.socket) -> None:
    while True:
      try:
        client = listener.accept()[0]
      except OSError:   # closed
        return
      with self._lock:
        self._connections.append(client)
      threading.Thread(target=self._serve, args=(client,), daemon=True).start()

  def _serve(self, client: socket.socket) -> None:
    self._forwarding.wait()
    try:
      upstream = socket.create_connection(self._diverted_to or self._upstream)
    except OSError:
      client.close()
      return
    with self._lock:
      self._connections.append(upstream)
    threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()
    self._pump(client, upstream)

  def _pump(self, source: socket.socket, target: socket.socket) -> None:
    """Copies `source` to `target` while forwarding; holds the bytes while stalled."""
    try:
      while data := source.recv(65536):
        self._forwarding.wait()
        target.sendall(data)
    except OSError:
      pass
    finally:
      for end in (source, target):
        with contextlib.suppress(OSError):
          end.shutdown(socket.SHUT_RDWR)


def forget_clients() -> None:
  """Drops this process's cached gcsfs and s3fs file systems (fsspec's instance caches,
  and etils.epath's one a protocol): each is bound to the endpoint it was made with."""
  from etils import epath  # pylint: disable=import-outside-toplevel
  for protocol in ("gs", "s3"):
    fsspec.get_filesystem_class(protocol).clear_instance_cache()
  epath.backend.fsspec_backend._get_filesystem.cache_clear()  # pylint: disable=protected-access


def _error_body(status: int, message: str, dialect: str) -> tuple[str, bytes]:
  """(content type, body) of an error as the storage of `dialect` words it: GCS's JSON
  (`{"error": {"code", "message", "errors"}}`) for "gs", S3's XML (`<Error><Code>`,
  `AccessDenied` for a 403) for "s3"."""
  if dialect == "gs":
    return "application/json; charset=UTF-8", json.dumps({"error": {
        "code": status, "message": message, "errors": [
            {"message": message, "domain": "global", "reason": "forbidden"}]}}).encode()
  code = "AccessDenied" if status == 403 else "InvalidAccessKeyId"
  return "application/xml", (
      f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>'
      f"{message}</Message><RequestId>0</RequestId><HostId>0</HostId></Error>").encode()


@contextlib.contextmanager
def answering_storage(status: int | None, message: str = "", dialect: str = "gs"
                      ) -> Iterator[str]:
  """A loopback HTTP server in a thread that answers the start-up probe (`HEAD /`, a
  400 as GCS gives) and every API request with `status` and `message` in the error
  format of `dialect` ("gs": GCS's JSON; "s3": S3's XML, `_error_body`; a HEAD of an
  object gets the status alone, as from S3), or, with `status` None, never answers an
  API request (a storage that passes the probe and then stalls); yields its URL, for
  `STORAGE_EMULATOR_HOST` or `AWS_ENDPOINT_URL`."""
  stop = threading.Event()

  class Answer(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # pylint: disable=arguments-differ
      del args

    def do_HEAD(self) -> None:  # pylint: disable=invalid-name
      self.send_response(400 if self.path == "/" or status is None else status)
      self.send_header("Content-Length", "0")
      self.end_headers()

    def do_GET(self) -> None:  # pylint: disable=invalid-name
      self._read_body()
      if status is None:
        stop.wait()
        return
      content_type, body = _error_body(status, message, dialect)
      self.send_response(status)
      self.send_header("Content-Type", content_type)
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    def _read_body(self) -> None:
      """Reads the request's body whole (a chunked one too): a reply while the client
      is still sending would reach it as a reset connection, not as the refusal."""
      if self.headers.get("Transfer-Encoding", "").lower() != "chunked":
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        return
      while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
        self.rfile.read(size + 2)
      while self.rfile.readline().strip():   # the trailers, up to the blank line
        pass

    do_POST = do_PUT = do_DELETE = do_GET

  listener = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
  listener.daemon_threads = True
  threading.Thread(target=listener.serve_forever, daemon=True).start()
  try:
    yield f"http://127.0.0.1:{listener.server_address[1]}"
  finally:
    stop.set()
    listener.shutdown()
    listener.server_close()


@pytest.fixture()
def proxied_bucket(request, tmp_path) -> Iterator[tuple[str, StorageProxy]]:
  """(`gs://bucket` or `s3://bucket`, as the test's parameter says, its `StorageProxy`):
  the GCS emulator (objects on disk) or a moto server of the test's own, behind a proxy
  that every client is pointed at."""
  if request.param == "gs":
    bucket = StoppableGcs(str(tmp_path / "gcs_data"))
    bucket.start()
    proxy = StorageProxy(bucket.endpoint)
    try:
      with (environment(**gcs_environment(proxy.endpoint)),
            fsspec_options(("gs", "gcs"), token="anon")):
        forget_clients()
        yield bucket.url, proxy
        forget_clients()
    finally:
      proxy.close()
      bucket.stop()
    return
  port = free_port()
  endpoint = f"http://127.0.0.1:{port}"
  command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
  with server(command, endpoint), environment(**s3_environment(endpoint)):
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    proxy = StorageProxy(endpoint)
    try:
      with environment(AWS_ENDPOINT_URL=proxy.endpoint):
        forget_clients()
        yield f"s3://{BUCKET}", proxy
        forget_clients()
    finally:
      proxy.close()


if __name__ == "__main__":
  if sys.argv[1:2] == ["gcs"]:
    gcs_emulator.serve(int(sys.argv[2]), *sys.argv[3:4])
