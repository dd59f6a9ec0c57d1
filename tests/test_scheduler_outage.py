"""The clusters' schedulers as outside services (docs/contracts.md, "Outside services",
"Scheduler commands"): the real `kubectl` (`launch.gke`) and the real `gcloud` (`launch.sweep
--backend=tpu_vm`, whose runs are queued resources) against a scheduler of their own on
loopback that is unreachable (a closed port), slow (a socket that accepts and never
answers) or refusing (an HTTP server answering 401 or 403). Each ends the launcher with
exit code 1 and exactly one line of the project on stderr, after the client's own
message when it has one, within the bound (`GRIFFIN_SCHEDULER_TIMEOUT_S`, here 3 s for
the slow cells). `sbatch` (`launch.slurm`) and `squeue` (a sweep's status) find slurmctld
unreachable through a slurm.conf of their own whose controller's port is closed (they
give up before any authentication, so no cluster runs); against a hung slurmctld they
are in tests/test_slurm_cluster.py, which runs a real one.

kubectl talks plain HTTP to the `server:` of a kubeconfig the test writes; gcloud talks
to `CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU` with a token from `CLOUDSDK_AUTH_ACCESS_TOKEN`
and a configuration directory of its own, its Compute Engine metadata check sent to a
closed loopback port (`GCE_METADATA_ROOT`), so that nothing leaves the machine. CI
installs kubectl (Debian's kubernetes-client, .ci/run); gcloud is not in Debian, so its
tests skip where it is not installed.
"""
import contextlib
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from typing import Iterator

import pytest

from launch.dispatch import scheduler
from launch.dispatch import sweep_job
from trainer_helpers import REPO
import tracker_tools

# The bound of the cells whose client would wait: long enough for the client to start
# and connect on a loaded machine, short enough to keep the tests cheap.
BOUND_S = 3
# Seconds a launcher takes to start on two loaded cores (imports), above what it waits
# for its command: launch.gke about 2.5 s and launch.sweep about 3.5 s when idle.
STARTUP_S = 15
# The project's line for a command that did not end within the bound (scheduler.run).
NO_ANSWER = {
    "kubectl": f"error: kubectl did not answer in {BOUND_S} s: is the cluster's API "
               "server (kubectl cluster-info) up? A submission may have gone through "
               "all the same",
    "gcloud": f"error: gcloud did not answer in {BOUND_S} s: is the Cloud TPU API (gcloud "
              "compute tpus queued-resources list) up? A submission may have gone "
              "through all the same"}
KUBECTL_REFUSED = "error: kubectl apply exited with code 1 (its message is above)"
GCLOUD_REFUSED = "error: gcloud exited with code 1 (its message is above)"
# Variables of the user's own clients that would point them elsewhere.
_CLIENT_VARIABLES = ("KUBECONFIG", "KUBECACHEDIR", "CLOUDSDK_", "GCE_METADATA",
                     "GOOGLE_APPLICATION_CREDENTIALS", "HTTP_PROXY", "HTTPS_PROXY",
                     "ALL_PROXY", "NO_PROXY", scheduler.TIMEOUT_ENV)


def _require(command: str) -> None:
  """Skips, with one line, where `command` is not installed; CI installs kubectl, so
  there a missing kubectl fails instead."""
  if shutil.which(command):
    return
  reason = f"{command} is not installed (on PATH)"
  if command == "kubectl" and os.environ.get("CI"):
    pytest.fail(reason + ": .ci/run installs Debian's kubernetes-client")
  pytest.skip(reason)


def _closed_port() -> int:
  """A loopback port nothing listens on: connecting is refused at once."""
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


@contextlib.contextmanager
def _refusing(status: int, body: dict) -> Iterator[tuple[str, list[str]]]:
  """A loopback HTTP server answering every request `status` with JSON `body`; yields
  its URL and the requests it answered."""
  seen: list[str] = []

  class Refuse(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # pylint: disable=invalid-name
      self.rfile.read(int(self.headers.get("Content-Length") or 0))
      seen.append(f"{self.command} {self.path}")
      data = json.dumps(body).encode()
      self.send_response(status)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(data)))
      self.end_headers()
      self.wfile.write(data)

    do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

    def log_message(self, *args) -> None:   # the test's output is the client's only
      del args

  with tracker_tools.serving(Refuse) as url:
    yield url, seen


