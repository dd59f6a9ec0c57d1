"""The tracker tests' tools: a real `mlflow server` on a loopback port with a SQLite
store and MLflow's basic authentication (so that a test can be refused), a loopback server that accepts connections and never answers, and W&B's own
reader of an offline run.

The server's start-up (imports, the store's migrations) takes several seconds of CPU, so
`start_mlflow` only launches it and `wait_until_up` waits: a test module starts it
first and trains meanwhile.
"""
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Iterator

# The environment of a test's `mlflow server`: no job runner (see `start_mlflow`), and
# the key basic authentication's CSRF protection demands.
QUIET_SERVER = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
                "MLFLOW_FLASK_SERVER_SECRET_KEY": "test-only-key"}
# The server's admin, created at its first start; a client logs in with these variables.
CREDENTIALS = {"MLFLOW_TRACKING_USERNAME": "admin",
               "MLFLOW_TRACKING_PASSWORD": "test-only-password"}


def start_mlflow(root: str, port: int) -> subprocess.Popen:
  """`mlflow server` in `root` (its store `root/mlflow.db`, its users `root/auth.db`),
  with basic authentication (`CREDENTIALS`), in a process group of its own (it starts
  workers), output in `root/server.log`. Its job runner (three task-queue consumers,
  about 10 s of CPU to start) is off: tracking needs none of it."""
  mlflow = os.path.join(os.path.dirname(sys.executable), "mlflow")
  auth_config = os.path.join(root, "auth.ini")
  with open(auth_config, "w", encoding="utf-8") as f:
    f.write("[mlflow]\ndefault_permission = READ\n"
            f"database_uri = sqlite:///{os.path.join(root, 'auth.db')}\n"
            f"admin_username = {CREDENTIALS['MLFLOW_TRACKING_USERNAME']}\n"
            f"admin_password = {CREDENTIALS['MLFLOW_TRACKING_PASSWORD']}\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
  with open(os.path.join(root, "server.log"), "w", encoding="utf-8") as log:
    return subprocess.Popen(
        [mlflow, "server", "--app-name", "basic-auth", "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{os.path.join(root, 'mlflow.db')}"],
        cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, **QUIET_SERVER, "MLFLOW_AUTH_CONFIG_PATH": auth_config})


def wait_until_up(process: subprocess.Popen, url: str, log_path: str,
                  timeout_s: float = 180) -> None:
  """Waits for `url`/health to answer; fails with the server's log if it never does."""
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if process.poll() is not None:
      break
    try:
      with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
        if response.status == 200:
          return
    except OSError:
      time.sleep(0.3)
  with open(log_path, encoding="utf-8") as f:
    raise AssertionError(f"mlflow server at {url} did not start:\n{f.read()[-3000:]}")


def stop(process: subprocess.Popen) -> None:
  """Stops the server and every process it started (its process group), some of which
  outlive their leader."""
  with contextlib.suppress(ProcessLookupError):
    os.killpg(process.pid, signal.SIGTERM)
  with contextlib.suppress(subprocess.TimeoutExpired):
    process.wait(timeout=10)
  with contextlib.suppress(ProcessLookupError):
    os.killpg(process.pid, signal.SIGKILL)
  process.wait()


def wandb_records(run_path: str) -> list:
  """The records of an offline W&B run (a run directory or its .wandb file), as W&B's
  own reader prints them (`wandb leet inspect --json`: one JSON object per record)."""
  wandb = os.path.join(os.path.dirname(sys.executable), "wandb")
  result = subprocess.run([wandb, "leet", "inspect", "--json", run_path],
                          capture_output=True, text=True, timeout=120, check=True)
  return [json.loads(line) for line in result.stdout.splitlines()]


@contextlib.contextmanager
def silent_server() -> Iterator[str]:
  """A loopback TCP server that accepts every connection and never answers (a service
  that hangs); yields its URL. Its thread stops, and the connections close, with the
  block."""
  listener = socket.create_server(("127.0.0.1", 0))
  listener.settimeout(0.1)
  stop = threading.Event()
  held = []

  def accept() -> None:
    while not stop.is_set():
      with contextlib.suppress(TimeoutError):
        held.append(listener.accept()[0])

  thread = threading.Thread(target=accept, daemon=True)
  thread.start()
  try:
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
  finally:
    stop.set()
    thread.join(5)
    for connection in [*held, listener]:
      connection.close()
