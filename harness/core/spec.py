"""What one matrix case is, and how its expected failure is judged: the values every layer shares.

This module sits below the matrix reader, the case registry and the runner (it imports only
topology and memory values), so none of them needs another to know what a case spec is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from harness.core.frames import in_module, innermost_in, project_of, raising_frame
from harness.core.memory import Budget
from harness.core.topology import Topology

if TYPE_CHECKING:
    from harness.core.result import CaseResult

#: Every marker a matrix entry may carry, with its pytest help (the plugin registers exactly these).
MARKERS: dict[str, str] = {
    "reshard": "a ckpt-harness matrix case (save -> reshard -> reload); every case has it",
    "smoke": "in the CPU smoke matrix",
    "extended": "in matrices/extended.yaml: more pairs and models of the smoke scenarios (default suite, not scripts/smoke)",
    "optimizer": "checks optimizer state",
    "resume": "checks training resume",
    "refusal": "a load that must refuse cleanly",
    "faults": "a damaged or foreign checkpoint: the load must refuse, never load it silently (matrices/faults.yaml)",
    "hf": "Megatron-Bridge HF export/import",
    "peft": "Megatron-Bridge HF PEFT adapters",
    "integrity": "writes HF artefacts (export, merged export, PEFT adapter, verl's HF tree) judged by export-integrity",
    "cp": "uses context parallelism",
    "tied": "tied embeddings",
    "moe": "mixture-of-experts models (gpt-moe*): expert parallelism (ep/etp) and expert-data-parallel optimizer state",
    "fsdp": "Megatron-FSDP (megatron.core.distributed.fsdp) models and fsdp_dtensor checkpoints (backend mcore_fsdp)",
    "bf16": "bf16 mixed precision (dtype bf16: Float16Module, fp32 main params)",
    "muon": "megatron-core's Muon (emerging-optimizers), chained or as the layer-wise distributed optimizer",
    "lion": "megatron-core's Lion (emerging-optimizers), chained or as the layer-wise distributed optimizer",
    "verl": "verl 0.9.1's MegatronCheckpointManager (backend verl_manager; matrices/verl.yaml and smoke entries)",
    "strategies": "mcore_dist save/load strategies (fully-parallel, async save + finalize, metadata caching)",
    "async": "asynchronous saves: byte identity with sync after finalize, kills while the write is in flight, trackers, resume trajectories",
    "buckets": "DDP gradient buckets as real runs have them (overlap_grad_reduce / overlap_param_gather, bucket_size)",
    "vpp": "virtual pipeline parallelism (model chunks, the interleaved schedule)",
    "bridge_training": "Megatron-Bridge's own training checkpoints (backend bridge_training: save_checkpoint / load_checkpoint)",
    "finetune": "a job started from a pretrained checkpoint's weights only (case finetune; Bridge's pretrained_checkpoint)",
    "interop": "a checkpoint one tool wrote, loaded by another (Megatron-Bridge <-> megatron-core / Megatron-LM layouts)",
    "convert": "checkpoint format conversions (torch_dist <-> fsdp_dtensor, fsdp_dtensor -> HF) through the converters upstream ships",
    "fanout": "one source loaded at many targets (a cross product; its save runs once per run: harness/run/reuse.py)",
    "arch": "matrices/architectures.yaml: one round trip per architecture the installed Megatron-Bridge registers (opt-in: scripts/test -m arch)",
    "slow": "heavier cases, not in the default suite",
    "main_job": "a case of a matrix the main job runs on every push (matrices/tiers.yaml: scripts/smoke); scripts/test leaves it to that job",
    "memory": "host-memory cases and budgets (heavier)",
    "gpu": "needs CUDA devices",
}


@dataclass(frozen=True)
class XFail:
    """A named upstream defect the case is expected to show (strict: a pass fails the case).

    The policy lives with the data, as Megatron's StrictHandling keeps its rules beside its values:
    `match` (a regex over the failure text) and `checks` (the checks that must fail, and the only
    ones that may) say which failure is the known one. The short form (a reason alone) accepts only
    failed checks, never an error: a harness bug, a crash or a timeout must not pass as the defect.
    An xfail that accepts an error (`match` without `checks`) names where the defect lies:
    `raised_in`, a dotted upstream module prefix (the matrix loader requires it). The traceback's
    innermost frame inside the project `raised_in` belongs to (`megatron.core`, `megatron.bridge`,
    `transformers`, ...: frames.project_of) must be in it, so an error that surfaces in generic code
    (torch) is the defect only when the named module called it, and a traceback with no frame of
    that project never meets it. An error raised in the harness's own code never meets an xfail: a
    message that happens to match is not the upstream defect.
    """

    reason: str
    match: str | None = None
    checks: tuple[str, ...] = ()
    raised_in: str | None = None
    #: (release requirement, the defect's signature there): the same defect in the form an older (or
    #: newer) release shows it (`known_on:` in a matrix), met only where that release is installed, so a
    #: sweep over history reads "same defect", never "failed", and the gate knows someone looked at it
    known_on: tuple[tuple[str, "XFail"], ...] = ()

    @property
    def accepts_errors(self) -> bool:
        """Whether an errored case can meet this xfail (a `match` and no `checks`)."""
        return bool(self.match) and not self.checks

    def explains(self, result: "CaseResult") -> str:
        """Why `result` is NOT the expected failure ("" when it is: its own signature, or the one it
        declares known on an installed release)."""
        why = self.explains_as_named(result)
        if why and self.met_as(result) is not None:
            return ""
        return why

    def met_as(self, result: "CaseResult") -> str | None:
        """The `known_on` release whose signature `result` meets, where that release is installed
        here and the named signature is not met (None otherwise)."""
        if not self.explains_as_named(result):
            return None
        return next((release for release, alt in self.known_on
                     if installed_matches(release) and not alt.explains_as_named(result)), None)

    def explains_as_named(self, result: "CaseResult") -> str:
        """Why `result` is NOT the failure this signature names ("" when it is)."""
        errored = result.status in ("error", "not-applicable")  # not-applicable: an error in a release the case does not fit
        if result.status != "failed" and not errored:
            return f"the case {result.status}"
        frame = raising_frame(result.error or "") if errored else None
        if frame is not None and frame.own:
            return f"raised in the harness's own code at {frame}: a harness error, not the named defect"
        if self.match and not re.search(self.match, result.failure_text()):
            return f"no match for {self.match!r}"
        if not self.match and not self.checks and errored:
            return "the case errored; an xfail without `match` or `checks` accepts only failed checks, never an error"
        if self.checks:
            if errored:
                return f"the case errored instead of failing checks {list(self.checks)}"
            failed = {c.name for c in result.checks if c.status == "failed"}
            extra = sorted(n for n in failed if not self.names(n))
            if extra:
                return f"check(s) {extra} failed too, beyond the expected {list(self.checks)}"
            if not any(self.names(n) for n in failed):
                return f"none of the expected checks {list(self.checks)} failed"
        if errored and self.raised_in:
            if frame is None:
                return f"the error names no raising frame, so it cannot show the defect raised in {self.raised_in}"
            home = project_of(self.raised_in)
            inner = innermost_in(result.error or "", home)
            if inner is None:
                return (f"raised at {frame} (module {frame.module}) with no frame of {home} in the traceback: "
                        f"not in {self.raised_in} where the named defect lies")
            if not in_module(inner.module, self.raised_in):
                return (f"raised at {frame}; the innermost {home} frame is {inner} (module {inner.module}), "
                        f"not in {self.raised_in} where the named defect lies")
        return ""

    def names(self, check_name: str) -> bool:
        """Whether `check_name` is one of the expected checks (a `@topology` suffix is ignored)."""
        return check_name in self.checks or check_base(check_name) in self.checks


def installed_matches(requirement: str) -> bool:
    """Whether the installed distribution a PEP 508 requirement names (`megatron-bridge<0.6`) satisfies
    it (False when it is not installed)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    req = Requirement(requirement)
    try:
        return req.specifier.contains(metadata.version(req.name), prereleases=True)
    except metadata.PackageNotFoundError:
        return False


