"""The --releases grammar of `ckpt-harness sweep`: one list of SPECs per release set, and its label."""

from __future__ import annotations

import re

# ----------------------------------------------------------------------------- the --releases grammar

_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_VERSION_ITEM = re.compile(rf"^({_NAME})\s*==\s*(\S+)$")
_BARE_VERSION = re.compile(r"^[0-9][A-Za-z0-9.+!_-]*$")
# A "+" starts a new item of a set only where a SPEC starts after it: NAME==, NAME @, or a path.
# So "git+https://..." and a local version ("0.5.0+cu12") never split.
_ITEM_START = re.compile(rf"\+(?=\s*(?:{_NAME}\s*(?:==|@)|/|\./|\.\./|~))")


class SweepSpecError(ValueError):
    """A --releases (or --from-results) argument that does not parse; the message names the token."""



def _is_path(item: str) -> bool:
    return item.endswith(".whl") or item.startswith(("/", "./", "../", "~"))


def _check_item(item: str, token: str) -> str:
    """One SPEC of a set, checked for syntax only (a version or VCS SPEC through envspec.parse_spec,
    which is pure for those kinds; a path or a `NAME @ file:/http(s):` direct reference is checked,
    and a wheel URL downloaded into the sweep's cache, when the driver builds it)."""
    from harness.gate import directref, envspec

    if _is_path(item) or directref.match(item):
        return item

    try:
        envspec.parse_spec(item)
    except ValueError as exc:
        raise SweepSpecError(f"--releases: {exc}" if repr(token) in str(exc) else f"--releases: {token!r}: {exc}") from None
    return item


def parse_releases(arg: str) -> list[list[str]]:
    """The --releases value -> one list of SPECs per release set, in the order given (oldest first).

    Grammar::

        RELEASES := SET ("," SET)*          sets are separated by commas
        SET      := ITEM ("+" ITEM)*        one release set may pin several packages at once
                  | VERSION                 continues the previous set's package
        ITEM     := a SPEC of `gate --candidate` (harness/gate/envspec.py): NAME==VERSION,
                    NAME @ git+URL@COMMIT, a source tree (/..., ./..., ../..., ~...), a .whl file,
                    NAME @ file:///PATH or NAME @ https://....whl

    `megatron-bridge==0.4.2,0.5.0,0.5.1` is three sets; `megatron-bridge==0.5.1+megatron-core==0.18.2`
    is one set of two packages. A bare VERSION (it starts with a digit) continues the previous set
    only when that set is exactly one NAME==VERSION item (after a multi-package set it would be
    ambiguous). A "+" separates items only where a SPEC starts after it, so `git+https://...` and a
    local version `0.5.0+cu12` stay whole. Empty sets, a package twice in one set, and the same set
    twice raise SweepSpecError naming the token.
    """
    if not arg or not arg.strip():
        raise SweepSpecError("--releases: empty; give SPEC,SPEC,... (e.g. megatron-bridge==0.4.2,0.5.0)")
    sets: list[list[str]] = []
    seen: dict[tuple[str, ...], str] = {}
    for pos, raw in enumerate(arg.split(","), 1):
        token = raw.strip()
        if not token:
            raise SweepSpecError(f"--releases: release set #{pos} is empty (a stray or doubled comma in {arg!r})")
        if _BARE_VERSION.match(token) and "==" not in token:
            prev = sets[-1] if sets else None
            m = _VERSION_ITEM.match(prev[0]) if prev and len(prev) == 1 else None
            if m is None:
                why = ("it comes first" if not prev else
                       f"the previous set {'+'.join(prev)!r} is not a single NAME==VERSION")
                raise SweepSpecError(f"--releases: bare version {token!r} (set #{pos}) continues no package: {why}; "
                                     "write NAME==VERSION")
            items = [_check_item(f"{m[1]}=={token}", token)]
        else:
            items = []
            for part in _ITEM_START.split(token):
                item = part.strip()
                if not item:
                    raise SweepSpecError(f"--releases: {token!r} (set #{pos}) has an empty item around '+'")
                if _BARE_VERSION.match(item) and "==" not in item:
                    raise SweepSpecError(f"--releases: {item!r} in {token!r}: inside a '+' set every item names its package")
                items.append(_check_item(item, item))
            names = [_package(i) for i in items]
            dup = next((n for n in names if n and names.count(n) > 1), None)
            if dup:
                raise SweepSpecError(f"--releases: {token!r} (set #{pos}) pins {dup} twice")
        key = tuple(sorted(items))
        if key in seen:
            raise SweepSpecError(f"--releases: {'+'.join(items)!r} (set #{pos}) repeats set {seen[key]}")
        seen[key] = f"#{pos}"
        sets.append(items)
    return sets


def _package(item: str) -> str | None:
    m = re.match(rf"^({_NAME})\s*(?:==|@)", item)
    return re.sub(r"[-_.]+", "-", m[1]).lower() if m and not _is_path(item) else None


def release_label(specs: list[str]) -> str:
    """A release set's name in the table: its SPECs joined with '+' (what --releases would say)."""
    return "+".join(s.strip() for s in specs) or "the pins"
