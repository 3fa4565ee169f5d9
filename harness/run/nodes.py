"""One world as nodes x ranks: one torchrun agent per node, the agents meeting through torchrun's
c10d rendezvous (issue 20 item 4). `launch_torchrun` runs it as its `--torchrun-template`:

    python -m harness.run.nodes --executor slurm|local --world-size {world_size} --per-node G --max-nodes N \\
        -- -m harness.run.rank_entry SPEC WORKDIR

A world of W ranks takes the fewest nodes n <= N with W ranks split evenly, at most G a node (a
world that fits one node runs on one). The agents start through the executor of the cluster extra:
  * slurm: inside the shard's allocation (harness.orchestration.schedulers.cluster), one `srun` step of n tasks,
    one a node, from the allocation's first node, where this command runs and the rendezvous lives;
  * local: submitit's LocalExecutor with n tasks on this machine, each playing one node
    (`--node-rank k`): the same rendezvous and agents, for tests and one-box runs.
submitit is imported lazily (`pip install 'ckpt-harness[cluster]'`); the default launchers never
reach this module. The workdir must be on a filesystem every node sees (Slurm: a shared one).
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from typing import Sequence

EXTRA = "pip install 'ckpt-harness[cluster]'"
EXECUTORS = ("local", "slurm")


class ClusterExtraMissing(ImportError):
    """submitit is not installed: the message names the extra that brings it."""


def import_submitit():
    """submitit, or ClusterExtraMissing naming the extra (it is optional: the default paths never need it)."""
    try:
        import submitit
    except ImportError as exc:
        raise ClusterExtraMissing(f"the cluster launcher needs submitit, which is not installed ({exc}): {EXTRA}") from None
    return submitit


def layout(world_size: int, per_node: int, max_nodes: int) -> tuple[int, int]:
    """(nodes, ranks per node) for a world of `world_size`: the fewest nodes that split it evenly with
    at most `per_node` ranks each; ValueError naming the numbers when no such split fits `max_nodes`."""
    if world_size < 1 or per_node < 1 or max_nodes < 1:
        raise ValueError(f"world size {world_size}, ranks per node {per_node}, nodes {max_nodes}: each must be >= 1")
    for nodes in range(1, max_nodes + 1):
        if world_size % nodes == 0 and world_size // nodes <= per_node:
            return nodes, world_size // nodes
    raise ValueError(f"a world of {world_size} ranks does not split evenly over at most {max_nodes} node(s) "
                     f"of at most {per_node} rank(s) each")


def template(executor: str, per_node: int, max_nodes: int, python: str | None = None) -> str:
    """The `--torchrun-template` that starts each world of a run through this module."""
    if executor not in EXECUTORS:
        raise ValueError(f"executor {executor!r}: one of {', '.join(EXECUTORS)}")
    py = shlex.quote(python or sys.executable)
    return (f"{py} -m harness.run.nodes --executor {executor} --world-size {{world_size}} "
            f"--per-node {per_node} --max-nodes {max_nodes} --")


def torchrun_command(nodes: int, per_node: int, endpoint: str, run_id: str, rest: Sequence[str],
                     node_rank: int | None = None, python: str | None = None) -> list[str]:
    """One node's agent: torchrun with the c10d rendezvous at `endpoint` (host:port). Without
    `node_rank` (srun) the rendezvous orders the nodes itself."""
    rank = [f"--node-rank={node_rank}"] if node_rank is not None else []
    return [python or sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", *rank,
            f"--nproc-per-node={per_node}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}", "--max-restarts=0", *rest]


def srun_command(nodes: int, agent: Sequence[str], cpus: str | None = None) -> list[str]:
    """The Slurm step: one agent on each of the allocation's first `nodes` nodes (--relative=0 keeps
    the first one, where the rendezvous is, in the step), with the job's CPUs a node (`cpus`: srun
    22.05+ does not take SLURM_CPUS_PER_TASK from the job by itself; else one CPU for all the ranks)."""
    return ["srun", "--relative=0", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1",
            *([f"--cpus-per-task={cpus}"] if cpus else []), "--kill-on-bad-exit=1", "--unbuffered", *agent]


def free_port() -> int:
    """A port free now on this host (as torchrun --standalone picks its own)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_agent(per_node: int, endpoint: str, run_id: str, rest: list[str], devices: list[str] | None) -> int:
    """A local task's body (pickled by submitit): this task is node `global_rank` of `num_tasks`;
    its agent gets `--node-rank` and, on GPUs, its own slice of the parent's devices. Returns
    torchrun's exit code."""
    import submitit

    env = submitit.JobEnvironment()
    node, nodes = env.global_rank, env.num_tasks
    cmd = torchrun_command(nodes, per_node, endpoint, run_id, rest, node_rank=node)
    child = dict(os.environ)
    if devices:  # the executor hides every GPU from its tasks: this node's share, LOCAL_RANK indexes it
        child["CUDA_VISIBLE_DEVICES"] = ",".join(devices[node * per_node:(node + 1) * per_node])
    else:  # gloo: run_from_env keeps its ranks off the GPUs anyway
        child.pop("CUDA_VISIBLE_DEVICES", None)
    print(f"node {node}/{nodes}: {shlex.join(cmd)}", flush=True)
    return subprocess.run(cmd, env=child, check=False).returncode


