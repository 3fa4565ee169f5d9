"""Judging and recording a check: one family of functions every case uses.

Each takes plain values (tensors, shard lists, knob records, an exception) and returns a `Check`,
so a case's judge is a pure function of its worlds' outputs and is tested without a process
(tests/test_judges.py). The comparisons themselves are harness.core.parity.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch

from harness.core.parity import (
    BITWISE,
    EXACT,
    NOT_COMPARED,
    Mismatch,
    Shard,
    Tolerance,
    assemble,
    compare_state,
    compare_tensors,
    max_abs_diff,
)
from harness.core.result import Check


def label_of(tolerance: Tolerance | None) -> Tolerance:
    """The check's tolerance: the one named, or bitwise."""
    return BITWISE if tolerance is None else tolerance


def _max_diff(expected: Mapping[str, torch.Tensor], actual: Mapping[str, torch.Tensor]) -> float:
    diffs = [max_abs_diff(expected[k], actual[k]) for k in expected if k in actual]
    return max(diffs, default=0.0)


def empty_check(name: str, what: str, empty_ok: str, tolerance: Tolerance = NOT_COMPARED) -> Check:
    """A check given nothing to judge: passed only where the caller says why nothing is the right
    answer (`empty_ok`), else failed, naming what was empty (a vacuous pass proves nothing)."""
    if empty_ok:
        return Check(name, "passed", f"{what}, as it must be: {empty_ok}", tolerance=tolerance)
    return Check(name, "failed", f"nothing to judge: {what}", tolerance=tolerance)


def state_check(
    name: str,
    expected: Mapping[str, torch.Tensor],
    actual: Mapping[str, torch.Tensor],
    expected_label: str,
    actual_label: str,
    detail_ok: str,
    tolerance: Tolerance | None = None,
    problems: Sequence[Mismatch] = (),
    empty_ok: str = "",
) -> Check:
    """Every key of both sides equal (bitwise, or within `tolerance`), plus any `problems` found on
    the way (coverage holes, diverged replicas from `assemble`). Both sides empty fails (no tensor
    was compared) unless `empty_ok` says why no tensors is right."""
    label = label_of(tolerance)
    if not expected and not actual and not problems:
        return empty_check(name, f"no tensors on either side ({expected_label}, {actual_label})", empty_ok, label)
    mismatches = list(problems) + compare_state(expected, actual, expected_label, actual_label, tolerance)
    if mismatches:
        worst = max((m.max_abs_diff for m in mismatches if m.max_abs_diff is not None), default=None)
        kinds = sorted({m.kind for m in mismatches})
        return Check(name, "failed", f"{len(mismatches)} mismatch(es): {', '.join(kinds)}", worst, label, mismatches)
    return Check(name, "passed", detail_ok, 0.0 if tolerance is None else _max_diff(expected, actual), label)


def tensor_check(
    name: str,
    expected: torch.Tensor,
    actual: torch.Tensor,
    expected_label: str,
    actual_label: str,
    detail_ok: str,
    tolerance: Tolerance | None = None,
    empty_ok: str = "",
) -> Check:
    """`expected` and `actual` equal (bitwise, or within `tolerance`); two empty tensors fail (no
    element was compared) unless `empty_ok` says why that is right."""
    if expected.numel() == 0 and actual.numel() == 0:
        return empty_check(name, f"no elements on either side ({expected_label} {tuple(expected.shape)}, "
                      f"{actual_label} {tuple(actual.shape)})", empty_ok, label_of(tolerance))
    m = compare_tensors(name, expected, actual, expected_label, actual_label, tolerance)
    diff = max_abs_diff(expected, actual)
    if m is None:
        return Check(name, "passed", detail_ok, diff, label_of(tolerance))
    return Check(name, "failed", str(m), diff, label_of(tolerance), [m])


def assembled(outs: Iterable[Any], field: str, label: str) -> tuple[dict[str, torch.Tensor], list[Mismatch]]:
    """Full tensors from the `field` shard lists of every rank's output (see parity.assemble)."""
    shards: list[Shard] = [s for o in outs for s in (getattr(o, field) or ())]
    return assemble(shards, label)


def replicated(outs: Iterable[Any], field: str) -> tuple[Any, bool]:
    """The value of `field` that ranks produced (None where a rank has none, e.g. off the last
    pipeline stage), and whether every rank that produced one agrees bitwise (DP/CP replicas)."""
    found = [getattr(o, field) for o in outs if getattr(o, field) is not None]
    if not found:
        return None, True
    first = found[0]
    return first, all(torch.equal(first.view(torch.uint8), f.view(torch.uint8)) for f in found[1:])


