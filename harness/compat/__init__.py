"""Every runtime patch the harness makes to an upstream, one module per upstream, each as a `Shim`
record (harness.compat._shim) in the module's `SHIMS`: its name, the upstream it touches, why (the
defect or API gap, with file:line), the probe that detects its condition (an error raised, an
attribute missing: never a version string), when it can go, its kind (ADAPTS an API or environment,
or HIDES an upstream defect that a named strict xfail shows without it), how it is triggered, the
option that switches it and whether it is on by default, and its apply function.
harness.compat.registry collects every module's records (pkgutil; no hand wiring) and answers by
name, upstream, kind, trigger, result label, and per option the switchable names and defaults.

  cuda    CUDA-on-CPU shims: torch.cuda calls and device='cuda' a CPU rank cannot run; the
          megatron import guard; Megatron-FSDP on a CPU rank (on demand)
  mcore   megatron-core: the dist_checkpointing write-results queue shims (ASYNC_RESULTS_QUEUE on
          demand), the defects a training case steps around (switch 'training', apply_workaround)
          and the API fallbacks for older releases
  te      Transformer-Engine absent: the stand-in Megatron-Bridge's import needs, `import_megatron_bridge`
  verl    verl: its defects (switch 'verl', apply_verl_workaround), its CPU shims (verl_rng_tracker_state,
          mbridge_te_spec with its helper te_spec), quiet_verl_noise
  fsdp    Megatron-FSDP fsdp_dtensor checkpoints: the defects the mcore_fsdp backend steps around (switch 'fsdp')
  noise   log and warning filters (quiet_known_noise)
  bridge_training  Megatron-Bridge training checkpoints on CPU (on demand: CUDA_RNG_STATE, RNG_TRACKER_STATE)
  megatron_lm  Megatron-LM's tools/checkpoint converters (vendored in third_party/megatron-lm): finding one,
          running its click command in a harness rank, and its defect workaround (switch 'converter')
  registry  the one registry of every module's records
Here: `all_shims`, `install` (a rank's shims), `require` (an on-demand shim), `installed` (what
the current case applied) and `begin_case`.

Switched records (kind HIDES) are applied only when a matrix entry lists them (each on by default);
an entry with one switched off shows the defect as a named strict xfail (the record's `shown_by`),
so a workaround never hides what the harness must show. The record is per process and per case: `begin_case` (the rank envelope)
starts it from the shims `install` applied in this process, so a forked rank never reports a shim
its parent applied for another case; the Bridge import's shims are noted by every call of
`import_megatron_bridge`, i.e. by the cases that use the Bridge. Installed files are never edited:
everything is a runtime patch.
"""

from __future__ import annotations

import torch

from harness.compat import _shim
from harness.compat import attention_env as _attention_env  # noqa: F401  records the user's NVTE_* before any build
from harness.compat._shim import ADAPTS, HIDES, INSTALL, REQUIRE, Shim, note

__all__ = ["ADAPTS", "HIDES", "Shim", "all_shims", "begin_case", "install", "installed", "require"]


def all_shims() -> tuple[Shim, ...]:
    """Every Shim record (harness.compat.registry), install order."""
    from harness.compat import registry

    return tuple(registry.records().values())


def install(device: torch.device) -> list[str]:
    """Apply, once per process, the shims this rank needs (each `install`-triggered one whose probe
    finds its condition on `device`), note them for the current case and return the case's record."""
    from harness.compat import registry
    from harness.compat.noise import quiet_known_noise

    quiet_known_noise()
    for shim in registry.by_trigger(INSTALL):
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
    from harness.compat import registry

    shim = registry.records().get(name)
    if shim is None or shim.trigger != REQUIRE:
        raise KeyError(f"no on-demand shim {name!r}")
    if _shim.applied(name):
        note(name)
    elif shim.needed(device or torch.device("cpu")):
        shim.apply()
        note(name)
