"""main-params: a bf16 job started from a checkpoint without its optimizer state holds, as its fp32
main params, exactly the weights the checkpoint saved.

With `load_optim: false` (or a finetune start) Megatron-Bridge 0.6.2 asks only the model section
of the checkpoint (training/checkpointing.py:2788-2810: no optimizer in the sharded state dict), so
the fp32 main params the optimizer section holds are never read. It then reloads the main params
(checkpointing.py:3108-3112): from the model params (`reload_model_params()`), or, with
`load_main_params_from_ckpt: true`, from the loaded state dict (`reload_model_params(state_dict)`:
megatron-core distrib_optimizer.py:3029-3066 maps each model param to the state dict's tensor by
name, :3107-3109 takes that tensor instead and :3124 copies its range into the fp32 shard). That
state dict holds the model section as saved (checkpointing.py:1977-1985, `model`, or `model<i>` per
VPP chunk): a bf16 job's saved bf16 weights, loaded into new bf16 tensors (seen on CPU, Core
0.19.2). Either way each main param must be its saved bf16 weight widened to fp32, bitwise
(widening is exact), on every element of every parameter.
"""

from __future__ import annotations

from typing import Mapping

import torch

from harness.core.parity import BITWISE, Mismatch, compare_state
from harness.core.result import Check
from harness.judge.checks import empty_check

MAIN_PARAMS = "main-params"
MAIN_PREFIX = "optimizer.state.param."


def main_params_check(saved: Mapping[str, torch.Tensor], mains: Mapping[str, torch.Tensor], src: str, dst: str,
                      saved_mains: Mapping[str, torch.Tensor] | None = None, path: str = "", problems: list[Mismatch] | None = None,
                      empty_ok: str = "") -> Check:
    """Every fp32 main param of the started job (`mains`, keyed `optimizer.state.param.<key>`) equals
    the bf16 weight saved under `<key>` (`saved`) widened to fp32, bitwise; a weight without a main
    param, or the reverse, fails. `saved_mains` (the saving job's own fp32 main params, same keys as
    `mains`) only adds to the detail how far they are from what the start restored: the optimizer
    section such a start does not read. `path` names how the main params were reloaded."""
    if not saved or not mains:
        what = ", ".join(w for w, d in ((f"saved weights@{src}", saved), (f"main params@{dst}", mains)) if not d)
        return empty_check(MAIN_PARAMS, f"no {what}", empty_ok, BITWISE)
    expected_label, actual_label = f"saved bf16 weights@{src} widened to fp32", f"fp32 main params@{dst}"
    expected = {MAIN_PREFIX + k: w.to(torch.float32) for k, w in saved.items()}
    actual = {k: v for k, v in mains.items() if k.startswith(MAIN_PREFIX)}
    mismatches = list(problems or []) + compare_state(expected, actual, expected_label, actual_label)
    if mismatches:
        worst = max((m.max_abs_diff for m in mismatches if m.max_abs_diff is not None), default=None)
        return Check(MAIN_PARAMS, "failed", f"{len(mismatches)} of {len(expected)} main param(s) at {dst} are not the saved "
                     f"weights ({', '.join(sorted({m.kind for m in mismatches}))}){path}", worst, BITWISE, mismatches)
    detail = f"{len(actual)} fp32 main params at {dst} equal the bf16 weights saved at {src}, bitwise{path}"
    if saved_mains:
        elements = sum(int((saved_mains[k] != v).sum()) for k, v in actual.items() if k in saved_mains and saved_mains[k].shape == v.shape)
        detail += (f"; the saving job's own fp32 main params (the optimizer section, not read) differ in {elements} of "
                   f"{sum(v.numel() for v in actual.values())} elements")
    return Check(MAIN_PARAMS, "passed", detail, 0.0, BITWISE)
