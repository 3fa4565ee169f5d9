"""Run one function on N ranks, with torch's own launchers, and leave nothing behind.

Three ways in, one rank body (`_rank_body`):
  * `launch(..., start_method="fork")`: torch.multiprocessing from a parent that has already
    imported torch and megatron-core (a world starts in ~1 s on 2 cores instead of ~20 s);
    the default for gloo/CPU worlds.
  * `launch(..., start_method="spawn" | "forkserver")`: fresh interpreters (spawn, the NCCL
    default, because a forked child cannot initialise CUDA), or children of a server that
    preloaded megatron-core (harness.run.forkserver_preload) and never ran the parent's threads.
  * `run_from_env()`: the body run by `torchrun`/`srun` (multi-node), `python -m harness.run.rank_entry`.

Everything a rank needs travels by value in the pickled `_WorldSpec` (the function, its argument,
the rank hooks as import paths), never through state the parent set up before forking, so every
start method and torchrun run the same thing.

Rendezvous goes through a FileStore in the world's own directory: no port to pick, so two worlds
(pytest -n 2) never race for one, and no store-server thread in the parent. (With a TCPStore
server in the parent, a rank forked while the server thread served its siblings could inherit a
held lock and hang in its own TCPStore constructor: ~1 world in 20 of 4 ranks, measured.)
Each rank's return value is written to the world's directory, never pickled
through a pipe, so large results cost no extra copies.
"""

from __future__ import annotations

import os
import pickle
import re
import shlex
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # asking about GPUs must not init CUDA

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from harness.core.context import RankContext, RankFn
from harness.core.frames import exception_of  # noqa: F401  (the one reader; callers import it from here too)
from harness.run import world_tmp
from harness.run.procs import descendants, kill
from harness.run.ranklog import LogFiles, redirect_rank, tail


