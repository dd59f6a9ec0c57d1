"""A loopback stand-in for a W&B server: the part of W&B's HTTP API that wandb 0.31's
`wandb-core` uses for `wandb.init` (a new run or a resumed one), `run.log` and
`run.finish`, keeping the history rows it is sent. It can go down mid-run (a closed
port, or every request held without an answer) and answer again. The real server
(wandb/local) is a Docker image, which the tests cannot run.

What wandb 0.31 asks, measured with a server that logged every request: GraphQL at
`/graphql` (`RunResumeStatus`, `UpsertBucket`, `OrganizationCoreWeaveOrganizationID`,
`CreateRunFiles` for the run's files, whose upload URLs point back here for a `PUT`),
the file stream (`POST /files/<entity>/<project>/<run>/file_stream`: history, summary
and system-metrics lines by offset), and W&B's telemetry of its own use (`POST
/sdk/otel/v1/metrics`, answered with nothing; the tracker turns it off).
"""
import contextlib
import http.server
import json
import threading
from typing import Any, Iterator, Optional

# The states of the stand-in: answering; its port closed (the connections the client
# keeps are closed unanswered); holding every request without an answer (a server that
# hangs).
UP, CLOSED, SILENT = "up", "closed", "silent"
ENTITY = "stand-in"


class WandbStandIn:
  """One stand-in server's runs, by name: their config, history rows (W&B's `_step`
  and the values logged, in the order they arrived) and summary.

  Attributes:
    url: the server's base URL (`WANDB_BASE_URL`).
  """

  def __init__(self):
    self.url = ""
    self._state = UP
    self._down_at: Optional[tuple[str, str]] = None
    self._runs: dict[str, dict[str, Any]] = {}
    self._lock = threading.Lock()
    self.released = threading.Event()   # set when the stand-in shuts down: held requests end
    self._server: Optional[_Server] = None

  def listen(self, port: int = 0) -> None:
    """Answers on `port` (0: a free one), in a thread of its own."""
    server = _Server(("127.0.0.1", port), _handler(self))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    self._server = server
    self.url = f"http://127.0.0.1:{server.server_address[1]}"

  def stop_listening(self) -> None:
    """Closes the port: a connection the client opens now is refused."""
    with self._lock:
      server, self._server = self._server, None
    if server is not None:
      server.shutdown()
      server.server_close()

  def go_down(self, state: str, at: str) -> None:
    """Goes `state` (`CLOSED`, `SILENT`) at the first request to a path starting with
    `at` ("/files/": the run has started, its rows never arrive), which gets no
    answer."""
    with self._lock:
      self._down_at = (at, state)

  def come_back(self) -> None:
    """Answers again, on the same port."""
    with self._lock:
      self._state, self._down_at = UP, None
    if self._server is None:
      self.listen(int(self.url.rsplit(":", 1)[1]))

  def history(self, run: str) -> list[dict[str, Any]]:
    with self._lock:
      return list(self._runs.get(run, {}).get("history", []))

  def state_for(self, path: str) -> str:
    """The state a request to `path` meets (it may be the one that takes it down)."""
    with self._lock:
      if self._down_at is not None and path.startswith(self._down_at[0]):
        self._state, self._down_at = self._down_at[1], None
      state = self._state
    if state == CLOSED:
      self.stop_listening()
    return state

  def graphql(self, operation: str, variables: dict[str, Any]) -> dict[str, Any]:
    """The answer to one GraphQL operation."""
    with self._lock:
      if operation == "RunResumeStatus":
        return {"model": {"id": "project", "name": variables.get("project"),
                          "entity": {"id": "entity", "name": ENTITY},
                          "bucket": self._resume_status(variables["name"])}}
      if operation == "UpsertBucket":
        return {"upsertBucket": {"bucket": self._upsert(variables), "inserted": True}}
      if operation == "CreateRunFiles":
        return {"createRunFiles": {"runID": variables["run"], "uploadHeaders": [],
                                   "files": [{"name": name,
                                              "uploadUrl": f"{self.url}/upload/{name}"}
                                             for name in variables["files"]]}}
      return {}   # OrganizationCoreWeaveOrganizationID and the like: nothing to say

  def _resume_status(self, name: str) -> Optional[dict[str, Any]]:
    """What a resumed run starts from: its history's length and last row, summary and
    config (None: no such run, W&B starts a new one)."""
    run = self._runs.get(name)
    if run is None:
      return None
    history = run["history"]
    return {"id": name, "name": name, "displayName": name,
            "summaryMetrics": json.dumps(run["summary"]),
            "logLineCount": 0, "historyLineCount": len(history), "eventsLineCount": 0,
            "historyTail": json.dumps([json.dumps(row) for row in history[-1:]]),
            "eventsTail": "[]", "config": json.dumps(run["config"]), "tags": [],
            "notes": None, "wandbConfig": None}

  def _upsert(self, variables: dict[str, Any]) -> dict[str, Any]:
    name = variables.get("name") or variables.get("id")
    run = self._run(name)
    if variables.get("config"):
      run["config"] = json.loads(variables["config"])
    return {"id": name, "name": name, "displayName": variables.get("displayName") or name,
            "description": "", "config": json.dumps(run["config"]), "sweepName": None,
            "project": {"id": "project", "name": variables.get("project"),
                        "entity": {"id": "entity", "name": ENTITY}},
            "historyLineCount": len(run["history"])}

  def _run(self, name: str) -> dict[str, Any]:
    return self._runs.setdefault(name, {"history": [], "summary": {}, "config": {}})

  def file_stream(self, run: str, files: dict[str, Any]) -> None:
    """Keeps the history lines past what the run has (W&B resends from an offset) and
    the newest summary."""
    with self._lock:
      kept = self._run(run)
      history = files.get("wandb-history.jsonl")
      if history:
        rows = [json.loads(line) for line in history["content"]]
        del kept["history"][history["offset"]:]
        kept["history"].extend(rows)
      summary = files.get("wandb-summary.json")
      if summary and summary["content"]:
        kept["summary"] = json.loads(summary["content"][-1])


def _handler(server: WandbStandIn) -> type:
  """The HTTP handler answering for `server`."""

  class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"   # wandb-core keeps its connections

    def do_POST(self) -> None:  # pylint: disable=invalid-name
      body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
      state = server.state_for(self.path)
      if state == SILENT:
        server.released.wait()
      if state != UP:
        self.close_connection = True
        return
      if self.path.endswith("/graphql"):
        request = json.loads(body)
        self._answer({"data": server.graphql(request.get("operationName", ""),
                                             request.get("variables") or {})})
      elif self.path.endswith("/file_stream"):
        server.file_stream(self.path.split("/")[-2], json.loads(body)["files"])
        self._answer({"exitcode": None, "limits": {}})
      else:   # uploads of the run's files, telemetry
        self._answer({})

    do_PUT = do_POST

    def _answer(self, value: Any) -> None:
      body = json.dumps(value).encode()
      self.send_response(200)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    def log_message(self, *args) -> None:   # the test's output is the client's only
      del args

  return Handler


class _Server(http.server.ThreadingHTTPServer):
  """Says nothing of connections the client drops (it does, when the stand-in goes
  down or at its exit)."""

  def handle_error(self, request, client_address) -> None:
    del request, client_address


@contextlib.contextmanager
def wandb_stand_in() -> Iterator[WandbStandIn]:
  """A stand-in W&B server on a loopback port, answering until the block ends (then
  its held requests end unanswered and its port closes)."""
  stand_in = WandbStandIn()
  stand_in.listen()
  try:
    yield stand_in
  finally:
    stand_in.released.set()
    stand_in.stop_listening()