def _environment(tmp_path, **values: str) -> dict:
  """The tests' environment without the user's client settings, HOME in `tmp_path` (where
  the clients keep caches and logs), and `values`."""
  env = {name: value for name, value in os.environ.items()
         if not name.upper().startswith(_CLIENT_VARIABLES)}
  home = tmp_path / "home"
  home.mkdir(exist_ok=True)
  return {**env, "HOME": str(home), **values}


def _run(argv: list, env: dict) -> tuple[subprocess.CompletedProcess, float, float]:
  """Runs a launcher from the repository: how it ended, when it started and ended
  (monotonic)."""
  began = time.monotonic()
  result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
  return result, began, time.monotonic()


# -- kubectl: launch.gke's `kubectl apply -f -` -------------------------------------------

GKE = [sys.executable, "-m", "launch.gke", "--name=outage", "--image=griffin:test",
       "--tpu_type=v5p-8", "--", "python", "-m", "pretrain.train"]


def _assert_given_up_after_the_bound(command: str, launcher) -> None:
  """Runs `launcher(url)` (its argv and environment) against a server that accepts and
  never answers; asserts one line naming `command`, exit 1, and that the launcher ended
  after the bound and within a few seconds of its client connecting."""
  accepted = []
  with tracker_tools.silent_server(accepted) as url:
    result, began, ended = _run(*launcher(url))
  assert result.returncode == 1, result.stderr
  lines = result.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith(NO_ANSWER[command]), result.stderr
  assert accepted, f"{command} never connected"
  # The client started before it connected, so the bound ran out at most BOUND_S after.
  assert ended - began >= BOUND_S and ended - accepted[0] < BOUND_S + 4, (
      ended - began, ended - accepted[0])


def _kube_env(tmp_path, server: str, bound_s: float) -> dict:
  """kubectl pointed at `server` (plain HTTP, a bearer token) by a kubeconfig of its
  own; its caches in `tmp_path`."""
  config = tmp_path / "kubeconfig"
  config.write_text(
      "apiVersion: v1\nkind: Config\n"
      f"clusters:\n- name: outage\n  cluster:\n    server: {server}\n"
      "contexts:\n- name: outage\n  context: {cluster: outage, user: outage}\n"
      "current-context: outage\n"
      "users:\n- name: outage\n  user: {token: not-a-valid-token}\n", encoding="utf-8")
  return _environment(tmp_path, KUBECONFIG=str(config),
                      KUBECACHEDIR=str(tmp_path / "kube-cache"),
                      **{scheduler.TIMEOUT_ENV: str(bound_s)})


def test_kubectl_apply_to_a_closed_port_is_kubectls_message_and_one_line(tmp_path):
  """Nothing listens at the API server's address: kubectl says so at once (its own
  line), and `launch.gke` adds its one line and exits 1, long before the bound."""
  _require("kubectl")
  port = _closed_port()
  result, began, ended = _run(GKE, _kube_env(tmp_path, f"http://127.0.0.1:{port}", 60))
  assert result.returncode == 1, result.stderr
  lines = result.stderr.splitlines()
  assert len(lines) == 2 and lines[-1] == KUBECTL_REFUSED, result.stderr
  assert f"127.0.0.1:{port}" in lines[0] and "refused" in lines[0], result.stderr
  assert ended - began < STARTUP_S, ended - began


@pytest.mark.slow   # the bound, and the launcher's start: about 6 s
def test_kubectl_apply_to_an_api_server_that_does_not_answer_is_one_line_after_the_bound(
    tmp_path):
  """The API server accepts and never answers: kubectl would wait for ever (no deadline
  of its own); `launch.gke` stops it after the bound and prints one line naming kubectl
  and `kubectl cluster-info`."""
  _require("kubectl")
  _assert_given_up_after_the_bound("kubectl", lambda url: (GKE, _kube_env(tmp_path, url,
                                                                         BOUND_S)))


# How a Kubernetes API server refuses: a Status object.
_KUBE_REFUSALS = {
    401: {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
          "message": "Unauthorized", "reason": "Unauthorized", "code": 401},
    403: {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
          "message": 'forbidden: User "outage" cannot create resource "jobsets"',
          "reason": "Forbidden", "code": 403}}


