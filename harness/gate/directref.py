"""PEP 508 direct references as a requirements file carries them, mapped to a local path.

Stdlib only and no harness imports: envspec.py (run as a file by scripts/ensure-env with a bare
python3.12) and releases.py both read SPECs through this module.

    NAME @ file:///abs/path/Megatron-Bridge               a local source tree
    NAME @ file:///abs/path/megatron_bridge-0.6.2-py3-none-any.whl   a local wheel file
    NAME @ file:rel/path  NAME @ file:./rel  NAME @ file:/abs   as pip (>= 24) takes them: relative to the cwd
    NAME @ https://host/.../megatron_bridge-0.6.2-py3-none-any.whl[#sha256=HEX]   a wheel, downloaded once

A file: URL may name `localhost` as its host (RFC 8089) and no other; its path is percent-decoded.
A wheel URL is downloaded once into <cache>/wheels/<sha256(URL)[:16]>/ with its sha256 recorded
next to it (source.json); a `#sha256=` (or any of pip's hash names) in the URL is checked against
the download and against the cached copy on every later use.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
#: NAME @ URL where the URL is a file: or http(s): one (a git+ URL is envspec's VCS form).
DIRECT = re.compile(rf"^({_NAME})\s*@\s*((?:file:|https?://)\S+)$", re.IGNORECASE)
STARTS = re.compile(rf"^{_NAME}\s*@\s*(?:file:|https?://)", re.IGNORECASE)  # DIRECT's start (a URL with a space fails DIRECT)
HASHES = ("sha1", "sha224", "sha256", "sha384", "sha512", "md5")  # what pip takes in a URL fragment
WHEELS = "wheels"  # under the cache dir
TIMEOUT_S = 60.0


def match(spec: str) -> tuple[str, str] | None:
    """(NAME as given, URL) of a `NAME @ file:...` / `NAME @ http(s)://...` SPEC, else None."""
    m = DIRECT.match(spec.strip())
    return (m[1], m[2]) if m else None


def is_file_url(url: str) -> bool:
    return url[:5].lower() == "file:"


def file_path(spec: str, url: str, cwd: Path) -> Path:
    """The local path a file: URL names (percent-decoded, made absolute against `cwd`, resolved)."""
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"{spec!r}: a file: URL names this machine's files (file:///PATH), not host {parts.netloc!r}")
    if not parts.path:
        raise ValueError(f"{spec!r}: a file: URL without a path")
    p = Path(urllib.parse.unquote(parts.path)).expanduser()
    return (p if p.is_absolute() else cwd / p).resolve()


def _hashes(spec: str, url: str) -> dict[str, str]:
    """The hashes a URL's fragment asks for ({'sha256': hex}); `egg=` and the like are ignored."""
    frag = urllib.parse.urlsplit(url).fragment
    out: dict[str, str] = {}
    for item in filter(None, frag.split("&")):
        key, _, value = item.partition("=")
        if key.lower() in HASHES:
            if not re.fullmatch(r"[0-9a-fA-F]+", value):
                raise ValueError(f"{spec!r}: #{key}= is not a hex digest: {value!r}")
            out[key.lower()] = value.lower()
    return out


def _digests(p: Path, algos: set[str]) -> dict[str, str]:
    hs = {a: hashlib.new(a) for a in algos | {"sha256"}}
    with p.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            for h in hs.values():
                h.update(chunk)
    return {a: h.hexdigest() for a, h in hs.items()}


def _check(spec: str, what: str, got: dict[str, str], want: dict[str, str]) -> None:
    for algo, hexdigest in sorted(want.items()):
        if got[algo] != hexdigest:
            raise ValueError(f"{spec!r}: {what} has {algo} {got[algo]}, the URL's #{algo}= says {hexdigest}")


def wheel_filename(spec: str, url: str) -> str:
    """The last path segment of an http(s) URL, percent-decoded: a .whl file name, nothing else."""
    name = urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])
    if not name.endswith(".whl") or name.startswith(".") or any(c in name for c in "/\\\0"):
        raise ValueError(f"{spec!r}: an http(s) URL must name a wheel (…/NAME-VERSION-PY-ABI-PLATFORM.whl); "
                         "a source archive would have to be built: give its unpacked tree instead")
    return name


def fetch_wheel(spec: str, url: str, cache: Path) -> Path:
    """The wheel an http(s) URL names, downloaded once into <cache>/wheels/ (ValueError when the
    download fails or a hash in the URL does not match)."""
    name = wheel_filename(spec, url)
    want = _hashes(spec, url)
    bare = urllib.parse.urlunsplit(urllib.parse.urlsplit(url)._replace(fragment=""))
    d = cache / WHEELS / hashlib.sha256(bare.encode()).hexdigest()[:16]
    dest, record = d / name, d / "source.json"
    if dest.is_file() and record.is_file():
        recorded = json.loads(record.read_text()).get("sha256")
        got = _digests(dest, set(want))
        if got["sha256"] != recorded:
            raise ValueError(f"{spec!r}: the cached copy {dest} has sha256 {got['sha256']}, {recorded} when downloaded: "
                             f"remove {d} to download it again")
        _check(spec, f"the cached copy {dest}", got, want)
        return dest
    d.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".download-", suffix=".whl")
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                with urllib.request.urlopen(bare, timeout=TIMEOUT_S) as r:  # noqa: S310 (http/https only: DIRECT)
                    for chunk in iter(lambda: r.read(1 << 20), b""):
                        out.write(chunk)
            except (urllib.error.URLError, OSError, ValueError) as exc:
                why = exc if isinstance(exc, urllib.error.HTTPError) else getattr(exc, "reason", None) or exc
                raise ValueError(f"{spec!r}: could not download {bare}: {why}") from None
        got = _digests(Path(tmp), set(want))
        _check(spec, f"the download of {bare}", got, want)
        os.replace(tmp, dest)
        record.write_text(json.dumps({"url": bare, "file": name, "sha256": got["sha256"]}, indent=2) + "\n")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest
