"""How a venv gets its packages: uv (default) from one hard-linked package store, or pip.

Stdlib only, like envspec (scripts/ensure-env runs it with a bare python3.12 before any venv
exists). Every venv is a full torch + megatron stack (~6.6 GB). uv installs from one store under
the cache (`uv-cache`) by hard links, so an env that differs from another by three packages costs
about those three packages on disk, and a sweep of ten releases fits where ten pip envs do not.
CKPT_HARNESS_INSTALLER=pip builds the old way; a CKPT_HARNESS_PIP stub (tests) always means pip.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

TAIL = 30
TOOLS = "requirements-tools.txt"  # the pinned uv that builds the envs
UV_JSON = ".ckpt-uv.json"  # inside a uv-built venv: which uv binary, store and base python built it
_LINE_NAME = re.compile(r"^\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)")


#: File descriptors of the env-build locks this process holds (envspec.ensure). Every install child
#: inherits them: flock(2) belongs to the open file, so a gate killed mid-build leaves its uv child
#: holding the lock until that child exits too, and the next build waits for it instead of clearing
#: the venv under a writer (seen: "directory already exists" from the next `uv venv`).
HELD_LOCKS: list[int] = []


class EnvBuildError(Exception):
    """A candidate environment could not be installed or imported; the message is for the user."""


def tail(text: str, n: int = TAIL) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


def pip_command(venv: Path) -> list[str]:
    """Every pip call goes through here; CKPT_HARNESS_PIP (a command line) replaces it, so tests can
    point it at a stub instead of spending minutes on real installs."""
    if stub := os.environ.get("CKPT_HARNESS_PIP"):
        return shlex.split(stub)
    return [str(venv / "bin" / "python"), "-m", "pip"]


def installer() -> str:
    if os.environ.get("CKPT_HARNESS_PIP"):
        return "pip"
    choice = os.environ.get("CKPT_HARNESS_INSTALLER", "uv")
    if choice not in ("uv", "pip"):
        raise ValueError(f"CKPT_HARNESS_INSTALLER must be uv or pip, got {choice!r}")
    return choice


def _pip_config(python: str) -> dict[str, str]:
    """pip's own configuration (files and PIP_* variables), as `pip config list` prints it: the
    index a uv install must use is the one pip uses here, never a host written into this file."""
    r = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False,
                       stdin=subprocess.DEVNULL)
    out: dict[str, str] = {}
    for line in r.stdout.splitlines() if r.returncode == 0 else []:
        key, sep, value = line.partition("=")
        if not sep:
            continue
        scope, _, name = key.rpartition(".")
        if scope.endswith(("install", "download")) or scope in ("global", ":env:", ""):
            value = value.strip().strip("'\"")
            # later scopes (PIP_* variables, listed last) win, as in pip
            out[name] = value
    return out


def uv_index_args(config: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """uv arguments and environment for pip's index configuration. pip merges every index and takes
    the best version; uv's equivalent is `--index-strategy unsafe-best-match`."""
    args = ["--index-strategy", "unsafe-best-match"]
    if config.get("index-url"):
        args += ["--index-url", config["index-url"]]
    for url in config.get("extra-index-url", "").split():
        args += ["--extra-index-url", url]
    for link in config.get("find-links", "").split():
        args += ["--find-links", link]
    if config.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        args.append("--no-index")
    env = {"SSL_CERT_FILE": config["cert"]} if config.get("cert") else {}
    return args, env


def uv_binary(root: Path, cache: Path, python: str, log: Path) -> Path:
    """The pinned uv (requirements-tools.txt), installed once into the cache by pip itself
    (`pip install --target`, pip's own index config); CKPT_HARNESS_UV names another binary."""
    if named := os.environ.get("CKPT_HARNESS_UV"):
        return Path(named)
    pin = next((ln.strip() for ln in (root / TOOLS).read_text().splitlines() if _LINE_NAME.match(ln)), "uv")
    target = cache / "tools" / re.sub(r"[^A-Za-z0-9.]+", "-", pin)
    uv = target / "bin" / "uv"
    if not uv.exists():
        run_logged([python, "-m", "pip", "install", "-q", "--target", str(target), pin], log)
    return uv


@dataclass(frozen=True)
class Uv:
    """uv pip over one shared store: `uv venv`, then `uv pip install` with pip's index configuration."""

    binary: Path
    store: Path  # the package store every env links from
    index: tuple[str, ...]
    env: tuple[tuple[str, str], ...]

    @classmethod
    def configured(cls, root: Path, cache: Path, python: str, log: Path) -> "Uv":
        args, env = uv_index_args(_pip_config(python))
        return cls(uv_binary(root, cache, python, log), cache / "uv-cache", tuple(args), tuple(sorted(env.items())))

    def run(self, args: list[str], log: Path) -> None:
        # UV_COMPILE_BYTECODE: pip writes .pyc at install, uv does not; without it a new env pays the
        # compile in its first run (a gate then reports the candidate's cases as slower: 5 s -> 14.6 s).
        # UV_NO_CONFIG: uv would read the pyproject.toml/uv.toml of the working directory, and a bisect
        # step runs in a Megatron-Bridge checkout whose [[tool.uv.index]] names pypi.nvidia.com: every
        # step's env failed to build (and was skipped) on a machine that reaches only pip's own index.
        run_logged([str(self.binary), *args], log, env={**os.environ, "UV_CACHE_DIR": str(self.store),
                                                        "UV_LINK_MODE": "hardlink", "UV_COMPILE_BYTECODE": "1",
                                                        "UV_NO_CONFIG": "1", **dict(self.env)})

    def venv(self, python: str, venv: Path, log: Path) -> None:
        self.run(["venv", "--quiet", "--python", python, str(venv)], log)

    def install(self, venv: Path, args: list[str], log: Path) -> None:
        self.run(["pip", "install", "--python", str(venv / "bin" / "python"), *self.index, *args], log)


def run_logged(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    with log.open("a") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, check=False,
                                env=env, pass_fds=tuple(HELD_LOCKS)).returncode
        except OSError as exc:
            f.write(f"{exc}\n")
            rc = -1
    if rc != 0:
        raise EnvBuildError(f"{tail(log.read_text(errors='replace'))}\n"
                            f"ckpt-harness: environment install failed ({shlex.join(cmd)} exited {rc}); full log: {log}")


def freeze_command(venv: Path) -> list[str]:
    """pip freeze where the venv has pip (pip-built, or a stub); uv's otherwise (uv venvs hold no pip)."""
    if os.environ.get("CKPT_HARNESS_PIP") or (venv / "bin" / "pip").exists():
        return [*pip_command(venv), "freeze"]
    uv = json.loads((venv / UV_JSON).read_text())["uv"]
    return [uv, "pip", "freeze", "--python", str(venv / "bin" / "python")]