@pytest.mark.parametrize("status", [401, pytest.param(403, marks=pytest.mark.slow)])
def test_kubectl_apply_refused_is_kubectls_message_and_one_line(tmp_path, status):
  """The API server refuses the token (401) or the permission (403): kubectl's own
  message, then `launch.gke`'s one line naming `kubectl apply` and its exit code."""
  _require("kubectl")
  with _refusing(status, _KUBE_REFUSALS[status]) as (url, seen):
    result, began, ended = _run(GKE, _kube_env(tmp_path, url, 60))
  assert seen, "kubectl never asked the server"
  assert result.returncode == 1, result.stderr
  lines = result.stderr.splitlines()
  assert len(lines) == 2 and lines[-1] == KUBECTL_REFUSED, result.stderr
  if status == 401:
    assert "credentials" in lines[0], result.stderr
  assert ended - began < STARTUP_S, ended - began


# -- gcloud: launch.sweep --backend=tpu_vm's `gcloud compute tpus queued-resources create` --

def _sweep(tmp_path) -> list:
  return [sys.executable, "-m", "launch.sweep", "--families=hawk", "--sizes=20k",
          f"--workdir={tmp_path / 'study'}", "--backend=tpu_vm", "--tpu_type=v5p-8",
          "--zone=us-east5-a"]


def _gcloud_env(tmp_path, endpoint: str, bound_s: float) -> dict:
  """gcloud with an empty configuration of its own, a token, a project, no prompts, the
  Cloud TPU API at `endpoint`, and its checks for Compute Engine, updates and usage
  reporting kept on the machine."""
  config = tmp_path / "gcloud"
  config.mkdir(exist_ok=True)
  return _environment(
      tmp_path, CLOUDSDK_CONFIG=str(config),
      CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU=endpoint.rstrip("/") + "/",
      CLOUDSDK_AUTH_ACCESS_TOKEN="not-a-valid-token", CLOUDSDK_CORE_PROJECT="p",
      CLOUDSDK_CORE_DISABLE_PROMPTS="1", CLOUDSDK_CORE_DISABLE_USAGE_REPORTING="true",
      CLOUDSDK_COMPONENT_MANAGER_DISABLE_UPDATE_CHECK="true",
      CLOUDSDK_CORE_CHECK_GCE_METADATA="false",
      CLOUDSDK_METRICS_ENVIRONMENT="griffin-tests",
      GCE_METADATA_ROOT=f"127.0.0.1:{_closed_port()}",
      **{scheduler.TIMEOUT_ENV: str(bound_s)})


@pytest.mark.slow   # the bound, and the sweep's start: about 7 s
def test_gcloud_to_a_closed_port_is_one_line_after_the_bound(tmp_path):
  """Nothing listens at the Cloud TPU API's address: gcloud retries a refused
  connection (five tries, backing off 2, 4, 8 and 16 s, each within a quarter: 23 to
  38 s, then a crash report of seven lines); the sweep stops it after the bound with
  one line."""
  _require("gcloud")
  result, began, ended = _run(
      _sweep(tmp_path), _gcloud_env(tmp_path, f"http://127.0.0.1:{_closed_port()}",
                                    BOUND_S))
  assert result.returncode == 1, result.stderr
  lines = result.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith(NO_ANSWER["gcloud"]), result.stderr
  # Under gcloud's own 23 s of retries: the bound ended it.
  assert BOUND_S <= ended - began < BOUND_S + STARTUP_S, ended - began


@pytest.mark.slow   # the bound, and the sweep's start: about 7 s
def test_gcloud_to_an_api_that_does_not_answer_is_one_line_after_the_bound(tmp_path):
  """The Cloud TPU API accepts and never answers: gcloud would wait its socket timeout
  (300 s) per try; the sweep stops it after the bound with one line."""
  _require("gcloud")
  _assert_given_up_after_the_bound("gcloud", lambda url: (_sweep(tmp_path),
                                                          _gcloud_env(tmp_path, url, BOUND_S)))


# How a Google API refuses: its error object.
_GOOGLE_REFUSALS = {
    401: {"error": {"code": 401, "status": "UNAUTHENTICATED",
                    "message": "Request had invalid authentication credentials."}},
    403: {"error": {"code": 403, "status": "PERMISSION_DENIED",
                    "message": "The caller does not have permission"}}}


