"""A real one-node Slurm cluster for tests: munged, slurmctld and slurmd (Debian's slurm-wlm), as root.

    cluster = SlurmCluster().up()        # daemons started, the node idle in `sinfo`
    subprocess.run(cluster.client(["salloc", "-n2", "--", ...]), env=cluster.env(os.environ))
    cluster.down()                       # every daemon, allocation and task of it killed; files removed

With `nodes` and `on_host` it is a cluster of namespace hosts (`varuna.bench.netns.NetnsHosts`): slurmctld runs
on the first, a slurmd on each (so each node's tasks live in its network stack and carry its name), and
clients run on the first too; munged serves them all through its socket (a path, seen from every namespace).

Everything of one cluster lives in its own directory (configuration, munge key and socket, state, logs)
and listens on free ports, so it touches no system Slurm or munge and two test sessions do not meet.
Each process it starts, and each process started with its `env` (salloc, srun, the tasks), carries
``SLURM_CONF=<its slurm.conf>``; `down` ends all of them, and `up` first ends those of a cluster whose
session died without its `down`.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from varuna.launch.pids import pid_alive, terminate

__all__ = ["SlurmCluster", "slurm_unavailable", "SLURM_TOOLS"]

SLURM_TOOLS = ("munged", "slurmctld", "slurmd", "salloc", "srun", "sinfo", "scontrol")
_PREFIX = "varuna-slurm-"


def slurm_unavailable() -> str | None:
    """Why a test Slurm cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "the Slurm tests start munged, slurmctld and slurmd as root; run them as root"
    missing = [tool for tool in SLURM_TOOLS if shutil.which(tool) is None]
    if missing:
        return (
            f"Slurm is not installed ({', '.join(missing)} missing): `make slurm-tools` as root installs "
            "Debian's slurm-wlm"
        )
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _processes_with(marker: str) -> dict[int, str]:
    """Live processes whose environment has ``SLURM_CONF`` starting with `marker` -> that value."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in environ:
            if item.startswith(b"SLURM_CONF=") and item[11:].decode(errors="replace").startswith(marker):
                found[int(entry.name)] = item[11:].decode(errors="replace")
    return found


def _kill(pids: set[int], grace_s: float) -> None:
    terminate(lambda: {p for p in pids if pid_alive(p)}, grace_s, kill_wait_s=2.0)


def remove_stale() -> None:
    """End the processes of clusters whose directory's owner (the pid in its name) is gone."""
    root = Path(tempfile.gettempdir())
    stale: set[int] = set()
    for pid, conf in _processes_with(str(root / _PREFIX)).items():
        owner = Path(conf).parent.name.removeprefix(_PREFIX).split("-")[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            stale.add(pid)
    _kill(stale, grace_s=2.0)
    for folder in root.glob(f"{_PREFIX}*"):
        owner = folder.name.removeprefix(_PREFIX).split("-")[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            shutil.rmtree(folder, ignore_errors=True)


class SlurmCluster:
    """One node (this machine, `cpus` CPUs) in one partition ``debug``; see the module docstring."""

    def __init__(
        self,
        cpus: int = 2,
        nodes: Mapping[str, str] | None = None,
        on_host: Callable[[str, list[str]], list[str]] | None = None,
    ) -> None:
        self.cpus = cpus
        self.nodes = dict(nodes or {socket.gethostname(): "127.0.0.1"})
        """Node name -> its address."""
        self.node = next(iter(self.nodes))
        """The controller's node, where `client` commands run."""
        self._on_host = on_host or (lambda _host, argv: argv)
        self.dir = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-"))
        self.dir.chmod(0o755)  # munged wants its socket's directory searchable by all
        self.conf = self.dir / "slurm.conf"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """`base` (default os.environ) without any outer Slurm job's variables, with this cluster's conf."""
        base = os.environ if base is None else base
        clean = {k: v for k, v in base.items() if not k.startswith(("SLURM_", "SALLOC_", "SBATCH_", "SRUN_"))}
        return {**clean, "SLURM_CONF": str(self.conf)}

    def client(self, argv: list[str]) -> list[str]:
        """`argv` (salloc, sbatch, sinfo, ...) as run on the controller's node."""
        return self._on_host(self.node, argv)

    def _write_config(self) -> None:
        d = self.dir
        for sub in ("state", "spool", "log", *(f"spool/{n}" for n in self.nodes)):
            (d / sub).mkdir()
        key = d / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        (d / "plugstack.conf").write_text("")
        (d / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
        self.conf.write_text(
            "\n".join(
                [
                    f"ClusterName=varuna{os.getpid()}",
                    f"SlurmctldHost={self.node}({self.nodes[self.node]})",
                    f"SlurmctldPort={_free_port()}",
                    f"SlurmdPort={_free_port()}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={d / 'munge.sock'}",
                    f"StateSaveLocation={d / 'state'}",
                    f"SlurmdSpoolDir={d / 'spool' / '%n'}",
                    f"SlurmctldPidFile={d / 'slurmctld.pid'}",
                    f"SlurmdPidFile={d / 'slurmd.%n.pid'}",
                    f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={d / 'log' / 'slurmd.%n.log'}",
                    f"PlugStackConfig={d / 'plugstack.conf'}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "SlurmdParameters=config_overrides",
                    "MpiDefault=none",
                    "SchedulerType=sched/builtin",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "JobCompType=jobcomp/none",
                    "MailProg=/bin/true",
                    "ReturnToService=2",
                    "KillWait=5",
                    *(
                        f"NodeName={n} NodeAddr={a} CPUs={self.cpus} State=UNKNOWN"
                        for n, a in self.nodes.items()
                    ),
                    f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )

    def _start(self, name: str, cmd: list[str]) -> None:
        log = open(self.dir / "log" / f"{name}.out", "wb")  # noqa: SIM115
        try:
            self.procs[name] = subprocess.Popen(
                cmd,
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()

    def logs(self) -> str:
        """The tail of every daemon's output, for a failure message."""
        parts = []
        for path in sorted((self.dir / "log").glob("*")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)

    def up(self, timeout_s: float = 60.0) -> SlurmCluster:
        """Start munged, slurmctld and slurmd; return once the node is idle (a RuntimeError if not)."""
        remove_stale()
        self._write_config()
        d = self.dir
        try:
            self._start(
                "munged",
                [
                    "munged",
                    "-F",
                    f"--socket={d / 'munge.sock'}",
                    f"--key-file={d / 'munge.key'}",
                    f"--pid-file={d / 'munged.pid'}",
                    f"--seed-file={d / 'munged.seed'}",
                    f"--log-file={d / 'log' / 'munged.log'}",
                ],
            )
            self._wait(lambda: (d / "munge.sock").exists(), timeout_s, "munged to make its socket")
            self._start("slurmctld", self.client(["slurmctld", "-D", "-i", "-f", str(self.conf)]))
            for node in self.nodes:
                self._start(
                    f"slurmd.{node}", self._on_host(node, ["slurmd", "-D", "-f", str(self.conf), "-N", node])
                )
            self._wait(self._idle, timeout_s, f"nodes {', '.join(self.nodes)} to be idle in sinfo")
        except BaseException:
            self.down()
            raise
        return self

    def _idle(self) -> bool:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.logs()}")
        out = subprocess.run(
            self.client(["sinfo", "-h", "-N", "-o", "%T"]),
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.split() == ["idle"] * len(self.nodes)

    def _wait(self, ready: object, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():  # type: ignore[operator]
            if time.monotonic() > deadline:
                raise RuntimeError(f"waited {timeout_s:g} s for {what}:\n{self.logs()}")
            time.sleep(0.2)

    def down(self) -> None:
        """End every process of this cluster (the daemons, then whatever of its jobs is left); remove its files."""
        for name in [*(f"slurmd.{n}" for n in self.nodes), "slurmctld", "munged"]:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        _kill(set(_processes_with(str(self.conf))), grace_s=2.0)  # salloc, srun, steps, tasks, slurmscriptd
        shutil.rmtree(self.dir, ignore_errors=True)
