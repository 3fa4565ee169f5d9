"""The interface between the runner and a case (what a scenario checks, in cases/)."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterator

from harness import world
from harness.matrix import CaseSpec
from harness.result import CaseResult


@dataclass
class RunEnv:
    """Where and how a case runs: its own scratch directory, the dist backend, the timeout."""

    case_dir: Path
    dist_backend: str = "auto"
    timeout_s: float = 300.0
    launcher: str = "mp"  # "mp" (torch.multiprocessing) or "torchrun"
    torchrun_template: str | None = None

    def launch(self, result: CaseResult, phase: str, fn: world.RankFn, arg: Any, world_size: int) -> list[Any]:
        """One world for one phase, timed into result.phases[phase]."""
        workdir = self.case_dir / f"world-{phase}"
        with timed(result, phase):
            if self.launcher == "torchrun":
                return world.launch_torchrun(
                    fn, arg, world_size, workdir, backend=self.dist_backend, timeout_s=self.timeout_s, template=self.torchrun_template
                )
            return world.launch(fn, arg, world_size, workdir, backend=self.dist_backend, timeout_s=self.timeout_s)


@contextmanager
def timed(result: CaseResult, phase: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        result.phases[phase] = round(result.phases.get(phase, 0.0) + time.perf_counter() - start, 3)


class Case(ABC):
    name: ClassVar[str]
    description: ClassVar[str]

    #: "gpt" (harness.models.ZOO) or "hf" (harness.hf_models.HF_ZOO)
    model_kind: ClassVar[str] = "gpt"

    def validate(self, spec: CaseSpec) -> None:
        """Raise ValueError for options this case does not understand."""
        self.check_model_kind(spec)
        if spec.options:
            raise ValueError(f"case {self.name} takes no options, got {sorted(spec.opts)}")

    def check_model_kind(self, spec: CaseSpec) -> None:
        from harness.hf_models import HF_ZOO

        is_hf = spec.model in HF_ZOO
        if is_hf != (self.model_kind == "hf"):
            raise ValueError(f"case {self.name} takes {'an HF fixture' if self.model_kind == 'hf' else 'a GPT zoo'} model, got {spec.model!r}")

    @abstractmethod
    def run(self, spec: CaseSpec, env: RunEnv, result: CaseResult) -> None:
        """Run the scenario; record every check (passed, failed or not-run with why) on result."""