@pytest.mark.slow   # the sweep's and gcloud's start: about 5 s
@pytest.mark.parametrize("status", [401, 403])
def test_gcloud_refused_is_gclouds_message_and_one_line(tmp_path, status):
  """The Cloud TPU API refuses the token (401; gcloud asks twice) or the permission
  (403): gcloud's own line, then the sweep's one line naming gcloud and its exit code;
  no run is marked submitted."""
  _require("gcloud")
  with _refusing(status, _GOOGLE_REFUSALS[status]) as (url, seen):
    result, began, ended = _run(_sweep(tmp_path), _gcloud_env(tmp_path, url, 60))
  assert seen and all(request.startswith("POST /v2/projects/p/locations/us-east5-a/"
                                         "queuedResources") for request in seen), seen
  assert result.returncode == 1, result.stderr
  lines = result.stderr.splitlines()
  assert len(lines) == 2 and lines[-1] == GCLOUD_REFUSED, result.stderr
  assert lines[0].startswith("ERROR: (gcloud.compute.tpus.queued-resources.create) "
                             + _GOOGLE_REFUSALS[status]["error"]["status"]), result.stderr
  assert ended - began < STARTUP_S, ended - began
  assert not (tmp_path / "study" / "runs" / "hawk_20k" / "sweep_status.json").exists()


# -- sbatch and squeue: slurmctld unreachable ---------------------------------------------

def _slurm_env(tmp_path) -> dict:
  """SLURM's clients pointed at a controller on a closed loopback port; MessageTimeout 2
  s, so that they retry once (2 x (MessageTimeout - 1) s: 18 s at SLURM's default 10)."""
  conf = tmp_path / "slurm.conf"
  conf.write_text(
      "ClusterName=outage\nSlurmctldHost=localhost(127.0.0.1)\n"
      f"SlurmctldPort={_closed_port()}\nMessageTimeout=2\nAuthType=auth/munge\n"
      "GresTypes=gpu\nNodeName=node1 CPUs=1 State=UNKNOWN\n"
      "PartitionName=gpu Nodes=node1 Default=YES\n",
      encoding="utf-8")
  env = _environment(tmp_path, SLURM_CONF=str(conf), **{scheduler.TIMEOUT_ENV: "60"})
  return {name: value for name, value in env.items()
          if not name.startswith(("SLURM_", "SBATCH_", "SQUEUE_")) or name == "SLURM_CONF"}


def _require_slurm() -> None:
  if not (shutil.which("sbatch") and shutil.which("squeue")):
    reason = "sbatch and squeue are not installed: apt-get install slurm-wlm"
    if os.environ.get("CI"):
      pytest.fail(reason)
    pytest.skip(reason)


def test_sbatch_to_an_unreachable_controller_is_sbatchs_message_and_one_line(tmp_path):
  """slurmctld's port closed: sbatch retries, then says it cannot contact the
  controller (its own line); `launch.slurm` adds its one line and exits 1."""
  _require_slurm()
  result, began, ended = _run(
      [sys.executable, "-m", "launch.slurm", "--nodes=1", "--gpus_per_node=1",
       f"--output={tmp_path}/%j.out", "--", "true"], _slurm_env(tmp_path))
  assert result.returncode == 1, result.stderr
  lines = result.stderr.splitlines()
  assert len(lines) == 2 and lines[-1] == (
      "error: sbatch exited with code 1 (its message is above)"), result.stderr
  assert "Unable to contact slurm controller" in lines[0], result.stderr
  assert ended - began < 2 + STARTUP_S, ended - began


@pytest.mark.slow   # squeue's retry and the sweep's start: about 6 s
def test_a_sweeps_status_with_the_controller_unreachable_is_one_line(tmp_path):
  """slurmctld's port closed while a sweep has runs on SLURM: squeue, asked about the
  first run's job, retries and fails; the sweep ends with one line carrying squeue's
  message and the check, before it looks at another run or submits anything (it used
  to count each run as running, squeue's message swallowed, its wait once per run)."""
  _require_slurm()
  study = tmp_path / "study"
  for size in ("20k", "40k"):
    sweep_job.write_status(str(study / "runs" / f"hawk_{size}"), {
        "state": "submitted", "backend": "slurm", "job_id": f"7_{size[:2]}",
        "failures": 0})
  result, began, ended = _run(
      [sys.executable, "-m", "launch.sweep", "--families=hawk", "--sizes=20k,40k",
       f"--workdir={study}", "--backend=slurm"], _slurm_env(tmp_path))
  assert result.returncode == 1, result.stderr
  lines = result.stderr.splitlines()
  assert lines == [
      "error: squeue exited with code 1 (slurm_load_jobs error: Unable to contact slurm "
      "controller (connect failure)): is slurmctld (scontrol ping) up? The sweep reads "
      "its runs' jobs from it"], result.stderr
  assert "submitted" not in result.stdout, result.stdout
  assert ended - began < 2 + STARTUP_S, ended - began
