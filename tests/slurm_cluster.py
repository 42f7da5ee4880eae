"""A one-node Slurm cluster for the tests marked `slurm`: Debian's munged, slurmctld and slurmd, started by hand as root
with a slurm.conf written for this machine, each with its own state, spool, log and socket under one temporary
directory and ports of their own, so two clusters (two test processes) on one machine never meet. Every process of
the cluster, the jobs' included, carries SYMGPT_TEST_SLURM=<that directory> in its environment; stopping the cluster
cancels its jobs, then ends each process that carries it, by pid. A watchdog process does the same if the test
process dies first (it waits for its stdin to close).

    python tests/slurm_cluster.py --watch DIR      # the watchdog (started by start_cluster)
"""
from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

MARK = "SYMGPT_TEST_SLURM"
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "squeue")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED")
CONF = """\
ClusterName=symgpttest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=10
MinJobAge=3600
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


def skip_reason() -> str | None:
    """Why the cluster cannot start here (one line), or None."""
    missing = [name for name in BINARIES if shutil.which(name) is None]
    if missing:
        return f"needs Slurm and munge (Debian: apt-get install slurm-wlm munge); missing: {', '.join(missing)}"
    if os.geteuid() != 0:
        return "needs root: the test cluster's slurmd starts jobs as root"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    """A running cluster: `env` is the environment its commands (sbatch, squeue, ...) and jobs need."""

    root: Path
    env: dict[str, str]
    daemons: list[subprocess.Popen]
    watchdog: subprocess.Popen

    def run(self, *command: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        """A Slurm command on this cluster (its output captured); fails the test when it fails, unless not `check`."""
        done = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=timeout)
        assert not check or done.returncode == 0, \
            f"{' '.join(command)}: exit {done.returncode}\n{done.stdout}{done.stderr}"
        return done

    def sbatch(self, script: Path, *options: str, arguments: tuple[str, ...] = (), env: dict[str, str] | None = None,
               cwd: Path | None = None) -> str:
        """`sbatch OPTIONS SCRIPT ARGUMENTS` from `cwd` (default: the script's directory), the job in the cluster's
        environment updated with `env`; returns the job id."""
        done = subprocess.run(["sbatch", "--parsable", *options, str(script), *arguments],
                              env={**self.env, **(env or {})}, cwd=cwd or script.parent, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, f"sbatch {script}: exit {done.returncode}\n{done.stdout}{done.stderr}"
        return done.stdout.strip().split(";")[0]

    def records(self, job: str) -> list[dict[str, str]]:
        """`scontrol show job JOB`'s records as fields (one per array task that has started, one for those that wait
        together; `JOB_TASK` names one task)."""
        lines = self.run("scontrol", "show", "job", "--oneliner", job).stdout.splitlines()
        return [dict(word.split("=", 1) for word in line.split() if "=" in word) for line in lines]

    def job(self, job: str) -> dict[str, str]:
        """The fields of one job, or one array task (`JOB_TASK`)."""
        return self.records(job)[0]

    def states(self, job: str) -> dict[str, str]:
        """Each task's state of the (array) job, keyed by its task id (the job id for a job without tasks)."""
        return {fields.get("ArrayTaskId", fields["JobId"]): fields["JobState"] for fields in self.records(job)}

    def until(self, condition, what: str, timeout: float = 600) -> None:
        """Poll `condition` every half second (each poll may run a Slurm command) until it holds; fail naming `what`
        with the end of the daemons' logs after `timeout` s (a bound for a hang, not a measurement)."""
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"{what}: did not happen within {timeout} s\n{self.log()}"
            time.sleep(0.5)

    def requeued(self, job: str, timeout: float = 300) -> None:
        """Wait until `job` is back in the queue after a requeue (its last run has ended: it waits, PENDING)."""
        self.until(lambda: (fields := self.job(job))["JobState"] == "PENDING" and fields["Restarts"] != "0",
                   f"job {job} to be requeued", timeout)

    def start_requeued(self, job: str, *changes: str, timeout: float = 300) -> None:
        """Start a requeued job now (Slurm holds one about two minutes), with scontrol update's `changes` (e.g.
        TimeLimit=10), asked again until it has left the queue."""
        self.requeued(job, timeout)

        def started() -> bool:
            if self.job(job)["JobState"] != "PENDING":
                return True
            self.run("scontrol", "update", f"JobId={job}", "StartTime=now", *changes)
            return False
        self.until(started, f"requeued job {job} to start", timeout)

    def wait(self, job: str, timeout: float = 600) -> dict[str, str]:
        """Each task's final state, once every task of `job` has ended."""
        self.until(lambda: all(state in ENDED for state in self.states(job).values()), f"job {job} to end", timeout)
        return self.states(job)

    def log(self) -> str:
        """The end of slurmctld's and slurmd's logs (for a failed assertion)."""
        return "\n".join(f"== {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-30:])
                         for path in sorted((self.root / "log").glob("*.log")))


