"""A real two-node SLURM cluster on one machine, for tests: slurmctld, two slurmd and munged.

The two nodes are the two network namespaces of `tests/netns.py` (10.0.0.1 and 10.0.0.2, each with its
own /etc/hosts naming both). slurmctld runs in namespace 0, so both nodes and every client reach it at
10.0.0.1; one slurmd runs in each namespace under its node name (`slurmd -N`). A job step's tasks are
forked by their node's slurmd, so they live in that node's network namespace and resolve the node names
to the two addresses, as on a real cluster. munged runs in the host's namespace: a unix socket is a file,
reachable from every network namespace. Everything (slurm.conf, munge key, state, spool, logs) lives in
one folder that SLURM_CONF points at; nothing under /etc or /run is touched.

    with start_cluster(tmp_path / "slurm") as cluster:
        job_id, proc = cluster.sbatch("job.sh", env=os.environ, timeout=300)  # sbatch --wait, on node 0

Needs root, iproute2, slurmctld/slurmd/slurm-client and munge (Debian: the packages of those names);
`unavailable()` says what is missing; `start_cluster` raises ClusterUnavailable when the machine cannot host
the cluster and ClusterFailed, with the daemons' logs, when the cluster does not come up.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from netns import Hosts, HostsUnavailable, make_hosts

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "sinfo", "scontrol", "scancel", "ip")
CTLD_PORT, SLURMD_PORT = 16817, 16818  # inside the namespaces, so they cannot clash with a real cluster's
# Daemons live in sbin, which a non-login PATH may lack.
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
# Client variables a surrounding SLURM job (or a user's shell) would leak into ours.
_CLIENT_VARS = re.compile(r"^(SLURM|SBATCH|SRUN|SALLOC|SQUEUE|SINFO|SCONTROL)_")


class ClusterUnavailable(Exception):
    """This machine cannot host the cluster (not root, programs missing, no network namespaces)."""


class ClusterFailed(Exception):
    """The cluster was started but did not come up; the message holds the daemons' logs."""


def unavailable() -> str | None:
    """Why this machine cannot host the test cluster, or None when it can."""
    if os.geteuid() != 0:
        return "a SLURM cluster in network namespaces needs root"
    missing = [program for program in PROGRAMS if shutil.which(program, path=SEARCH_PATH) is None]
    if missing:
        return (f"{', '.join(missing)} not installed (apt-get install slurmctld slurmd slurm-client munge "
                "iproute2)")
    return None


