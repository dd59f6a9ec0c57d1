"""What a new user sees: no third-party noise before our first line, every error one
line on stderr with exit code 2 for a command-line or config mistake, and `-h`/`--help`
listing a command's own flags and the shared ones."""
import os
import signal
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_FLAGS = ("--[no]traceback", "--[no]verbose")
GIN_FLAGS = ("--gin_file", "--gin_param")


def _run(*args, env_extra=None):
  """A command as a user runs it: no test-only logging settings in the environment."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("TF_CPP_MIN_LOG_LEVEL", "JAX_PLATFORMS", "XLA_FLAGS")}
  env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
  env.update(env_extra or {})
  return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=240)


def _one_line_error(result, code=2):
  assert result.returncode == code, (result.returncode, result.stderr)
  lines = result.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
  return lines[0]


def test_macro_typo_is_one_clean_line_before_any_work(tmp_path):
  workdir = tmp_path / "run"
  line = _one_line_error(_run("pretrain.train", "--gin_file=configs/quickstart.gin",
                              "--gin_param=TRAIN_STEP=20", f"--workdir={workdir}"))
  assert line == ("error: Gin macro TRAIN_STEP is set but nothing reads it; did you mean "
                  "TRAIN_STEPS?")
  assert not workdir.exists()


@pytest.mark.slow
def test_cluster_command_without_data_config_names_the_file_to_add(tmp_path):
  line = _one_line_error(_run(
      "pretrain.train", "--gin_file=configs/models/griffin_7b.gin",
      "--gin_file=configs/mesh/fsdp_tensor4.gin", "--gin_file=configs/base/trainer.gin",
      f"--workdir={tmp_path / 'run'}"))
  assert "No data configuration: add one of configs/data/*.gin" in line


@pytest.mark.slow
def test_workdir_naming_a_file(tmp_path):
  existing = tmp_path / "notes.txt"
  existing.write_text("x")
  line = _one_line_error(_run("pretrain.train", "--gin_file=configs/quickstart.gin",
                              f"--workdir={existing}"))
  assert line == (f"error: --workdir {existing} is a file, not a directory; choose a "
                  "directory (it is created if missing)")


@pytest.mark.slow
@pytest.mark.parametrize("args,fragment", [
    (("pretrain.sample", "--workdir=/nonexistent", "--prompt=a", "--max_new_tokens=-1"),
     "--max_new_tokens=-1"),
    (("pretrain.train", "--workdir=/tmp/x"), "--gin_file is required"),
    (("pretrain.evaluate", "--workdir=/tmp/x", "--no_such_flag"), "no_such_flag"),
])
def test_bad_flags_are_one_line_and_exit_2_before_heavy_work(args, fragment):
  assert fragment in _one_line_error(_run(*args))


COMMANDS = {
    "pretrain.train": GIN_FLAGS + ("--workdir",),
    "pretrain.evaluate": ("--workdir", "--step", "--text_file", "--output", "--tasks",
                          "--include_path"),
    "pretrain.sample": ("--workdir", "--prompt", "--max_new_tokens", "--temperature"),
    "pretrain.convert": ("--checkpoint", "--workdir", "--preset", "--vocab"),
    "pretrain.export": ("--workdir", "--step", "--output", "--dtype"),
    "pretrain.tokenizer": ("--input_glob", "--vocab_size", "--output", "--model_type",
                           "--text_field"),
    "pretrain.data.prepare": GIN_FLAGS + ("--output",),
    "pretrain.extrapolation": ("--workdir",),
    "pretrain.summary": GIN_FLAGS + ("--mesh", "--batch", "--seq"),
    "launch.local": ("--num_processes", "--devices_per_process"),
    "launch.sweep": GIN_FLAGS + ("--families", "--sizes", "--workdir", "--design",
                                 "--cooldown_tokens_per_param", "--lr_sweep",
                                 "--train_optimum"),
    "launch.fork": ("--source", "--step", "--workdir"),
    "launch.tpu_vm": ("--tpu", "--zone", "--tpu_type", "--dry_run"),
    "launch.gke": ("--name", "--image", "--tpu_type", "--num_slices", "--dry_run"),
    "launch.slurm": ("--nodes", "--gpus_per_node", "--partition", "--dry_run"),
}


def test_help_lists_own_and_shared_flags_on_a_clean_stderr():
  result = _run("launch.gke", "--help")
  assert result.returncode == 0 and result.stderr == "", result.stderr
  for flag in COMMANDS["launch.gke"] + SHARED_FLAGS:
    assert flag in result.stdout, flag


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_dash_h_of_every_command(command):
  result = _run(command, "-h")
  assert result.returncode == 0 and result.stderr == "", result.stderr
  for flag in COMMANDS[command] + SHARED_FLAGS:
    assert flag in result.stdout, (command, flag)


# A /dev with NVIDIA device files and no CUDA runtime behind them, as on a CPU-only
# SLURM node whose GPUs are GRES placeholders, or a GPU node without CUDA's libraries:
# JAX then starts the CUDA plugin, which fails.
_NVIDIA_DEV = r"""
set -e
d=$(mktemp -d)
mount -t tmpfs tmpfs "$d"
for spec in "null 1 3" "zero 1 5" "random 1 8" "urandom 1 9" "nvidia0 195 0" "nvidiactl 195 255"; do
  set -- $spec; mknod -m 666 "$d/$1" c "$2" "$3"
done
ln -s /proc/self/fd "$d/fd"
mount --move "$d" /dev
cd "$REPO"
exec "$PYTHON" -m pretrain.summary --gin_file=configs/models/tiny_griffin.gin
"""


def test_cpu_run_where_the_cuda_plugin_cannot_start_prints_one_line():
  probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, check=False)
  if probe.returncode != 0:
    pytest.skip("needs a mount namespace (unshare --mount) to fake NVIDIA device files")
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  env.update(REPO=REPO, PYTHON=sys.executable)
  result = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                           _NVIDIA_DEV], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "Traceback" not in result.stderr, result.stderr
  lines = result.stderr.splitlines()
  assert len(lines) == 1 and "JAX's xla_cuda12 plugin did not start" in lines[0], lines


def test_sigusr2_prints_every_threads_stack_and_the_command_goes_on():
  """How to see where a process that seems hung waits: `kill -USR2 PID`."""
  script = ("import threading, time\nfrom plumbing import cli\n"
            "def waiter():\n"
            "  time.sleep(3)\n"
            "def main(argv):\n"
            "  thread = threading.Thread(target=waiter)\n"
            "  thread.start()\n"
            "  print('READY', flush=True)\n"
            "  thread.join()\n"
            "  print('STILL RUNNING', flush=True)\n"
            "cli.run(main)\n")
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  process = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    assert process.stdout.readline().strip() == "READY"
    process.send_signal(signal.SIGUSR2)
    out, err = process.communicate(timeout=60)
  finally:
    process.kill()
  assert process.returncode == 0, err
  assert out.strip() == "STILL RUNNING"
  # The main thread may still be in the print or already in the join: either is main.
  assert "Current thread" in err and "in main" in err, err
  assert "line 4 in waiter" in err, err  # the other thread, asleep the whole time
