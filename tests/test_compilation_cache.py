"""The trainer's default persistent compilation cache: a restart loads its programs."""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = """
import os, sys, jax, jax.numpy as jnp
from pretrain import train
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
train.use_compilation_cache(sys.argv[1])
print(jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_max_size)
jax.jit(lambda x: jnp.sin(x) * 3)(jnp.arange(4.0)).block_until_ready()
"""


def _run(directory, **env):
  environ = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
  result = subprocess.run([sys.executable, "-c", _SCRIPT, directory], cwd=REPO,
                          env={**environ, **env}, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout.split()


def test_cache_directory_receives_compiled_programs_and_is_size_bounded(tmp_path):
  cache = tmp_path / "cache"
  assert _run(str(cache)) == ["True", str(8 << 30)]
  assert any(name.endswith("-cache") for name in os.listdir(cache))
  assert _run(str(cache), JAX_COMPILATION_CACHE_MAX_SIZE="1000000")[1] == "1000000"


def test_empty_directory_turns_the_cache_off():
  assert _run("")[0] == "False"


def test_unusable_directory_is_one_line_before_any_work(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  workdir = tmp_path / "run"
  result = subprocess.run(
      [sys.executable, "-m", "pretrain.train", "--gin_file=configs/quickstart.gin",
       f"--compilation_cache_dir={blocker}/cache", f"--workdir={workdir}"],
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert result.returncode != 0
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and "--compilation_cache_dir" in lines[0], result.stderr
  assert not workdir.exists()
