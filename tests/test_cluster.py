"""The cluster extra (issue 20 item 4): matrix shards as jobs of submitit's local executor, merged
into one report; a case's world as 2 "nodes" x 2 ranks, two torchrun agents meeting through the
c10d rendezvous on localhost; the Slurm job script submitit writes for a multi-node shard; and the
default paths, which never import the extra."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.orchestration.schedulers.cluster import ClusterOptions, make_executor, run_matrix, run_shard, shard_argv
from harness.run import nodes

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "matrices" / "smoke.yaml"
RANKS_DIR = "CKPT_HARNESS_TEST_RANKS"


def record_rank() -> None:
    """A rank hook (`--rank-hook test_cluster:record_rank`): what torchrun told this rank, one file each."""
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")
    doc = {k: os.environ.get(k) for k in keys} | {"agent_pid": os.getppid()}
    Path(os.environ[RANKS_DIR], f"{doc['TORCHELASTIC_RUN_ID']}-{doc['RANK']}.json").write_text(json.dumps(doc))


def _ids(k: str) -> list[str]:
    from harness.orchestration.matrix import load_matrix

    return [s.id for s in load_matrix(SMOKE).select(k)]


def test_a_world_takes_the_fewest_nodes_that_split_it_evenly():
    assert nodes.layout(4, 2, 2) == (2, 2)
    assert nodes.layout(1, 2, 2) == (1, 1) and nodes.layout(4, 4, 2) == (1, 4) and nodes.layout(6, 4, 2) == (2, 3)
    with pytest.raises(ValueError, match="3 ranks does not split evenly over at most 2 node"):
        nodes.layout(3, 2, 2)
    with pytest.raises(ValueError, match="must be >= 1"):
        nodes.layout(4, 0, 2)


def test_a_world_that_does_not_fit_the_nodes_is_refused_before_any_agent_starts(capsys):
    rc = nodes.main(["--executor", "local", "--world-size", "8", "--per-node", "2", "--max-nodes", "2",
                     "--", "-m", "harness.run.rank_entry", "spec.pkl", "workdir"])
    assert rc == 2 and "a world of 8 ranks does not split evenly over at most 2 node(s)" in capsys.readouterr().err


def test_a_matrix_sent_as_local_jobs_merges_into_one_report_with_every_case_once(tmp_path):
    k = "reshard-weights gpt-gqa tp1pp1dp1cp1->"  # worlds of 1 -> 2 or 4 ranks
    ids = _ids(k)
    assert len(ids) >= 3
    code, doc = run_matrix(SMOKE, tmp_path, ClusterOptions(executor="local", shards=2), k=k)
    assert code == 0 and doc is not None
    assert [r["id"] for r in doc["results"]] == ids and doc["summary"]["passed"] == len(ids)
    assert json.loads((tmp_path / "results.json").read_text())["results"] == doc["results"]
    assert "passed" in (tmp_path / "results.md").read_text() and (tmp_path / "report.html").exists()
    assert (tmp_path / "junit.xml").read_text().count("<testcase ") == len(ids)  # merge's own four files
    record = json.loads((tmp_path / "cluster.json").read_text())
    assert [j["exit_code"] for j in record["jobs"]] == [0, 0]
    parts = [{r["id"] for r in json.loads(Path(j["part"], "results.json").read_text())["results"]} for j in record["jobs"]]
    assert all(parts) and not parts[0] & parts[1] and parts[0] | parts[1] == set(ids)  # two real shards, not one twice


def test_a_shard_that_dies_is_named_and_nothing_is_merged_and_an_empty_part_gets_no_job(tmp_path):
    lines: list[str] = []
    k = "reshard-weights gpt-tied ->tp2pp1"
    assert len(_ids(k)) == 3  # 5 shards: 2 parts stay empty
    code, doc = run_matrix(SMOKE, tmp_path, ClusterOptions(executor="local", shards=5), k=k,
                           run_args=["--no-such-option"], log=lines.append)
    assert code == 2 and doc is None and not (tmp_path / "results.json").exists()
    jobs = json.loads((tmp_path / "cluster.json").read_text())["jobs"]
    assert [j["exit_code"] for j in jobs] == [2, 2, 2] and all(j["shard"].endswith("/5") for j in jobs)
    assert "do not make one run" in lines[-1] and f"{jobs[0]['part']}/results.json: not a readable results.json" in lines[-1]
    for job, line in zip(jobs, lines[-4:-1]):  # each shard named, with its own log's tail
        assert f"shard {job['shard']}" in line and "unrecognized arguments: --no-such-option" in line


@pytest.mark.slow  # a launcher test (57 s on 2 cores): multi-node rendezvous; the single-node cluster tests stay default
def test_a_case_world_runs_as_two_nodes_of_two_ranks_through_c10d(tmp_path, monkeypatch):
    """Each world of the case goes through harness.run.nodes: its 4-rank world as two torchrun
    agents (--nnodes 2, --node-rank 0 and 1, c10d rendezvous on localhost), 2 ranks each."""
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    monkeypatch.setenv(RANKS_DIR, str(ranks))
    k = "reshard-weights gpt-gqa tp2pp2dp1cp1->tp1pp1dp1cp1"
    assert len(_ids(k)) == 1
    opts = ClusterOptions(executor="local", nodes=2, ranks_per_node=2)
    code, doc = run_matrix(SMOKE, tmp_path / "out", opts, k=k, run_args=["--rank-hook", "test_cluster:record_rank"])
    assert code == 0 and [r["status"] for r in doc["results"]] == ["passed"]
    worlds: dict[str, list[dict]] = {}
    for f in ranks.iterdir():
        r = json.loads(f.read_text())
        worlds.setdefault(r["TORCHELASTIC_RUN_ID"], []).append(r)
    sizes = sorted(len(w) for w in worlds.values())
    assert sizes[-1] == 4 and set(sizes[:-1]) == {1}, worlds  # the case's save world (4 ranks); its 1-rank worlds
    (world,) = [w for w in worlds.values() if len(w) == 4]
    assert sorted(int(r["RANK"]) for r in world) == [0, 1, 2, 3] and {r["WORLD_SIZE"] for r in world} == {"4"}
    assert {r["GROUP_WORLD_SIZE"] for r in world} == {"2"} and {r["LOCAL_WORLD_SIZE"] for r in world} == {"2"}
    assert all(r["TORCHELASTIC_RUN_ID"].startswith("ckpt-") for r in world)  # harness.run.nodes' rendezvous, not --standalone
    by_node: dict[str, set] = {}
    for r in world:
        by_node.setdefault(r["GROUP_RANK"], set()).add((r["LOCAL_RANK"], r["agent_pid"]))
    assert sorted(by_node) == ["0", "1"] and all(len(v) == 2 for v in by_node.values())
    assert len({pid for v in by_node.values() for _, pid in v}) == 2  # two agents, each the parent of its 2 ranks
    # the launcher log of the 4-rank world (the case's log dir in the shard's report): the two agents
    (log,) = [t for f in (tmp_path / "out" / "parts").rglob("*-torchrun.log") if "--nnodes=2" in (t := f.read_text())]
    agents = [ln for ln in log.splitlines() if ln.startswith("node ") and "torch.distributed.run" in ln]
    assert len(agents) == 2 and all("--rdzv-backend=c10d" in a and "--nproc-per-node=2" in a for a in agents), log
    assert {a.split("--node-rank=")[1].split()[0] for a in agents} == {"0", "1"}


def test_a_multi_node_shard_asks_slurm_for_whole_nodes_and_runs_once_on_the_first(tmp_path, monkeypatch):
    """No Slurm here: a stand-in sbatch keeps the job script submitit writes for a 2-node shard."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\ncp "$1" {tmp_path}/job.sh\necho "Submitted batch job 4242"\n')
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")  # submitit looks for it; the shard never calls it here
    for tool in ("sbatch", "srun"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    opts = ClusterOptions(executor="slurm", nodes=2, gpus_per_node=8, cpus_per_node=64, partition="batch",
                          slurm={"account": "proj"}, timeout_min=90)
    argv = shard_argv(SMOKE, 1, 3, tmp_path / "part", opts, k="gqa", workdir=Path("/shared/work"))
    job = make_executor(opts, tmp_path / "jobs").submit(run_shard, argv, {})
    assert job.job_id == "4242"
    script = (tmp_path / "job.sh").read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=batch",
                 "#SBATCH --account=proj", "#SBATCH --time=90", "#SBATCH --cpus-per-task=64"):
        assert line in script, script
    run_line = [ln for ln in script.splitlines() if "submitit.core._submit" in ln]
    assert run_line and not any("srun" in ln for ln in run_line), script  # the shard runs once, not once a node
    assert argv[argv.index("--shard") + 1] == "1/3" and argv[argv.index("--workdir") + 1] == "/shared/work"
    tpl = argv[argv.index("--torchrun-template") + 1]
    assert "harness.run.nodes --executor slurm --world-size {world_size} --per-node 8 --max-nodes 2 --" in tpl
    one_node = shard_argv(SMOKE, 2, 3, tmp_path / "part", ClusterOptions(executor="slurm", gpus_per_node=8))
    assert "--torchrun-template" not in one_node and one_node[one_node.index("--gpus-per-node") + 1] == "8"  # packed
    agent = nodes.torchrun_command(2, 8, "node1:29400", "ckpt-1", ["-m", "harness.run.rank_entry", "s", "w"])
    step = nodes.srun_command(2, agent, "64")
    assert step[:6] == ["srun", "--relative=0", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=64"]
    assert {"--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=node1:29400"} <= set(agent)


def test_the_default_paths_never_import_the_extra_and_the_cluster_command_names_it(tmp_path):
    """submitit blocked (an import of it raises): `run` works, `cluster run` says which extra to install."""
    block = "import sys; sys.modules['submitit'] = None; from harness.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", block, *args], capture_output=True, text=True, cwd=ROOT, env=env, check=False)

    ran = cli("run", str(SMOKE), "-k", "gpt-tied tp1pp1dp1cp1->tp1pp2dp1cp1")
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    missing = cli("cluster", "run", str(SMOKE), "--out", str(tmp_path / "out"), "-k", "gpt-tied")
    assert missing.returncode == 2 and "pip install 'ckpt-harness[cluster]'" in missing.stderr, missing.stderr
    assert not (tmp_path / "out").exists()
