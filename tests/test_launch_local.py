"""Real multi-process JAX runs through `launch.local`: 2 processes x 2 CPU devices talking
over gloo, and what happens when one of them dies."""
import os
import pathlib
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from launch.clusters import common
from launch.clusters import local as local_cluster

REPO = pathlib.Path(__file__).resolve().parents[1]

# Each process feeds only its rows of a global [8, 3] batch; a jitted reduction over the
# batch-sharded array and a shard_map psum must see every process's data.
PROGRAM = """
import os, sys, time
from sharding import distributed
distributed.initialize_from_environment()
import jax, jax.numpy as jnp, numpy as np
from sharding import mesh as mesh_lib, partition
P = jax.sharding.PartitionSpec
mesh = mesh_lib.create_mesh(mesh_lib.MeshConfig(data=-1))
rows = partition.process_batch_rows(mesh, 8)
local = np.arange(24, dtype=np.float32).reshape(8, 3)[rows]
x = partition.make_global_batch(mesh, {"x": local})["x"]
sums = jax.jit(lambda x: jnp.sum(x * x, axis=0), out_shardings=partition.replicated(mesh))(x)
ids = jax.make_array_from_callback(
    (jax.device_count(),), jax.sharding.NamedSharding(mesh, P("data")),
    lambda index: np.arange(jax.device_count(), dtype=np.float32)[index])
psum = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "data"), mesh=mesh,
                             in_specs=P("data"), out_specs=P()))(ids)
print("RESULT", jax.process_index(), jax.process_count(), jax.local_device_count(),
      jax.device_count(), rows.start, rows.stop, *np.asarray(sums).tolist(),
      float(np.asarray(psum)[0]), os.getpid(), flush=True)
if "loop" in sys.argv:
  print("READY", flush=True)
  step = jax.jit(lambda v: jnp.sum(v))
  for _ in range(3000):
    step(x).block_until_ready()
    time.sleep(0.1)
"""


@pytest.fixture(scope="module")
def program(tmp_path_factory):
  path = tmp_path_factory.mktemp("prog") / "program.py"
  path.write_text(PROGRAM)
  return str(path)


def _env():
  env = dict(os.environ)
  env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
  return env


