"""One path layer: local paths, `gs://` and `s3://` URLs for every file the project touches.

Workdirs (config.gin, metrics.jsonl, TensorBoard, checkpoints), tokenizer models, token
stores and convert output all go through this module, so a run on a TPU pod, whose hosts
share a bucket and no disk, writes where a run on one machine does.

Backends, no hand-written cloud client:
  * files and directories: `etils.epath` on its fsspec backend (gcsfs, s3fs). epath would
    otherwise pick TensorFlow's gfile when TensorFlow is installed (it is, for SeqIO), and
    gfile has no `s3://` and ignores emulator endpoints; `EPATH_USE_TF=false` is set here,
    before any epath call, so one backend serves both schemes (Orbax uses epath too).
  * arrays: tensorstore kvstores (`kvstore_spec`), with the endpoint of an S3-compatible
    server taken from `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL` as boto does.
  * Orbax checkpoints: Orbax 0.12 builds tensorstore specs for local and `gs://` paths
    only; `_teach_orbax_s3` lets it write `s3://` through the same `kvstore_spec`.

Credentials and endpoints come from each client's usual environment (see the README,
"Object storage").

Object stores have no append and no rename: a whole-object write is atomic, so files
that change (metrics.jsonl) are rewritten whole (`write_text`), never appended to.
"""
from __future__ import annotations

import os

os.environ.setdefault("EPATH_USE_TF", "false")  # before epath resolves a backend

import base64
import functools
import hashlib
import logging
import re
import socket
import ssl
import tempfile
import threading
import time
import urllib.parse
import uuid
from typing import Any, Callable, Optional, TypeVar

import fsspec
import fsspec.config
from etils import epath
from orbax.checkpoint._src.serialization import tensorstore_utils as _orbax_ts_utils

from plumbing.errors import UserError, usage_error

SCHEMES = ("gs://", "s3://")
# The most a command's start-up check of its bucket's endpoint waits for it to connect and
# answer (`check_writable`): a storage that is not there fails in one line before any
# compute, not after the clients' own timeouts and retries.
STARTUP_PROBE_S = 5.0
# The most the start-up check then waits for its probe file to be written and removed: a
# storage that answers the connection check and then stalls, or a client that retries a
# refusal (gcsfs retries a 401 'Invalid Credentials' 6 times, about 35 s), fails in one
# line within STARTUP_PROBE_S + STARTUP_WRITE_S.
STARTUP_WRITE_S = 10.0
# gcsfs logs each request that ran out of retries with a traceback; `guarded` reports the
# failure itself, in one line.
logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
# gcsfs and s3fs cache directory listings for the life of a process; other processes
# (the other hosts, a restarted run, Orbax's own writes) change a bucket under it, and a
# stale listing hides checkpoint steps. List afresh every time.
for _protocol in ("gs", "gcs", "s3"):
  fsspec.config.conf.setdefault(_protocol, {}).setdefault("use_listings_cache", False)
T = TypeVar("T")


def is_url(path: str) -> bool:
  """Whether `path` names object storage (`gs://`, `s3://`) rather than a local file."""
  return str(path).startswith(SCHEMES)


def resolve(path: str) -> str:
  """A URL unchanged (without a trailing slash); a local path made absolute ('~' too)."""
  path = os.fspath(path)
  if is_url(path):
    return path.rstrip("/")
  return os.path.abspath(os.path.expanduser(path))


def join(base: str, *names: str) -> str:
  """`base/name/...` for local paths and URLs alike."""
  if is_url(base):
    return "/".join([base.rstrip("/"), *names])
  return os.path.join(base, *names)


def as_path(path: str) -> epath.Path:
  return epath.Path(resolve(path))


def exists(path: str) -> bool:
  return guarded(path, lambda: as_path(path).exists())


def isdir(path: str) -> bool:
  return guarded(path, lambda: as_path(path).is_dir())


def makedirs(path: str) -> None:
  """Creates a directory and its parents (on object storage: nothing to create)."""
  guarded(path, lambda: as_path(path).mkdir(parents=True, exist_ok=True))


READ_ATTEMPTS = 6


