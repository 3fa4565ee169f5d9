"""The release sweep: one matrix over a list of release sets, read as one version x case table.

    ckpt-harness sweep --releases megatron-bridge==0.4.2,0.5.0,0.5.1 [MATRIX] [-k WORDS] [--cross] --out DIR
    ckpt-harness sweep --from-results 0.4.2=runs/a 0.5.0=runs/b/results.json --out DIR

The gate answers "is this one bump safe"; a sweep answers "in which release did this defect arrive,
and in which did it leave". Each release set's run is a results.json (harness/report/results.py).
The package: spec.py (the --releases grammar), table.py (outcomes, the table over the runs
`sweep_table`, the cross-version grid over golden-corpus checks `cross_table`), render.py
(DIR/sweep.{md,html,json}, `write`), cli.py (`add_parser`, `run_cli`) are pure and tested on
hand-made docs; driver.py builds each release's environment and runs the matrix there.

Outcomes. A case's outcome in a release is its status, with two refinements the table needs:
`failed` whose error says XPASS(strict) is `xpassed` (the named defect no longer reproduces), and
`error` whose error has an "API not available in ..." line is `api-missing` (the harness could not
drive that release). `api-missing`, `not-run`, `not-applicable` and `absent` (no record of the case
in that run) are coverage holes: the release neither kept nor changed the case's outcome, so a change
is measured between the covered releases on either side of a hole (and says so).
"""

from harness.gate.sweep.cli import CrossDriver, Driver, add_parser, run_cli
from harness.gate.sweep.render import (
           load_results,
           markdown,
           render_html,
           to_json,
           write,
)
from harness.gate.sweep.spec import SweepSpecError, parse_releases, release_label
from harness.gate.sweep.table import (
           BAD,
           GLYPHS,
           GREEN,
           HOLES,
           MEANING,
           NOT_WRITTEN,
           CaseRow,
           Change,
           CheckChange,
           CrossCell,
           CrossTable,
           Release,
           SweepInputError,
           SweepTable,
           cross_pairs,
           cross_table,
           outcome,
           sweep_table,
)

__all__ = ["SweepSpecError", "SweepInputError", "parse_releases", "sweep_table", "cross_table", "cross_pairs",
           "SweepTable", "CrossTable", "write", "markdown", "render_html", "to_json", "add_parser", "run_cli", "load_results",
           "release_label", "outcome", "Driver", "CrossDriver", "GLYPHS", "MEANING", "HOLES", "GREEN", "BAD", "NOT_WRITTEN",
           "CaseRow", "Change", "CheckChange", "CrossCell", "Release"]
