"""The persistent tier and the Checkpointer over it: real Orbax round trips, resharding, keep policy, partial saves, mismatches,
and damaged steps skipped for the previous one."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.config import ModelConfig
from plumbing import storage
from plumbing.errors import CheckpointSaveError, UnreadableCheckpointError
from pretrain.checkpoints import persistent as ckpt
from pretrain.checkpoints.checkpointer import Checkpointer
from pretrain.checkpoints import integrity
from pretrain.checkpoints.loading import load
from pretrain.checkpoints.metadata import RunMetadata
from pretrain.optimizer import OptimizerConfig, make_optimizer
from pretrain.run_directory import RunDirectory
from pretrain.runtime import Runtime
from sharding.mesh import MeshConfig
from trainer_helpers import fill_disk, small_disk

CONFIG = ModelConfig(vocab_size=64, width=32, rnn_width=32, num_heads=2, depth=3,
                     attention_window=8)
METADATA = {"model_config": {"width": 32}, "vocabulary": "byte", "sequence_length": 16}


@pytest.fixture(scope="module")
def data_parallel():
  """A runtime over 8 devices, all data-parallel; parameters and an optimizer state."""
  setup = Runtime.create(CONFIG, MeshConfig(data=8))
  params = setup.init_params(seed=0)
  tx = make_optimizer(OptimizerConfig(), 10)
  # Non-trivial moments, so a restore that dropped them would show.
  @jax.jit
  def stepped_state(params):
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
    return tx.update(grads, tx.init(params), params)[1]
  opt_state = stepped_state(params)
  return setup, params, tx, opt_state


def _tier(workdir, **options):
  return ckpt.PersistentTier(RunDirectory(str(workdir)), **options)


def _checkpointer(workdir):
  """The persistent tier alone, as a run has it."""
  return Checkpointer.for_run(RunDirectory(str(workdir)), every=1)


def _assert_trees_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_round_trip_restores_exact_state_and_reshards(tmp_path, data_parallel):
  setup, params, tx, opt_state = data_parallel
  saver = _tier(str(tmp_path))
  saver.save(5, params=params, opt_state=opt_state, rng=jax.random.key(7), metadata=METADATA)
  saver.close()

  # Restore onto a different mesh: parameters sharded over fsdp=2 (embed axis).
  other = Runtime.create(CONFIG, MeshConfig(data=4, fsdp=2))
  abstract_opt, _ = other.opt_state_layout(tx)
  restorer = _tier(str(tmp_path))
  assert restorer.latest_step() == 5
  restored = restorer.restore(5, abstract_params=other.abstract_params,
                              abstract_opt_state=abstract_opt)
  assert restorer.metadata(5) == METADATA
  restorer.close()
  assert restored.step == 5
  np.testing.assert_array_equal(jax.random.key_data(restored.rng),
                                jax.random.key_data(jax.random.key(7)))
  _assert_trees_equal(restored.params, params)
  _assert_trees_equal(restored.opt_state, opt_state)
  embedding = restored.params["embedder"]["embedding"]
  assert embedding.sharding.spec == other.param_shardings["embedder"]["embedding"].spec
  assert "fsdp" in str(embedding.sharding.spec)


def test_partial_saves_are_never_picked_and_are_cleaned(tmp_path, data_parallel):
  setup, params, _, opt_state = data_parallel
  saver = _tier(str(tmp_path))
  saver.save(2, params=params, opt_state=opt_state, rng=jax.random.key(0), metadata=METADATA)
  saver.close()
  directory = tmp_path / "checkpoints"
  # What a kill mid-save leaves: Orbax's temporary directory, and (on storage without
  # atomic rename) a step directory holding some items but no commit marker.
  tmp_dir = directory / "4.orbax-checkpoint-tmp-1234567"
  (tmp_dir / "params").mkdir(parents=True)
  (tmp_dir / "params" / "partial").write_bytes(b"\0" * 100)
  unmarked = directory / "6"
  (unmarked / "params").mkdir(parents=True)
  (unmarked / "_CHECKPOINT_METADATA").write_text("{}")
  assert ckpt.complete_steps(directory) == [2]
  assert [p.name for p in ckpt.unmarked_step_dirs(directory)] == ["6"]

  resumer = _tier(str(tmp_path))
  assert resumer.latest_step() == 2
  assert not unmarked.exists()
  restored = resumer.restore(2, abstract_params=setup.abstract_params)
  _assert_trees_equal(restored.params, params)
  # Saving the step that was only partially written before now works.
  resumer.save(6, params=params, opt_state=opt_state, rng=jax.random.key(0),
               metadata=METADATA)
  resumer.close()
  assert ckpt.complete_steps(directory) == [2, 6]
  # Orbax removes temporary directories in the background, finished before a save.
  assert not tmp_dir.exists()


def test_keep_policy_last_k_plus_every_m(tmp_path, data_parallel):
  _, params, _, _ = data_parallel
  small = {"w": params["final_norm"]["scale"]}
  saver = _tier(tmp_path, keep_last=2, keep_every=4)
  for step in range(1, 10):
    saver.save(step, params=small, opt_state=None, rng=jax.random.key(0), metadata=METADATA)
  saver.close()
  assert ckpt.complete_steps(tmp_path / "checkpoints") == [4, 8, 9]


def test_mismatching_model_names_parameters(tmp_path, data_parallel):
  _, params, _, _ = data_parallel
  saver = _tier(str(tmp_path))
  saver.save(1, params=params, opt_state=None, rng=jax.random.key(0), metadata=METADATA)
  saver.close()
  wider = Runtime.create(CONFIG.replace(width=48, num_heads=2), MeshConfig(data=8))
  restorer = _tier(str(tmp_path))
  with pytest.raises(ckpt.CheckpointMismatchError) as info:
    restorer.restore(1, abstract_params=wider.abstract_params)
  restorer.close()
  message = str(info.value)
  assert "blocks/block_0/mlp/down/bias: checkpoint (1, 32) vs model (1, 48)" in message
  assert "more" in message  # long lists are cut, not a wall of text
  assert len(message.splitlines()) < 20


def test_describe_mismatch_reports_missing_and_extra():
  text = ckpt.describe_mismatch({"a": (2,), "b": (3,)}, {"a": (2,), "c": (4,)})
  assert "b: in the checkpoint (3,), not in the model" in text
  assert "c: in the model (4,), missing from the checkpoint" in text
  assert ckpt.describe_mismatch({"a": (2,)}, {"a": (2,)}) is None


def test_converted_checkpoint_without_optimizer_state(tmp_path, data_parallel):
  setup, params, tx, _ = data_parallel
  saver = _tier(str(tmp_path))
  saver.save(0, params=params, opt_state=None, rng=jax.random.key(0), metadata=METADATA)
  saver.close()
  opt_shapes = jax.eval_shape(tx.init, setup.abstract_params)
  restorer = _tier(str(tmp_path))
  restored = restorer.restore(0, abstract_params=setup.abstract_params,
                              abstract_opt_state=opt_shapes)
  restorer.close()
  assert restored.opt_state is None and restored.step == 0


def test_read_only_on_missing_directory_is_a_clear_error(tmp_path):
  with pytest.raises(ckpt.UserError, match="No checkpoints in"):
    _tier(tmp_path / "nothing", read_only=True)
  assert not os.path.exists(tmp_path / "nothing")


def _largest_data_file(step_dir):
  """The largest file holding parameter values of a step (an OCDBT data file)."""
  files = [os.path.join(parent, name) for parent, _, names in os.walk(step_dir / "params")
           for name in names if os.sep + "d" + os.sep in os.path.join(parent, name)]
  return max(files, key=os.path.getsize)


def _flip_a_byte(path):
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    byte = f.read(1)[0]
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([byte ^ 0x10]))


@pytest.mark.parametrize("damage, kind", [
    (_flip_a_byte, "checksum"),     # Orbax alone would restore the wrong numbers
    (lambda path: os.truncate(path, os.path.getsize(path) // 2), "size")])
def test_damaged_newest_step_is_set_aside_and_the_previous_one_restored(
    tmp_path, data_parallel, damage, kind):
  setup, params, tx, opt_state = data_parallel
  saver = _tier(str(tmp_path))
  for step in (2, 4):
    saver.save(step, params=params, opt_state=opt_state, rng=jax.random.key(step),
               metadata=METADATA)
  saver.close()
  directory = tmp_path / "checkpoints"
  assert (directory / "4" / integrity.MANIFEST).exists()
  damage(_largest_data_file(directory / "4"))

  resumer = _checkpointer(tmp_path)
  restored, skipped = resumer.restore_newest(
      abstract_params=setup.abstract_params,
      abstract_opt_state=setup.opt_state_layout(tx)[0])
  assert restored.step == 2 and restored.tier.name == "persistent"
  _assert_trees_equal(restored.params, params)
  ((step, found),) = [(error.step, error.kind) for error in skipped]
  assert (step, found) == (4, kind)
  assert str(skipped[0]).startswith("checkpoint 4 is unreadable (params/")
  assert resumer.tiers[0].all_steps() == [2]
  assert sorted(os.listdir(directory)) == ["2", f"4.corrupt-{kind}"]
  resumer.close()


def test_steps_without_manifest_restore_and_a_torn_one_is_skipped(tmp_path, data_parallel):
  setup, params, _, _ = data_parallel
  saver = _tier(str(tmp_path))
  for step in (2, 4):
    saver.save(step, params=params, opt_state=None, rng=jax.random.key(0),
               metadata=METADATA)
  saver.close()
  directory = tmp_path / "checkpoints"
  for step in ("2", "4"):   # as written before manifests existed
    os.remove(directory / step / integrity.MANIFEST)
  reader = _checkpointer(tmp_path)
  restored, skipped = reader.restore_newest(abstract_params=setup.abstract_params,
                                            abstract_opt_state=None)
  assert (restored.step, skipped) == (4, [])
  os.truncate(_largest_data_file(directory / "4"), 100)   # only the read tells
  restored, skipped = reader.restore_newest(abstract_params=setup.abstract_params,
                                            abstract_opt_state=None)
  assert restored.step == 2 and [e.kind for e in skipped] == ["unreadable"]
  assert "OUT_OF_RANGE" in skipped[0].detail
  reader.close()


def test_load_skips_an_unreadable_newest_step_without_renaming(tmp_path, data_parallel,
                                                               capsys):
  setup, params, _, _ = data_parallel
  metadata = RunMetadata(CONFIG, "byte", 16).to_json()
  saver = _tier(str(tmp_path))
  for step in (2, 4):
    saver.save(step, params=params, opt_state=None, rng=jax.random.key(0),
               metadata=metadata)
  saver.close()
  directory = tmp_path / "checkpoints"
  _flip_a_byte(_largest_data_file(directory / "4"))
  model = load(str(tmp_path))
  assert model.step == 2
  _assert_trees_equal(model.params, params)
  (line,) = capsys.readouterr().err.strip().splitlines()
  assert line.startswith("warning: checkpoint 4 is unreadable (params/") and line.endswith(
      "fails its checksum): using 2")
  with pytest.raises(UnreadableCheckpointError, match=r"^checkpoint 4 is unreadable"):
    load(str(tmp_path), step=4)
  assert sorted(os.listdir(directory)) == ["2", "4"]


def test_a_save_that_failed_for_space_succeeds_once_space_is_back(tmp_path, data_parallel):
  setup, params, _, _ = data_parallel
  directory = tmp_path / "run" / "checkpoints"
  with small_disk(directory, 4 << 20):
    saver = _tier(str(tmp_path / "run"))
    saver.save(2, params=params, opt_state=None, rng=jax.random.key(0), metadata=METADATA)
    saver.wait()
    fill_disk(directory)
    saver.save(4, params=params, opt_state=None, rng=jax.random.key(0), metadata=METADATA)
    with pytest.raises(CheckpointSaveError, match="^checkpoint 4 failed: no space left on "
                       f"device under {directory}$"):
      saver.wait()
    os.remove(directory / "filler")
    saver.discard_failed(4)
    saver.save(6, params=params, opt_state=None, rng=jax.random.key(0), metadata=METADATA)
    saver.wait()
    assert saver.all_steps() == [2, 6] and sorted(os.listdir(directory)) == ["2", "6"]
    saver.close()
    resumer = _checkpointer(tmp_path / "run")
    restored, skipped = resumer.restore_newest(abstract_params=setup.abstract_params,
                                               abstract_opt_state=None)
    assert (restored.step, skipped) == (6, [])
    resumer.close()


@pytest.mark.slow  # starts a storage server
@pytest.mark.parametrize("bucket", ["gcs_bucket", "s3_bucket"])
def test_damaged_step_in_a_bucket_is_moved_aside(request, bucket, data_parallel):
  """Same size, one byte changed: on gs:// the checksum GCS keeps of the object tells,
  on s3:// the downloaded bytes."""
  setup, params, _, _ = data_parallel
  workdir = f"{request.getfixturevalue(bucket)}/integrity/{request.node.callspec.id}"
  saver = _tier(workdir)
  for step in (2, 4):
    saver.save(step, params=params, opt_state=None, rng=jax.random.key(0),
               metadata=METADATA)
  saver.close()
  directory = str(RunDirectory(workdir).checkpoints)
  step_dir = storage.join(directory, "4")
  files = storage.list_files(step_dir)
  assert integrity.MANIFEST in files
  damaged = max((name for name in files if name.startswith("params/ocdbt.process_0/d/")),
                key=files.get)
  data = bytearray(storage.read_bytes(storage.join(step_dir, damaged)))
  data[len(data) // 2] ^= 0x10
  storage.write_bytes(storage.join(step_dir, damaged), bytes(data))

  resumer = _checkpointer(workdir)
  restored, skipped = resumer.restore_newest(abstract_params=setup.abstract_params,
                                             abstract_opt_state=None)
  resumer.close()
  assert restored.step == 2 and [(e.step, e.kind) for e in skipped] == [(4, "checksum")]
  _assert_trees_equal(restored.params, params)
  assert storage.listdir(directory) == ["2", "4.corrupt-checksum"]
  assert storage.list_files(storage.join(directory, "4.corrupt-checksum")) == files