def read_bytes(path: str) -> bytes:
  """The whole file; an object replaced while being read (a writer's new version, e.g.
  metrics.jsonl of a live run, rewritten every logged step) is read again, up to
  `READ_ATTEMPTS` times, 0.1 s apart."""
  def read():
    for attempt in range(READ_ATTEMPTS):
      try:
        return as_path(path).read_bytes()
      except OSError as error:  # s3fs.utils.FileExpired: replaced while being read
        if type(error).__name__ != "FileExpired" or attempt == READ_ATTEMPTS - 1:
          raise
        time.sleep(0.1)
  return guarded(path, read)


def read_text(path: str) -> str:
  return read_bytes(path).decode("utf-8")


def write_bytes(path: str, data: bytes) -> None:
  """Writes the whole file at once: readers see the old or the new content, never a
  mix (local: a temporary file renamed over it; object storage: one upload)."""
  def write():
    if is_url(path):
      as_path(path).write_bytes(data)
      return
    target = resolve(path)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    temporary = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
    with open(temporary, "wb") as f:
      f.write(data)
    os.replace(temporary, target)
  guarded(path, write)


def write_text(path: str, text: str) -> None:
  write_bytes(path, text.encode("utf-8"))


def remove(path: str) -> None:
  guarded(path, lambda: as_path(path).unlink(missing_ok=True))


def rmtree(path: str) -> None:
  """Deletes a directory tree (or the objects under a prefix); absent is fine."""
  def delete():
    target = as_path(path)
    if target.exists():
      target.rmtree()
  guarded(path, delete)


def listdir(path: str) -> list[str]:
  """Names directly under `path`, sorted; [] when it does not exist."""
  def names():
    target = as_path(path)
    return sorted(p.name for p in target.iterdir()) if target.exists() else []
  return guarded(path, names)


def list_files(directory: str) -> dict[str, int]:
  """Every file under `directory`, recursively, by its '/'-separated path relative to
  it, with its size in bytes; {} when it does not exist. On object storage this is one
  listing (paged), not a request per directory."""
  def files():
    if is_url(directory):
      fs, root = fsspec.core.url_to_fs(resolve(directory))
      found = fs.find(root, detail=True) if fs.exists(root) else {}
      return {path[len(root):].lstrip("/"): int(info["size"])
              for path, info in found.items()}
    root = resolve(directory)
    return {os.path.relpath(os.path.join(parent, name), root).replace(os.sep, "/"):
            os.path.getsize(os.path.join(parent, name))
            for parent, _, names in os.walk(root) for name in names}
  return guarded(directory, files)


def stored_crc32c(directory: str) -> dict[str, str]:
  """The CRC32C (8 hex digits) of every object under a `gs://` directory, by relative
  path, as GCS computed it from the stored bytes (one listing, no download); {} for
  other storage, whose listings carry no such checksum."""
  if not str(directory).startswith("gs://"):
    return {}
  def checksums():
    fs, root = fsspec.core.url_to_fs(resolve(directory))
    found = fs.find(root, detail=True) if fs.exists(root) else {}
    return {path[len(root):].lstrip("/"): base64.b64decode(info["crc32c"]).hex()
            for path, info in found.items() if info.get("crc32c")}
  return guarded(directory, checksums)


def open_read(path: str) -> Any:
  """A binary file object of `path` for reading in pieces (large files)."""
  return guarded(path, lambda: as_path(path).open("rb"))


def move_tree(source: str, destination: str) -> None:
  """Moves a directory to `destination` (which must not exist): one atomic rename on
  a local disk; on object storage, which cannot rename, a server-side copy of every
  object followed by the deletion of `source` (interrupted, `source` is still whole or
  was already copied)."""
  def move():
    if not is_url(source):
      os.rename(resolve(source), resolve(destination))
      return
    fs, source_root = fsspec.core.url_to_fs(resolve(source))
    destination_root = fsspec.core.url_to_fs(resolve(destination))[1]
    for name in list_files(source):
      fs.copy(f"{source_root}/{name}", f"{destination_root}/{name}")
    fs.rm(source_root, recursive=True)
  guarded(source, move)


def copy(source: str, destination: str) -> None:
  write_bytes(destination, read_bytes(source))


def upload_tree(local_dir: str, destination: str) -> None:
  """Copies every file under `local_dir` to the same relative path under `destination`
  (a directory or a URL), for outputs that a library writes only to local disk."""
  for parent, _, names in os.walk(local_dir):
    relative = os.path.relpath(parent, local_dir)
    parts = [] if relative == "." else relative.split(os.sep)
    for name in names:
      copy(os.path.join(parent, name), join(destination, *parts, name))


