"""A real multi-node Slurm cluster (slurm/cluster/up.sh) for the tests in this directory.

The session fixture ``cluster`` brings the cluster up once (3 nodes, KillWait 10 s) and always
tears it down (slurm/cluster/down.sh), even when a test fails or the run is interrupted; the
teardown fails the session if anything (process, namespace, bridge, mount, route) is left behind.
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

    def job_pids(self, node: str, needle: str) -> list[int]:
        """PIDs on ``node`` whose command line contains ``needle``."""
        p = self.node_exec(node, ["pgrep", "-f", needle], check=False)
        return [int(x) for x in p.stdout.split()]

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


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    env = dict(os.environ, OPGUARD_TEST_CLUSTER=str(BASE), KILLWAIT=str(KILLWAIT))
    t0 = time.monotonic()
    try:
        up = subprocess.run([str(CLUSTER_DIR / "up.sh"), str(NODES)], env=env, capture_output=True, text=True,
                            timeout=120)
        startup = time.monotonic() - t0
        if up.returncode != 0:
            raise AssertionError(f"slurm/cluster/up.sh failed (rc {up.returncode}):\n{up.stderr}")
        c = Cluster(BASE, NODES, KILLWAIT, startup)
        (c.base / "run" / "startup-seconds").write_text(f"{startup:.3f}\n")
        print(f"\nslurm test cluster: {NODES} nodes up in {startup:.2f} s", file=sys.stderr)
        yield c
    finally:
        down = subprocess.run([str(CLUSTER_DIR / "down.sh")], env=env, capture_output=True, text=True, timeout=120)
        if down.returncode != 0:
            raise AssertionError(f"slurm/cluster/down.sh left something behind:\n{down.stderr}")


@pytest.fixture
def workdir(cluster: Cluster, request: pytest.FixtureRequest) -> Path:
    """A fresh directory on the shared filesystem for one test."""
    name = str(request.node.name).replace("[", "-").replace("]", "").replace("/", "-")
    d = cluster.shared / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    return d
