"""A real two-node SLURM cluster for tests, on one machine.

`slurmctld`, `munged` and two `slurmd` daemons (Debian's `slurm-wlm` and `munge`), each
daemon with its own network namespace, and each node with its own hostname (UTS
namespace) and `/etc/hosts` (mount namespace):

    namespace <tag>-ctl   bridge br0 10.199.0.1/24   slurmctld ("ctl")
    namespace <tag>-n1    eth0 10.199.0.11/24        slurmd -N node1
    namespace <tag>-n2    eth0 10.199.0.12/24        slurmd -N node2

A job's tasks run inside their node's namespaces, so a two-node job really crosses a
network interface: JAX's coordinator listens on node1 and node2's processes reach it
through the bridge. The addresses exist only inside the namespaces the fixture creates;
nothing is added to the host's own network, and `stop()` deletes them.

Each node declares 2 CPUs and 2 GPUs as GRES over placeholder character devices (the
processes run on CPU). `JobRequeue=1` with a 10 s requeue delay (`cred_expire`, which
SLURM waits after a requeue before the job may start again), and two partitions:
`gpu` (preemptible: `PreemptMode=REQUEUE`, `GraceTime=60`) and `urgent` (a higher
`PriorityTier`, whose jobs preempt `gpu` jobs). `KillWait` is 60 s, not the default 30
(see KILL_WAIT_S); `MessageTimeout` is 60 s, not the default 10 (see MESSAGE_TIMEOUT_S).

Client commands (`sbatch`, `squeue`, `scontrol`, `scancel`, `sacct`, `sinfo`) reach
slurmctld through small wrappers that enter the controller's network namespace;
`env()` puts them first on PATH and points `SLURM_CONF` at the cluster's config.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from typing import Iterable, Optional

SUBNET = "10.199.0"
CONTROLLER_ADDRESS = f"{SUBNET}.1"
NODES = ("node1", "node2")
CPUS_PER_NODE = 2
GPUS_PER_NODE = 2
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "sacct", "sinfo", "srun")
REQUEUE_DELAY_S = 10
GRACE_TIME_S = 60
# The time a cancelled or timed-out job's tasks have to save and exit (a JAX process
# takes seconds to finalize) before SIGKILL; srun, "forcing job termination" on its own
# SIGTERM, waits as long. SLURM's default, 30 s, was too short on CI's loaded 2 cores:
# at a time limit the four tasks had not saved when srun killed them (exit 134, the
# survivors aborting once the coordinator's process was gone), and the job resumed from
# an older periodic checkpoint.
KILL_WAIT_S = 60
# On a loaded host a node's slurmd can take over SLURM's default 10 s to answer the
# controller's REQUEST_SIGNAL_TASKS while a dying step's tasks abort (a task killed,
# srun ending the step). The controller's agent then retries that signal about 60 s
# later against the job's step 0, which after a requeue is the next run's: CI saw the
# requeued job SIGTERMed twice that way, 50-70 s after each start, until its restart
# budget ran out. Answers within this timeout are never retried.
MESSAGE_TIMEOUT_S = 60
DAEMONS = ("munged", "slurmctld", "slurmd")

# The user of `SlurmCluster.unprivileged_bin`'s clients: nobody.
UNPRIVILEGED_UID = 65534


def unavailable_reason() -> Optional[str]:
  """Why no cluster can start on this host (one line), or None."""
  missing = [d for d in DAEMONS if shutil.which(d) is None and
             not os.path.exists(f"/usr/sbin/{d}")]
  if missing:
    return (f"SLURM cluster tests need {', '.join(missing)}: "
            "apt-get install slurm-wlm munge (as .ci/run does)")
  probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "true"],
                         capture_output=True, text=True, check=False)
  if probe.returncode != 0:
    return ("SLURM cluster tests need network, UTS and mount namespaces "
            f"(unshare: {probe.stderr.strip() or probe.returncode})")
  return None


def _node_address(index: int) -> str:
  return f"{SUBNET}.{11 + index}"


def _run(*command: str) -> None:
  subprocess.run(command, check=True, capture_output=True, text=True)


class SlurmCluster:
  """The daemons, namespaces and files of one cluster under `root`."""

  def __init__(self, root: str):
    self.root = os.path.abspath(root)
    self.tag = f"gpc{os.getpid()}"
    self.conf = os.path.join(self.root, "slurm.conf")
    self.bin = os.path.join(self.root, "bin")
    self._namespaces: list[str] = []
    # munged's socket, key and log: where user nobody (`unprivileged_bin`) can reach the
    # socket, which a test's private temporary directory is not.
    self.munge = os.path.join("/run", f"{self.tag}-munge")

  def namespace(self, host: str) -> str:
    return f"{self.tag}-{host}"

  def env(self, base: Optional[dict] = None) -> dict:
    """`base` (default os.environ) with the cluster's clients first on PATH."""
    env = dict(os.environ if base is None else base)
    env["PATH"] = self.bin + os.pathsep + env.get("PATH", "")
    env["SLURM_CONF"] = self.conf
    return env

  # -- start -------------------------------------------------------------------------

  def start(self) -> "SlurmCluster":
    os.makedirs(self.root, exist_ok=True)
    try:
      self._write_files()
      self._start_munge()
      self._make_network()
      self._start_in(self.namespace("ctl"), "ctl",
                     ["slurmctld", "-f", self.conf, "-i"])
      for index, node in enumerate(NODES):
        self._start_in(self.namespace(f"n{index + 1}"), node,
                       ["slurmd", "-f", self.conf, "-N", node])
      self._wait_until_idle()
    except BaseException:
      self.stop()
      raise
    return self

  def _write_files(self) -> None:
    root = self.root
    for sub in ("ctld/state", "dev", "bin", *(f"{n}/spool" for n in NODES)):
      os.makedirs(os.path.join(root, sub), exist_ok=True)
    os.makedirs(self.munge, exist_ok=True)
    os.chmod(self.munge, 0o755)
    key = os.path.join(self.munge, "munge.key")
    with open(key, "wb") as f:
      f.write(os.urandom(1024))
    os.chmod(key, 0o400)
    for gpu in range(GPUS_PER_NODE):   # GRES files: placeholders, never opened
      path = os.path.join(root, "dev", f"nvidia{gpu}")
      if not os.path.exists(path):
        os.mknod(path, 0o600 | 0o020000, os.makedev(195, gpu))
    with open(os.path.join(root, "hosts"), "w", encoding="ascii") as f:
      f.write("127.0.0.1 localhost\n" f"{CONTROLLER_ADDRESS} ctl\n")
      f.writelines(f"{_node_address(i)} {node}\n" for i, node in enumerate(NODES))
    node_lines = [
        f"NodeName={node} NodeAddr={_node_address(i)} CPUs={CPUS_PER_NODE} "
        f"RealMemory=4000 Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN"
        for i, node in enumerate(NODES)]
    nodes = ",".join(NODES)
    with open(self.conf, "w", encoding="ascii") as f:
      f.write("\n".join([
          "ClusterName=griffintest",
          f"SlurmctldHost=ctl({CONTROLLER_ADDRESS})",
          "AuthType=auth/munge",
          f"AuthInfo=socket={self.munge}/socket,cred_expire={REQUEUE_DELAY_S}",
          "CredType=cred/munge",
          "SlurmUser=root", "SlurmdUser=root",
          f"StateSaveLocation={root}/ctld/state",
          f"SlurmctldPidFile={root}/ctld/pid", f"SlurmctldLogFile={root}/ctld/log",
          f"SlurmdSpoolDir={root}/%n/spool", f"SlurmdPidFile={root}/%n/pid",
          f"SlurmdLogFile={root}/%n/log",
          "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
          "JobAcctGatherType=jobacct_gather/none",
          "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
          "SwitchType=switch/none", "MpiDefault=none",
          "SchedulerType=sched/builtin", "SchedulerParameters=sched_interval=2",
          "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
          "SlurmdParameters=config_overrides", "ReturnToService=2",
          "JobRequeue=1", "PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE",
          "GresTypes=gpu", f"KillWait={KILL_WAIT_S}",
          f"MessageTimeout={MESSAGE_TIMEOUT_S}", "InactiveLimit=0", "MinJobAge=3600",
          *node_lines,
          f"PartitionName=gpu Nodes={nodes} Default=YES MaxTime=INFINITE State=UP "
          f"PriorityTier=1 PreemptMode=REQUEUE GraceTime={GRACE_TIME_S}",
          f"PartitionName=urgent Nodes={nodes} MaxTime=INFINITE State=UP "
          "PriorityTier=10 PreemptMode=OFF",
          # Only group root may use it: how a site refuses a user without permission.
          f"PartitionName=restricted Nodes={nodes} MaxTime=INFINITE State=UP "
          "AllowGroups=root",
      ]) + "\n")
    with open(os.path.join(root, "gres.conf"), "w", encoding="ascii") as f:
      f.write(f"NodeName=node[1-{len(NODES)}] Name=gpu "
              f"File={root}/dev/nvidia[0-{GPUS_PER_NODE - 1}]\n")
    self._write_clients(self.bin)
    self._write_clients(self.unprivileged_bin,
                        f"setpriv --reuid={UNPRIVILEGED_UID} --regid={UNPRIVILEGED_UID} "
                        "--clear-groups ")

  @property
  def unprivileged_bin(self) -> str:
    """Clients that run as user nobody: root may use every partition, so a refusal for
    want of permission needs another user. Put first on PATH instead of `env`'s."""
    return os.path.join(self.root, "bin-nobody")

  def _stop_munge(self) -> None:
    """Ends munged (it writes its seed file as it goes), then removes its directory."""
    pid_file = os.path.join(self.munge, "pid")
    try:
      with open(pid_file, encoding="ascii") as f:
        pid = int(f.read().strip())
      os.kill(pid, signal.SIGTERM)
      deadline = time.monotonic() + 10
      while time.monotonic() < deadline:
        os.kill(pid, 0)
        time.sleep(0.05)
    except (OSError, ValueError):   # gone, or never started
      pass
    shutil.rmtree(self.munge, ignore_errors=True)

  def _write_clients(self, directory: str, run_as: str = "") -> None:
    """Client wrappers in `directory` that reach the controller's namespace, run through
    `run_as` (a command prefix that changes the user, or nothing)."""
    os.makedirs(directory, exist_ok=True)
    controller_ns = f"/run/netns/{self.namespace('ctl')}"
    for client in CLIENTS:
      path = os.path.join(directory, client)
      with open(path, "w", encoding="ascii") as f:
        # With another user, the configuration goes in as descriptor 3, opened here:
        # that user may not enter the test's private temporary directories.
        conf = ('SLURM_CONF=/dev/fd/3\nexec 3<"{}"'.format(self.conf) if run_as
                else f'SLURM_CONF="{self.conf}"')
        f.write(f'#!/bin/sh\nexport {conf}\n'
                f'exec nsenter --net={controller_ns} {run_as}/usr/bin/{client} "$@"\n')
      os.chmod(path, 0o755)

  def _start_munge(self) -> None:
    munge = self.munge
    _run("munged", "--force", f"--socket={munge}/socket", f"--key-file={munge}/munge.key",
         f"--log-file={munge}/log", f"--pid-file={munge}/pid", f"--seed-file={munge}/seed")

  def _make_network(self) -> None:
    ctl = self.namespace("ctl")
    for host in ("ctl", *(f"n{i + 1}" for i in range(len(NODES)))):
      _run("ip", "netns", "add", self.namespace(host))
      self._namespaces.append(self.namespace(host))
      _run("ip", "-n", self.namespace(host), "link", "set", "lo", "up")
    _run("ip", "-n", ctl, "link", "add", "br0", "type", "bridge")
    _run("ip", "-n", ctl, "addr", "add", f"{CONTROLLER_ADDRESS}/24", "dev", "br0")
    _run("ip", "-n", ctl, "link", "set", "br0", "up")
    for i in range(len(NODES)):
      node_ns = self.namespace(f"n{i + 1}")
      _run("ip", "-n", ctl, "link", "add", f"veth{i + 1}", "type", "veth", "peer", "name",
           "eth0", "netns", node_ns)
      _run("ip", "-n", ctl, "link", "set", f"veth{i + 1}", "master", "br0", "up")
      _run("ip", "-n", node_ns, "addr", "add", f"{_node_address(i)}/24", "dev", "eth0")
      _run("ip", "-n", node_ns, "link", "set", "eth0", "up")

  def _start_in(self, namespace: str, hostname: str, daemon: list[str]) -> None:
    """Starts a daemon (it forks into the background) in `namespace`'s network, with
    its own hostname and /etc/hosts. nsenter rather than `ip netns exec`, which would
    remount /sys and hide the cgroup mounts slurmd looks for."""
    hosts = os.path.join(self.root, "hosts")
    _run("nsenter", f"--net=/run/netns/{namespace}", "unshare", "--uts", "--mount", "sh",
         "-c", f'hostname {hostname} && mount --bind {hosts} /etc/hosts && exec "$@"',
         "sh", *daemon)

  def _wait_until_idle(self, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    states = ""
    while time.monotonic() < deadline:
      states = self.client("sinfo", "-h", "-N", "-p", "gpu", "-o", "%t")
      if states.split() == ["idle"] * len(NODES):
        return
      time.sleep(0.5)
    raise RuntimeError(f"SLURM nodes not idle after {timeout_s} s: {states!r}\n"
                       + self.logs())

  # -- use -----------------------------------------------------------------------------

  def client(self, *command: str, check: bool = True) -> str:
    result = subprocess.run([os.path.join(self.bin, command[0]), *command[1:]],
                            env=self.env(), capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
      raise RuntimeError(f"{' '.join(command)}: exit {result.returncode}: {result.stderr}")
    return result.stdout

  def job(self, job_id: str) -> dict:
    """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
    text = self.client("scontrol", "show", "job", "-o", job_id)
    return dict(item.split("=", 1) for item in text.split() if "=" in item)

  def wait_for(self, job_id: str, states: Iterable[str], timeout_s: float) -> dict:
    """Waits until the job is in one of `states`; returns its record."""
    wanted = set(states)
    deadline = time.monotonic() + timeout_s
    record: dict = {}
    while time.monotonic() < deadline:
      record = self.job(job_id)
      if record.get("JobState") in wanted:
        return record
      time.sleep(1)
    raise AssertionError(f"job {job_id} not {sorted(wanted)} after {timeout_s} s: "
                         f"{record.get('JobState')}\n" + self.logs())

  def logs(self, lines: int = 15) -> str:
    """The tails of the daemons' logs, for failure messages."""
    out = []
    for name in ("ctld", *NODES):
      path = os.path.join(self.root, name, "log")
      if os.path.exists(path):
        with open(path, encoding="utf-8", errors="replace") as f:
          out.append(f"--- {name} log ---\n" + "".join(f.readlines()[-lines:]))
    return "\n".join(out)

  # -- stop ----------------------------------------------------------------------------

  def stop(self) -> None:
    """Ends every job, daemon and process in the namespaces, then the namespaces."""
    if os.path.exists(os.path.join(self.bin, "scancel")) and self._namespaces:
      self.client("scancel", "--full", "--signal=KILL", "--user=root", check=False)
    for namespace in self._namespaces:
      pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True,
                            text=True, check=False).stdout.split()
      for pid in pids:
        try:
          os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
          pass
    self._stop_munge()
    for namespace in reversed(self._namespaces):
      subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
    self._namespaces = []
