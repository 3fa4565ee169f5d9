"""The architecture x path x status table of docs/architectures.md, from a run's results.json of
matrices/architectures.yaml: one row per registered architecture (harness.core.families), one cell
per case kind (hf-roundtrip: weights, logits, the dist checkpoint at S loaded at D; peft-export:
LoRA through PEFT) and pair, each the case's status and seconds, plus what the cell cannot say by
itself (the strict xfail's reason, the not-run's missing piece, a failure's first failed check).

    python -m harness.models.arch_table REPORT/results.json > table.md

Written from results, never by hand, so the table says what a run measured."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from harness.core.families import FAMILIES, Family
from harness.report.grid import ARCH_KINDS as KINDS
from harness.report.grid import ARCH_TARGETS as TARGETS
from harness.report.grid import MAMBA_TAG, arch_extra
from harness.report.grid import arch_target as _target
from harness.models.xfails_lora import LANGUAGE_ONLY_LORA, LANGUAGE_ONLY_WHY, LORA_NOT_GENERATED

#: a remote-code family's LoRA cells: PEFT wraps a transformers model, and none exists for it (harness.models.remote)
NO_HF_CLASS = "n/a (no HF class)"

SHORT = {"passed": "pass", "failed": "FAIL", "error": "ERROR", "xfailed": "xfail", "xpassed": "XPASS",
         "not-run": "not-run", "not-applicable": "n/a"}


KIND_TARGETS = {"hf-roundtrip": TARGETS, "peft-export": TARGETS}
#: the CanonicalLoRA peft-export cell (one pair per family: its target named in the cell)
CANONICAL = "peft-export canonical"
#: the Mamba-2 projections' LoRA cases (beside the grid, keyed by case id: named in the family's reasons)
MAMBA = "peft-export mamba"


def _absent(f: Family) -> str:
    """A cell with no case: "deferred" (a VL/omni/audio family), "not built" (a text family without a case), else "-"."""
    return {"vl": "deferred", "unbuilt": "not built"}.get(f.path, "-")


def _why(r: dict[str, Any]) -> str:
    if r.get("status") == "xfailed":
        return str(r.get("xfail_reason") or "").split(":")[0][:90]
    if r.get("status") == "not-run":
        return str(r.get("not_run_reason") or "")[:90]
    bad = [c for c in r.get("checks") or [] if c.get("status") not in ("passed", "xfailed")]
    if bad:
        return f"{bad[0].get('name')}: {str(bad[0].get('detail') or '')[:80]}"
    err = (r.get("error") or "").strip().splitlines()
    return err[-1][:90] if err else ""


def _cell(r: dict[str, Any]) -> str:
    secs = sum((r.get("phases") or {}).values())
    return f"{SHORT.get(r['status'], r['status'])} {secs:.1f}" if r["status"] != "not-run" else "not-run"


def cells(doc: dict[str, Any]) -> dict[tuple[str, str, str], dict[str, Any]]:
    """(zoo model, case kind, target "tp2"/"pp2"/"uneven"/"vpp"/"ep2") -> the case record; a Mamba projection
    LoRA case (zoo model, MAMBA, its id)."""
    out = {}
    for r in doc.get("results") or []:
        if r.get("case") in KINDS:
            if arch_extra(r["id"]):
                out[(r.get("model"), MAMBA, r["id"])] = r
                continue
            kind = CANONICAL if r["case"] == "peft-export" and "-canonical_lora]" in r["id"] else r["case"]
            out[(r.get("model"), kind, _target(r["id"]))] = r
    return out


def _mamba_label(case_id: str) -> str:
    """"in-proj tp1->tp2" from a Mamba projection LoRA case id."""
    m = re.search(rf"-tp(\d+)pp(\d+)\S*?->tp(\d+)pp(\d+)\S*?-lora-{MAMBA_TAG}(\S+)\]$", case_id)
    if not m:
        return case_id
    side = lambda tp, pp: f"tp{tp}" if pp == "1" else f"pp{pp}"  # noqa: E731
    return f"{m[5]} {side(m[1], m[2])}->{side(m[3], m[4])}"


def rows(doc: dict[str, Any], families: tuple[Family, ...] = FAMILIES) -> list[list[str]]:
    """One row per family: architecture, zoo name, a cell per case kind and target, reasons. Raises on a results.json
    with no case of the architecture matrix (an empty table would read as "nothing to say")."""
    got = cells(doc)
    if not got:
        raise ValueError("no hf-roundtrip or peft-export case in this results.json")
    out = []
    for f in families:
        line, whys = [f.architecture, f.zoo_name], []
        for kind in KINDS:
            for tgt in KIND_TARGETS[kind]:
                r = got.get((f.zoo_name, kind, tgt)) if f.has_cases else None
                if r is None:
                    has_pair = (f.zoo_name, "hf-roundtrip", tgt) in got
                    line.append("not generated" if kind == "peft-export" and f.name in LORA_NOT_GENERATED and has_pair
                                else NO_HF_CLASS if kind == "peft-export" and f.path == "remote" and has_pair
                                else _absent(f))
                    continue
                line.append(_cell(r))
                if r["status"] != "passed" and (w := _why(r)) and w not in whys:
                    whys.append(w)
        canon = [got[k] for k in got if k[0] == f.zoo_name and k[1] == CANONICAL and f.has_cases]
        line.append(f"{_cell(canon[0])} ({_target(canon[0]['id'])})" if canon else "not generated" if f.name in LORA_NOT_GENERATED
                    else NO_HF_CLASS if f.path == "remote" else _absent(f))
        if canon and canon[0]["status"] != "passed" and (w := _why(canon[0])) and w not in whys:
            whys.append(w)
        mamba = [got[k] for k in sorted(k for k in got if k[0] == f.zoo_name and k[1] == MAMBA)]
        if mamba:
            whys.append("Mamba in_proj/out_proj LoRA: " + ", ".join(f"{_mamba_label(r['id'])} {_cell(r)}" for r in mamba))
        for r in mamba:  # one by one: two cases of one finding give its reason once
            if r["status"] != "passed" and (w := _why(r)) and w not in whys:
                whys.append(w)
        if f.name in LORA_NOT_GENERATED:
            whys.append(f"LoRA not generated: {LORA_NOT_GENERATED[f.name]}")
        if f.name in LANGUAGE_ONLY_LORA:
            whys.append(f"LoRA on the language path only: {LANGUAGE_ONLY_WHY}")
        if f.path == "remote":
            whys.append("hub remote code: round trips without logits, no LoRA case (no transformers class for PEFT to wrap)")
        if not f.has_cases:
            whys.append(f.note)
        out.append(line + ["; ".join(whys)])
    return out


def header() -> list[str]:
    """The table's column names, one per cell of a `rows` row."""
    names = {"hf-roundtrip": "round trip", "peft-export": "LoRA"}
    shown = {"vpp": "pp2vpp2", "uneven": "pp2 1+3"}
    return ["architecture", "zoo", *(f"{names[k]} tp1->{shown.get(t, t)}" for k in KINDS for t in KIND_TARGETS[k]),
            "CanonicalLoRA", "reason / finding"]


