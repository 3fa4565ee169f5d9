"""What the HTML pages share (the run report, the gate's verdict.html, the sweep page): one palette
of statuses, case anchors, the counts strip and the grid picture. A grid places one small colored
link per case (case kind x topology pair, architecture x column, release x case), so a reader sees
where the red is before reading a row, and one click opens that case's details. Plain HTML and CSS:
no script, no external file."""

from __future__ import annotations

import re
from dataclasses import dataclass
from html import escape
from typing import Any, Callable, Iterable

from harness.core.families import FAMILIES

#: status -> cell color; the sweep's outcomes (xpassed, api-missing, absent) beside the run statuses
COLORS = {"passed": "#2da44e", "failed": "#cf222e", "error": "#8250df", "xfailed": "#d4a72c", "xpassed": "#fb8f44",
          "not-run": "#8c959f", "not-applicable": "#afb8c1", "api-missing": "#d0d7de", "absent": "#ffffff"}
#: the order pages list cases in: what needs a reader first
RANK = ("failed", "error", "xfailed", "not-applicable", "not-run", "passed")
#: the architecture matrix's case kinds and the targets its columns name (harness.models.arch_table)
ARCH_KINDS = ("hf-roundtrip", "peft-export")
ARCH_TARGETS = ("tp2", "pp2", "uneven", "vpp", "ep2")
_ARCH_NAMES = {"hf-roundtrip": "round trip", "peft-export": "LoRA"}
#: the tag prefix of the architecture matrix's Mamba-2 projection LoRA entries (harness.models.xfails_lora.MAMBA_LORA):
#: a layout of their own, beside the grid's cells (the family's reasons name them), never in one
MAMBA_TAG = "mamba-"
_PAIR = re.compile(r"-(tp\d+pp\d+dp\d+cp\d+\S*?)->(tp\d+pp\d+dp\d+cp\d+[a-z0-9]*)")
_UNIT_AXIS = re.compile(r"(tp|pp|dp|cp)1(?!\d)")

CSS = """
body{font:14px system-ui,sans-serif;margin:24px;color:#1f2328}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #d0d7de;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa}.num{text-align:right;font-variant-numeric:tabular-nums}
pre{background:#f6f8fa;padding:8px;overflow-x:auto;max-height:420px;font-size:12px}
details{margin:8px 0;border:1px solid #d0d7de;border-radius:6px;padding:6px 10px}summary{cursor:pointer}
.status{font-weight:600}.small{font-size:12px;color:#57606a}code{font-size:12px}
.counts{display:flex;flex-wrap:wrap;gap:8px;margin:12px 0}
.count{display:inline-block;padding:6px 12px;border-radius:6px;color:#fff;text-decoration:none;font-size:15px;background:#57606a}
.count b{font-size:22px;margin-right:6px}
.gridwrap{overflow-x:auto;margin:8px 0 16px}
table.grid{width:max-content}table.grid td,table.grid th{padding:2px;border:1px solid #eaeef2}
table.grid th.col{writing-mode:vertical-rl;transform:rotate(180deg);font-weight:400;font-size:11px;white-space:nowrap}
table.grid th.row{font-weight:400;font-size:12px;white-space:nowrap}
table.grid td{min-width:14px}.cells{display:flex;flex-wrap:wrap;max-width:144px}
a.gc{display:inline-flex;width:14px;height:14px;margin:1px;border:1px solid #6e7781;vertical-align:middle;overflow:hidden}
a.gc i{flex:1}a.gc.flag{outline:2px solid #000;outline-offset:0}
.legend span{display:inline-block;width:12px;height:12px;border:1px solid #6e7781;vertical-align:middle;margin:0 4px 0 12px}
"""
CSS += "".join(f".s-{s}{{background:{c}}}" for s, c in COLORS.items())


def status_class(status: str) -> str:
    """The CSS class of a status's color (`s-passed`); unknown statuses get no color."""
    return "s-" + re.sub(r"[^a-z0-9-]", "-", status.lower())


