"""Real Slurm: a cluster of two slurmd "nodes" on this machine, started here in a
tmp dir (slurm-wlm 22.05: auth/none and cred/none, proctrack/linuxproc, task/none: no munge, no
cgroups), then
  (a) `ckpt-harness run --scheduler cluster --executor slurm --shards 2`: the cases go through sbatch
      as two parts and come back merged, with the ids and outcomes of a direct serial run;
  (b) one 2-rank case's save world across both nodes: the cluster scheduler's job holds 2 nodes, its
      world starts as one torchrun agent a node (an srun step) meeting through the c10d rendezvous.
Skipped, with the reason, where the Slurm binaries are absent (.ci/run installs slurm-wlm)."""

from __future__ import annotations

import getpass
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from harness.cli import main
from harness.orchestration.matrix import load_matrix
from harness.orchestration.runner import RunOptions, run_cases
from harness.orchestration.schedulers import get
from harness.orchestration.schedulers.cluster import Cluster, ClusterOptions
from harness.run.nodes import free_port

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "matrices" / "smoke.yaml"
TOOLS = ("slurmctld", "slurmd", "sbatch", "srun", "sinfo", "squeue", "scancel")
MISSING = [t for t in TOOLS if shutil.which(t) is None]
RANKS_DIR = "CKPT_HARNESS_TEST_RANKS"
#: the allocation's first node runs the job and the rendezvous (harness.run.nodes.run_slurm names it
#: by SLURMD_NODENAME), so it is named as this host is (Slurm refuses two nodes when one is called
#: `localhost`: "Duplicated NodeHostName"); the second is reached by its NodeAddr only, and its name
#: extends the first so it sorts after it (Slurm orders an allocation's nodes by name: "ckpt-n2" came first)
NODES = (socket.gethostname(), f"{socket.gethostname()}-n2")


def _resolves(name: str) -> bool:
    try:
        return bool(socket.gethostbyname(name))
    except OSError:
        return False

pytestmark = [
    pytest.mark.skipif(bool(MISSING), reason=f"Slurm is not installed here (no {', '.join(MISSING)} on PATH; "
                       "apt-get install slurm-wlm, as .ci/run does)"),
    pytest.mark.skipif(not _resolves(NODES[0]), reason=f"this host's name {NODES[0]!r} does not resolve: the rendezvous "
                       "on the first node is reached by it"),
    pytest.mark.xdist_group("slurm"),  # its tests on one worker: one cluster at a time (a test's own: no daemon outlives it)
]


def record_rank() -> None:
    """A rank hook (`test_slurm:record_rank`): the node and rank torchrun and Slurm gave this rank."""
    keys = ("RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SLURMD_NODENAME", "SLURM_JOB_ID")
    doc = {k: os.environ.get(k) for k in keys}
    Path(os.environ[RANKS_DIR], f"{doc['TORCHELASTIC_RUN_ID']}-{doc['RANK']}.json").write_text(json.dumps(doc))


