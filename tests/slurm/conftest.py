"""A real multi-node Slurm cluster (slurm/cluster/up.sh) for the tests in this directory.

The session fixture ``cluster_manager`` brings the cluster up on first use (3 nodes, KillWait
10 s; ``cluster`` with proctrack/linuxproc, ``cgroup_cluster`` with proctrack/cgroup) and always
tears it down (slurm/cluster/down.sh), even when a test fails or the run is interrupted; the
teardown fails the session if anything (process, namespace, bridge, mount, route, cgroup) is
left behind. Start-up times are appended to $BASE/startup-seconds.log.
Every test here is marked ``slurm`` and skips with a reason when the machine cannot run the
cluster (not root, slurm-wlm or munge missing); under CI=true a skip fails the suite.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SLURM_DIR = REPO / "slurm"
CLUSTER_DIR = SLURM_DIR / "cluster"
APPS = Path(__file__).resolve().parent / "apps"
BIN = Path(sys.executable).parent  # the venv running pytest (CI clones the repo elsewhere)
BASE = Path(os.environ.get("OPGUARD_TEST_CLUSTER", "/tmp/opguard-test-cluster"))
NODES = 3
KILLWAIT = 10
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.slurm)


def missing_reason() -> str | None:
    if os.geteuid() != 0:
        return "the Slurm test cluster needs root (network, UTS and mount namespaces)"
    missing = [b for b in ("slurmctld", "slurmd", "munged", "sbatch", "ip", "nsenter", "unshare")
               if shutil.which(b, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None]
    if missing:
        return (f"missing {', '.join(missing)}: apt-get install -y --no-install-recommends "
                "slurm-wlm munge iproute2 util-linux")
    return None


@dataclass
class Job:
    job_id: int
    fields: dict[str, str] = field(default_factory=dict)

    @property
    def state(self) -> str:
        return self.fields.get("JobState", "?")

    @property
    def exit_code(self) -> str:
        return self.fields.get("ExitCode", "?")


@dataclass
class Cluster:
    base: Path
    nodes: int
    killwait: int
    startup_s: float

    @property
    def conf(self) -> Path:
        return self.base / "etc" / "slurm.conf"

    @property
    def shared(self) -> Path:
        return self.base / "shared"

    def local_ssd(self, node: str) -> Path:
        """The host path that node ``node`` sees as /local-ssd."""
        return self.base / "nodes" / node / "local-ssd"

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("OPGUARD_", "SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "PMI_", "OMPI_"))}
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = f"{BIN}:{env.get('PATH', '/usr/bin:/bin')}"
        env["OPGUARD_TEST_CLUSTER"] = str(self.base)
        env.update(extra or {})
        return env

    def run(self, args: Sequence[str], extra_env: Mapping[str, str] | None = None, timeout: float = 120,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        p = subprocess.run(list(args), env=self.env(extra_env), capture_output=True, text=True, timeout=timeout,
                           cwd=self.shared)
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(args)} -> rc {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
        return p

    def sbatch(self, script: Path | str, *args: str, env: Mapping[str, str] | None = None) -> int:
        p = self.run(["sbatch", "--parsable", *args, str(script)], env)
        return int(p.stdout.strip().split(";")[0])

    def show(self, job_id: int) -> dict[str, str]:
        p = self.run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        out: dict[str, str] = {}
        for tok in p.stdout.split():
            k, sep, v = tok.partition("=")
            if sep:
                out.setdefault(k, v)
        return out

    def wait_state(self, job_id: int, states: set[str], timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            f = self.show(job_id)
            if f.get("JobState") in states:
                return f
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} not in {sorted(states)} after {timeout} s: {f}")
            time.sleep(0.1)

    def wait(self, job_id: int, timeout: float = 120) -> Job:
        """Wait until the job has ended and no node still runs any of it (squeue empty)."""
        f = self.wait_state(job_id, TERMINAL, timeout)
        deadline = time.monotonic() + max(30, timeout)
        while self.run(["squeue", "-h", "-j", str(job_id)], check=False).stdout.strip():
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} still completing after its end")
            time.sleep(0.1)
        return Job(job_id, f)

    def node_exec(self, node: str, args: Sequence[str], timeout: float = 60,
                  check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run([str(CLUSTER_DIR / "node_exec.sh"), node, *args], timeout=timeout, check=check)

    def log(self, name: str) -> str:
        path = self.base / "log" / name
        return path.read_text(errors="replace") if path.exists() else ""


def wait_for(predicate: object, timeout: float, what: str, interval: float = 0.1) -> None:
    """Poll ``predicate()`` until true or fail after ``timeout`` seconds, naming ``what``."""
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


class ClusterManager:
    """Starts the cluster on first use and restarts it when a test needs another proctrack plugin
    (linuxproc: every process of a step is signalled; cgroup: the production setting)."""

    def __init__(self) -> None:
        self.current: Cluster | None = None
        self.proctrack: str | None = None
        self.startups: list[float] = []

    def _script(self, name: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(CLUSTER_DIR / name), *args], env=env, capture_output=True, text=True, timeout=120)

    def env(self, proctrack: str = "linuxproc") -> dict[str, str]:
        return dict(os.environ, OPGUARD_TEST_CLUSTER=str(BASE), KILLWAIT=str(KILLWAIT), PROCTRACK=proctrack)

    def ensure(self, proctrack: str) -> Cluster:
        if self.current is not None and self.proctrack == proctrack:
            return self.current
        if self.current is not None:
            self.down()
        t0 = time.monotonic()
        up = self._script("up.sh", self.env(proctrack), str(NODES))
        startup = time.monotonic() - t0
        if up.returncode != 0:
            raise AssertionError(f"slurm/cluster/up.sh failed (rc {up.returncode}):\n{up.stderr}")
        self.startups.append(startup)
        self.current, self.proctrack = Cluster(BASE, NODES, KILLWAIT, startup), proctrack
        with open(BASE / "startup-seconds.log", "a") as f:
            f.write(f"{proctrack} {startup:.3f}\n")
        print(f"\nslurm test cluster ({proctrack}): {NODES} nodes up in {startup:.2f} s", file=sys.stderr)
        return self.current

    def down(self) -> None:
        self.current = self.proctrack = None
        down = self._script("down.sh", self.env())
        if down.returncode != 0:
            raise AssertionError(f"slurm/cluster/down.sh left something behind:\n{down.stderr}")


@pytest.fixture(scope="session")
def cluster_manager() -> Iterator[ClusterManager]:
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    mgr = ClusterManager()
    try:
        yield mgr
    finally:
        mgr.down()  # always, even when a test failed; fails the session if anything is left behind


@pytest.fixture
def cluster(cluster_manager: ClusterManager) -> Cluster:
    """The running cluster with proctrack/linuxproc (started on first use)."""
    return cluster_manager.ensure("linuxproc")


@pytest.fixture
def cgroup_cluster(cluster_manager: ClusterManager) -> Cluster:
    """The running cluster with proctrack/cgroup (restarted if the other plugin was running)."""
    return cluster_manager.ensure("cgroup")


@pytest.fixture
def workdir(cluster_manager: ClusterManager, request: pytest.FixtureRequest) -> Path:
    """A fresh directory on the shared filesystem for one test."""
    name = str(request.node.name).replace("[", "-").replace("]", "").replace("/", "-")
    d = BASE / "shared" / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    return d