def anchor(case_id: str) -> str:
    """The element id of a case's details on every page (grid cells and rows link to it)."""
    return "c" + "".join(ch if ch.isalnum() else "-" for ch in case_id)


def kind_of(r: dict[str, Any]) -> str:
    """A record's case kind: `reshard-weights[...]` -> `reshard-weights`."""
    return r.get("case") or r["id"].split("[", 1)[0]


def short_topology(topo: str) -> str:
    """`tp2pp1dp1cp1` -> `tp2`, `tp1pp2dp1cp1vpp2` -> `pp2vpp2`, `tp1pp1dp1cp1` -> `1`: the axes that are not 1."""
    return _UNIT_AXIS.sub("", topo) or "1"


def pair_of(r: dict[str, Any]) -> str:
    """`S→D` of a record (short topologies), from its source/target or else its id; `-` when it has none."""
    src, dst = r.get("source"), r.get("target")
    if not (src and dst) and (m := _PAIR.search(r["id"])):
        src, dst = m[1], m[2]
    return f"{short_topology(src)}→{short_topology(dst)}" if src and dst else "-"


def arch_target(case_id: str) -> str:
    """Which column of the architecture matrix a case fills: tp2, pp2, uneven (first_stage_layers), vpp or ep2."""
    m = _PAIR.search(case_id)
    tgt = m[2] if m else "?"
    if "first_stage_layers=" in case_id:
        return "uneven"
    return "ep2" if "ep2" in tgt else "vpp" if "vpp" in tgt else "pp2" if "pp2" in tgt else "tp2"


def arch_column(r: dict[str, Any]) -> str | None:
    """The architecture grid's column of a record (`round trip tp2`, `LoRA canonical`), None outside it:
    the architecture matrix's cases, hf-roundtrip and peft-export of an `hf-*` zoo model from tp1."""
    kind = kind_of(r)
    if (kind not in ARCH_KINDS or not str(r.get("model") or _model_of(r["id"])).startswith("hf-")
            or not pair_of(r).startswith("1→")):
        return None
    if kind == "peft-export" and "-canonical_lora]" in r["id"]:
        return "LoRA canonical"
    if arch_extra(r["id"]):
        return None
    return f"{_ARCH_NAMES[kind]} {arch_target(r['id'])}"


def arch_extra(case_id: str) -> bool:
    """Whether an architecture-matrix case is one of the entries beside the grid (MAMBA_TAG)."""
    return re.search(rf"-{MAMBA_TAG}[a-z-]+\]$", case_id) is not None


def arch_columns() -> list[str]:
    """The architecture grid's columns in the order of docs/architectures.md's table."""
    return [f"{_ARCH_NAMES[k]} {t}" for k in ARCH_KINDS for t in ARCH_TARGETS] + ["LoRA canonical"]


def _model_of(case_id: str) -> str:
    m = re.search(r"\[[^-\]]+-(hf-[A-Za-z0-9_.]+)-tp\d", case_id)
    return m[1] if m else ""


def architecture_label(r: dict[str, Any]) -> str:
    """`LlamaForCausalLM (hf-llama)`: the HF architecture a zoo model stands for (harness.core.families)."""
    model = str(r.get("model") or _model_of(r["id"]))
    arch = next((f.architecture for f in FAMILIES if f.zoo_name == model), None)
    return f"{arch} ({model})" if arch else model


@dataclass(frozen=True)
class Cell:
    """One case in a grid: its statuses (one per side: two halves on the verdict page), a tooltip,
    and `flag` (a failing finding or a change there: a black outline)."""

    case_id: str
    statuses: tuple[str, ...]
    title: str
    flag: bool = False
    href: str | None = None

    def html(self) -> str:
        one = len(self.statuses) == 1  # one status colors the cell, several split it in halves
        halves = "" if one else "".join(f'<i class="{status_class(s)}"></i>' for s in self.statuses)
        cls = "gc" + (f" {status_class(self.statuses[0])}" if one else "") + (" flag" if self.flag else "")
        return f'<a class="{cls}" href="#{escape(self.href or anchor(self.case_id))}" title="{escape(self.title)}">{halves}</a>'


