"""One report from the results of a matrix's shards (`ckpt-harness merge`, issue 20 item 3): the parts'
results.json documents joined, refused loudly when a part is incomplete, a case appears twice, a
part ran another matrix, or (given the ids the matrix selects) a case is missing or foreign. The
merged report is every file `run` writes for one run (results.json, results.md, junit.xml,
report.html), rendered in memory before any is written: a refused merge leaves nothing behind."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from harness.core.result import STATUSES, CaseResult

#: What a merge writes into its --out dir, the names the CI workflows give `run --junit/--html`.
FILES = ("results.json", "results.md", "junit.xml", "report.html")


class MergeError(ValueError):
    """A set of parts that does not make one whole run (the message names the part and the case)."""


def read_part(path: Path) -> dict:
    path = Path(path)
    file = path / "results.json" if path.is_dir() else path
    try:
        doc = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise MergeError(f"{file}: not a readable results.json ({type(exc).__name__}: {exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
        raise MergeError(f"{file}: no 'results' list: not a results.json")
    doc["_path"] = str(file)
    return doc


def merge(parts: Sequence[dict], expected_ids: Sequence[str] | None = None) -> dict:
    """The merged document: every part's results in the order of `expected_ids` when given (else
    part by part), the summary recounted, wall_s the longest part's (shards run side by side)."""
    if not parts:
        raise MergeError("no part to merge")
    matrices = {p.get("matrix") for p in parts}
    if len(matrices) > 1:
        raise MergeError(f"the parts ran different matrices: {sorted(map(str, matrices))}")
    where: dict[str, str] = {}
    results: dict[str, dict] = {}
    for p in parts:
        if not p.get("complete", False):
            raise MergeError(f"{p['_path']}: an incomplete run (complete: false): a shard died before its last case")
        for r in p["results"]:
            _check_record(r, p["_path"])
            if r["id"] in where:
                raise MergeError(f"case {r['id']} is in two parts: {where[r['id']]} and {p['_path']}")
            where[r["id"]], results[r["id"]] = p["_path"], r
    order = list(results)
    if expected_ids is not None:
        missing = [i for i in expected_ids if i not in results]
        foreign = [i for i in results if i not in set(expected_ids)]
        if missing or foreign:
            raise MergeError(f"{len(missing)} case(s) of the matrix in no part (e.g. {missing[:3]}); "
                             f"{len(foreign)} case(s) not in the matrix (e.g. {foreign[:3]})")
        order = list(expected_ids)
    merged = [results[i] for i in order]
    first = parts[0]
    return {
        "matrix": first.get("matrix"), "finished": max(str(p.get("finished", "")) for p in parts), "complete": True,
        "wall_s": max(float(p.get("wall_s", 0.0)) for p in parts),
        "platform": first.get("platform"), "versions": first.get("versions"), "environment": first.get("environment"),
        "summary": {s: sum(r["status"] == s for r in merged) for s in STATUSES},
        "results": merged, "merged_from": [p["_path"] for p in parts],
    }


def _check_record(r: object, path: str) -> None:
    """A record the reports can read back (CaseResult.from_dict), else MergeError naming part and case."""
    if not isinstance(r, dict) or not isinstance(r.get("id"), str):
        raise MergeError(f"{path}: a result without a case id: {str(r)[:120]}")
    try:
        CaseResult.from_dict(r)
    except (TypeError, ValueError, AttributeError) as exc:
        raise MergeError(f"{path}: case {r['id']} is not a case result ({type(exc).__name__}: {exc})") from None


def render(doc: dict, title: str) -> dict[str, bytes]:
    """FILES for a merged document: the JUnit holds one testcase per case, as `run --junit` writes it."""
    from harness.report import html, results

    cases = [CaseResult.from_dict(r) for r in doc["results"]]
    return {
        "results.json": json.dumps(doc, indent=2, default=str).encode(),
        "results.md": results.markdown(doc).encode(),
        "junit.xml": results.junit_xml(cases, title, float(doc.get("wall_s") or 0.0)),
        "report.html": html.render(doc, title).encode(),
    }


def write(files: dict[str, bytes], out: Path) -> Path:
    """`files` into `out` (created)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (out / name).write_bytes(data)
    return out
