"""The tracker tests' tools: a real `mlflow server` on a loopback port with a SQLite
store and MLflow's basic authentication (so that a test can be refused), a loopback server that accepts connections and never answers, and W&B's own
reader of an offline run.

The server's start-up (imports, the store's migrations) takes several seconds of CPU, so
`start_mlflow` only launches it and `wait_until_up` waits: a test module starts it
first and trains meanwhile.
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
import urllib.request
from typing import Iterator, Optional, Sequence

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
def silent_server(accepted: Optional[list] = None) -> Iterator[str]:
  """A loopback TCP server that accepts every connection and never answers (a service
  that hangs); yields its URL. The time (monotonic) of each connection it takes is
  appended to `accepted` where given. Its thread stops, and the connections close, with
  the block."""
  listener = socket.create_server(("127.0.0.1", 0))
  listener.settimeout(0.1)
  stop = threading.Event()
  held = []

  def accept() -> None:
    while not stop.is_set():
      with contextlib.suppress(TimeoutError):
        held.append(listener.accept()[0])
        if accepted is not None:
          accepted.append(time.monotonic())

  thread = threading.Thread(target=accept, daemon=True)
  thread.start()
  try:
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
  finally:
    stop.set()
    thread.join(5)
    for connection in [*held, listener]:
      connection.close()


@contextlib.contextmanager
def refusing_server() -> Iterator[str]:
  """A loopback HTTP server that answers every request 401 with a GraphQL error, as a
  tracker's server answers a key it does not know; yields its URL."""
  class Refuse(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # pylint: disable=invalid-name
      self.rfile.read(int(self.headers.get("Content-Length") or 0))
      body = b'{"errors": [{"message": "user is not logged in"}]}'
      self.send_response(401)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    do_GET = do_PUT = do_POST

    def log_message(self, *args) -> None:   # the test's output is the client's only
      del args

  with serving(Refuse) as url:
    yield url


@contextlib.contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
  """A loopback HTTP server answering with `handler` in a thread of its own until the
  block ends; yields its URL."""
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  try:
    yield f"http://127.0.0.1:{server.server_address[1]}"
  finally:
    server.shutdown()
    server.server_close()


def session_command(workdir: str, *names: str) -> list[str]:
  """A command running one session of trackers `names` alone (no trainer) in `workdir`
  (see `_session`)."""
  return [sys.executable, os.path.abspath(__file__), workdir, *names]


def _session(workdir: str, names: Sequence[str]) -> None:
  """One session of the trackers as the trainer's process 0 runs them, in a process of
  its own so that what the clients do at exit is seen too: their logs to the workdir's
  clients.log, two rows already in metrics.jsonl, a third logged, then the end, which
  waits for an unanswered call `SESSION_EXIT_WAIT_S` in the environment (seconds;
  `delivery.EXIT_WAIT_S` unset). Prints how long the end took and when it ended
  (`time.monotonic()`, which is the machine's: the test sees how long the exit took)."""
  # pylint: disable=import-outside-toplevel  # the command's, not the tests'
  from plumbing import quiet
  from pretrain.observability.trackers import RunInfo, TrackerContext, delivery
  from pretrain.observability.trackers import rows as rows_lib
  from pretrain.run_directory import RunDirectory
  quiet.keep_client_logs(RunDirectory(workdir).client_log)
  trackers = delivery.Trackers(list(names), TrackerContext(workdir), exit_wait_s=float(
      os.environ.get("SESSION_EXIT_WAIT_S", delivery.EXIT_WAIT_S)))
  trackers.start(RunInfo("outage"), SESSION_ROWS[:2])
  trackers.log(rows_lib.from_json(SESSION_ROWS[2]))
  began = time.monotonic()
  trackers.close(60)
  print(f"close took {time.monotonic() - began:.1f} s, ended at {time.monotonic():.3f}")


# The rows of a session: metrics.jsonl's two, and one logged.
SESSION_ROWS = [{"step": step, "loss": 3.0 - step / 10} for step in (1, 2, 3)]


if __name__ == "__main__":
  _session(sys.argv[1], sys.argv[2:])