def local_copy(path: str) -> str:
  """A local file with the content of `path`: the path itself when local; for a URL a
  download into a content-addressed cache (`$GRIFFIN_DOWNLOAD_CACHE`, default
  ~/.cache/griffin_pretrain/downloads), for readers that need a real file (SentencePiece,
  Gin)."""
  if not is_url(path):
    return resolve(path)
  data = read_bytes(path)
  cache = os.path.expanduser(os.environ.get(
      "GRIFFIN_DOWNLOAD_CACHE", os.path.join("~", ".cache", "griffin_pretrain", "downloads")))
  target = os.path.join(cache, f"{hashlib.sha256(data).hexdigest()[:32]}-{os.path.basename(path)}")
  if not os.path.exists(target):
    write_bytes(target, data)
  return target


def check_writable(directory: str, flag: str = "--workdir") -> None:
  """Creates `directory` and proves it writable (a probe file written and removed), so
  a wrong bucket, endpoint or permission fails in one line before any compute: on
  object storage within STARTUP_PROBE_S (the endpoint answers) + STARTUP_WRITE_S (the
  probe file)."""
  if not is_url(directory) and os.path.exists(directory) and not os.path.isdir(directory):
    raise usage_error(f"{flag} {directory} is a file, not a directory; choose a "
                      "directory (it is created if missing)")
  check_reachable(directory, STARTUP_PROBE_S, schemes=SCHEMES, answer=True)
  try:
    if is_url(directory):  # on S3, s3fs's makedirs would create a missing bucket
      probe = join(directory, f".write_test-{uuid.uuid4().hex[:8]}")
      _within(probe, STARTUP_WRITE_S, lambda: (write_bytes(probe, b""), remove(probe)))
    else:
      makedirs(directory)
      with tempfile.NamedTemporaryFile(dir=directory, prefix=".write_test"):
        pass
  except UserError as error:
    raise UserError(f"{flag} {directory} is not writable: {error}") from None
  except OSError as error:
    raise UserError(f"{flag} {directory} is not writable: {error.strerror or error}. "
                    f"Choose another {flag} or fix its permissions.") from None


class _RetriedErrors(logging.Handler):
  """Collects the HTTP errors gcsfs retries (it logs each at DEBUG and says nothing
  else until it gives up), so that a call cut short by `_within` can name the refusal
  it was retrying (a 401) rather than only the time it took. Errors without a status
  (a refused connection) are left out: gcsfs's records name no request, and another
  thread's retries (a call left behind by an earlier check) must not name this one."""

  def __init__(self):
    super().__init__(logging.DEBUG)
    self.errors: list[str] = []

  def emit(self, record: logging.LogRecord) -> None:
    message = record.getMessage()
    if " retrying after exception: " in message:
      error = message.split(" retrying after exception: ", 1)[1]
      if re.search(r"\b[45]\d\d$", error):   # gcsfs's HttpError: "message, status"
        self.errors.append(error)


def _within(path: str, timeout_s: float, action: Callable[[], T]) -> T:
  """`action()` (storage calls on `path`), waited for at most `timeout_s`, else a
  one-line UserError naming the last error gcsfs retried (for a gs:// path) or, when
  none, the silence. The action runs in a daemon thread that is left behind when it
  does not end: the clients' own timeouts and retries (minutes) are not the project's
  bound. Meanwhile gcsfs's records go to the collector only, not to the console."""
  outcome: dict[str, Any] = {}

  def run() -> None:
    try:
      outcome["value"] = action()
    except BaseException as error:  # pylint: disable=broad-except  # re-raised below
      outcome["error"] = error

  logger, collector = logging.getLogger("gcsfs"), _RetriedErrors()
  level, propagate = logger.level, logger.propagate
  if str(path).startswith("gs://"):
    logger.addHandler(collector)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
  try:
    worker = threading.Thread(target=run, name="storage-check", daemon=True)
    worker.start()
    worker.join(timeout_s)
  finally:
    logger.removeHandler(collector)
    logger.setLevel(level)
    logger.propagate = propagate
  if worker.is_alive():
    host, port, _ = _endpoint(path)
    reason = (f"{collector.errors[-1]}; retried for {timeout_s:g} s" if collector.errors
              else f"{host}:{port}: no answer in {timeout_s:g} s")
    raise UserError(describe_error(path, TimeoutError(reason)))
  if "error" in outcome:
    raise outcome["error"]
  return outcome["value"]


