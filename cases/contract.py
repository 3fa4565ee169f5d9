"""The contract between the matrix, the runner and a case (what a scenario checks, in cases/).

A case *declares* what it accepts, and the matrix loader checks all of it before anything runs:
  Options     a frozen dataclass: every option with its type and default; unknown keys and
              wrong types are errors naming the option
  needs       the backend capabilities it uses (harness.backends.CAPABILITIES)
  model_kind  "gpt" or "hf" (harness.core.zoo)
              (`requirements(opts)` returns model kind and needs when an option decides them)
  checks      the names of the checks it can record (what `xfail.checks` may name)
  refusable   whether `expect: refuse` means something for it
  machine_requirements(opts)  what the machine must offer for these options (harness.core.requires;
              `layer_spec: te` -> te); unmet, the case is `not-run` with the reason
A case then splits into the worlds it launches (`run`) and a pure judge of their outputs, so the
judging is tested in-process (tests/test_judges.py).

The worlds a case launches go through the one rank envelope (harness.run.envelope.RunEnv).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from harness.backends import ref_of
from harness.core.options import NoOptions, parse_options
from harness.core.result import CaseResult
from harness.core.spec import CaseSpec, check_base
from harness.judge.checks import STRATEGY_CHECK
from harness.run.envelope import RunEnv


class Case(ABC):
    name: ClassVar[str]
    description: ClassVar[str]
    model_kind: ClassVar[str | tuple[str, ...]] = "gpt"  # or the kinds it takes, e.g. ("gpt", "hf")
    Options: ClassVar[type] = NoOptions
    needs: ClassVar[frozenset[str]] = frozenset()
    checks: ClassVar[tuple[str, ...]] = ()
    refusable: ClassVar[bool] = False
    #: whether the case runs a backend's pending-save finalize step (harness.models.training does) and
    #: checks the checkpoint is complete only after it: what an async-saving backend needs
    finalizes_saves: ClassVar[bool] = False

    def options(self, spec: CaseSpec) -> Any:
        return parse_options(self.Options, spec.opts, f"case {self.name}")

    def validate(self, spec: CaseSpec) -> Any:
        """Everything the case accepts, checked before anything runs; returns the typed options.
        Raises ValueError naming what is wrong."""
        from harness.backends import get_backend
        from harness.core.zoo import get_model

        opts = self.options(spec)
        kind, needs, why = self.requirements(opts)
        model = get_model(spec.model)
        if model.kind not in ((kind,) if isinstance(kind, str) else kind):
            raise ValueError(f"case {self.name}{why} takes a{'n HF fixture' if kind == 'hf' else ' GPT zoo'} model, got {spec.model!r}")
        if model.kind == "gpt":
            from harness.models.mcore import unavailable_reason

            why_not = unavailable_reason(model, getattr(opts, "layer_spec", "local"))
            if why_not:
                raise ValueError(f"model {spec.model!r} cannot be built in this environment: {why_not}")
        try:
            backend = get_backend(ref_of(spec))
        except KeyError as exc:
            raise ValueError(exc.args[0]) from None
        missing = sorted(needs - backend.capabilities)
        if missing:
            raise ValueError(
                f"case {self.name}{why} needs a backend that can {', '.join(missing)}; backend {spec.backend!r} "
                f"can {', '.join(sorted(backend.capabilities)) or 'nothing'}"
            )
        try:
            backend.validate_case(self, spec.source, spec.target, opts)
        except ValueError as exc:
            raise ValueError(f"backend {spec.backend}: {exc}") from None
        if spec.expect == "refuse" and not self.refusable:
            raise ValueError(f"case {self.name} cannot be expected to refuse (expect: refuse is for cases that judge a refusal)")
        if spec.xfail is not None:
            budgets = {f"memory-budget:{b.phase}@rank{b.rank}" for b in spec.budgets}
            unknown = [c for c in spec.xfail.checks if check_base(c) not in self.checks and c not in budgets
                       and c != STRATEGY_CHECK and c not in backend.checks]
            if unknown:
                raise ValueError(
                    f"xfail.checks names {unknown}, which case {self.name} never records; its checks: {list(self.checks)}"
                    + (f", backend {spec.backend}'s: {list(backend.checks)}" if backend.checks else "")
                    + (f", budgets: {sorted(budgets)}" if budgets else "")
                )
        self.validate_options(spec, opts)
        return opts

    def requirements(self, opts: Any) -> tuple[str, frozenset[str], str]:
        """(model kind, backend capabilities, why) for these options: the class's `model_kind` and
        `needs`, unless an option decides them (corrupt-load: a damage kind belongs to one artefact,
        a dist checkpoint of a GPT model or an HF export/adapter of an HF fixture). `why` qualifies
        the error message, e.g. " with damage 'flip-byte'"."""
        return self.model_kind, self.needs, ""

    def backends(self, spec: CaseSpec, opts: Any) -> list[Any]:
        """Every backend the case drives (harness.backends.BackendRef), the spec's first: the runner
        preloads each and lets each judge what its own saves and loads recorded (`strategy_check`).
        An option `load_with` (resume's and finetune's: the backend that loads, with its options,
        harness.backends.parse_ref) adds that one."""
        from harness.backends import parse_ref, ref_of

        load_with = getattr(opts, "load_with", "")
        return [ref_of(spec)] + ([parse_ref(load_with)] if load_with else [])

    def machine_requirements(self, opts: Any) -> frozenset[str]:
        """What these options need of the machine (harness.core.requires). The GPT cases share the
        `layer_spec` option (harness.models.build_gpt): `te` needs Transformer-Engine (and with it
        CUDA); a case with other needs overrides this."""
        return frozenset({"te"}) if getattr(opts, "layer_spec", "local") == "te" else frozenset()

    def validate_options(self, spec: CaseSpec, opts: Any) -> None:
        """Rules across options, topology and expectation (a case overrides it where it has some)."""

    @abstractmethod
    def run(self, spec: CaseSpec, opts: Any, env: RunEnv, result: CaseResult) -> None:
        """Launch the worlds, then record every check (passed, failed or not-run with why) on result."""
