"""The checks of bridge_training (train-state, flops, rng-state): what each Bridge load restored
(iteration, consumed samples, FLOPs, RNG states) against what its save wrote, from the events both
recorded (harness.run.events: per world phase, per rank).

Every load starts from decoys (bridge_training.RngDecoy for the RNGs, a fresh TrainState) and its
event records them (`rng_before`, `train_state_before`): a state that equals the saved one after the
load proves a restore only where it differed before. Where it did not, that rank's comparison
proves nothing: the check is not-run, saying the state before the load already equalled the saved
one. Where Bridge must not restore the RNG (finetune, load_rng false, TP/PP changed) the check
asserts the load left every generator at its decoy."""

from __future__ import annotations

from typing import Any

from harness.run.events import each_event

TRAIN_STATE_CHECK, FLOPS_CHECK, RNG_CHECK = "train-state", "flops", "rng-state"
FLOPS = "floating_point_operations_so_far"


def _finetune(o: Any, load: dict) -> bool:
    """Whether the load was a finetune: Bridge sets `checkpoint.finetune` itself when it falls back
    to `pretrained_checkpoint` (the event says what the config held after the load)."""
    return bool(load.get("finetune", o.finetune))


SAME_BEFORE = "the state before the load already equalled the saved one"


def _untouched(where: str, load: dict, why: str) -> tuple[list[str], list[str], bool]:
    """A load that must leave the RNG alone (`why`): every generator still at its pre-load decoy."""
    before = load.get("rng_before") or {}
    if not before:
        return [], [f"{why}; no pre-load RNG record to show the load left them alone"], False
    moved = sorted(k for k, v in before.items() if load["rng"].get(k) != v)
    if moved:
        return [f"{where}: RNG {', '.join(moved)} changed by a load that must not restore them ({why})"], [], False
    return [], [f"{why}: every generator left at its pre-load decoy"], True


def _rng_problems(o: Any, where: str, load: dict, saves: list[dict]) -> tuple[list[str], list[str], bool]:
    """(problems, notes, whether anything was proven) about one rank's RNG after a load."""
    if not o.load_rng or _finetune(o, load):
        return _untouched(where, load, f"RNG not loaded ({'finetune' if _finetune(o, load) else 'load_rng: false'})")
    same = [s for s in saves if (s["tp"], s["pp"]) == (load["tp"], load["pp"])]
    if not same:
        s = saves[0]
        return _untouched(where, load, f"RNG not restored: TP/PP changed (tp{s['tp']}pp{s['pp']} -> tp{load['tp']}pp{load['pp']}); "
                                       "Bridge ignores the RNG states then, by design")
    src = next((s for s in same if (s["tp_rank"], s["pp_rank"], s["dp_rank"]) == (load["tp_rank"], load["pp_rank"], 0)), None)
    if src is None:
        return [f"{where}: no save at tp_rank {load['tp_rank']} pp_rank {load['pp_rank']} dp_rank 0 to compare the RNG with"], [], False
    differ = sorted(k for k, v in src["rng"].items() if load["rng"].get(k) != v)
    if differ:
        return [f"{where}: RNG {', '.join(differ)} not restored (the DP-rank-0 state of its TP/PP rank)"], [], False
    before = load.get("rng_before") or {}
    vacuous = sorted(k for k, v in src["rng"].items() if before.get(k, v) == v)
    if vacuous:
        return [], [f"{where}: RNG {', '.join(vacuous)}: {SAME_BEFORE}" + ("" if before else " (no pre-load RNG record)")], False
    return [], [], True