def grid(grid_id: str, corner: str, rows: list[str], cols: list[str], cells: dict[tuple[str, str], list[Cell]]) -> str:
    """A table of rows x cols, each intersection the cells of its cases (empty where none)."""
    head = f'<tr><th class="row">{escape(corner)}</th>' + "".join(f'<th class="col">{escape(c)}</th>' for c in cols) + "</tr>"
    body = "".join(f'<tr><th class="row">{escape(r)}</th>'
                   + "".join(_td(cells.get((r, col), [])) for col in cols) + "</tr>"
                   for r in rows)
    return f'<div class="gridwrap"><table class="grid" id="{escape(grid_id)}">{head}{body}</table></div>'


def _td(cells: list[Cell]) -> str:
    return f'<td><div class="cells">{"".join(c.html() for c in cells)}</div></td>' if cells else "<td></td>"


def _topology_key(pair: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", pair)]


def kind_pair_grid(records: Iterable[dict[str, Any]], cell_of: Callable[[dict[str, Any]], Cell], grid_id: str = "grid-kind") -> str:
    """Case kind (rows, in first-seen order) x topology pair S→D (columns): one cell per record."""
    cells: dict[tuple[str, str], list[Cell]] = {}
    rows: list[str] = []
    for r in records:
        kind = kind_of(r)
        rows += [kind] if kind not in rows else []
        cells.setdefault((kind, pair_of(r)), []).append(cell_of(r))
    cols = sorted({c for _, c in cells}, key=_topology_key)
    return grid(grid_id, "case kind \\ S→D", rows, cols, cells) if rows else ""


def arch_grid(records: Iterable[dict[str, Any]], cell_of: Callable[[dict[str, Any]], Cell], grid_id: str = "grid-arch") -> str:
    """Architecture (rows) x column (case kind and target, as docs/architectures.md): one cell per
    hf-roundtrip / peft-export case of an hf-* model; '' when the run has none."""
    cells: dict[tuple[str, str], list[Cell]] = {}
    rows: list[str] = []
    for r in records:
        if (col := arch_column(r)) is None:
            continue
        label = architecture_label(r)
        rows += [label] if label not in rows else []
        cells.setdefault((label, col), []).append(cell_of(r))
    cols = [c for c in arch_columns() if any(k[1] == c for k in cells)]
    return grid(grid_id, "architecture \\ column", rows, cols, cells) if rows else ""


def counts(items: Iterable[tuple[str, int, str, str | None]]) -> str:
    """The counts strip: (label, n, status for the color, link) per box; a box with n == 0 is left out.
    Each box carries its label and number (data-key, data-n) for the pages' browser tests."""
    boxes = []
    for label, n, status, href in items:
        if not n:
            continue
        inner = f"<b>{n}</b>{escape(label)}"
        attrs = f'class="count {status_class(status)}" data-key="{escape(label)}" data-n="{n}"'
        boxes.append(f'<a {attrs} href="{escape(href)}">{inner}</a>' if href else f"<span {attrs}>{inner}</span>")
    return f'<div class="counts" id="counts">{"".join(boxes)}</div>'


def legend(statuses: Iterable[str], extra: str = "") -> str:
    """One line naming each color (and what a black outline means on this page)."""
    return ('<p class="legend small">' + "".join(f'<span class="{status_class(s)}"></span>{escape(s)}' for s in statuses)
            + (f" &nbsp; {escape(extra)}" if extra else "") + "</p>")


def page(title: str, body: str, css: str = "") -> str:
    """A whole self-contained page."""
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title><style>{CSS}{css}</style>"
            f"</head><body>{body}</body></html>")
