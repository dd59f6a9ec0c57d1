"""The two checkpoint tiers with real Orbax checkpoints: restore takes the newest
complete step of either, never a half-written, damaged or foreign-layout local one; a
failed local save turns the tier off."""
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.config import ModelConfig
from pretrain.checkpoints import checkpointer as ckpt
from pretrain.checkpoints import local as local_checkpoints
from pretrain.checkpoints.integrity import COMMIT_MARKER
from pretrain.checkpoints.persistent import complete_steps
from pretrain.checkpoints.policies import Snapshot
from pretrain.optimizer import OptimizerConfig, make_optimizer
from pretrain.run_directory import RunDirectory
from pretrain.runtime import Runtime
from sharding.mesh import MeshConfig
from trainer_helpers import fill_disk, small_disk

CONFIG = ModelConfig(vocab_size=64, width=16, rnn_width=16, num_heads=2, depth=1,
                     block_pattern=("recurrent", "attention"), attention_window=8)
REPO = str(pathlib.Path(__file__).resolve().parents[1])
METADATA = {"model_config": {"width": 32}, "vocabulary": "byte", "sequence_length": 16}


@pytest.fixture(scope="module")
def state():
  """Parameters sharded over fsdp x tensor (so shards differ per device), an optimizer
  state with non-trivial moments, and their abstract trees."""
  runtime = Runtime.create(CONFIG, MeshConfig(data=2, fsdp=2, tensor=2))
  params = runtime.init_params(seed=0)
  tx = make_optimizer(OptimizerConfig(), 10)
  abstract_opt = runtime.opt_state_layout(tx)[0]

  @jax.jit
  def moments(params):
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.25), params)
    return tx.update(grads, tx.init(params), params)[1]
  opt_state = jax.device_put(moments(params), jax.tree.map(lambda a: a.sharding,
                                                             abstract_opt))
  return runtime, params, opt_state, abstract_opt


@pytest.fixture(scope="module")
def saved(state, tmp_path_factory):
  """A run directory with persistent step 4 and local steps 4 (a save that was then
  made persistent too) and 6 (params and moments doubled, another RNG); tests copy it."""
  _, params, opt_state, _ = state
  root = tmp_path_factory.mktemp("saved")
  saver = _checkpointer(root)
  _save_both(saver, params, opt_state, persistent_step=4, local_step=6)
  saver.close()
  return root


@pytest.fixture()
def run_dir(saved, tmp_path):
  """A copy of `saved`; the local tier's per-run directory is keyed by the workdir's
  path, so it is renamed to the copy's key."""
  shutil.copytree(saved, tmp_path, dirs_exist_ok=True)
  old = RunDirectory(str(saved / "run"), str(tmp_path / "local")).local_run
  new = _run_directory(tmp_path).local_run
  os.rename(old, new)
  return tmp_path


def _run_directory(tmp_path, local=True):
  return RunDirectory(str(tmp_path / "run"), str(tmp_path / "local") if local else None)


def _checkpointer(tmp_path, local=True):
  """The run's tiers; the persistent one saves only when told (its interval is far)."""
  config = ckpt.CheckpointConfig(local_every=2, local_keep=2, async_save=False)
  return ckpt.Checkpointer.for_run(_run_directory(tmp_path, local), config, every=1000)


def _tier(checkpointer, name):
  (tier,) = [tier for tier in checkpointer.tiers if tier.name == name]
  return tier


def _local(checkpointer):
  """The checkpointer's local tier."""
  return _tier(checkpointer, "local")


def _save_due(checkpointer, step, params, opt_state, rng):
  """What the loop's save of `step` does: the local tier saves at its interval."""
  checkpointer.save(step, Snapshot(params, opt_state, rng, METADATA), info=print)


def _scaled(tree, factor):
  return jax.tree.map(lambda x: x * factor if jnp.issubdtype(x.dtype, jnp.floating) else x,
                      tree)


def _save_both(checkpointer, params, opt_state, persistent_step, local_step):
  rng = jax.random.key(7)
  _tier(checkpointer, "persistent").save(persistent_step, params=params,
                                          opt_state=opt_state, rng=rng, metadata=METADATA)
  _save_due(checkpointer, local_step, _scaled(params, 2.0), _scaled(opt_state, 2.0),
            jax.random.key(9))
  checkpointer.wait()


def _restore(checkpointer, runtime, abstract_opt):
  restored, skipped = checkpointer.restore_newest(abstract_params=runtime.abstract_params,
                                                  abstract_opt_state=abstract_opt)
  assert not skipped
  return restored