def knob_check(name: str, sides: Sequence[tuple[str, Sequence[Sequence[Mapping[str, Any]]]]], detail_ok: str,
               empty_ok: str = "") -> Check:
    """Every configuration knob a case asked is what the built objects use, on every rank of
    every side: `sides` is [(label, [per-rank list of {knob, asked, actual, ok}])]. No side, or a
    side whose ranks recorded no knob, fails (nothing was compared) unless `empty_ok` says why."""
    if not sides:
        return empty_check(name, "no side recorded knobs", empty_ok, EXACT)
    bare = [f"{label} ({len(ranks)} rank(s))" for label, ranks in sides if not any(ranks)]
    if bare:
        return empty_check(name, f"no knob records from {', '.join(bare)}", empty_ok, EXACT)
    bad = [
        f"{label} rank {rank}: {k['knob']} asked {k['asked']!r}, built {k['actual']!r}"
        for label, ranks in sides
        for rank, knobs in enumerate(ranks)
        for k in knobs
        if not k["ok"]
    ]
    if bad:
        return Check(name, "failed", "; ".join(bad[:6]), tolerance=EXACT)
    return Check(name, "passed", detail_ok, tolerance=EXACT)


def refusal_check(exc_type: str | None, message: str, allowed: Sequence[str], change: str, meaning: str = "",
                  frame: str = "", action: str = "load") -> Check:
    """An `expect: refuse` load (or a golden rollback): it must raise one of `allowed`. A load that
    completes fails (the checkpoint was accepted where it should not be), and so does a refusal
    through another exception (the user gets no clear reason: an AttributeError or KeyError inside
    the loader is a crash, not a refusal); `frame`, the last frame of its traceback, then says where
    it was raised. `exc_type` None means the load completed. `action` names the call that was to
    refuse (an "export" for hf-roundtrip's unmapped source key)."""
    meaning = f" (meaning: {meaning})" if meaning else ""
    if exc_type is None:
        return Check("refusal", "failed", f"the {action} across {change} was expected to refuse but completed{meaning}", tolerance=NOT_COMPARED)
    first = message.splitlines()[0][:240] if message else ""
    if exc_type in allowed:
        return Check("refusal", "passed", f"refused across {change}: {exc_type}: {first}{meaning}", tolerance=NOT_COMPARED)
    return Check(
        "refusal", "failed",
        f"refused across {change}, but with {exc_type or 'an unrecognised error'}: {first!r}"
        + (f", raised at {frame}" if frame else "") + f"; not one of {list(allowed)}, so a user gets no clear reason",
        tolerance=NOT_COMPARED,
    )


#: Where megatron's optimizer sharded state dict (model-space form, the one harness.models.training's
#: optimizer view asks for) puts the main param of a model tensor, megatron-core 0.19.2: the
#: distributed optimizer's fully_reshardable form names it `param`, the non-distributed
#: Float16OptimizerWithFloat16Params (and the distributed optimizer's fully_sharded_model_space
#: form) `fp32_param`. Under bf16 both hold the fp32 main params.
MAIN_PARAM_PREFIXES = ("optimizer.state.param.", "optimizer.state.fp32_param.")
WEIGHTS_MATCH_MAIN_PARAMS = "weights-match-main-params"