class WorldError(RuntimeError):
    """A world that did not finish: a rank raised or died, or the world timed out."""

    def __init__(self, message: str, rank: int | None = None, rank_traceback: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.rank_traceback = rank_traceback


class WorldTimeout(WorldError):
    pass


@dataclass
class _WorldSpec:
    fn: RankFn
    arg: Any
    world_size: int
    backend: str
    workdir: str
    store_file: str  # FileStore rendezvous of our own launcher; "" under torchrun/srun
    timeout_s: float
    threads: int = 1
    hooks: tuple[str, ...] = ()  # "module:function" run in every rank before `fn` (fault injection, plugins)
    logs: LogFiles | None = None  # where each rank's fds 1/2 go (harness.run.ranklog); None: the workdir's rank<N>.log
    tmpdir: str = ""  # the world's temp (harness.run.world_tmp); "": the process's own


def choose_backend(world_size: int, requested: str = "auto") -> str:
    """NCCL when every rank can have its own GPU, else gloo on CPU (NCCL refuses shared GPUs)."""
    if requested not in ("auto", "gloo", "nccl"):
        raise ValueError(f"dist backend must be auto, gloo or nccl, got {requested!r}")
    if requested != "auto":
        if requested == "nccl" and torch.cuda.device_count() < world_size:
            raise WorldError(
                f"nccl requested for {world_size} ranks but {torch.cuda.device_count()} GPU(s) are visible"
            )
        return requested
    return "nccl" if torch.cuda.device_count() >= world_size else "gloo"


START_METHODS = ("fork", "spawn", "forkserver")


def _import_path(path: str) -> Any:
    import importlib

    module, _, attr = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def choose_start_method(backend: str, requested: str | None = None) -> str:
    """fork for gloo (measured fastest on 2 cores: the parent's imports are inherited), spawn for
    NCCL (CUDA cannot be initialised in a forked child); any of START_METHODS when asked."""
    if requested in (None, "auto"):
        return "spawn" if backend == "nccl" else "fork"
    if requested not in START_METHODS:
        raise ValueError(f"start method must be auto or one of {START_METHODS}, got {requested!r}")
    if requested == "fork" and backend == "nccl":
        raise WorldError("start method fork cannot run NCCL ranks (CUDA cannot be initialised in a forked child)")
    return requested


def _result_path(workdir: str | Path, rank: int) -> Path:
    return Path(workdir) / f"rank{rank}.result.pt"


def _rank_body(spec: _WorldSpec, rank: int, local_rank: int) -> None:
    from harness import compat
    from harness.models.parallel import teardown_parallel_state

    torch.set_num_threads(spec.threads)
    if spec.tmpdir:
        world_tmp.use(spec.tmpdir)
    if spec.backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    compat.install(device)
    for hook in spec.hooks:
        _import_path(hook)()
    timeout = timedelta(seconds=spec.timeout_s)
    if spec.store_file:  # our own launcher: a file in the world's dir
        store = dist.FileStore(spec.store_file, spec.world_size)
        store.set_timeout(timeout)
        dist.init_process_group(spec.backend, store=store, rank=rank, world_size=spec.world_size, timeout=timeout)
    else:  # torchrun/srun: MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE
        dist.init_process_group(spec.backend, init_method="env://", rank=rank, world_size=spec.world_size, timeout=timeout)
    ctx = RankContext(rank, spec.world_size, local_rank, spec.backend, Path(spec.workdir), device)
    result = spec.fn(ctx, spec.arg)
    torch.save(result, _result_path(spec.workdir, rank))
    # Only on success: after an exception, teardown would block on peers; the process just exits.
    teardown_parallel_state()
    # NCCL asks for it before exit (else it warns and may hang in its destructor); a rank function may have
    # ended the group itself (Megatron-LM's checkpoint_inspector converter does: cases/convert.py)
    if spec.backend == "nccl" and dist.is_initialized():
        dist.destroy_process_group()
    # gloo: the rank exits next, which closes its groups anyway; destroy_process_group took 0.15 s of
    # a 0.39 s 2-rank world and 0.28 s of a 0.61 s 4-rank one on 2 cores (docs/measurements.md)


def _logs(spec: _WorldSpec) -> LogFiles:
    return spec.logs or LogFiles(spec.workdir)


def _dump_stacks(ctx, logs: LogFiles) -> str:
    """Where the ranks that are still running sit (faulthandler, via SIGUSR1)."""
    alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
    for r in alive:
        try:
            os.kill(ctx.processes[r].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    if not alive:
        return ""
    time.sleep(1.0)
    return f"\nstill running: rank(s) {alive}; their stacks:" + tail(logs, alive, 40)


def _mp_entry(local_rank: int, spec: _WorldSpec) -> None:
    # Own process group: whatever this rank starts can be killed with it, even once orphaned.
    os.setpgid(0, 0)
    # Rank output is for failures: the libraries print banners, progress bars and warnings on every
    # build and export; a failure report quotes the tail (CKPT_HARNESS_VERBOSE=1 keeps the terminal).
    redirect_rank(_logs(spec).rank(local_rank))
    if spec.backend == "gloo":
        # gloo ranks run on CPU even on a GPU box; hide GPUs before anything initialises CUDA.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(spec.world_size))
    try:
        _rank_body(spec, local_rank, local_rank)
    except (Exception, SystemExit, KeyboardInterrupt):
        raise
    except BaseException:  # noqa: BLE001 - see RankBaseException
        raise RankBaseException(traceback.format_exc().rstrip()) from None


class RankBaseException(Exception):
    """A rank's BaseException that is no Exception (torch DCP's CheckpointException is one), carried
    as its whole traceback: torch's spawn wrapper catches Exception only, so such a rank died with no
    error file and the cause was left to its log's tail (none under CKPT_HARNESS_VERBOSE). The last
    exception line of the text stays the original's, which is what `exception_of` reads."""


#: what a rank raises when a PEER died under it (a collective's transport torn down, an aborted
#: communicator): never the cause while a rank raised something else
_FOLLOW_ON = re.compile(r"Connection reset by peer|Connection closed by peer|Broken pipe|gloo/transport|"
                        r"NCCL communicator was aborted|DistNetworkError|DistBackendError|Socket Timeout")


def follow_on(rank_traceback: str) -> bool:
    """Whether a rank's traceback is a peer's failure reaching it through a collective."""
    exc_type, message = exception_of(rank_traceback)
    return bool(_FOLLOW_ON.search(f"{exc_type}: {message}"))


def _first_failure(error_files: list[str], world_size: int) -> WorldError:
    """The rank that failed first is the cause; peers then fail in their collectives. A peer's
    follow-on (its transport reset by the rank that died) can reach disk first, as the dying rank
    still formats its traceback: it is the cause only when every failure is one."""
    failed = []
    for rank, f in enumerate(error_files):
        path = Path(f)
        if path.exists():
            with open(path, "rb") as fh:
                tb = pickle.load(fh)
            failed.append((follow_on(tb), path.stat().st_mtime_ns, rank, tb))
    failed.sort()
    _, _, rank, tb = failed[0]
    others = "".join(f"\n(then rank {r} failed: {t.strip().splitlines()[-1]})" for _, _, r, t in failed[1:])
    return WorldError(f"rank {rank} of {world_size} raised:\n{tb}{others}", rank=rank, rank_traceback=tb)


def _states(ctx) -> str:
    return ", ".join(
        f"rank {r}: " + ("running" if p.exitcode is None else f"exit {p.exitcode}") for r, p in enumerate(ctx.processes)
    )


def _wait(ctx, workdir: Path, logs: LogFiles, world_size: int, timeout_s: float, pids: list[int], seen: set) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        seen |= descendants(pids)
        try:
            if ctx.join(timeout=0.25, grace_period=2.0):
                return
        except tmp.ProcessRaisedException:
            raise _first_failure(ctx.error_files, world_size) from None
        except tmp.ProcessExitedException as exc:
            raise WorldError(f"rank {exc.error_index} of {world_size} died: {exc}{tail(logs, [exc.error_index])}",
                             rank=exc.error_index) from None
        early = [r for r, p in enumerate(ctx.processes) if p.exitcode == 0 and not _result_path(workdir, r).exists()]
        if early:
            # torch's _wrap turns SIGINT (its parent-death signal) into a silent exit 0.
            raise WorldError(f"rank(s) {early} of {world_size} exited without a result ({_states(ctx)})"
                             f"{tail(logs, early)}", rank=early[0])
        if time.monotonic() > deadline:
            raise WorldTimeout(f"world of {world_size} rank(s) still running after {timeout_s:.0f}s; killed ({_states(ctx)})")


def _start(spec: _WorldSpec, world_size: int, start_method: str):
    """Start the ranks. Under fork, with the parent's objects frozen out of the garbage collector
    (gc.freeze): a rank's collections would otherwise walk and write every object it inherited,
    copying the parent's whole heap page by page (the preloaded megatron/transformers imports)."""
    import gc

    fork = start_method == "fork"
    if fork:
        gc.freeze()
    try:
        return tmp.start_processes(_mp_entry, args=(spec,), nprocs=world_size, join=False, start_method=start_method)
    finally:
        if fork:
            gc.unfreeze()  # the parent collects as before; the ranks keep their inherited objects frozen


def launch(
    fn: RankFn,
    arg: Any,
    world_size: int,
    workdir: str | Path,
    *,
    backend: str = "auto",
    timeout_s: float = 300.0,
    start_method: str | None = None,
    hooks: tuple[str, ...] = (),
    logs: LogFiles | None = None,
) -> list[Any]:
    """Run `fn(ctx, arg)` on `world_size` ranks; return each rank's return value, rank order.

    Raises WorldError carrying the failing rank's traceback when a rank raises or dies, and
    WorldTimeout when the world outlives `timeout_s`; every rank and every process a rank started
    is gone when this returns or raises. Each rank's output goes to `logs` (default: rank<N>.log in
    `workdir`, removed when the world succeeds).
    """
    backend = choose_backend(world_size, backend)
    start_method = choose_start_method(backend, start_method)
    if start_method == "forkserver":
        import multiprocessing

        multiprocessing.set_forkserver_preload(["harness.run.forkserver_preload"])
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    store_file = workdir / f"rendezvous-{os.getpid()}-{time.monotonic_ns()}"
    spec = _WorldSpec(fn, arg, world_size, backend, str(workdir), str(store_file), timeout_s, hooks=hooks, logs=logs,
                      tmpdir=world_tmp.make())
    try:
        ctx = _start(spec, world_size, start_method)
    except BaseException:
        world_tmp.remove(spec.tmpdir)
        raise
    pids = ctx.pids()
    seen: set[psutil.Process] = set()
    try:
        try:
            _wait(ctx, workdir, _logs(spec), world_size, timeout_s, pids, seen)
        except WorldError as err:
            stacks = _dump_stacks(ctx, _logs(spec))
            if stacks:
                err.args = (str(err) + stacks,)
            raise
    finally:
        seen |= descendants(pids)
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(5)
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        kill({p for p in seen if p.is_running()})
        for f in ctx.error_files:
            Path(f).unlink(missing_ok=True)
        store_file.unlink(missing_ok=True)
        world_tmp.remove(spec.tmpdir)
    results = []
    for rank in range(world_size):
        path = _result_path(workdir, rank)
        results.append(torch.load(path, weights_only=False))
        path.unlink()
        if not _logs(spec).kept:
            _logs(spec).rank(rank).unlink(missing_ok=True)  # output of a good world is noise
    return results


def run_from_env(fn: RankFn, arg: Any, workdir: str | Path, timeout_s: float, hooks: tuple[str, ...] = (),
                 logs: LogFiles | None = None) -> Any:
    """The rank body under torchrun/srun: rendezvous from the standard env variables; the
    process-group timeout is the case's, as in `launch`. With `logs`, the rank's output goes there
    (else to the launcher's)."""
    world_size = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    backend = os.environ.get("CKPT_HARNESS_DIST_BACKEND", "nccl" if torch.cuda.is_available() else "gloo")
    if backend == "gloo":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # gloo ranks run on CPU, as in `launch`
    spec = _WorldSpec(fn, arg, world_size, backend, str(workdir), "", timeout_s, int(os.environ.get("OMP_NUM_THREADS", "1")), hooks, logs)
    Path(workdir).mkdir(parents=True, exist_ok=True)
    if logs is not None:
        redirect_rank(logs.rank(rank))
    _rank_body(spec, rank, local_rank)
    return torch.load(_result_path(workdir, rank), weights_only=False)


def dump_spec(path: Path, fn: RankFn, arg: Any, timeout_s: float, hooks: tuple[str, ...] = (), logs: LogFiles | None = None) -> None:
    """What `python -m harness.run.rank_entry PATH` runs: fn and arg must be importable/picklable."""
    with open(path, "wb") as f:
        pickle.dump({"fn": fn, "arg": arg, "timeout_s": timeout_s, "hooks": hooks, "logs": logs}, f)


def torchrun_prefix(world_size: int, template: str | None = None) -> list[str]:
    """The command that starts the ranks: local torchrun by default; for multi-node, a template
    such as "srun -N2 torchrun --nnodes 2 --nproc-per-node {nproc_per_node} --rdzv-backend c10d
    --rdzv-endpoint HEAD:29500" ({world_size} and {nproc_per_node} are filled in; the workdir
    must then be on a filesystem every node sees)."""
    if template:
        nodes = int(os.environ.get("CKPT_HARNESS_NODES", "1"))
        return shlex.split(template.format(world_size=world_size, nproc_per_node=max(1, world_size // nodes)))
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}"]


def launch_torchrun(
    fn: RankFn,
    arg: Any,
    world_size: int,
    workdir: str | Path,
    *,
    backend: str = "auto",
    timeout_s: float = 300.0,
    template: str | None = None,
    hooks: tuple[str, ...] = (),
    logs: LogFiles | None = None,
) -> list[Any]:
    """`launch`, but the ranks are started by torchrun (or srun + torchrun) running
    `python -m harness.run.rank_entry`; same results, same errors, nothing left behind. With
    `logs`, each rank's output goes there and the launcher's own to `logs.launcher()`."""
    import subprocess

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / "spec.pkl"
    dump_spec(spec_path, fn, arg, timeout_s, hooks, logs)
    env = {**os.environ, "CKPT_HARNESS_DIST_BACKEND": choose_backend(world_size, backend), "OMP_NUM_THREADS": "1"}
    tmp = "" if template else world_tmp.make()  # a multi-node world's temps are each node's own
    if tmp:
        env["TMPDIR"] = tmp
    cmd = [*torchrun_prefix(world_size, template), "-m", "harness.run.rank_entry", str(spec_path), str(workdir)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise WorldTimeout(f"torchrun world of {world_size} rank(s) still running after {timeout_s:.0f}s; killed") from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything the launcher left in its session
        except ProcessLookupError:
            pass
        spec_path.unlink(missing_ok=True)
        if tmp:
            world_tmp.remove(tmp)
    if logs is not None and logs.kept and output.strip():
        logs.launcher().parent.mkdir(parents=True, exist_ok=True)
        with open(logs.launcher(), "a") as f:
            f.write(output)
    if proc.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-80:])
        rank = re.search(r"Root Cause.*?rank\s*:\s*(\d+)", output, re.S)
        raise WorldError(f"torchrun world of {world_size} failed (exit {proc.returncode}):\n{tail}",
                         rank=int(rank.group(1)) if rank else None, rank_traceback=tail)
    results = []
    for rank in range(world_size):
        path = _result_path(workdir, rank)
        results.append(torch.load(path, weights_only=False))
        path.unlink()
    return results


__all__ = ["RankContext", "WorldError", "WorldTimeout", "launch", "choose_backend", "run_from_env", "dump_spec"]
