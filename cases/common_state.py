"""common-state: ranks that disagree on the common (unsharded) state at a save, and what the user is told.

A dist checkpoint keeps one copy of the common state: rank 0's. A job whose ranks drifted apart in
something every rank holds (a step counter, a flag in its args, a small tensor) gets rank 0's back on
resume, silently for the others; megatron-core's save validation (`validate_access_integrity`,
validation.py `_validate_common_state_dict` over dict_utils `diff`) compares every rank's common state
with rank 0's and logs a warning on each rank that differs. This case saves a GPT zoo model at S with
an entry `harness_common` that differs on every rank but 0 in one named way (`divergence`, a matrix
axis), then loads the checkpoint at D:

  value        a scalar (`step`) and one element of a tensor (`tensor`) differ
  key          rank 0 holds `only_rank0`, the others `only_here` instead
  list-length  the others' list (`history`) has one element more
  list-shorter the others' list (`history`) has one element less
  tensor-shape the others' tensor (`tensor`) has one element more (a per-rank buffer that grew): torch
               cannot compare it elementwise, and diff must still call it a mismatch

Checks:
  warned         every rank but 0 logged megatron-core's common-state warning, naming each differing
                 entry by its whole key path (e.g. `('harness_common', 'step')`), and no other path of the
                 entry (a list index that is not the extra element included); rank 0 logged none (the
                 harness knows what it made differ: the expectation is its own)
  loaded-common  the common state loaded at D is rank 0's on every rank (what the checkpoint keeps)
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from .contract import Case
from harness.backends import BackendRef, get_backend, ref_of
from harness.core.context import RankContext
from harness.core.parity import EXACT, NOT_COMPARED
from harness.core.result import CaseResult, Check
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.core.zoo import ModelSpec, get_model
from harness.models import mcore as models
from harness.run.envelope import RunEnv

Divergence = Literal["value", "key", "list-length", "list-shorter", "tensor-shape"]
KEY = "harness_common"
PATH = r"\('harness_common'(?:, [^()]*)?\)"  # a key path of the entry as megatron-core's warning writes it (a tuple)
#: the logger megatron-core's common-state check writes to, and the words of its warning
LOGGER, WARNING = "megatron.core.dist_checkpointing.validation", "common state dict differs"


@dataclass(frozen=True)
class CommonStateOptions:
    divergence: Divergence = "value"


def common_of(rank: int, divergence: str) -> dict[str, Any]:
    """Rank `rank`'s `harness_common`: rank 0's is the reference, every other rank's differs as named."""
    off = rank > 0
    out: dict[str, Any] = {"step": 100, "tensor": torch.arange(4, dtype=torch.float32), "history": [1, 2], "tag": "run-a"}
    if off and divergence == "value":
        out["step"] = 100 + rank
        out["tensor"][rank % 4] += 0.5
    elif off and divergence == "list-length":
        out["history"] = [1, 2, 3]
    elif off and divergence == "list-shorter":
        out["history"] = [1]
    elif off and divergence == "tensor-shape":
        out["tensor"] = torch.arange(5, dtype=torch.float32)
    if divergence == "key":
        out["only_here" if off else "only_rank0"] = rank
    return out


def expected_paths(divergence: str) -> dict[str, set[tuple]]:
    """What megatron-core's warning on a rank but 0 should name: paths only on rank 0, only on this rank,
    and present on both with other values."""
    if divergence == "value":
        return {"only_rank0": set(), "only_here": set(), "mismatch": {(KEY, "step"), (KEY, "tensor")}}
    if divergence == "tensor-shape":
        return {"only_rank0": set(), "only_here": set(), "mismatch": {(KEY, "tensor")}}
    if divergence == "key":
        return {"only_rank0": {(KEY, "only_rank0")}, "only_here": {(KEY, "only_here")}, "mismatch": set()}
    if divergence == "list-shorter":
        return {"only_rank0": {(KEY, "history", 1)}, "only_here": set(), "mismatch": set()}
    return {"only_rank0": set(), "only_here": {(KEY, "history", 2)}, "mismatch": set()}


@dataclass(frozen=True)
class _Phase:
    model: ModelSpec
    topo: Topology
    backend: BackendRef
    directory: str
    divergence: str
    load: bool = False