def _relay(job, nodes: int) -> None:
    """Every node's output on our stdout: launch_torchrun reads the failing rank from torchrun's report."""
    for k in range(nodes):
        task = job.task(k)
        for text in (task.stdout(), task.stderr()):
            if text:
                sys.stdout.write(text if text.endswith("\n") else text + "\n")
    sys.stdout.flush()


def run_local(nodes: int, per_node: int, rest: Sequence[str], timeout_min: float) -> int:
    """`nodes` torchrun agents on this machine as the tasks of one LocalExecutor job."""
    submitit = import_submitit()
    endpoint, run_id = f"127.0.0.1:{free_port()}", f"ckpt-{os.getpid()}-{time.time_ns()}"
    devices = None
    if os.environ.get("CKPT_HARNESS_DIST_BACKEND") == "nccl":  # set by launch_torchrun (choose_backend)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = [d for d in visible.split(",") if d] if visible else [str(i) for i in range(nodes * per_node)]
    with tempfile.TemporaryDirectory(prefix="ckpt-nodes-") as folder:
        executor = submitit.LocalExecutor(folder=folder)
        executor.update_parameters(tasks_per_node=nodes, timeout_min=timeout_min)
        job = executor.submit(node_agent, per_node, endpoint, run_id, list(rest), devices)
        try:
            codes = job.results()
        except Exception as exc:  # a task that died outside torchrun: submitit's FailedJobError
            _relay(job, nodes)
            print(f"ckpt-harness nodes: a node task failed: {exc}", flush=True)
            return 1
        _relay(job, nodes)
    bad = [(k, c) for k, c in enumerate(codes) if c != 0]
    if bad:
        print(f"ckpt-harness nodes: torchrun failed on node(s) {bad} (node, exit code)", flush=True)
    return 1 if bad else 0


def run_slurm(nodes: int, per_node: int, rest: Sequence[str]) -> int:
    """One srun step inside the current allocation; the rendezvous on this (its first) node."""
    if "SLURM_JOB_ID" not in os.environ:
        print("ckpt-harness nodes: --executor slurm runs inside a Slurm allocation (SLURM_JOB_ID is unset): "
              "start it with `ckpt-harness cluster run --executor slurm` or from an sbatch script", file=sys.stderr)
        return 2
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    agent = torchrun_command(nodes, per_node, f"{host}:{free_port()}", f"ckpt-{os.environ['SLURM_JOB_ID']}-{time.time_ns()}", rest)
    return subprocess.run(srun_command(nodes, agent, os.environ.get("SLURM_CPUS_PER_TASK")), check=False).returncode


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m harness.run.nodes OPTIONS -- -m harness.run.rank_entry SPEC WORKDIR", file=sys.stderr)
        return 2
    cut = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m harness.run.nodes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--executor", choices=EXECUTORS, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--per-node", type=int, required=True, help="most ranks on one node (its GPUs)")
    parser.add_argument("--max-nodes", type=int, required=True)
    parser.add_argument("--timeout-min", type=float, default=60.0, help="local: the job's limit (the case's own timeout kills it first)")
    args = parser.parse_args(argv[:cut])
    try:
        nodes, per_node = layout(args.world_size, args.per_node, args.max_nodes)
        if args.executor == "local":
            return run_local(nodes, per_node, argv[cut + 1:], args.timeout_min)
        return run_slurm(nodes, per_node, argv[cut + 1:])
    except (ValueError, ClusterExtraMissing) as exc:
        print(f"ckpt-harness nodes: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