def weights_match_main_params(
    sides: Sequence[tuple[str, Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]], dtype: str, empty_ok: str = "",
) -> Check:
    """Mixed precision keeps two copies of every weight: the bf16 model param and the optimizer's
    fp32 main param, which the optimizer steps and copies down (round to nearest even) after every
    step. A load that restores one and not the other (the model section from one checkpoint, the
    optimizer from another, or a load path that skips the copy) trains on silently from weights
    the optimizer does not hold. So: every bf16 model weight equals its fp32 main param cast to
    bf16, bitwise, on every side; a weight without a main param, or the reverse, fails too.

    `sides` is [(label, full model tensors by key, full optimizer tensors by
    `optimizer.state.<kind>.<key>`)], as harness.judge.checks.assembled gives them. fp32 training has no
    such split (the optimizer steps the model params themselves): recorded not-run, with why. No
    side, or a side with no weights and no main params, fails unless `empty_ok` says why."""
    name = WEIGHTS_MATCH_MAIN_PARAMS
    if dtype != "bf16":
        return Check(name, "not-run", f"dtype {dtype}: the optimizer steps the model params themselves, there is no "
                     "separate fp32 main copy to match", tolerance=NOT_COMPARED)
    if not sides:
        return empty_check(name, "no side to compare (no weights, no optimizer)", empty_ok, BITWISE)
    bare = [label for label, weights, optimizer in sides
            if not weights and not any(k.startswith(MAIN_PARAM_PREFIXES) for k in optimizer)]
    if bare:
        return empty_check(name, f"no bf16 weights and no fp32 main params at {', '.join(bare)}", empty_ok, BITWISE)
    mismatches: list[Mismatch] = []
    total = 0
    for label, weights, optimizer in sides:
        expected_label, actual_label = f"fp32 main params@{label} cast to bf16", f"bf16 weights@{label}"
        mains: dict[str, torch.Tensor] = {}
        for k, v in optimizer.items():
            prefix = next((p for p in MAIN_PARAM_PREFIXES if k.startswith(p)), None)
            if prefix is None:
                continue
            if v.dtype != torch.float32:  # a "main" param that is not fp32 is no main copy at all
                mismatches.append(Mismatch(k, "dtype", expected_label, actual_label, detail=f"main param is {v.dtype}, expected torch.float32"))
            mains[k[len(prefix):]] = v.to(torch.bfloat16)
        total += len(weights)
        mismatches += compare_state(mains, weights, expected_label, actual_label)
    if mismatches:
        worst = max((m.max_abs_diff for m in mismatches if m.max_abs_diff is not None), default=None)
        kinds = sorted({m.kind for m in mismatches})
        return Check(name, "failed", f"{len(mismatches)} mismatch(es): {', '.join(kinds)}; first: {mismatches[0]}", worst,
                     BITWISE, mismatches)
    labels = ", ".join(label for label, _, _ in sides)
    return Check(name, "passed", f"{total} bf16 weights equal their fp32 main params cast to bf16 (at {labels})", 0.0, BITWISE)


#: The check a backend records when its options ask a strategy (Backend.strategy_check).
STRATEGY_CHECK = "strategy"
ASYNC_FINALIZE = "async-finalize"


def async_finalize_check(records: Sequence[Sequence[Mapping[str, Any]]], directories: Sequence[str],
                         complete_now: Mapping[str, bool | None]) -> Check:
    """An async save counts as done only after its finalize step. For every checkpoint the job
    saved (`directories`, in order): every rank finalized it (`records`: per rank, the backend's
    finalize records), it was NOT a complete checkpoint just before the finalize (else the step
    proved nothing: the save was not asynchronous), it was complete right after, and it is
    complete now, as the next job finds it (`complete_now`, the parent's look, None = unknown).
    A job that skips the finalize leaves shards without metadata: this check fails, and the case
    does not load what was never completed. No directory, or no rank's records, fails: nothing
    was finalized."""
    if not directories:
        return Check(ASYNC_FINALIZE, "failed", "nothing to judge: no async save directory given", tolerance=EXACT)
    if not records:
        return Check(ASYNC_FINALIZE, "failed", f"nothing to judge: no rank recorded a finalize for {list(directories)}",
                     tolerance=EXACT)
    problems = []
    for d in directories:
        seen = [[r for r in rank if r.get("directory") == d] for rank in records]
        missing = [i for i, s in enumerate(seen) if not s]
        if missing:
            problems.append(f"{d}: never finalized on rank(s) {missing}")
            continue
        if any(r["complete_before"] for s in seen for r in s):
            problems.append(f"{d}: already a complete checkpoint before its finalize step (not an async save)")
        if not all(r["complete_after"] for s in seen for r in s):
            problems.append(f"{d}: not a complete checkpoint after its finalize step")
    for d in directories:
        if complete_now.get(d) is False:
            problems.append(f"{d}: not a complete checkpoint when the job ended (no metadata.json/.metadata)")
    n = len(directories)
    if problems:
        return Check(ASYNC_FINALIZE, "failed", "; ".join(problems), tolerance=EXACT)
    return Check(ASYNC_FINALIZE, "passed", f"{n} async save(s): incomplete until finalize on every rank, complete after",
                 tolerance=EXACT)


def not_run_checks(names: Iterable[str], why: str) -> list[Check]:
    """Checks a case could not get to, each recorded not-run with why."""
    return [Check(n, "not-run", why, tolerance=NOT_COMPARED) for n in names]