class _Caught(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _rank(ctx: RankContext, p: _Phase) -> dict[str, Any]:
    backend = get_backend(p.backend)
    model = models.build_gpt(p.model, p.topo)
    models.fill_canonical(model, p.model)
    state = {**models.sharded_state_dict(model), KEY: common_of(ctx.rank, p.divergence)}
    if p.load:
        loaded = backend.load_state(ctx, state, Path(p.directory)).get(KEY)
        return {"loaded": None if loaded is None else {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in loaded.items()}}
    caught, logger = _Caught(), logging.getLogger(LOGGER)
    level = logger.level  # harness.compat.noise quiets "megatron" below ERROR: a user's job logs warnings
    logger.addHandler(caught)
    logger.setLevel(logging.WARNING)
    try:
        backend.save_state(ctx, state, Path(p.directory))
    finally:
        logger.removeHandler(caught)
        logger.setLevel(level)
    return {"warnings": [m for m in caught.messages if WARNING in m]}


def judge_warned(warnings: list[list[str]], divergence: str) -> Check:
    """`warnings[r]`: the common-state warnings rank r logged during the save."""
    if len(warnings) < 2:
        return Check("warned", "failed", f"a world of {len(warnings)} rank(s): no rank to differ from rank 0", tolerance=NOT_COMPARED)
    want = expected_paths(divergence)
    every = {repr(p) for ps in want.values() for p in ps}
    problems = [f"rank 0 warned: {warnings[0][0][:200]}"] if warnings[0] else []
    for r, got in enumerate(warnings[1:], start=1):
        if not got:
            problems.append(f"rank {r} differs from rank 0 ({divergence}) and logged no common-state warning")
            continue
        text = " ".join(got)
        unnamed = sorted(p for p in every if p not in text)
        if unnamed:
            problems.append(f"rank {r}'s warning does not name {', '.join(unnamed)}: {text[:300]}")
        for path in sorted(set(re.findall(PATH, text)) - every):  # an index past a list's end is no entry either
            problems.append(f"rank {r}'s warning names {path}, which does not differ")
    if problems:
        return Check("warned", "failed", "; ".join(problems), tolerance=NOT_COMPARED)
    return Check("warned", "passed", f"ranks 1..{len(warnings) - 1} each named {', '.join(sorted(every))}; rank 0 warned of "
                 "nothing", tolerance=NOT_COMPARED)


def judge_loaded(loaded: list[dict[str, Any] | None], divergence: str) -> Check:
    """Every rank's loaded `harness_common` against rank 0's at the save."""
    ref = common_of(0, divergence)
    ref = {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in ref.items()}
    if not loaded:
        return Check("loaded-common", "failed", "no rank loaded anything", tolerance=EXACT)
    bad = [f"rank {r}: {got!r}" for r, got in enumerate(loaded) if got != ref]
    if bad:
        return Check("loaded-common", "failed", f"expected rank 0's {ref!r}; " + "; ".join(bad)[:600], tolerance=EXACT)
    return Check("loaded-common", "passed", f"{len(loaded)} rank(s) loaded rank 0's common state ({len(ref)} entries)", tolerance=EXACT)


class CommonState(Case):
    name = "common-state"
    description = "ranks that disagree on the common state at a save: megatron-core must warn naming each entry; the load gives rank 0's"
    needs = frozenset({"weights"})
    checks = ("warned", "loaded-common")
    Options = CommonStateOptions

    def validate_options(self, spec: CaseSpec, opts: CommonStateOptions) -> None:
        if spec.source.world_size < 2:
            raise ValueError(f"case common-state needs a source of 2 or more ranks to differ from rank 0; {spec.source.id} has 1")

    def run(self, spec: CaseSpec, opts: CommonStateOptions, env: RunEnv, result: CaseResult) -> None:
        model, backend, ckpt = get_model(spec.model, "gpt"), ref_of(spec), env.case_dir / "ckpt"
        saved = env.launch("save", _rank, _Phase(model, spec.source, backend, str(ckpt), opts.divergence), spec.source)
        loaded = env.launch("load", _rank, _Phase(model, spec.target, backend, str(ckpt), opts.divergence, load=True), spec.target)
        result.checks.append(judge_warned([o["warnings"] for o in saved], opts.divergence))
        result.checks.append(judge_loaded([o["loaded"] for o in loaded], opts.divergence))


CASE = CommonState()
