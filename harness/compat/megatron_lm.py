"""Megatron-LM's checkpoint format converters and how a harness rank runs them.

The converters live in Megatron-LM's `tools/checkpoint/`, which the megatron-core wheel does not
ship. The harness uses the unmodified copy in third_party/megatron-lm (tag core_v0.19.0, which
pairs with the pinned megatron-core 0.19.2: third_party/megatron-lm/PROVENANCE.md), or the
checkout `CKPT_HARNESS_MEGATRON_LM` names.

`run_command` runs one of the tool's click commands inside a rank of the harness's world (gloo on
CPU, NCCL on GPU), with the flags upstream documents. Two runtime patches are recorded in the
result's shims. Each is applied only when its condition is found:
  JOIN_WORLD    the command's own `init_process_group` (NCCL plus torch.cuda.set_device) is
                skipped when the process group is already up (always, inside a world);
  COMMON_STATE  a workaround (switch 'converter': the case option `converter_workarounds`),
                applied only when the matrix entry lists `common_state` and the
                input has no `common.pt`: the tool's `load_common` reads common.pt, which
                megatron-core 0.19 no longer writes, so it falls back to
                `dist_checkpointing.load_common_state_dict` (which reads both forms).
The tool's `device_type="cuda"` mesh and `.cuda()` calls run on CPU through the CUDA-on-CPU
shims every CPU rank already has (harness.compat.cuda).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Iterator, Sequence

from harness.compat._shim import ADAPTS, CALLER, HIDES, Shim, note

ENV = "CKPT_HARNESS_MEGATRON_LM"
INSPECTOR = "tools/checkpoint/checkpoint_inspector.py"
VENDORED = Path(__file__).resolve().parents[2] / "third_party" / "megatron-lm"
VENDORED_TAG = "core_v0.19.0"
VENDORED_COMMIT = "5be9626709af2722333bf54797c954c09edeada3"
#: the git blob of the vendored file (tests/test_convert.py: the copy is unmodified)
VENDORED_BLOB = "ac3d9aab7fa458de42c8108fa744897b973c4dfe"
TO_FSDP_DTENSOR = "convert-torch-dist-to-fsdp-dtensor"

#: What was read for an fsdp_dtensor -> torch_dist converter at the vendored tag and on main (d98e8a6).
REVERSE_LOOKED_AT = (
    f"{INSPECTOR} (its commands: inspect, print-tensor, convert-torch-dist-to-fsdp-dtensor, modify-state-dict, "
    "compare-two-checkpoint, print-torch-dcp-in-json: none writes torch_dist)",
    "tools/checkpoint/dist_checkpoint_io.py (helpers only: model-free full-tensor load of either format and a single-rank "
    "save; optimizer, RNG and _extra_state are dropped)",
    "tools/checkpoint/gpt_hybrid_conversion.py (GPT <-> hybrid Mamba layer remapping with --input-format/--output-format; "
    "a structural conversion that needs --hybrid-layer-pattern and drops optimizer state, with no identity direction, "
    "and it keeps the input's model prefix 'model.module.', which a torch_dist load does not read)",
    "megatron/training --ckpt-convert-format (torch | torch_dist only; Megatron-FSDP requires --ckpt-format fsdp_dtensor, "
    "arguments.py:1146)",
)

JOIN_WORLD = "checkpoint_inspector joins the harness's process group"
COMMON_STATE = "checkpoint_inspector reads megatron-core 0.19's common state"

@dataclass(frozen=True)
class Tool:
    """A converter script found on disk, and where it came from (said in every result)."""

    path: str
    origin: str


def find_inspector(environ: dict[str, str] | None = None) -> Tool | str:
    """checkpoint_inspector.py from `CKPT_HARNESS_MEGATRON_LM`'s checkout, else the vendored copy;
    a str says why there is none."""
    env = os.environ if environ is None else environ
    root = env.get(ENV, "")
    if root:
        path = Path(root) / INSPECTOR
        if not path.is_file():
            return f"{ENV}={root}: no {INSPECTOR} in that checkout"
        return Tool(str(path), f"{ENV}={root}")
    path = VENDORED / INSPECTOR
    if not path.is_file():
        return (f"the vendored converter {path} is missing (third_party/ is not in an installed wheel); "
                f"set {ENV} to a Megatron-LM checkout")
    return Tool(str(path), f"third_party/megatron-lm ({VENDORED_TAG}, {VENDORED_COMMIT[:7]})")


def load(tool: Tool) -> ModuleType:
    """Import the script by path, once per process (its imports are megatron-core's)."""
    name = "ckpt_harness_mlm_" + hashlib.sha1(tool.path.encode()).hexdigest()[:12]
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, tool.path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {tool.path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


_COMMAND = re.compile(r"^@cli\.command\([^)]*\)\s*\n(?:(?!def |@cli\.).*\n)*?def (\w+)\(", re.MULTILINE)


def command_names(tool: Tool) -> list[str]:
    """The tool's click commands, read from its source without importing it (click names a command
    after its function, `_` -> `-`)."""
    return sorted(name.replace("_", "-") for name in _COMMAND.findall(Path(tool.path).read_text()))


def reverse_commands(names: Sequence[str]) -> list[str]:
    """Commands whose name says they write torch_dist from fsdp_dtensor (none at core_v0.19.0)."""
    return [c for c in names if "to-torch-dist" in c or "fsdp-dtensor-to" in c]


@contextmanager
def _patched(module: ModuleType, name: str, value: object) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def _common_state_reader(original):
    def load_common(checkpoint_dir):
        from megatron.core.dist_checkpointing.serialization import load_common_state_dict
        from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

        if (Path(checkpoint_dir) / COMMON_STATE_FNAME).is_file():
            return original(checkpoint_dir)
        note(COMMON_STATE)
        return load_common_state_dict(str(checkpoint_dir))

    return load_common


def run_command(module: ModuleType, argv: Sequence[str], workarounds: Sequence[str] = ()) -> None:
    """Run the tool's click command `argv` (command name first) in this rank, as `torchrun
    checkpoint_inspector.py ARGV` would, in the world the harness already set up."""
    import torch.distributed as dist

    from harness.compat import registry

    registry.check("converter", workarounds, "converter workaround(s)")
    with _joined(module, dist.is_initialized()), _common(module, "common_state" in workarounds):
        module.cli.main(list(argv), prog_name=Path(module.__file__ or INSPECTOR).name, standalone_mode=False)


@contextmanager
def _joined(module: ModuleType, world_up: bool) -> Iterator[None]:
    if not world_up or not hasattr(module, "init_process_group"):
        yield
        return
    note(JOIN_WORLD)
    with _patched(module, "init_process_group", lambda message: print(f"[ckpt-harness world] {message}")):
        yield


@contextmanager
def _common(module: ModuleType, on: bool) -> Iterator[None]:
    if not on or not hasattr(module, "load_common"):
        yield
        return
    with _patched(module, "load_common", _common_state_reader(module.load_common)):
        yield


SHIMS: tuple[Shim, ...] = (
    Shim(
        name=JOIN_WORLD,
        upstream="tools/checkpoint/checkpoint_inspector.py",
        why="the converter's click commands call their own init_process_group (NCCL plus torch.cuda.set_device), "
        "written for a torchrun of the script alone; inside the harness's world the group is already up",
        probe="torch.distributed is initialized and the tool module has init_process_group",
        retire_when="when the tool joins an existing process group itself (or is driven outside a harness world)",
        kind=ADAPTS, trigger=CALLER,
        apply=_joined,
        needed=lambda device: _world_up(),
    ),
    # ---- defects (switch 'converter', on by default; an entry without one shows it as its strict xfail)
    Shim(
        name="common_state",
        upstream="tools/checkpoint/checkpoint_inspector.py",
        why="Megatron-LM core_v0.19.0 tools/checkpoint/checkpoint_inspector.py:738 convert_checkpoint calls the "
        "deprecated dist_checkpointing.strategies.common.load_common, which reads <ckpt>/common.pt; megatron-core "
        "0.19 (PR #5160, 40b1fd37c1, 'deprecate common strategy') stores the common state inside the DCP "
        "checkpoint as the ShardedObject 'common_state' and writes no common.pt, so every torch_dist checkpoint "
        "0.19 writes fails with CheckpointingException 'Common file .../common.pt does not exist'; the harness "
        "points load_common at dist_checkpointing.load_common_state_dict, which reads both forms",
        probe="the input checkpoint has no common.pt (the tool's load_common would raise CheckpointingException "
        "'Common file ... does not exist'); with one, the tool's own reader runs",
        retire_when="when checkpoint_inspector reads the common state with dist_checkpointing.load_common_state_dict",
        kind=HIDES, trigger=CALLER, switch="converter",
        apply=_common,
        shown_by="matrices/smoke.yaml:defect-common-state",
        recorded_as=COMMON_STATE,
    ),
)


def _world_up() -> bool:
    import torch.distributed as dist

    return dist.is_initialized()
