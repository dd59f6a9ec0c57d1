"""launch.chaos's fault plan and loss comparison. The chaos run itself (a 2-process
training under SIGKILL and SIGTERM that must end with the uninterrupted run's losses) is
in tests/test_multihost_train.py, where it shares that module's uninterrupted run."""
import errno
import os
import socket
import threading

import pytest

from launch.faults import chaos
from launch.faults.storage_faults import CuttableProxy, SmallDisk
from plumbing import storage
from plumbing.errors import UserError


def test_fault_plan_is_seeded_mixed_and_inside_the_run():
  plan = chaos.plan_faults(200, 5, 2, seed=0)
  assert plan == chaos.plan_faults(200, 5, 2, seed=0)
  assert plan != chaos.plan_faults(200, 5, 2, seed=1)
  steps = [f.planned_step for f in plan]
  assert steps == sorted(set(steps)) and 20 <= steps[0] and steps[-1] < 150
  assert {f.kind for f in plan} == {"SIGKILL", "SIGTERM"}
  assert {f.process for f in plan} <= {0, 1}
  with pytest.raises(UserError, match="--faults=9 do not fit in --steps=8"):
    chaos.plan_faults(8, 9, 2, seed=0)


def test_loss_comparison_flags_differences_and_missing_steps():
  reference = {1: 5.0, 2: 4.0, 3: 3.0}
  assert chaos.compare_losses(reference, {1: 5.0, 2: 4.0 * (1 + 5e-7), 3: 3.0},
                              1e-6)["equal"]
  different = chaos.compare_losses(reference, {1: 5.0, 2: 4.0 * (1 + 2e-6), 3: 3.0}, 1e-6)
  assert not different["equal"] and different["mismatched_steps"] == [2]
  missing = chaos.compare_losses(reference, {1: 5.0, 2: 4.0}, 1e-6)
  assert not missing["equal"] and missing["missing_steps"] == [3]


def test_report_names_a_restart_from_scratch():
  """Without a local tier a kill before the first persistent save restarts at step 0."""
  fault = dict(kind="SIGKILL", process=0, at_step=30, resumed_step=0, tier=None,
               steps_lost=30, recover_s=86.0)
  report = dict(processes=2, devices_per_process=2, steps=200, seed=0, local_every=0,
                checkpoint_every=None, faults=[fault], goodput=None, median_recover_s=86.0,
                steps_lost=30, wall_s=600.0, relaunches=0, verdict="pass",
                loss_check=dict(steps_compared=200, max_rel_diff=0.0, equal=True,
                                tolerance=1e-6))
  text = chaos.format_report(report)
  assert "local tier off" in text
  row = text.splitlines()[2].split()
  assert row[:6] == ["1", "SIGKILL", "0", "30", "0", "(scratch)"], text
  ridden = dict(fault, kind="outage", resumed_step=None, steps_lost=0, recover_s=1.5,
                outcome="rode it out")
  text = chaos.format_report(report | {"faults": [ridden]})
  assert text.splitlines()[2].split() == ["1", "outage", "-", "30", "-", "(rode", "it",
                                          "out)", "0", "1.5", "s"], text


def test_storage_fault_kinds_are_planned_and_checked():
  plan = chaos.plan_faults(200, 8, 2, seed=0, kinds=chaos.KINDS)
  assert {f.kind for f in plan} == {"SIGKILL", "SIGTERM", "corrupt", "hang", "disk_full",
                                    "outage"}
  # The default draws no storage kind: they need a mount or an emulator.
  assert not set(chaos.DEFAULT_KINDS) & set(chaos.STORAGE_KINDS)
  with pytest.raises(UserError, match="disk_full fills the disk of the local checkpoint "
                     "tier: it needs --local_every > 0"):
    chaos.check_storage_kinds(["disk_full"], local_every=0, bucket=False)
  with pytest.raises(UserError, match="outage cuts the run off its bucket: pass "
                     "--gcs_emulator"):
    chaos.check_storage_kinds(["SIGKILL", "outage"], local_every=10, bucket=False)
  chaos.check_storage_kinds(["disk_full", "outage"], local_every=10, bucket=True)
  with pytest.raises(UserError, match="unknown fault kind"):
    chaos.plan_faults(200, 2, 2, seed=0, kinds=("flood",))
  with pytest.raises(UserError, match="hang needs --num_processes >= 2"):
    chaos.plan_faults(200, 2, 1, seed=0, kinds=("hang",))


def _step(root, step, item, size):
  """A committed step directory holding one file of `size` bytes under `item`."""
  os.makedirs(os.path.join(root, str(step), item))
  with open(os.path.join(root, str(step), "commit_success.txt"), "w") as f:
    f.write("done")
  path = os.path.join(root, str(step), item, "data")
  with open(path, "wb") as f:
    f.write(b"x" * size)
  return path


def test_corrupt_tears_the_newest_step_of_either_tier(tmp_path):
  workdir, local = str(tmp_path / "run"), str(tmp_path / "local")
  old = _step(os.path.join(workdir, "checkpoints"), 4, "params", 100)
  newest = _step(os.path.join(workdir, "checkpoints"), 8, "params", 100)
  shards = [_step(os.path.join(local, "key", f"process_{i}_of_2"), 6, "shards", 100)
            for i in range(2)]
  assert chaos.corrupt_newest_checkpoint(workdir, local) == "checkpoint 8"
  assert [os.path.getsize(p) for p in (old, newest, *shards)] == [100, 50, 100, 100]
  shards = [_step(os.path.join(local, "key", f"process_{i}_of_2"), 10, "shards", 100)
            for i in range(2)]
  assert chaos.corrupt_newest_checkpoint(workdir, local) == "local checkpoint 10"
  assert [os.path.getsize(p) for p in shards] == [50, 50]
  assert chaos.corrupt_newest_checkpoint(str(tmp_path / "empty"), None) is None