def start_cluster(root: Path, cpus: int = 4) -> Cluster:
    """munged, slurmctld and slurmd for one node of `cpus` CPUs (more than the machine has, for tasks that mostly
    wait), with all their files under `root`; waits until the node is idle."""
    for name in ("munge", "key", "state", "spool", "log"):
        (root / name).mkdir(parents=True, exist_ok=True)
    (root / "key").chmod(0o700)
    key = root / "key" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    node = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(CONF.format(root=root, node=node, cpus=cpus, ctld_port=free_port(), slurmd_port=free_port()))
    env = {**os.environ, "SLURM_CONF": str(conf), MARK: str(root)}
    watchdog = subprocess.Popen([sys.executable, __file__, "--watch", str(root)], stdin=subprocess.PIPE,
                                env={k: v for k, v in env.items() if k != MARK}, start_new_session=True)
    cluster = Cluster(root, env, [], watchdog)
    commands = [["munged", "--foreground", "--force", f"--socket={root}/munge/munge.socket", f"--key-file={key}",
                 f"--pid-file={root}/munge/munged.pid", f"--log-file={root}/log/munged.log",
                 f"--seed-file={root}/munge/munged.seed"],
                ["slurmctld", "-D", "-i", "-f", str(conf)], ["slurmd", "-D", "-N", node, "-f", str(conf)]]
    try:
        for command in commands:
            with open(root / "log" / f"{command[0]}.out", "ab") as out:
                cluster.daemons.append(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT))
            if command[0] == "munged":
                cluster.until(lambda: (root / "munge" / "munge.socket").exists(), "munged's socket", 60)
        cluster.until(lambda: cluster.run("sinfo", "--noheader", "--format=%T", check=False).stdout.strip() == "idle",
                      "the test cluster's node to be idle", 120)
    except BaseException:
        stop_cluster(cluster)
        raise
    return cluster


def marked(root: Path) -> list[int]:
    """The pids of every process whose environment carries MARK=root (the cluster's daemons and jobs)."""
    mark, pids = f"{MARK}={root}".encode(), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
    return pids


def end_marked(root: Path, grace: float = 10) -> None:
    """SIGTERM to every process of the cluster, SIGKILL to those left after `grace` seconds."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        deadline = time.monotonic() + grace
        while (pids := marked(root)) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
            time.sleep(0.2)


def cancel_jobs(env: dict[str, str], timeout: float = 60) -> None:
    """Cancel every job of the cluster whose commands run in `env` and wait (at most `timeout` s) until none is
    left."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(["scancel", "--user", pwd.getpwuid(os.geteuid()).pw_name], env=env, capture_output=True,
                       timeout=30)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            queue = subprocess.run(["squeue", "--noheader", "--format=%i"], env=env, capture_output=True, text=True,
                                   timeout=30)
            if queue.returncode or not queue.stdout.strip():
                break
            time.sleep(0.5)


def stop_cluster(cluster: Cluster) -> None:
    """Cancel the jobs, end every process of the cluster, and let the watchdog go."""
    cancel_jobs(cluster.env)
    for daemon in reversed(cluster.daemons):
        daemon.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            daemon.wait(timeout=15)
    end_marked(cluster.root)
    for daemon in cluster.daemons:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
    cluster.watchdog.stdin.close()
    cluster.watchdog.wait(timeout=120)


def watch(root: Path) -> None:
    """The watchdog: once stdin closes (the test process ended, however it ended), stop what is left."""
    sys.stdin.buffer.read()
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    if marked(root):
        cancel_jobs(env, timeout=30)
        end_marked(root)


if __name__ == "__main__":
    assert sys.argv[1:2] == ["--watch"], __doc__
    watch(Path(sys.argv[2]))