def state_check(o: Any, events: dict[str, dict[str, list[dict]]]) -> list[Any]:
    """Checks over every load (none when no load ran): `train-state` (iteration, step, consumed
    samples), `flops` (the FLOP count the load returns and restores) and `rng-state`."""
    from harness.core.parity import EXACT
    from harness.core.result import Check

    saves, loads = each_event(events, "save", "bridge_training"), each_event(events, "load", "bridge_training")
    if not loads:
        return []
    if not saves and not all(_finetune(o, ev) for _, _, ev in loads):  # a checkpoint another backend wrote
        got = sorted({(ev["iteration"], ev["flops"]) for _, _, ev in loads})
        why = (f"the checkpoint was written by another backend (no bridge_training save in this case) and there is "
               f"nothing of its own to compare with: restored (iteration, FLOPs) {got}; the resumed trajectory is judged by the case")
        return [Check(n, "not-run", why, tolerance=EXACT) for n in (TRAIN_STATE_CHECK, FLOPS_CHECK, RNG_CHECK)]
    found: dict[str, list[str]] = {TRAIN_STATE_CHECK: [], FLOPS_CHECK: [], RNG_CHECK: []}
    proven: dict[str, bool] = {TRAIN_STATE_CHECK: False, FLOPS_CHECK: False, RNG_CHECK: False}
    vacuous: dict[str, list[str]] = {TRAIN_STATE_CHECK: [], FLOPS_CHECK: [], RNG_CHECK: []}
    notes: set[str] = set()
    finetune = all(_finetune(o, ev) for _, _, ev in loads)
    for phase, rank, ev in loads:
        where = f"{phase}@rank{rank}"
        if _finetune(o, ev):
            if ev["iteration"] != 0 or ev["train_state"]["step"] != 0 or ev["train_state"]["consumed_train_samples"] != 0:
                found[TRAIN_STATE_CHECK].append(f"{where}: finetune restored iteration {ev['iteration']} (train state "
                                                f"{ev['train_state']}); a finetune starts at 0")
            elif any(e["iteration"] != 0 for _, _, e in saves):  # a saved iteration was there to restore, and was not
                proven[TRAIN_STATE_CHECK] = True
            else:
                vacuous[TRAIN_STATE_CHECK].append(f"{where}: finetune kept iteration 0, and no save of this case records a "
                                                  "nonzero iteration it could have restored instead")
            p, n, ok = _rng_problems(o, where, ev, saves)
            found[RNG_CHECK] += p
            notes.update(n)
            proven[RNG_CHECK] |= ok
            continue
        written = [e for _, _, e in saves if e["iteration"] == ev["iteration"]]
        if not written:
            found[TRAIN_STATE_CHECK].append(f"{where}: restored iteration {ev['iteration']}, which no save of this case wrote "
                                            f"(saved: {sorted({e['iteration'] for _, _, e in saves})})")
            continue
        want, got, before = written[0]["train_state"], ev["train_state"], ev.get("train_state_before") or {}
        counters = {k: v for k, v in want.items() if k != FLOPS}
        if {k: v for k, v in got.items() if k != FLOPS} != counters:
            found[TRAIN_STATE_CHECK].append(f"{where}: train state {got} restored, {want} saved")
        elif before and any(before.get(k) != v for k, v in counters.items()):
            proven[TRAIN_STATE_CHECK] = True
        else:
            vacuous[TRAIN_STATE_CHECK].append(f"{where}: train state {want}: {SAME_BEFORE}" + ("" if before else " (no pre-load record)"))
        if got[FLOPS] != want[FLOPS] or ev["flops"] != want[FLOPS]:
            found[FLOPS_CHECK].append(f"{where}: FLOPs {want[FLOPS]!r} saved, {got[FLOPS]!r} restored in the train state, "
                                      f"{ev['flops']!r} returned by load_checkpoint")
        elif before and before.get(FLOPS) != want[FLOPS]:
            proven[FLOPS_CHECK] = True
        else:
            vacuous[FLOPS_CHECK].append(f"{where}: FLOPs {want[FLOPS]!r}: {SAME_BEFORE}" + ("" if before else " (no pre-load record)"))
        p, n, ok = _rng_problems(o, where, ev, written)
        found[RNG_CHECK] += p
        notes.update(n)
        proven[RNG_CHECK] |= ok
    rng_notes = sorted(n for n in notes if SAME_BEFORE not in n)
    vacuous[RNG_CHECK] = sorted(n for n in notes if SAME_BEFORE in n)
    passed = {
        TRAIN_STATE_CHECK: "finetune: iteration and train state start at 0" if finetune
        else f"{len(loads)} rank-load(s) restored the iteration, step and consumed samples saved (each differed before the load)",
        FLOPS_CHECK: "finetune: not restored" if finetune
        else "the FLOP count saved is the one restored and returned, exactly (it differed before the load)",
        RNG_CHECK: "; ".join(rng_notes) or "python, numpy, torch, CUDA (where present) and tracker RNG states restored on every rank, "
                   "each from a decoy",
    }
    out = []
    for name, problems in found.items():
        if name == FLOPS_CHECK and finetune:
            continue
        if problems:
            detail = "; ".join(problems[:8]) + (f"; ... {len(problems) - 8} more" if len(problems) > 8 else "")
            out.append(Check(name, "failed", detail, tolerance=EXACT))
        elif proven[name]:
            also = f"; not proven on some rank-loads: {'; '.join(vacuous[name][:3])}" if vacuous[name] else ""
            out.append(Check(name, "passed", passed[name] + also, tolerance=EXACT))
        else:
            why = vacuous[name] or rng_notes if name == RNG_CHECK else vacuous[name]
            out.append(Check(name, "not-run", "nothing proven: " + ("; ".join(why[:4]) or SAME_BEFORE), tolerance=EXACT))
    return out