def test_corrupt_tears_an_object_of_a_bucket_workdir(gcs_bucket):
  workdir = f"{gcs_bucket}/chaos-corrupt"
  for step in (4, 8):
    storage.write_bytes(f"{workdir}/checkpoints/{step}/params/d/data", b"x" * 100)
    storage.write_bytes(f"{workdir}/checkpoints/{step}/params/d/small", b"x" * 10)
    storage.write_text(f"{workdir}/checkpoints/{step}/commit_success.txt", "done")
  assert chaos.corrupt_newest_checkpoint(workdir, None) == "checkpoint 8"
  sizes = {step: storage.list_files(f"{workdir}/checkpoints/{step}/params")
           for step in (4, 8)}
  assert sizes == {4: {"d/data": 100, "d/small": 10}, 8: {"d/data": 50, "d/small": 10}}


def _echo_server():
  """A loopback server that echoes each connection's bytes back; returns its port."""
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen()

  def echo(connection):
    with connection:
      while data := connection.recv(1024):
        connection.sendall(data)

  def accept():
    while True:
      connection, _ = server.accept()
      threading.Thread(target=echo, args=(connection,), daemon=True).start()

  threading.Thread(target=accept, daemon=True).start()
  return server.getsockname()[1]


def test_cut_proxy_refuses_and_drops_connections_until_restored():
  proxy = CuttableProxy(_echo_server())
  try:
    open_connection = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    open_connection.sendall(b"ping")
    assert open_connection.recv(4) == b"ping"
    proxy.cut()
    assert open_connection.recv(4) == b""     # the connection in flight is closed
    with pytest.raises(ConnectionRefusedError):
      socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    port = proxy.port
    proxy.restore()
    assert proxy.port == port                 # the same endpoint answers again
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as again:
      again.sendall(b"pong")
      assert again.recv(4) == b"pong"
  finally:
    proxy.close()


def test_small_disk_fills_to_the_last_byte_and_frees(tmp_path):
  disk = SmallDisk(str(tmp_path / "disk"), size_mb=2)
  try:
    disk.mount()
  except UserError as error:
    pytest.skip(str(error))   # not root: the next test checks the message
  try:
    assert 2 * 2**20 - 64 * 1024 < disk.fill() <= 2 * 2**20
    with pytest.raises(OSError) as full:
      with open(tmp_path / "disk" / "more", "wb") as f:
        f.write(b"x" * 4096)
    assert full.value.errno == errno.ENOSPC
    disk.free()
    with open(tmp_path / "disk" / "more", "wb") as f:
      f.write(b"x" * 4096)
  finally:
    disk.unmount()
  assert not os.path.ismount(tmp_path / "disk")


def test_a_refused_mount_is_one_line_naming_the_fix(tmp_path, monkeypatch):
  """Where `mount` is refused (not root), as a `mount` on PATH that refuses shows."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "mount").write_text("#!/bin/sh\necho 'mount: only root can do that.' >&2\n"
                                 "exit 1\n")
  (bin_dir / "mount").chmod(0o755)
  monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
  with pytest.raises(UserError) as error:
    SmallDisk(str(tmp_path / "disk"), size_mb=8).mount()
  message = str(error.value)
  assert "\n" not in message
  assert message == (f"launch.chaos: --kinds=disk_full mounts a 8 MiB tmpfs at "
                     f"{tmp_path / 'disk'} and could not (mount: only root can do that.): "
                     "run it as root (or with CAP_SYS_ADMIN), or leave disk_full out of "
                     "--kinds")


def test_a_full_disk_lasts_until_a_local_save_met_it():
  faults = chaos.StorageFaults(outage_fault_s=20, disk_full_s=5, local_every=10)
  disk = chaos.Fault("disk_full", 0, 30, at_step=31, sent_s=100.0)
  assert not faults.due(disk, 104.0, logged=45, restarted=False)   # too short
  assert not faults.due(disk, 110.0, logged=40, restarted=False)   # save 40 not met yet
  assert faults.due(disk, 110.0, logged=41, restarted=False)       # step 41: 40 was saved
  assert faults.due(disk, 110.0, logged=32, restarted=True)
  assert faults.due(disk, 181.0, logged=32, restarted=False)       # the run is stuck
  outage = chaos.Fault("outage", 0, 30, at_step=31, sent_s=100.0)
  assert not faults.due(outage, 119.0, logged=31, restarted=False)
  assert faults.due(outage, 120.0, logged=31, restarted=False)


def test_every_step_is_compared_and_a_missing_row_fails():
  stopped = chaos.Fault("outage", 0, 2, at_step=2, resumed_step=6, outcome="restarted")
  ridden = chaos.Fault("outage", 0, 9, at_step=9, outcome="rode it out")
  reference = {step: float(step) for step in range(1, 9)}
  assert chaos.compare_losses(reference, dict(reference), 1e-6)["equal"]
  check = chaos.compare_losses(reference, {s: v for s, v in reference.items() if s != 4},
                               1e-6)
  assert not check["equal"] and check["missing_steps"] == [4]
  check = chaos.compare_losses(reference, reference | {5: 6.0}, 1e-6)
  assert not check["equal"] and check["mismatched_steps"] == [5]
  # launch.local pauses 1, 2, 4, 8, 16 s before restarts that keep failing: 31 s > 20 s.
  assert chaos.restart_budget([stopped, ridden], outage_fault_s=20) == 2 + 2 + 2 * 5
  # ... and at most 60 s: 63 s after six pauses, then 60 s each up to 303 s > 300 s.
  assert chaos.restart_budget([stopped], outage_fault_s=300) == 1 + 2 + 10
