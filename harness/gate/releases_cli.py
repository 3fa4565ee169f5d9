"""Print the release set of candidate SPECs (harness/gate/releases.py) without building anything.

    python3.12 harness/gate/releases_cli.py megatron-bridge==0.5.1 [SPEC ...] [--json] [--strict]

Exit 0 with the set printed; 2 when the set is unsolvable (one line per conflict) or a SPEC is
bad. Metadata of index releases is fetched with `pip download --no-deps` (no install).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a file by a bare python3.12: make `harness` importable
    sys.path.insert(0, str(ROOT))

from harness.gate import envspec, releases  # noqa: E402


def baseline_venv(root: Path, cache: Path) -> Path | None:
    """The cached baseline venv (the dependents' metadata comes from its dist-info), if built."""
    venv = cache / f"venv-{envspec.resolve(root, []).key}"
    return venv if (venv / ".complete").exists() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="releases_cli.py", description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="+", metavar="SPEC")
    parser.add_argument("--root", type=Path, default=ROOT, help="the harness checkout (its pin files)")
    parser.add_argument("--cache", type=Path, default=releases.default_cache())
    parser.add_argument("--venv", type=Path, help="baseline venv (default: the cached one for --root's pins)")
    parser.add_argument("--json", action="store_true", help="print to_dict() as JSON")
    parser.add_argument("--strict", action="store_true", help="a user pin against a declared requirement is a conflict too")
    args = parser.parse_args(argv)
    venv = args.venv or baseline_venv(args.root, args.cache)
    if venv is None:
        print("ckpt-harness: no baseline venv: dependents of moved pins are not computed", file=sys.stderr)
    try:
        rs = releases.resolve_release_set(args.specs, args.root, venv, releases.PipIndex(args.cache), strict=args.strict,
                                          cache=args.cache)
    except releases.UnsolvableReleaseSet as exc:
        print("ckpt-harness: the release set cannot be solved:", file=sys.stderr)
        for line in exc.lines:
            print(f"  {line}", file=sys.stderr)
        return 2
    except (ValueError, LookupError, OSError) as exc:
        print(f"ckpt-harness: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(rs.to_dict(), indent=2) if args.json else rs.text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