@dataclass
class Cluster:
    hosts: Hosts
    folder: Path
    daemons: dict[str, subprocess.Popen] = field(default_factory=dict)  # name -> foreground daemon

    @property
    def nodes(self) -> tuple[str, str]:
        return self.hosts.hostnames

    @property
    def conf(self) -> Path:
        return self.folder / "slurm.conf"

    def env(self, base: dict) -> dict:
        """`base` without any other SLURM job's variables, pointed at this cluster."""
        env = {k: v for k, v in base.items() if not _CLIENT_VARS.match(k)}
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = os.pathsep.join([env.get("PATH", ""), "/usr/sbin", "/sbin"])
        return env

    def on_node(self, node: int, *command) -> list[str]:
        """`command` (a SLURM client or anything else) run on node 0 or 1."""
        return self.hosts.prefix(node) + [str(c) for c in command]

    def client(self, *command, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(self.on_node(0, *command), env=self.env(os.environ), capture_output=True,
                              text=True, timeout=timeout, check=False)

    def node_states(self) -> dict[str, str]:
        """{node name: state} as slurmctld sees it ("idle", "alloc", "down*", ...)."""
        proc = self.client("sinfo", "--noheader", "--Node", "--format=%N %T", timeout=10)
        return dict(line.split() for line in proc.stdout.splitlines() if line.strip())

    def wait_until_idle(self, timeout: float = 30):
        deadline, states = time.monotonic() + timeout, {}
        while time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):  # slurmctld still starting: ask again
                states = self.node_states()
            if [states.get(node) for node in self.nodes] == ["idle", "idle"]:
                return
            self.check_daemons()
            time.sleep(0.25)
        raise ClusterFailed(f"nodes not idle within {timeout:g} s: {states or 'slurmctld not answering'}\n"
                            f"{self.logs()}")

    def check_daemons(self):
        for name, daemon in self.daemons.items():
            if daemon.poll() is not None:
                raise ClusterFailed(f"{name} exited with code {daemon.returncode}\n{self.logs()}")

    def sbatch(self, *args, env: dict, timeout: float, cwd=None) -> tuple[str | None, subprocess.CompletedProcess]:
        """`sbatch --wait ARGS` on node 0: (job id, the finished sbatch). Its exit code is the job's; a job
        still running after `timeout` seconds is cancelled and TimeoutExpired raised."""
        proc = subprocess.Popen(self.on_node(0, "sbatch", "--wait", *args), env=self.env(env), cwd=cwd,
                                text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.client("scancel", "--user=root")
            proc.kill()
            proc.communicate()
            raise
        job = re.search(r"Submitted batch job (\d+)", out)
        return (job.group(1) if job else None), subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def job_state(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as {key: value}: JobState, ExitCode, NodeList, ... (kept 5 minutes after the
        job ends; there is no accounting database to ask later)."""
        out = self.client("scontrol", "--oneliner", "show", "job", job_id).stdout
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def logs(self, chars: int = 1500) -> str:
        parts = []
        for log in sorted([*self.folder.glob("*.log"), *self.folder.glob("*.out")]):
            parts.append(f"--- {log.name}\n{log.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)

    def stop(self):
        """Cancel jobs, stop the daemons, kill whatever is left in the namespaces, remove them."""
        controller = self.daemons.get("slurmctld")
        if controller is not None and controller.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.client("scancel", "--user=root", timeout=10)
        for daemon in reversed(self.daemons.values()):  # slurmds, slurmctld, then munged
            if daemon.poll() is None:
                daemon.terminate()
        for daemon in self.daemons.values():
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        # Job steps (slurmstepd and the trainers under it) outlive a stopped slurmd; remove() kills every process
        # in these namespaces, all of them ours, so nothing else is touched.
        self.hosts.remove()


def _cgroup_plugin() -> str:
    """slurmd 22.05 always loads a cgroup plugin, and its autodetection fails in some containers; v1 only
    loads (nothing here asks it to create a cgroup). 23.02 and later can turn cgroups off."""
    slurmd = shutil.which("slurmd", path=SEARCH_PATH)
    out = subprocess.run([slurmd, "-V"], capture_output=True, text=True, check=True).stdout
    major, minor = (int(n) for n in re.search(r"(\d+)\.(\d+)", out).groups())
    return "disabled" if (major, minor) >= (23, 2) else "cgroup/v1"


def _write_config(folder: Path, hosts: Hosts):
    (folder / "state").mkdir()
    for node in hosts.hostnames:
        (folder / "spool" / node).mkdir(parents=True)
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    cpus = os.cpu_count() or 1
    nodes = "\n".join(f"NodeName={name} NodeAddr={address} CPUs={cpus} State=UNKNOWN"
                      for name, address in zip(hosts.hostnames, hosts.addresses))
    # The controller must be named after this machine (slurmctld checks), at node 0's address.
    (folder / "slurm.conf").write_text(f"""\
ClusterName=toolkit-test
SlurmctldHost={socket.gethostname().split(".")[0]}({hosts.addresses[0]})
SlurmctldPort={CTLD_PORT}
SlurmdPort={SLURMD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={folder}/munge.sock
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/linear
SchedulerType=sched/builtin
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
# sbatch --wait polls every 2 s unless 2 < MinJobAge/2 (integer division); then 2, 8, 32 s: a ~20 s job waited 42 s.
# Finished jobs stay listed for at least MinJobAge seconds, and the tests read them right after sbatch returns.
MinJobAge=5
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
    (folder / "cgroup.conf").write_text(f"CgroupPlugin={_cgroup_plugin()}\n")


def _start(cluster: Cluster, name: str, command: list[str]):
    with open(cluster.folder / f"{name}.out", "w") as out:  # the daemon keeps its own copy of the file
        cluster.daemons[name] = subprocess.Popen(command, env=cluster.env(os.environ), stdout=out,
                                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


@contextlib.contextmanager
def start_cluster(folder: Path, tag: str | None = None, timeout: float = 30):
    """Yield a running two-node Cluster whose daemons keep their files in `folder`; always torn down."""
    reason = unavailable()
    if reason:
        raise ClusterUnavailable(reason)
    folder.mkdir(parents=True)
    folder.chmod(0o755)  # munged wants its socket's folder searchable
    try:
        hosts = make_hosts(tag or f"s{os.getpid()}")
    except HostsUnavailable as error:
        raise ClusterUnavailable(str(error)) from None
    cluster = Cluster(hosts, folder)
    try:
        _write_config(folder, hosts)
        # Foreground daemons (-F, -D) stay our children: their pids are ours to stop. -f: munged as root.
        munged = shutil.which("munged", path=SEARCH_PATH)
        _start(cluster, "munged", [munged, "-F", "-f", f"--socket={folder}/munge.sock",
                                   f"--key-file={folder}/munge.key", f"--pid-file={folder}/munged.pid",
                                   f"--seed-file={folder}/munged.seed", f"--log-file={folder}/munged.log"])
        _wait_for_file(folder / "munge.sock", cluster, timeout=10)
        _start(cluster, "slurmctld", cluster.on_node(0, "slurmctld", "-D", "-i"))
        for node, name in enumerate(hosts.hostnames):
            _start(cluster, f"slurmd-{name}", cluster.on_node(node, "slurmd", "-D", "-N", name))
        cluster.wait_until_idle(timeout)
        yield cluster
    finally:
        cluster.stop()


def _wait_for_file(path: Path, cluster: Cluster, timeout: float):
    deadline = time.monotonic() + timeout
    while not path.exists():
        cluster.check_daemons()
        if time.monotonic() > deadline:
            raise ClusterFailed(f"{path} did not appear within {timeout:g} s\n{cluster.logs()}")
        time.sleep(0.05)