def _conf(root: Path, ports: list[int]) -> str:
    user, cpus = getpass.getuser(), os.cpu_count() or 1
    nodes = "\n".join(f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs={cpus} State=UNKNOWN" for n, p in zip(NODES, ports[1:]))
    return f"""ClusterName=ckpt
SlurmctldHost=localhost
SlurmctldPort={ports[0]}
AuthType=auth/none
CredType=cred/none
SlurmUser={user}
SlurmdUser={user}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture
def slurm(tmp_path_factory):
    """slurmctld and two slurmd (-N HOSTNAME, -N HOSTNAME-n2) in the foreground as our children; SLURM_CONF
    points sbatch, srun and submitit at them. Stopped (jobs cancelled first) at the end."""
    root = tmp_path_factory.mktemp("slurm")
    for d in ("state", "log", *(f"spool/{n}" for n in NODES)):
        (root / d).mkdir(parents=True)
    conf = root / "slurm.conf"
    conf.write_text(_conf(root, [free_port() for _ in range(1 + len(NODES))]))
    mp = pytest.MonkeyPatch()
    mp.setenv("SLURM_CONF", str(conf))
    mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    procs = [subprocess.Popen(["slurmctld", "-D", "-f", str(conf)], stdout=(root / "log" / "slurmctld.out").open("w"),
                              stderr=subprocess.STDOUT)]
    procs += [subprocess.Popen(["slurmd", "-D", "-f", str(conf), "-N", n], stdout=(root / "log" / f"slurmd-{n}.out").open("w"),
                               stderr=subprocess.STDOUT) for n in NODES]
    try:
        deadline, state = time.monotonic() + 60, ""
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True).stdout
            if sorted(state.split()) == sorted([*NODES, *["idle"] * len(NODES)]):
                break
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.5)
        if sorted(state.split()) != sorted([*NODES, *["idle"] * len(NODES)]):
            logs = "\n".join(f"{f.name}: {f.read_text()[-1500:]}" for f in sorted((root / "log").iterdir()))
            pytest.fail(f"the test cluster did not come up: sinfo said {state!r}\n{logs}")
        yield root
    finally:  # the jobs' batch steps end before their slurmd (else a slurmstepd outlives the test)
        subprocess.run(["scancel", "--full", "--user", getpass.getuser()], capture_output=True, check=False)
        for _ in range(60):
            if not subprocess.run(["squeue", "-h"], capture_output=True, text=True).stdout.strip():
                break
            time.sleep(0.5)
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        mp.undo()


def _outcomes(results) -> list[tuple[str, str]]:
    return [(r["id"], r["status"]) if isinstance(r, dict) else (r.id, r.status) for r in results]


@pytest.mark.slow  # real Slurm daemons (slow tier); the same scheduler path runs in the default tier through
# submitit's local executor (tests/test_cluster.py)
def test_the_cluster_scheduler_sends_parts_through_sbatch_and_merges_them_as_a_serial_run(slurm, tmp_path):
    k = "reshard-weights gpt tp1pp1dp1cp1->tp1pp2dp1cp1"
    specs = load_matrix(SMOKE).select(k)
    assert len(specs) == 3
    serial = run_cases(specs, RunOptions(workdir=tmp_path / "serial"), scheduler="serial")
    assert {s for _, s in _outcomes(serial)} == {"passed"}
    code = main(["run", str(SMOKE), "-k", k, "--scheduler", "cluster", "--executor", "slurm", "--shards", "2",
                 "--timeout-min", "10", "--workdir", str(tmp_path / "work"), "--report", str(tmp_path / "report"), "--keep"])
    doc = json.loads((tmp_path / "report" / "results.json").read_text())
    assert code == 0, doc
    assert _outcomes(doc["results"]) == _outcomes(serial)  # same ids, same order, same outcomes
    jobs = {n.split("ran in job ")[1].split()[0] for r in doc["results"] for n in r["notes"] if n.startswith("ran in job ")}
    array = {j.split("_")[0] for j in jobs}
    assert len(array) == 1 and jobs == {f"{a}_{i}" for a in array for i in (0, 1)}, jobs  # one sbatch array, two tasks
    folder = next((tmp_path / "work").glob("ckpt-harness-cluster-*"))  # kept (--keep): submitit's job files and logs
    assert {p.name for p in folder.glob("*_result.pkl")} == {f"{j}_0_result.pkl" for j in jobs}, sorted(folder.iterdir())


@pytest.mark.slow  # a launcher test (42 s on 2 cores); sbatch's parts and merge stay default
def test_a_two_rank_world_spans_two_slurm_nodes_through_c10d(slurm, tmp_path, monkeypatch):
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    monkeypatch.setenv(RANKS_DIR, str(ranks))
    specs = load_matrix(SMOKE).select("reshard-weights gpt-gqa tp2pp1dp1cp1->tp1pp1dp1cp1")
    assert len(specs) == 1
    scheduler = Cluster(ClusterOptions(executor="slurm", nodes=2, ranks_per_node=1, timeout_min=10), get("serial"))
    options = RunOptions(workdir=tmp_path / "work", rank_hooks=("test_slurm:record_rank",))
    (result,) = run_cases(specs, options, scheduler=scheduler)
    assert result.status == "passed", result.error
    worlds: dict[str, list[dict]] = {}
    for f in ranks.iterdir():
        r = json.loads(f.read_text())
        worlds.setdefault(r["TORCHELASTIC_RUN_ID"], []).append(r)
    (world,) = [w for w in worlds.values() if len(w) == 2]  # the save world; the load and judge worlds have 1 rank
    assert sorted(int(r["RANK"]) for r in world) == [0, 1] and {r["WORLD_SIZE"] for r in world} == {"2"}
    assert {r["SLURMD_NODENAME"] for r in world} == set(NODES)  # one rank on each slurmd node
    assert {r["GROUP_RANK"] for r in world} == {"0", "1"} and len({r["SLURM_JOB_ID"] for r in world}) == 1
    assert all(r["TORCHELASTIC_RUN_ID"].startswith(f"ckpt-{world[0]['SLURM_JOB_ID']}-") for r in world)  # nodes' rendezvous