def _assert_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert x.sharding.is_equivalent_to(y.sharding, x.ndim)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_newer_local_step_is_restored_exactly(run_dir, state):
  runtime, params, opt_state, abstract_opt = state

  restored = _restore(_checkpointer(run_dir), runtime, abstract_opt)
  assert (restored.tier.name, restored.step) == ("local", 6)
  _assert_equal(restored.params, _scaled(params, 2.0))
  _assert_equal(restored.opt_state, _scaled(opt_state, 2.0))
  np.testing.assert_array_equal(jax.random.key_data(restored.rng),
                                jax.random.key_data(jax.random.key(9)))


def test_wiped_local_dir_falls_back_to_persistent(run_dir, state):
  runtime, params, opt_state, abstract_opt = state
  shutil.rmtree(run_dir / "local")   # the host was replaced

  restored = _restore(_checkpointer(run_dir), runtime, abstract_opt)
  assert (restored.tier.name, restored.step) == ("persistent", 4)
  _assert_equal(restored.params, params)
  _assert_equal(restored.opt_state, opt_state)


def test_half_written_local_step_is_ignored_and_removed(run_dir, state):
  runtime, params, opt_state, abstract_opt = state
  process_dir = _run_directory(run_dir).local_tier
  # A save cut short after the rename but before the commit marker (non-atomic storage),
  # and one cut short before the rename.
  shutil.copytree(process_dir / "6", process_dir / "8")
  os.remove(process_dir / "8" / COMMIT_MARKER)
  shutil.copytree(process_dir / "6", process_dir / "10.orbax-checkpoint-tmp-123")

  resumer = _checkpointer(run_dir)
  restored = _restore(resumer, runtime, abstract_opt)
  assert (restored.tier.name, restored.step) == ("local", 6)
  assert not (process_dir / "8").exists()
  assert _local(resumer).all_steps() == [6]


def test_persistent_step_newer_than_local_wins(run_dir, state):
  runtime, params, opt_state, abstract_opt = state
  saver = _checkpointer(run_dir)
  _tier(saver, "persistent").save(8, params=params, opt_state=opt_state,
                                  rng=jax.random.key(7), metadata=METADATA)
  saver.close()
  restored = _restore(_checkpointer(run_dir), runtime, abstract_opt)
  assert (restored.tier.name, restored.step) == ("persistent", 8)


def test_local_step_of_another_layout_is_not_offered(run_dir, state):
  runtime, params, opt_state, _ = state
  other = Runtime.create(CONFIG, MeshConfig(data=8))   # another mesh: other shards
  tx = make_optimizer(OptimizerConfig(), 10)
  resumer = _checkpointer(run_dir)
  restored = _restore(resumer, other, other.opt_state_layout(tx)[0])
  assert (restored.tier.name, restored.step) == ("persistent", 4)
  # The run continues from step 4 and will save step 6 again: the stale one is gone.
  assert _local(resumer).all_steps() == []


def test_keep_policy_and_no_local_tier(run_dir, state):
  _, params, opt_state, _ = state
  saver = _checkpointer(run_dir / "fresh")
  for step in (2, 4, 6):
    _save_due(saver, step, params, opt_state, jax.random.key(0))
  saver.wait()
  assert _local(saver).all_steps() == [4, 6]   # local_keep=2
  saver.close()
  plain = _checkpointer(run_dir / "plain", local=False)
  assert [tier.name for tier in plain.tiers] == ["persistent"]
  _save_due(plain, 2, params, opt_state, jax.random.key(0))  # no-op
  plain.close()


@pytest.mark.parametrize("steps, newest", [
    ([[4, 6]], 6), ([[4, 6], [4, 6]], 6), ([[4, 6], [4]], 4), ([[4, 6], []], None),
    ([[6, 8], [4, 6], [6]], 6), ([[]], None)])
def test_processes_agree_on_their_newest_common_step(steps, newest):
  assert (local_checkpoints.common_steps(steps) or [None])[-1] == newest


@pytest.mark.parametrize("field, value", [("local_every", 0), ("local_keep", 0),
                                          ("local_keep", ckpt.MAX_LOCAL_KEEP + 1)])
def test_bad_local_settings_name_the_field(field, value):
  with pytest.raises(ValueError, match=f"CheckpointConfig.{field}"):
    ckpt.CheckpointConfig(**{field: value})