def _endpoint(url: str) -> tuple[str, int, bool]:
  """(host, port, whether over TLS) the clients of `url` talk to: for gs://,
  `STORAGE_EMULATOR_HOST` (an emulator) or GCS itself; for s3://, `AWS_ENDPOINT_URL_S3`
  / `AWS_ENDPOINT_URL` or S3 itself."""
  if str(url).startswith("gs://"):
    address = os.environ.get("STORAGE_EMULATOR_HOST") or "https://storage.googleapis.com"
  else:
    address = (os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
               or "https://s3.amazonaws.com")
  parsed = urllib.parse.urlsplit(address if "://" in address else "http://" + address)
  tls = parsed.scheme == "https"
  return parsed.hostname or "", parsed.port or (443 if tls else 80), tls


def check_reachable(url: str, timeout_s: float = 10, schemes: tuple[str, ...] = ("gs://",),
                    answer: bool = False) -> None:
  """Fails fast, in one line, when nothing answers at the endpoint of a URL of
  `schemes` (other paths pass); with `answer`, also when the endpoint accepts the
  connection but does not answer within `timeout_s` in all (see `_await_answer`).

  gcsfs retries a refused connection 6 times with exponential backoff (about 36 s before
  the error) and offers no setting for it; one TCP connection to its endpoint tells the
  same in milliseconds. Skipped behind an HTTP(S) proxy, which may be the only route to
  the endpoint. `check_writable` and the checkpoint hook (`reachable`) probe `s3://`
  endpoints too: botocore's connection errors reach s3fs's callers under several names,
  one connection attempt names the problem the same way every time.
  """
  proxies = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")
  if not str(url).startswith(schemes) or any(os.environ.get(name) for name in proxies):
    return
  host, port, tls = _endpoint(url)
  deadline = time.monotonic() + timeout_s
  try:
    with socket.create_connection((host, port), timeout=timeout_s) as connection:
      if answer:
        _await_answer(connection, host, tls, deadline)
  except OSError as error:
    text = (f"no answer in {timeout_s:g} s" if isinstance(error, TimeoutError)
            else error.strerror or error)
    reason = ConnectionError(f"{host}:{port}: {text}")
    raise UserError(describe_error(url, reason)) from None


def _await_answer(connection: socket.socket, host: str, tls: bool, deadline: float) -> None:
  """Waits until the endpoint on `connection` says something, by `deadline` (else
  TimeoutError): a server that accepts and never answers (hung, or a black hole behind
  a load balancer) would otherwise hold each client call for its own timeouts, minutes
  with retries. Over TLS a completed handshake is the answer (the certificate is the
  clients' to check); else the first byte of the reply to a HEAD request."""
  connection.settimeout(max(deadline - time.monotonic(), 0.01))
  if tls:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.wrap_socket(connection, server_hostname=host).close()
    return
  connection.sendall(f"HEAD / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
                     .encode("ascii"))
  connection.recv(1)


def reachable(url: str, timeout_s: float = 2.0) -> Optional[str]:
  """None when the storage of `url` answers within `timeout_s` (always, for a local
  path); otherwise why not, in one line. One connection and the first byte of an
  answer (`check_reachable`'s `answer`): cheap enough to ask at every step of an
  outage, and a storage that accepts connections and stalls (a hung server, a black
  hole behind a load balancer) counts as down, so a save waits for it as for one that
  refuses connections instead of for the clients' own timeouts."""
  try:
    check_reachable(url, timeout_s, schemes=SCHEMES, answer=True)
  except UserError as error:
    return str(error)
  return None


def _endpoint_variables(path: str) -> str:
  return ("STORAGE_EMULATOR_HOST" if str(path).startswith("gs://")
          else "AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3")


def _one_line(error: BaseException) -> str:
  text = " ".join(str(error).split()) or type(error).__name__
  return text[:200] + "..." if len(text) > 200 else text


