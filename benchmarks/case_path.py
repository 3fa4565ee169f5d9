"""The path a case's result takes through the project's modules, from `cli run` to its verdict.

`python -m benchmarks.case_path [CASE-ID-WORDS...]` runs one smoke case in this process (serial,
no reuse store) under `sys.setprofile` and follows every project function that holds the case's
CaseResult as an argument: the module holding the result changes on each such call and return.
It prints the modules in order and three numbers the design review asks for, before and after a
refactor (docs/architecture.md):

- modules: distinct project modules the result passes through;
- returns: times the result comes back to a module it had left (A -> B -> A counts one);
- climbs: calls that hand the result to a module on a higher floor than the caller's
  (tests/test_layout.py FLOORS: a lower module calling back up).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PREFIXES = ("harness.", "cases.", "harness", "cases")


def _floor(module: str) -> int:
    import importlib.util

    spec = importlib.util.spec_from_file_location("_layout", ROOT / "tests" / "test_layout.py")
    layout = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(layout)  # type: ignore[union-attr]
    try:
        return layout.wing_of(module)[0]
    except LookupError:
        return -1


def trace(argv: list[str]) -> list[tuple[str, str]]:
    """(event, module) each time the module holding a CaseResult changes while `cli.main(argv)` runs."""
    from harness import cli
    from harness.core.result import CaseResult

    path: list[tuple[str, str]] = []

    def ours(frame) -> str | None:  # noqa: ANN001
        name = frame.f_globals.get("__name__", "")
        # records and helpers of the bottom floor are data, not a step of the path
        return name if name.startswith(PREFIXES) and not name.startswith("harness.core") else None

    def holds(frame) -> bool:  # noqa: ANN001
        return ours(frame) is not None and any(isinstance(v, CaseResult) for v in frame.f_locals.values())

    def holder(frame) -> str | None:  # noqa: ANN001 - the innermost project frame at or above `frame` holding a result
        while frame is not None and not holds(frame):
            frame = frame.f_back
        return ours(frame) if frame is not None else None

    def step(event: str, module: str | None) -> None:
        if module and (not path or path[-1][1] != module):
            path.append((event, module))

    def profile(frame, event, arg):  # noqa: ANN001 - sys.setprofile's signature
        if event == "call" and ours(frame):
            code = frame.f_code
            args = [frame.f_locals.get(v) for v in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]]
            if any(isinstance(a, CaseResult) for a in args):
                step("call", ours(frame))
        elif event == "return" and holds(frame):
            step("return", holder(frame.f_back))

    sys.setprofile(profile)
    try:
        cli.main(argv)
    finally:
        sys.setprofile(None)
    return path


def measure(path: list[tuple[str, str]]) -> dict[str, int]:
    seen: set[str] = set()
    returns = climbs = 0
    previous: str | None = None
    for event, module in path:
        if module in seen and module != previous:
            returns += 1
        if event == "call" and previous is not None and _floor(module) > _floor(previous):
            climbs += 1
        seen.add(module)
        previous = module
    return {"modules": len(seen), "returns": returns, "climbs": climbs, "steps": len(path)}


def main(words: list[str]) -> int:
    words = words or ["reshard-weights", "gpt-gqa-tp1pp1dp1cp1->tp2pp1dp1cp1"]
    import contextlib
    import io

    from harness import cli

    listed = io.StringIO()
    with contextlib.redirect_stdout(listed):
        cli.main(["list", str(ROOT / "matrices" / "smoke.yaml"), "-k", " ".join(words)])
    ids = listed.getvalue().split()
    if len(ids) != 1:
        print(f"the words must select exactly one smoke case, they select {len(ids)}: {ids[:5]}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="ckpt-harness-case-path-") as tmp:
        argv = ["run", str(ROOT / "matrices" / "smoke.yaml"), "-k", " ".join(words), "--report", tmp, "--no-reuse"]
        path = trace(argv)
    if not path:
        print("no CaseResult was seen: did the selection match a case?", file=sys.stderr)
        return 1
    for event, module in path:
        print(f"{event:6} {module}")
    print(" ".join(f"{k}={v}" for k, v in measure(path).items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
