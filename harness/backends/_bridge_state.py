"""The checks of bridge_training (train-state, flops, rng-state): what each Bridge load restored
(iteration, consumed samples, FLOPs, RNG states) against what its save wrote, from the events both
recorded (harness.run.events: per world phase, per rank)."""

from __future__ import annotations

from typing import Any

from harness.run.events import each_event

TRAIN_STATE_CHECK, FLOPS_CHECK, RNG_CHECK = "train-state", "flops", "rng-state"
FLOPS = "floating_point_operations_so_far"


def _finetune(o: Any, load: dict) -> bool:
    """Whether the load was a finetune: Bridge sets `checkpoint.finetune` itself when it falls back
    to `pretrained_checkpoint` (the event says what the config held after the load)."""
    return bool(load.get("finetune", o.finetune))


def _rng_problems(o: Any, where: str, load: dict, saves: list[dict]) -> tuple[list[str], list[str]]:
    """(problems, notes) about one rank's RNG after a load."""
    if not o.load_rng or _finetune(o, load):
        return [], [f"RNG not loaded ({'finetune' if _finetune(o, load) else 'load_rng: false'})"]
    same = [s for s in saves if (s["tp"], s["pp"]) == (load["tp"], load["pp"])]
    if not same:
        s = saves[0]
        return [], [f"RNG not restored: TP/PP changed (tp{s['tp']}pp{s['pp']} -> tp{load['tp']}pp{load['pp']}); "
                    "Bridge ignores the RNG states then, by design"]
    src = next((s for s in same if (s["tp_rank"], s["pp_rank"], s["dp_rank"]) == (load["tp_rank"], load["pp_rank"], 0)), None)
    if src is None:
        return [f"{where}: no save at tp_rank {load['tp_rank']} pp_rank {load['pp_rank']} dp_rank 0 to compare the RNG with"], []
    differ = sorted(k for k, v in src["rng"].items() if load["rng"].get(k) != v)
    return ([f"{where}: RNG {', '.join(differ)} not restored (the DP-rank-0 state of its TP/PP rank)"] if differ else []), []


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
    notes: set[str] = set()
    finetune = all(_finetune(o, ev) for _, _, ev in loads)
    for phase, rank, ev in loads:
        where = f"{phase}@rank{rank}"
        if _finetune(o, ev):
            if ev["iteration"] != 0 or ev["train_state"]["step"] != 0 or ev["train_state"]["consumed_train_samples"] != 0:
                found[TRAIN_STATE_CHECK].append(f"{where}: finetune restored iteration {ev['iteration']} (train state "
                                                f"{ev['train_state']}); a finetune starts at 0")
            _, n = _rng_problems(o, where, ev, saves)
            notes.update(n)
            continue
        written = [e for _, _, e in saves if e["iteration"] == ev["iteration"]]
        if not written:
            found[TRAIN_STATE_CHECK].append(f"{where}: restored iteration {ev['iteration']}, which no save of this case wrote "
                                            f"(saved: {sorted({e['iteration'] for _, _, e in saves})})")
            continue
        want, got = written[0]["train_state"], ev["train_state"]
        if {k: v for k, v in got.items() if k != FLOPS} != {k: v for k, v in want.items() if k != FLOPS}:
            found[TRAIN_STATE_CHECK].append(f"{where}: train state {got} restored, {want} saved")
        if got[FLOPS] != want[FLOPS] or ev["flops"] != want[FLOPS]:
            found[FLOPS_CHECK].append(f"{where}: FLOPs {want[FLOPS]!r} saved, {got[FLOPS]!r} restored in the train state, "
                                      f"{ev['flops']!r} returned by load_checkpoint")
        p, n = _rng_problems(o, where, ev, written)
        found[RNG_CHECK] += p
        notes.update(n)
    passed = {
        TRAIN_STATE_CHECK: "finetune: iteration and train state start at 0" if finetune
        else f"{len(loads)} rank-load(s) restored the iteration, step and consumed samples saved",
        FLOPS_CHECK: "finetune: not restored" if finetune else "the FLOP count saved is the one restored and returned, exactly",
        RNG_CHECK: "; ".join(sorted(notes)) or "python, numpy, torch and tracker RNG states restored on every rank",
    }
    out = []
    for name, problems in found.items():
        if name == FLOPS_CHECK and finetune:
            continue
        detail = "; ".join(problems[:8]) + (f"; ... {len(problems) - 8} more" if len(problems) > 8 else "")
        out.append(Check(name, "failed" if problems else "passed", detail or passed[name], tolerance=EXACT))
    return out