def refusal(path: str, error: BaseException) -> Optional[str]:
  """One line naming the storage's refusal of a request on `path` (HTTP 401, 403 or
  404) and what to check; None when `error` is no refusal (the storage did not answer,
  or something else failed). A refusal is the storage's answer: retrying it, or
  waiting for the storage as for an outage, cannot help before the credentials, the
  permission or the bucket are fixed."""
  # A refused connection names the endpoint, whose port may hold "403" (127.0.0.1:40383):
  # HTTP statuses count as whole numbers, and only in errors that are no ConnectionError.
  if isinstance(error, ConnectionError):
    return None
  text = _one_line(error)
  credentials = ("GOOGLE_APPLICATION_CREDENTIALS or `gcloud auth application-default "
                 "login`" if str(path).startswith("gs://") else "AWS_ACCESS_KEY_ID / "
                 "AWS_SECRET_ACCESS_KEY or AWS_PROFILE")
  bucket = str(path).split("/")[2] if "//" in str(path) else path
  if re.search(r"\b401\b", text) or "Unauthorized" in text:
    return (f"the storage of {path} refused the credentials (HTTP 401: {text}); check "
            f"the credentials in use ({credentials}) and {_endpoint_variables(path)}")
  # gcsfs raises a 403 as OSError("Forbidden: URL\nmessage"), s3fs as PermissionError.
  if (isinstance(error, PermissionError) or re.search(r"\b403\b", text)
      or "AccessDenied" in text or text.startswith("Forbidden")):
    return (f"permission denied on {path} (HTTP 403): the credentials in use may not "
            f"write bucket '{bucket}' ({text}); check their permissions ({credentials})")
  if (isinstance(error, FileNotFoundError) or "NoSuchBucket" in text
      or re.search(r"\b404\b", text)):
    return f"{path}: not found; does bucket '{bucket}' exist? ({text})"
  return None


def describe_error(path: str, error: BaseException) -> str:
  """One line naming what went wrong with `path` on object storage and what to check."""
  return refusal(path, error) or (
      f"cannot reach the storage of {path} ({type(error).__name__}: {_one_line(error)}); "
      f"check the network, the credentials and {_endpoint_variables(path)}")


def guarded(path: str, action: Callable[[], T]) -> T:
  """Runs `action`; on object storage a client error becomes a one-line UserError
  (local paths keep their OSError, which callers already report)."""
  if not is_url(path):
    return action()
  try:
    return action()
  except UserError:
    raise
  except Exception as error:  # pylint: disable=broad-except  # clients raise many kinds
    raise UserError(describe_error(path, error)) from None


def kvstore_spec(location: str) -> dict[str, Any]:
  """The tensorstore kvstore of a directory: `file`, `gcs` or `s3` (with the endpoint and
  region of `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL` and `AWS_REGION`, when set)."""
  location = resolve(location)
  if not is_url(location):
    return {"driver": "file", "path": location + "/"}
  scheme, rest = location.split("://", 1)
  bucket, _, prefix = rest.partition("/")
  spec: dict[str, Any] = {"driver": "gcs" if scheme == "gs" else "s3", "bucket": bucket,
                          "path": prefix + "/" if prefix else ""}
  if scheme == "s3":
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
      spec["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
      spec["aws_region"] = region
  return spec


def _replace_gcs_with_s3(node: Any, bucket: str) -> Any:
  """`node` (a tensorstore spec built for gs://bucket/...) with its gcs kvstores made s3."""
  if isinstance(node, dict):
    if node.get("driver") == "gcs" and node.get("bucket") == bucket:
      spec = kvstore_spec(f"s3://{bucket}/{node.get('path', '')}")
      spec["path"] = node.get("path", "")  # keep Orbax's own trailing-slash choice
      return spec
    return {key: _replace_gcs_with_s3(value, bucket) for key, value in node.items()}
  if isinstance(node, list):
    return [_replace_gcs_with_s3(value, bucket) for value in node]
  return node


def _teach_orbax_s3() -> None:
  """Orbax 0.12 writes arrays through tensorstore specs it builds for local and gs://
  paths only (an s3:// path fails as 'not absolute'). Build the gs:// spec of the same
  bucket and path, then swap its gcs kvstores for `kvstore_spec`'s s3 ones."""
  original = _orbax_ts_utils.build_kvstore_tspec
  if getattr(original, "handles_s3", False):
    return

  @functools.wraps(original)
  def build_kvstore_tspec(directory, *args, **kwargs):
    directory = os.fspath(directory)
    if not directory.startswith("s3://"):
      return original(directory, *args, **kwargs)
    bucket = directory[len("s3://"):].split("/", 1)[0]
    spec = original("gs://" + directory[len("s3://"):], *args, **kwargs)
    return _replace_gcs_with_s3(spec, bucket)

  build_kvstore_tspec.handles_s3 = True
  _orbax_ts_utils.build_kvstore_tspec = build_kvstore_tspec


_teach_orbax_s3()