def test_unreadable_local_step_is_set_aside_for_the_persistent_one(run_dir, state):
  runtime, params, opt_state, abstract_opt = state
  process_dir = _run_directory(run_dir).local_tier
  data = [os.path.join(parent, name) for parent, _, names in os.walk(process_dir / "6")
          for name in names if os.sep + "d" + os.sep in os.path.join(parent, name)]
  with open(max(data, key=os.path.getsize), "r+b") as f:   # bit rot: same size
    f.seek(40)
    byte = f.read(1)[0]
    f.seek(40)
    f.write(bytes([byte ^ 0x01]))

  resumer = _checkpointer(run_dir)
  restored, skipped = resumer.restore_newest(abstract_params=runtime.abstract_params,
                                             abstract_opt_state=abstract_opt)
  assert (restored.tier.name, restored.step) == ("persistent", 4)
  _assert_equal(restored.params, params)
  assert [(e.tier, e.step, e.kind) for e in skipped] == [("local", 6, "checksum")]
  assert str(skipped[0]).startswith("local checkpoint 6 is unreadable (shards/")
  assert os.listdir(process_dir) == ["6.corrupt-checksum"]
  resumer.close()


def test_failed_local_save_turns_the_local_tier_off(tmp_path, state, capsys):
  _, params, opt_state, _ = state
  config = ckpt.CheckpointConfig(local_every=2)
  with small_disk(tmp_path / "local", 1 << 20):
    saver = ckpt.Checkpointer.for_run(_run_directory(tmp_path), config, every=1000)
    process_dir = _local(saver).directory
    fill_disk(tmp_path / "local")
    _save_due(saver, 2, params, opt_state, jax.random.key(0))
    saver.wait()
    assert [tier.name for tier in saver.tiers] == ["persistent"]
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (f"warning: local checkpoint 2 failed: no space left on device under "
                    f"{process_dir}; the local tier is off for the rest of this run")
    assert os.listdir(process_dir) == []   # the failed save's leftovers are gone
    # The persistent tier goes on.
    saver.tiers[0].save(2, params=params, opt_state=opt_state, rng=jax.random.key(0),
                        metadata=METADATA)
    saver.close()
  assert complete_steps(tmp_path / "run" / "checkpoints") == [2]


# Each of 2 processes (1 CPU device each) saves local steps 1-3 of a replicated array;
# process 1's local directory is a full disk.
TWO_PROCESS_SAVES = """
import os, sys
from sharding import distributed
distributed.initialize_from_environment()
import jax, numpy as np
from pretrain.checkpoints import checkpointer as ckpt
from pretrain.checkpoints.policies import Snapshot
from pretrain.run_directory import RunDirectory
workdir, local = sys.argv[1:3]
run = RunDirectory(workdir, local)
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
array = jax.make_array_from_callback((256,), replicated,
                                     lambda index: np.arange(256, dtype=np.float32)[index])
saver = ckpt.Checkpointer.for_run(run, ckpt.CheckpointConfig(local_every=1), every=1000)
for step in (1, 2, 3):
  saver.save(step, Snapshot({"w": array}, {"m": array}, jax.random.key(0), {}), info=print)
saver.close()
steps = sorted(int(p) for p in os.listdir(run.local_tier) if p.isdigit())
print("STEPS", jax.process_index(), *steps, flush=True)
"""


@pytest.mark.slow   # fast tier under 5 min: two processes (8 s)
def test_a_local_save_failed_on_one_process_turns_the_tier_off_on_every_process(tmp_path):
  """Process 1's local save of step 1 fails (its disk is full); both turn the tier off at
  the next local save, so process 0 keeps the step 1 they could restart from rather
  than save steps 2 and 3 and prune it (each keeps 2)."""
  workdir, local = str(tmp_path / "run"), str(tmp_path / "local")
  run_key = hashlib.sha1(workdir.encode()).hexdigest()[:12]
  full = os.path.join(local, run_key, "process_1_of_2")
  program = tmp_path / "saves.py"
  program.write_text(TWO_PROCESS_SAVES)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH",
                                                                          "")]))
  with small_disk(full, 1 << 20):
    fill_disk(full)
    launched = subprocess.run(
        [sys.executable, "-m", "launch.local", "--num_processes=2", "--", sys.executable,
         str(program), workdir, local], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=240, check=False)
  assert launched.returncode == 0, launched.stdout + launched.stderr
  steps = sorted(line.split(" STEPS ")[1].split() for line in launched.stdout.splitlines()
                 if " STEPS " in line)
  assert steps == [["0", "1"], ["1"]], launched.stdout   # process 1 holds no step
  # launch.local prefixes each process's lines with its index, on the launcher's stdout.
  warnings = [line for line in launched.stdout.splitlines() if "warning: " in line]
  assert warnings == [
      f"[1] warning: local checkpoint 1 failed: no space left on device under {full}; the "
      "local tier is off for the rest of this run",
      "[0] warning: a local checkpoint failed on another process; the local tier is off "
      "on every process for the rest of this run (a restart needs a step every process "
      "holds)"], launched.stdout
