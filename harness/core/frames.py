"""Where an exception was raised, read from its formatted traceback: the one reading of a frame.

A verdict must tell whose code raised. A name lookup that fails in the harness's own frame is an
API the release under test does not offer (the harness's driver reached for it); the same error
raised inside an upstream package's frames is that package's own defect, a regression when it
worked before. Expected failures and refusals name the raising frame for the same reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)\s*$')
_TRACEBACK = "Traceback (most recent call last):"
#: this project's own top-level packages (in the checkout, or installed from its wheel)
OWN_PACKAGES = ("harness", "cases", "tests", "benchmarks")
#: the checkout (or site-packages, for an installed wheel) this module was imported from
_ROOT = str(Path(__file__).resolve().parents[2])
_INSTALLED = ("site-packages/", "dist-packages/")


@dataclass(frozen=True)
class Frame:
    """One `File "...", line N, in fn` entry of a traceback, with the source line printed under it."""

    path: str
    line: int
    function: str
    code: str = ""

    @property
    def relative(self) -> str:
        """The path from its package root on (site-packages/, third_party/ or the checkout)."""
        for root in (*_INSTALLED, "third_party/"):
            if root in self.path:
                return self.path.split(root, 1)[1]
        if self.path.startswith(_ROOT + "/"):
            return self.path[len(_ROOT) + 1:]
        return self.path

    @property
    def module(self) -> str:
        """The dotted module the frame runs in (`megatron.bridge.models.conversion.auto_bridge`)."""
        rel = self.relative
        if rel.startswith("megatron-lm/"):  # the vendored Megatron-LM tree: megatron/training, ...
            rel = rel.split("/", 1)[1]
        mod = rel[:-3] if rel.endswith(".py") else rel
        return mod.replace("/", ".").removesuffix(".__init__")

    @property
    def own(self) -> bool:
        """Whether the frame is this project's own code: harness/ or cases/ (tests/ too) of this
        checkout, or of the harness's wheel; never a package that ships a `tests` of its own (verl)."""
        top = self.module.split(".", 1)[0]
        if top not in OWN_PACKAGES:
            return False
        if any(root in self.path for root in _INSTALLED):
            return top in ("harness", "cases")
        return self.path.startswith(_ROOT + "/") and "third_party/" not in self.path

    def __str__(self) -> str:
        code = f": {self.code}" if self.code and not self.code.startswith(("^", "~")) else ""
        return f"{self.relative}:{self.line} in {self.function}{code}"


def frames(traceback_text: str) -> list[Frame]:
    """The frames of the exception a traceback ends with (a chained exception's earlier blocks
    left out), outermost first; interpreter-internal frames (`<frozen importlib._bootstrap>`) too."""
    lines = (traceback_text or "").splitlines()
    start = max((i for i, ln in enumerate(lines) if ln.strip() == _TRACEBACK), default=-1) + 1
    out = []
    for i in range(start, len(lines)):
        m = _FRAME.match(lines[i])
        if m:
            code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.match(lines[i + 1]) else ""
            out.append(Frame(m[1], int(m[2]), m[3], code))
    return out


#: harness frames that only pass a call on: (function, the forwarding line's start)
_FORWARDERS = (
    ("__torch_function__", "return func("),  # harness.compat.cuda's CUDA-to-CPU torch-function mode
    ("stand_in_import", "return original("),  # harness.compat.te's import hook (the TE stand-in)
)


def _forwards(frame: Frame) -> bool:
    """A harness frame that only passes the call on (a torch op, an import): it raised in what it
    forwarded to, called from the frame below (the module whose import statement failed, the op's
    caller), never in the forwarder; on a rank without the forwarder that caller is the innermost frame."""
    return frame.own and any(frame.function == fn and frame.code.startswith(code) for fn, code in _FORWARDERS)


def raising_frame(traceback_text: str) -> Frame | None:
    """The innermost frame with a real source file: where the exception was raised (None when the
    text names no frame). An import machinery frame is skipped (the module being imported or the
    statement importing it is where the lookup failed), and so is a harness torch-function mode that
    only forwards the op (its caller called the op; on a CUDA rank, with no such mode, the caller is
    the innermost frame)."""
    found = [f for f in frames(traceback_text) if not f.path.startswith("<")]
    while len(found) > 1 and _forwards(found[-1]):
        found.pop()
    return found[-1] if found else None


def in_module(module: str, prefix: str) -> bool:
    """Whether dotted `module` is `prefix` or inside it (`megatron.core.x` is in `megatron.core`,
    `megatron.corex` is not)."""
    return module == prefix or module.startswith(prefix + ".")


#: namespace packages that several distributions share: there the project is the first two components
_SHARED_NAMESPACES = ("megatron",)


def project_of(module: str) -> str:
    """The upstream project (the distribution) a dotted module belongs to: `megatron.core`,
    `megatron.bridge`, `megatron.training` under the `megatron` namespace that several share; the
    first component otherwise (`transformers`, `peft`, `verl`, `mbridge`, `torch`)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] in _SHARED_NAMESPACES and len(parts) > 1 else parts[0]


def innermost_in(traceback_text: str, prefix: str) -> Frame | None:
    """The innermost frame of the traceback whose module is `prefix` or inside it (None when no
    frame is): where the code of that project last ran before the exception, whatever generic
    library (torch) it called into raised."""
    return next((f for f in reversed(frames(traceback_text)) if in_module(f.module, prefix)), None)


def raised_in_own_code(traceback_text: str) -> bool | None:
    """True when the raising frame is the harness's own (harness/, cases/), False when it is an
    upstream package's, None when the traceback names no frame."""
    frame = raising_frame(traceback_text)
    return None if frame is None else frame.own


#: an exception's line in a traceback: `pkg.mod.SomeError: message` (the class name kept)
_EXC_HEADER = re.compile(r"^(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Failure)):?\s?(.*)$")


def exception_of(rank_traceback: str) -> tuple[str, str]:
    """(exception class name, message) of the last exception in a formatted traceback."""
    lines = rank_traceback.rstrip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        m = _EXC_HEADER.match(lines[i])
        if m and not lines[i].startswith(" "):
            return m.group(1), "\n".join([m.group(2), *lines[i + 1 :]]).strip()
    return "", lines[-1] if lines else ""