def finalize_gate(backend: Any, outs: Sequence[Any], directories: Sequence[str]) -> Check | None:
    """The async-finalize check of a training job's saves when `backend` saves asynchronously
    (None for a synchronous backend: its save returns complete). `outs`: the save world's
    TrainOut records (their `finalized_saves`)."""
    if not backend.saves_async:
        return None
    from pathlib import Path

    records = [getattr(o, "finalized_saves", []) for o in outs]
    return async_finalize_check(records, directories, {d: backend.checkpoint_complete(Path(d)) for d in directories})


# --------------------------------------------------------------------------- async saves (case async-save)

ASYNC_EQUALS_SYNC = "async-equals-sync"


def async_equals_sync_check(sync: Mapping[str, Any], asynchronous: Mapping[str, Any], layouts: tuple[Mapping[str, tuple], Mapping[str, tuple]],
                            allowed: Mapping[str, str] = {}) -> Check:
    """The same job state saved synchronously and asynchronously (then finalized) must read back the
    same: `sync` and `asynchronous` are harness.judge.ckpt_content.read_tree contents (every DCP item,
    megatron-core's metadata.json, every other file parsed), compared key by key (tensors bitwise,
    objects by value). `allowed` maps a regex over a difference's path to why that difference is
    the save's own record of how it was written (Bridge's run_config.yaml holds `async_save`);
    those are reported, never failed. `layouts` (each side's .distcp files: size, sha256) is reported
    only: torch DCP lays files out per writer bucket, so raw bytes may legitimately differ."""
    import re

    from harness.judge.ckpt_content import differences

    found = differences(dict(sync), dict(asynchronous), "")
    found = [d.lstrip(".") for d in found]
    excused = {d: why for d in found for pattern, why in allowed.items() if re.search(pattern, d)}
    real = [d for d in found if d not in excused]
    sizes = [{f: v[0] for f, v in side.items()} for side in layouts]
    if dict(layouts[0]) == dict(layouts[1]):
        layout = "raw .distcp bytes identical too (same files, sizes, sha256)"
    elif sizes[0] == sizes[1]:
        layout = "the same .distcp files and sizes, raw bytes differ: compared by content"
    else:
        layout = (f".distcp layout differs (sync {len(sizes[0])} files, {sum(sizes[0].values())} B; async {len(sizes[1])} files, "
                  f"{sum(sizes[1].values())} B): compared by content, not bytes")
    n_tensors = sum(isinstance(v, torch.Tensor) for v in sync.values())
    note = ("; differences that record how the save ran: " + "; ".join(f"{d} ({why})" for d, why in list(excused.items())[:4])
            if excused else "")
    if not sync or not asynchronous:
        return Check(ASYNC_EQUALS_SYNC, "failed", f"nothing read from the {'sync' if not sync else 'async'} checkpoint", tolerance=EXACT)
    if real:
        return Check(ASYNC_EQUALS_SYNC, "failed", f"{len(real)} difference(s) between the sync and the finalized async checkpoint: "
                     + "; ".join(real[:6]) + (f"; ... {len(real) - 6} more" if len(real) > 6 else "") + f" [{layout}]{note}",
                     tolerance=EXACT)
    return Check(ASYNC_EQUALS_SYNC, "passed", f"{len(sync)} items ({n_tensors} tensors bitwise, the rest by value: DCP objects, "
                 f"common state, metadata.json, the other files) equal; {layout}{note}", tolerance=EXACT)


def tracker_names_check(seen: Sequence[tuple[str, str | None, str]]) -> Check:
    """The "latest" tracker (latest_checkpointed_iteration.txt) never names a step whose save is not
    finished: `seen` is [(when, what the tracker named then or None = no tracker file, what it must
    name then)], e.g. ("before the async save's finalize", "1", "1"), ("after the kill", "2", "1").
    No observation fails: nothing was looked at."""
    if not seen:
        return Check("tracker", "failed", "nothing to judge: no look at the tracker was recorded", tolerance=EXACT)
    bad = [f"{when}: names {got if got is not None else 'nothing (no tracker file)'}, expected {want}" for when, got, want in seen
           if got != want]
    text = "; ".join(f"{when}: {got if got is not None else 'none'}" for when, got, _ in seen)
    if bad:
        return Check("tracker", "failed", "the tracker names an unfinished step: " + "; ".join(bad), tolerance=EXACT)
    return Check("tracker", "passed", f"the tracker names only finished steps ({text})", tolerance=EXACT)
