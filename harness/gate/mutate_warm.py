"""A warm parent for a campaign's mutant runs: every import that reaches no target, paid once.

A mutant run was `python -m harness.cli run ...` in a fresh interpreter: 8-17 s of importing torch,
transformers, peft, Megatron-Core and the Bridge before its first case, for every batch of every
mutant. The warm parent (`python -m harness.gate.mutate_warm TARGETS`) imports what it can once and
forks one child per run; the child activates the mutant (harness.faults.mutant_hook), then runs
`harness.cli` as `__main__` with the run's arguments, exactly the command line it replaces.

What it may import is measured, not listed: each preload step runs in a forked child, which goes on
as the warm parent only when no target module is in sys.modules after it (a target imported before
its mutant is active would keep its real code, and mutant_hook refuses to activate then); otherwise
the child is dropped and the process before the step goes on. A campaign over
megatron.core.dist_checkpointing keeps torch, transformers and peft warm; one over peft keeps torch,
transformers and Megatron-Core.

Protocol: one JSON line per request on stdin ({"args", "env", "log", "timeout"}), one JSON line per
answer ({"code", "timed_out"}) on the fd that was stdout; the parent's own output goes to stderr.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]


def _torch() -> None:
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401


def _guards() -> None:
    from harness.compat.cuda import guard_megatron_import
    from harness.compat.noise import quiet_known_noise

    guard_megatron_import()
    quiet_known_noise()


def _transformers() -> None:
    import transformers  # noqa: F401
    import transformers.modeling_utils  # noqa: F401


def _peft() -> None:
    import peft  # noqa: F401


def _core() -> None:
    from harness.run.preload import warm

    warm(bridge=False)


def _bridge() -> None:
    from harness.run.preload import warm

    warm(bridge=True)


def _runner() -> None:
    import harness.orchestration.runner  # noqa: F401


#: tried in this order; each kept only when it imports no target
STEPS: tuple[tuple[str, Callable[[], None]], ...] = (
    ("torch", _torch), ("guards", _guards), ("transformers", _transformers), ("peft", _peft),
    ("megatron.core", _core), ("megatron.bridge", _bridge), ("runner", _runner))


def _reaches(targets: list[str]) -> bool:
    return any(t in sys.modules for t in targets)


def _try(step: Callable[[], None], targets: list[str]) -> bool:
    """Run `step` in a forked child of this process; when it imports no target, the child goes on
    as the warm parent (it holds the protocol's pipes) and this process leaves; when it does, or it
    fails, the child leaves and this process goes on without it. Each step is imported once."""
    pid = os.fork()
    if pid == 0:
        try:
            step()
            ok = not _reaches(targets)
        except BaseException:  # noqa: BLE001 - a step that fails is a step not kept
            ok = False
        if not ok:
            os._exit(1)
        return True  # the child: this process is the warm parent from now on
    _, status = os.waitpid(pid, os.WUNTRACED)  # the child stops itself once it has taken over
    if os.WIFSTOPPED(status):
        os.kill(pid, signal.SIGCONT)
        os._exit(0)  # the child took over: this one goes, its pipes stay open in the child
    return False


def preload(targets: list[str]) -> list[str]:
    """The steps kept, imported in this process (which may by then be a child of the one started)."""
    kept = []
    for name, step in STEPS:
        if _try(step, targets):
            kept.append(name)
            os.kill(os.getpid(), signal.SIGSTOP)  # tell the one before: taken over (it continues us)
    return kept


def _child(request: dict) -> None:
    """The forked run: the mutant activated, then `python -m harness.cli ARGS` in this process."""
    import atexit
    import runpy

    code = 3
    try:
        os.setsid()
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.environ.update(request["env"])
        from harness.faults import mutant_hook

        mutant_hook.activate_from_env()
        sys.argv = ["harness.cli", *request["args"]]
        try:
            runpy.run_module("harness.cli", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the run's own crash is its outcome, in its log
        import traceback

        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # what a fresh interpreter's exit runs
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _wait(pid: int, timeout: float | None) -> tuple[int, bool]:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), False
        if deadline is not None and time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            return -1, True
        time.sleep(0.1)


def serve(targets: list[str]) -> None:
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever an import prints stays off the protocol
    kept = preload(targets)
    proto.write(json.dumps({"kept": kept, "pid": os.getpid()}) + "\n")
    proto.flush()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        code, timed_out = _wait(pid, request.get("timeout"))
        proto.write(json.dumps({"code": code, "timed_out": timed_out}) + "\n")
        proto.flush()


class WarmParent:
    """The client: one warm parent process, one run at a time (a campaign worker holds one each)."""

    def __init__(self, targets: list[str], env: dict[str, str], log: Path):
        log.parent.mkdir(parents=True, exist_ok=True)
        self._err = open(log, "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "harness.gate.mutate_warm", json.dumps(targets)], cwd=ROOT,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True)
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError(f"the warm parent died while preloading; see {log}")
        doc = json.loads(ready)
        self.kept: list[str] = doc["kept"]
        self.pid: int = doc["pid"]  # the process that took over, not always the one started

    def run(self, args: list[str], env: dict[str, str], log: Path, timeout_s: float | None) -> tuple[int, bool]:
        """(exit code, timed out) of `ckpt-harness ARGS` (`run ...`) forked from here with `env` added."""
        log.parent.mkdir(parents=True, exist_ok=True)
        self.proc.stdin.write(json.dumps({"args": args, "env": env, "log": str(log), "timeout": timeout_s}) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError("the warm parent died")
        doc = json.loads(answer)
        return int(doc["code"]), bool(doc["timed_out"])

    def close(self) -> None:
        """Its stdin closed, it leaves; gone in 30 s or killed."""
        self.proc.stdin.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(self.pid):
            time.sleep(0.1)
        if _alive(self.pid):
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait()
        self._err.close()


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # our own child (the process started): reap it
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