def markdown(doc: dict[str, Any]) -> str:
    head = header()
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows(doc)]
    return summary(doc) + "\n\n" + "\n".join(lines) + "\n"


def summary(doc: dict[str, Any], families: tuple[Family, ...] = FAMILIES) -> str:
    """How many architectures: every case passed; every case a real result (passed or its strict
    named xfail); not-run (each names its missing piece); red (a failure, error or XPASS)."""
    got = cells(doc)
    green, real, holes, not_run, red, lora_gap = [], [], [], [], [], []
    unbuilt = [f.name for f in families if not f.has_cases]
    for f in families:
        rs = [got[k] for k in got if k[0] == f.zoo_name]
        if not rs or f.name in unbuilt:  # a family without cases in today's matrix (deferred, not built)
            continue
        st = {r["status"] for r in rs}
        if st == {"passed"}:
            green.append(f.name)
        if st <= {"passed", "xfailed"} and f.name in LORA_NOT_GENERATED:
            lora_gap.append(f.name)
        elif st <= {"passed", "xfailed"}:
            real.append(f.name)
        elif st == {"not-run"}:
            not_run.append(f.name)
        elif st <= {"passed", "xfailed", "not-run"}:
            holes.append(f.name)
        else:
            red.append(f.name)
    remote = [n for n in real if n in {f.name for f in families if f.path == "remote"}]
    return (f"{len(real)} architectures with real results on every case ({len(green)} of them every case passed"
            + (f"; {len(remote)} of them hub remote code, round trips without logits: {', '.join(remote)}" if remote else "") + "), "
            + (f"{len(lora_gap)} with real results on every round trip and no LoRA case generated yet ({', '.join(lora_gap)}: "
               "the harness's adapter mapping lacks their layers), " if lora_gap else "")
            + f"{len(holes)} with real results and a not-run case" + (f" ({', '.join(holes)})" if holes else "")
            + f", {len(not_run)} not-run, {len(red)} with a red case" + (f" ({', '.join(red)})" if red else "")
            + (f", {len(unbuilt)} without a case (deferred VL/omni/audio or not built: the table's last column says why)" if unbuilt else "")
            + ".")


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1:
        print("usage: python -m harness.models.arch_table RESULTS.json", file=sys.stderr)
        return 2
    path = Path(args[0])
    path = path / "results.json" if path.is_dir() else path
    sys.stdout.write(markdown(json.loads(path.read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