def check_base(name: str) -> str:
    """`megatron-logits@tp1pp2dp1cp1` -> `megatron-logits`: a check recorded once per topology."""
    return name.split("@")[0]


#: An axis named `backend.<option>` varies a backend option rather than a case option.
BACKEND_AXIS = "backend."


@dataclass(frozen=True)
class CaseSpec:
    """One case of a matrix: a scenario, a model, a backend, a topology pair and its options."""

    case: str
    model: str
    backend: str
    source: Topology
    target: Topology
    options: tuple[tuple[str, Any], ...] = ()
    axes: tuple[str, ...] = ()  # option names that vary in this entry (shown in the id); `backend.X` names a backend option
    tag: str = ""  # an entry's own suffix, to tell apart entries that differ only in fixed options
    expect: str = "pass"  # pass | refuse
    xfail: XFail | None = None
    markers: tuple[str, ...] = ()
    timeout_s: float = 300.0
    budgets: tuple[Budget, ...] = ()
    origin: str = ""  # file:entry, for messages
    backend_options: tuple[tuple[str, Any], ...] = ()  # the backend's own options (its `Options`)
    #: What the machine must offer (harness.core.requires): the entry's `requires` plus what the case's
    #: options imply; unmet -> the case is `not-run` with the reasons.
    requires: tuple[str, ...] = ()
    #: Lines every result of this spec carries (e.g. the original pair of a topology cut by --max-world).
    notes: tuple[str, ...] = ()

    @property
    def opts(self) -> dict[str, Any]:
        return dict(self.options)

    @property
    def backend_opts(self) -> dict[str, Any]:
        return dict(self.backend_options)

    def axis_value(self, axis: str) -> Any:
        return self.backend_opts[axis[len(BACKEND_AXIS):]] if axis.startswith(BACKEND_AXIS) else self.opts[axis]

    @property
    def id(self) -> str:
        def part(a: str) -> str:
            v = self.axis_value(a)
            return f"-{v}" if isinstance(v, str) else f"-{a.removeprefix(BACKEND_AXIS)}={v}"

        axes = "".join(part(a) for a in self.axes)
        tag = f"-{self.tag}" if self.tag else ""
        return f"{self.case}[{self.backend}-{self.model}-{self.source.id}->{self.target.id}{axes}{tag}]"
