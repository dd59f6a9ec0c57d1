"""The storage faults `launch.chaos` injects, made with real parts rather than mocks.

A full disk: `SmallDisk` mounts a tmpfs of bounded size at a directory (the run's local
checkpoint tier) before the run starts; `fill` then writes a filler file that leaves no
byte free, as a disk filled by another job would, and `free` removes it. Mounting needs
root (or CAP_SYS_ADMIN); where it is refused, `mount` raises one line naming the fix.

A bucket that goes away: the run trains into `gs://bucket/...` on a GCS emulator
(`launch.gcs_emulator`, a real HTTP server) that the trainers reach only through
`CuttableProxy`, a TCP relay this process controls. `cut` closes every open connection
and the listening socket, so clients get "connection refused" as from a stopped server;
`restore` listens on the same port again. The emulator itself keeps running (the harness
reads the run's metrics from it directly), so the bucket comes back with its contents.
"""
from __future__ import annotations

import contextlib
import errno
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Optional

from plumbing.errors import EXIT_FAILED, UserError

FILLER = "chaos-filler"
_CHUNK = 1 << 20


class SmallDisk:
  """A tmpfs of `size_mb` MiB at `directory`, which `fill` fills and `free` empties."""

  def __init__(self, directory: str, size_mb: int):
    self.directory = directory
    self.size_mb = size_mb
    self.mounted = False

  def mount(self) -> None:
    """Mounts the tmpfs; raises a one-line UserError where mounting is refused."""
    os.makedirs(self.directory, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m", "tmpfs",
                             self.directory], capture_output=True, text=True, check=False)
    if result.returncode:
      reason = (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]
      raise UserError(f"launch.chaos: --kinds=disk_full mounts a {self.size_mb} MiB tmpfs "
                      f"at {self.directory} and could not ({reason}): run it as root (or "
                      "with CAP_SYS_ADMIN), or leave disk_full out of --kinds", EXIT_FAILED)
    self.mounted = True

  def unmount(self) -> None:
    """Unmounts (lazily: a process still holding a file there does not block it)."""
    if self.mounted:
      subprocess.run(["umount", "--lazy", self.directory], check=False,
                     capture_output=True)
      self.mounted = False

  def fill(self) -> int:
    """Writes the filler until the file system has no byte left; returns its size."""
    path = os.path.join(self.directory, FILLER)
    written = 0
    with open(path, "wb", buffering=0) as f:
      size = _CHUNK
      while size:   # the last free bytes in smaller and smaller writes
        try:
          written += f.write(b"\0" * size)
        except OSError as error:
          if error.errno != errno.ENOSPC:
            raise
          size //= 2
    return written

  def free(self) -> None:
    try:
      os.remove(os.path.join(self.directory, FILLER))
    except FileNotFoundError:
      pass


class CuttableProxy:
  """Relays TCP connections from 127.0.0.1:`port` to `target_port` until `cut`.

  One thread accepts; each connection gets two relay threads, one per direction.
  """

  def __init__(self, target_port: int, port: int = 0):
    self._target = ("127.0.0.1", target_port)
    self._lock = threading.Lock()
    self._connections: set[socket.socket] = set()
    self._listener: Optional[socket.socket] = None
    self.port = port
    self.is_cut = True
    self.restore()

  @property
  def endpoint(self) -> str:
    return f"http://127.0.0.1:{self.port}"

  def restore(self) -> None:
    """Listens (again) on the proxy's port and relays new connections."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", self.port))
    listener.listen(64)
    self.port = listener.getsockname()[1]
    with self._lock:
      self._listener, self.is_cut = listener, False
    threading.Thread(target=self._accept, args=(listener,), daemon=True,
                     name="proxy-accept").start()

  def cut(self) -> None:
    """Closes the listener and every relayed connection: new connections are refused
    and requests in flight fail, as when the server's host goes away."""
    with self._lock:
      listener, self._listener, self.is_cut = self._listener, None, True
      connections, self._connections = self._connections, set()
    if listener is not None:
      _close(listener)
    for connection in connections:
      _close(connection)

  def close(self) -> None:
    self.cut()

  def _accept(self, listener: socket.socket) -> None:
    while True:
      try:
        client, _ = listener.accept()
      except OSError:  # closed by `cut`
        return
      try:
        upstream = socket.create_connection(self._target, timeout=10)
        upstream.settimeout(None)
      except OSError:
        _close(client)
        continue
      with self._lock:
        if self._listener is not listener:   # cut meanwhile
          _close(client)
          _close(upstream)
          continue
        self._connections.update((client, upstream))
      for source, sink in ((client, upstream), (upstream, client)):
        threading.Thread(target=self._relay, args=(source, sink), daemon=True,
                         name="proxy-relay").start()

  def _relay(self, source: socket.socket, sink: socket.socket) -> None:
    """Copies bytes one way until either side closes; then closes both."""
    try:
      while data := source.recv(65536):
        sink.sendall(data)
    except OSError:
      pass
    finally:
      with self._lock:
        self._connections.discard(source)
        self._connections.discard(sink)
      _close(source)
      _close(sink)


def _close(sock: socket.socket) -> None:
  try:
    sock.shutdown(socket.SHUT_RDWR)
  except OSError:
    pass
  sock.close()


def free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def start_gcs_emulator(data_dir: str, timeout_s: float = 60.0,
                       log_path: Optional[str] = None) -> tuple[subprocess.Popen, int]:
  """Starts `launch.gcs_emulator` on a free port, its objects under `data_dir` and its
  stderr in `log_path` (default: discarded); returns the process and its port once it
  answers. A missing emulator package is one line."""
  if importlib.util.find_spec("gcp_storage_emulator") is None:
    raise UserError("launch.chaos: --gcs_emulator needs the gcp-storage-emulator package: "
                    "pip install gcp-storage-emulator (or the project's `test` extra)",
                    EXIT_FAILED)
  port = free_port()
  with contextlib.ExitStack() as stack:
    log = (stack.enter_context(open(log_path, "ab")) if log_path  # pylint: disable=consider-using-with
           else subprocess.DEVNULL)
    process = subprocess.Popen([sys.executable, "-m", "launch.gcs_emulator", str(port),
                                data_dir], stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=log)
  url = f"http://127.0.0.1:{port}/storage/v1/b"
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if process.poll() is not None:
      raise UserError(f"launch.chaos: the GCS emulator exited with code {process.returncode}"
                      f" before serving (try: python -m launch.gcs_emulator {port})",
                      EXIT_FAILED)
    try:
      urllib.request.urlopen(url, timeout=2).close()
      return process, port
    except urllib.error.HTTPError:   # any HTTP answer: it serves
      return process, port
    except OSError:
      time.sleep(0.1)
  process.kill()
  raise UserError(f"launch.chaos: the GCS emulator did not answer within {timeout_s:.0f} s",
                  EXIT_FAILED)


def stop_process(process: subprocess.Popen, signal_number: int = signal.SIGINT,
                 timeout_s: float = 10.0) -> None:
  """`signal_number`, then SIGKILL if the process lingers past `timeout_s`. SIGINT by
  default: the emulator finishes the request it serves."""
  if process.poll() is None:
    process.send_signal(signal_number)
    try:
      process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()