def _launch(*args, **kwargs):
  return subprocess.Popen([sys.executable, "-m", "launch.local", *args], cwd=REPO, env=_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def test_two_processes_run_cross_process_collectives(program):
  launcher = _launch("--num_processes=2", "--devices_per_process=2", "--", sys.executable,
                     program)
  out, err = launcher.communicate(timeout=240)
  assert launcher.returncode == 0, out + err
  results = {}
  for line in out.splitlines():
    match = re.match(r"\[(\d)\] RESULT (.*)", line)
    if match:
      results[int(match.group(1))] = [float(v) for v in match.group(2).split()]
  assert sorted(results) == [0, 1], out
  expected_sums = (np.arange(24, dtype=np.float64).reshape(8, 3) ** 2).sum(axis=0)
  for index, values in results.items():
    process, count, local, total, start, stop = values[:6]
    assert (process, count, local, total) == (index, 2, 2, 4)
    assert (start, stop) == (4 * index, 4 * index + 4)  # each process feeds its own rows
    np.testing.assert_allclose(values[6:9], expected_sums)
    assert values[9] == 0 + 1 + 2 + 3


def test_failing_process_stops_the_rest_and_sets_exit_code():
  script = ("import os, sys, time\n"
            "if os.environ['JAX_PROCESS_ID'] == '2': sys.exit(3)\n"
            "time.sleep(300)\n")
  start = time.monotonic()
  launcher = _launch("--num_processes=3", "--", sys.executable, "-c", script)
  out, err = launcher.communicate(timeout=120)
  assert launcher.returncode == 3
  assert "process 2 of 3 exited with code 3; stopped the other 2 processes" in err
  assert time.monotonic() - start < 30


def test_max_restarts_starts_every_process_again_until_they_succeed(tmp_path):
  # Process 1 fails in attempts 0 and 1, but only after process 0 has recorded that attempt
  # (a marker file), so the launcher cannot stop process 0 before it prints.
  script = ("import os, sys, time\n"
            "attempt = int(os.environ['GRIFFIN_RESTART_ATTEMPT'])\n"
            "process = os.environ['JAX_PROCESS_ID']\n"
            "print('ATTEMPT', process, attempt, flush=True)\n"
            f"marker = os.path.join({str(tmp_path)!r}, f'p{{process}}_{{attempt}}')\n"
            "open(marker, 'w').close()\n"
            "if process == '1' and attempt < 2:\n"
            "  deadline = time.monotonic() + 60\n"
            "  while not os.path.exists(marker.replace('p1_', 'p0_')) and time.monotonic() < deadline:\n"
            "    time.sleep(0.05)\n"
            "  sys.exit(4)\n")
  launcher = _launch("--num_processes=2", "--max_restarts=3", "--", sys.executable, "-c",
                     script)
  out, err = launcher.communicate(timeout=120)
  assert launcher.returncode == 0, err
  attempts = sorted(tuple(line.split()[-2:]) for line in out.splitlines() if "ATTEMPT" in line)
  assert attempts == sorted((str(p), str(a)) for p in range(2) for a in range(3))
  assert err.count("process 1 of 2 exited with code 4") == 2
  assert "restart 1 of 3" in err and "restart 2 of 3" in err and "restart 3" not in err


@pytest.mark.slow   # fast tier under 5 min: restarts of real processes (6 s); max_restarts stays fast
def test_restart_budget_spent_exits_with_the_failure():
  script = "import os, sys\nsys.exit(5 if os.environ['JAX_PROCESS_ID'] == '0' else 0)\n"
  launcher = _launch("--num_processes=2", "--max_restarts=2", "--", sys.executable, "-c",
                     script)
  _, err = launcher.communicate(timeout=120)
  assert launcher.returncode == 5
  assert err.count("process 0 of 2 exited with code 5") == 3
  assert "restart 2 of 2" in err


@pytest.mark.slow   # fast tier under 5 min: waits out the backoff (4 s)
def test_restarts_that_fail_at_once_back_off():
  """A failure that repeats at once (a bucket still down) must not spend the budget in
  seconds: the pauses double while attempts keep failing within a minute."""
  assert [local_cluster.restart_delay_s(n, 1.0) for n in range(1, 9)] == [1, 2, 4, 8, 16, 32, 60, 60]
  assert local_cluster.restart_delay_s(3, 0.0) == 0
  start = time.monotonic()
  launcher = _launch("--num_processes=1", "--max_restarts=2", "--restart_backoff_s=0.5",
                     "--", sys.executable, "-c", "raise SystemExit(3)")
  _, err = launcher.communicate(timeout=120)
  assert launcher.returncode == 3
  assert "restart 1 of 2 in 0.5 s" in err and "restart 2 of 2 in 1 s" in err, err
  assert time.monotonic() - start >= 1.5  # 0.5 s, then 1 s


@pytest.mark.slow
def test_killed_process_is_named_and_launcher_exits_within_60s(program):
  launcher = _launch("--num_processes=2", "--devices_per_process=2", "--", sys.executable,
                     program, "loop")
  pids, ready = {}, 0
  for line in launcher.stdout:
    match = re.match(r"\[(\d)\] RESULT .* (\d+)$", line.strip())
    if match:
      pids[int(match.group(1))] = int(match.group(2))
    ready += "READY" in line
    if ready == 2:
      break
  assert sorted(pids) == [0, 1]
  start = time.monotonic()
  os.kill(pids[1], 9)
  _, err = launcher.communicate(timeout=120)
  elapsed = time.monotonic() - start
  print(f"launcher exited {elapsed:.1f} s after process 1 was killed")
  assert launcher.returncode != 0
  assert "process 1 of 2 was killed by signal SIGKILL" in err
  assert elapsed < 60


@pytest.mark.slow
def test_survivors_exit_on_their_own_when_a_peer_dies(program):
  """Without a launcher to clean up (a real cluster), the runtime's heartbeat timeout
  must still end the surviving process instead of leaving it blocked."""
  coordinator = f"127.0.0.1:{common.free_port()}"
  processes = []
  for index in range(2):
    env = _env()
    env.update(common.local_process_env(coordinator, 2, index, 2))
    processes.append(subprocess.Popen([sys.executable, program, "loop"], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
  try:
    for process in processes:
      for line in process.stdout:
        if "READY" in line:
          break
    start = time.monotonic()
    processes[1].kill()
    code = processes[0].wait(timeout=90)
    elapsed = time.monotonic() - start
    print(f"surviving process exited with {code} {elapsed:.1f} s after its peer was killed")
    assert code != 0
    assert elapsed < 60
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()


def _assert_usage_error(launcher, fragment):
  out, err = launcher.communicate(timeout=60)
  assert launcher.returncode == 2, (out, err)
  assert "Traceback" not in err, err
  errors = [line for line in err.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1 and fragment in errors[0], err
  assert out == ""


@pytest.mark.parametrize("args, fragment", [
    (["--num_processes=2", "python", "-c", "pass"], "after `--`"),
    (["--num_processes=2", "--"], "no command after `--`"),
    (["--num_processes=2", "stray", "--", "python", "-c", "pass"], "['stray'] before `--`"),
    (["--devices_per_process=2", "--", "python", "-c", "pass"], "--num_processes"),
])
def test_usage_errors(args, fragment):
  _assert_usage_error(_launch(*args), fragment)


@pytest.mark.parametrize("flag", ["--num_processes=0", "--num_processes=two"])
def test_bad_flag_value_is_one_line_and_exit_code_2(flag):
  _assert_usage_error(_launch(flag, "--", "python", "-c", "pass"), "--num_processes")


def test_process_environment():
  env = common.local_process_env("127.0.0.1:1234", 4, 2, 3,
                                 "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=8")
  assert env == {
      "JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
      "JAX_PROCESS_ID": "2", "JAX_PLATFORMS": "cpu",
      "XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=3"}


# Process 0 stops for a storage outage it alone saw; process 1 waits for it in a
# collective.
OUTAGE_STOP = """
import time
from plumbing import cli
from plumbing.errors import StorageOutageStop


def main(argv):
  from sharding import distributed
  distributed.initialize_from_environment()
  import jax, numpy as np
  from jax.experimental import multihost_utils
  multihost_utils.process_allgather(np.int32(1))
  if jax.process_index() == 0:
    print("STOPPING AT", time.time(), flush=True)
    raise StorageOutageStop("the storage does not answer")
  multihost_utils.process_allgather(np.int32(1))


cli.run(main)
"""


@pytest.mark.slow   # fast tier under 5 min: 6 s of processes
def test_a_process_stopped_by_an_outage_exits_without_waiting_for_the_others(tmp_path):
  """An outage stop skips JAX's shutdown barrier, which the others, waiting in the next
  collective, never reach: the stopped process exits at once and the launcher stops the
  rest (before, it waited until their hang watchdog ended them, or the barrier's 50 s)."""
  program = tmp_path / "outage_stop.py"
  program.write_text(OUTAGE_STOP)
  launcher = _launch("--num_processes=2", "--", sys.executable, str(program))
  out, err = launcher.communicate(timeout=240)
  ended = time.time()
  assert launcher.returncode == 1, out + err
  assert "[0] error: the storage does not answer" in out + err
  assert "launch.local: process 0 of 2 exited with code 1; stopped the other 1 process" \
      in err, err
  (stopping,) = [line for line in out.splitlines() if "STOPPING AT" in line]
  assert ended - float(stopping.split()[-1]) < 10, (out, err)
