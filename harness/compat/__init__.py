"""Every runtime workaround for an upstream assumption or defect, one module per upstream, each
with its reason and a probe (`Shim.needed`) that detects its condition: a shim applies because the
condition is there (an error raised, an attribute missing), never because a version string matches.

  cuda    CUDA-on-CPU shims (SHIMS): torch.cuda calls and device='cuda' a CPU rank cannot run
  mcore   megatron-core: the dist_checkpointing write-results queue shims (SHIMS, ASYNC_RESULTS_QUEUE
          on demand) and the defects a training case steps around (WORKAROUNDS, apply_workaround)
  te      Transformer-Engine absent: the stand-in Megatron-Bridge's import needs, `import_megatron_bridge`
  verl    verl: VERL_WORKAROUNDS, apply_verl_workaround, VERL_SHIMS (verl_rng_tracker_state,
          mbridge_te_spec with its helper te_spec), quiet_verl_noise
  noise   log and warning filters (quiet_known_noise)
  bridge_training  Megatron-Bridge training checkpoints on CPU (on demand: CUDA_RNG_STATE, RNG_TRACKER_STATE)
  megatron_lm  Megatron-LM's tools/checkpoint converters (vendored in third_party/megatron-lm): finding one,
          running its click command in a harness rank, and its defect workarounds (CONVERTER_WORKAROUNDS)
Here: the Shim record, `install` (a rank's shims), `require` (an on-demand shim), `installed` (what
the current case applied) and `begin_case`.

WORKAROUNDS (mcore, verl) are applied only when a matrix entry lists them; an entry with one
switched off shows the defect as a named strict xfail, so a workaround never hides what the
harness must show. The record is per process and per case: `begin_case` (the rank envelope)
starts it from the shims `install` applied in this process, so a forked rank never reports a shim
its parent applied for another case; the Bridge import's shims are noted by every call of
`import_megatron_bridge`, i.e. by the cases that use the Bridge. Installed files are never edited:
everything is a runtime patch.
"""

from __future__ import annotations

import torch

from harness.compat import _shim
from harness.compat._shim import Shim, note

__all__ = ["Shim", "all_shims", "begin_case", "install", "installed", "require"]


def all_shims() -> tuple[Shim, ...]:
    """Every Shim record, install order (the verl and Bridge shims are applied by their own functions)."""
    from harness.compat import bridge_training, cuda, mcore

    return cuda.SHIMS + mcore.SHIMS + bridge_training.SHIMS


def install(device: torch.device) -> list[str]:
    """Apply, once per process, the shims this rank needs (each whose probe finds its condition on
    `device`), note them for the current case and return the case's record."""
    from harness.compat.noise import quiet_known_noise

    quiet_known_noise()
    for shim in all_shims():
        if shim.on_demand:
            continue
        if not _shim.applied(shim.name):
            if not shim.needed(device):
                continue
            shim.apply()
            _shim._base.append(shim.name)
        note(shim.name)
    return installed()


def installed() -> list[str]:
    """The shims the current case applied or used in this process (since `begin_case`)."""
    return list(_shim._record)


def begin_case() -> None:
    """Start the current case's record: the shims `install` applied in this process, nothing else
    (not what a parent process or an earlier case applied, e.g. the Bridge import of an HF case)."""
    _shim._record[:] = list(_shim._base)


def require(name: str, device: torch.device | None = None) -> None:
    """Apply the on-demand shim `name` in this process (once, if its probe finds its condition);
    it is then listed with the others for the current case."""
    shim = next((s for s in all_shims() if s.name == name), None)
    if shim is None or not shim.on_demand:
        raise KeyError(f"no on-demand shim {name!r}")
    if _shim.applied(name):
        note(name)
    elif shim.needed(device or torch.device("cpu")):
        shim.apply()
        note(name)
