"""inspect and check-load as Markdown (the terminal's and docs' form); --json prints the dicts."""

from __future__ import annotations

import json

from harness.inspect.part import Inspection, _rel

_SHOWN = 20


def _value(v, width: int = 160) -> str:
    text = json.dumps(v, default=str) if isinstance(v, (dict, list)) else str(v)
    return text if len(text) <= width else text[:width - 3] + "..."


def _field(k: str, v) -> list[str]:
    """One record as a bullet; a mapping as a bullet with one sub-bullet per entry."""
    if isinstance(v, dict) and v:
        return [f"- {k}:", *[f"  - {kk}: {_value(vv)}" for kk, vv in v.items() if vv not in (None, {}, [])]]
    return [f"- {k}: {_value(v)}"]


def _list(title: str, items: list) -> list[str]:
    if not items:
        return []
    lines = [f"- {title}: {len(items)}"]
    for it in items[:_SHOWN]:
        lines.append(f"  - {_value(it, 400) if not isinstance(it, dict) else ', '.join(f'{k} {v}' for k, v in it.items())}")
    if len(items) > _SHOWN:
        lines.append(f"  - ... {len(items) - _SHOWN} more (--json)")
    return lines


def inspection(ins: Inspection) -> str:
    bad = ins.all_findings
    lines = [f"# inspect {ins.root}", "", f"- layout: {ins.layout}",
             f"- verdict: {'INTEGRITY FINDINGS: ' + str(len(bad)) if bad else 'clean (no integrity finding)'}"]
    lines += [line for k, v in ins.info.items() if v for line in _field(k, v)]
    lines += _list("layout findings", ins.findings) + _list("notes", ins.notes)
    for p in ins.parts:
        lines += ["", f"## {_rel(p.path, ins.root)}: {p.format}", ""]
        lines += [line for k, v in p.info.items() if v not in (None, {}, []) for line in _field(k, v)]
        lines += _list("integrity findings", p.findings) + _list("notes", p.notes)
        if not p.findings:
            lines.append("- integrity: every file the metadata names is present and consistent")
    return "\n".join(lines) + "\n"


def check(result: dict) -> str:
    lines = [f"# check-load {result['root']} --to {result['target']}", "",
             f"- verdict: **{result['verdict']}** (exit {result['exit_code']}, {result['seconds']:.1f} s)",
             f"- layout: {result['layout']}"]
    lines += _list("layout findings", result["layout_findings"])
    for p in result["parts"]:
        lines += ["", f"## {p['path']}: {p['format']}: {p['verdict']}", ""]
        if "model" in p:
            what = "saved adapter tensors" if p["mode"] == "adapter" else "keys the load asks for"
            lines += [f"- model: {p['model']} (from {p['model_from']}); {p['ranks_built']} target rank(s) built on meta",
                      f"- {what}: {p['asked']}"]
        lines += _list("integrity findings", p["integrity"])
        lines += _list("missing (asked for, not saved)", p.get("missing") or [])
        lines += _list("mismatched (global shape or dtype)", p.get("mismatched") or [])
        lines += _list("uncovered (a rank's box not held by the saved chunks)", p.get("uncovered") or [])
        lines += _list("unexpected (saved, not asked for)", p.get("unexpected") or [])
        if p["verdict"] == "loads" and "model" in p:
            lines.append("- every key asked for is saved with its global shape and dtype, every rank's box is held by "
                         "the saved chunks" if p["mode"] == "model" else "- every adapter tensor fits its base linear")
        elif p["verdict"] == "loads" and not any(n.startswith("config.json not read") for n in p["notes"]):
            lines.append({"hf_safetensors": f"- its files are whole (headers, index, tie); the config's model splits at {result['target']}",
                          "peft_adapter": "- its files are whole (header; adapter_config.json agrees with the tensors)"}
                         .get(p["format"], "- its files are whole"))
        elif p["verdict"] == "loads":
            lines.append("- its files are whole")
        opt = p.get("optimizer")
        if opt and opt["format"] != "none":
            lines.append(f"- optimizer: {opt['format']} (saved at {opt['saved_at'] or 'an unrecorded topology'})")
            lines += _list("optimizer problems", opt["problems"])
        lines += _list("notes", p["notes"])
    return "\n".join(lines) + "\n"
