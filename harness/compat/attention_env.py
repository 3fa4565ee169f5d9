"""One process, several models of different attention backends.

megatron-core's LanguageModule._set_attention_backend (models/common/language_module/language_module.py:
108-152 in 0.19.2) writes NVTE_FLASH_ATTN / NVTE_FUSED_ATTN / NVTE_UNFUSED_ATTN into the PROCESS
environment for the model's attention backend, and asserts that a value already there agrees: after a
model of backend `auto` (most providers: NVTE_FUSED_ATTN=1) a model of backend `flash` (the Gemma
providers, gemma/gemma_provider.py:47) cannot be built in the same process ("NVTE_FUSED_ATTN set to 1,
but expected 0"). A training job builds one model family per process; the harness builds many in one
(a pytest worker, an in-process world, the forkserver's children inherit its parent's environment),
so each build starts from the environment the user gave the process: what megatron-core wrote for an
earlier model is taken back; a value the user set stays, and megatron-core's assertion judges it.
"""

from __future__ import annotations

import json
import os

from harness.compat._shim import ADAPTS, CALLER, Shim, note

NAME = "per-model NVTE attention env"
#: the backend switches, and the FlashAttention generation pins it writes for config.flash_attention_version (:144-152)
VARIABLES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN", "NVTE_FLASH_ATTN_V2", "NVTE_FLASH_ATTN_V3", "NVTE_FLASH_ATTN_V4")
#: the user's values, recorded when harness.compat is first imported in the process tree (children inherit the record)
USER_RECORD = "CKPT_HARNESS_NVTE_USER"


def _user_values() -> dict[str, str | None]:
    if USER_RECORD not in os.environ:
        os.environ[USER_RECORD] = json.dumps({k: os.environ.get(k) for k in VARIABLES})
    return json.loads(os.environ[USER_RECORD])


_user_values()  # at import (harness.compat imports this module): before any model of this process is built


def needed() -> bool:
    """A NVTE_* attention variable differs from what the user started the process tree with."""
    user = _user_values()
    return any(os.environ.get(k) != user.get(k) for k in VARIABLES)


def fresh_attention_env() -> None:
    """Before building a model: the NVTE_* attention variables back to the user's values (recorded
    as a shim of the current case when an earlier build in this process had changed them)."""
    if not needed():
        return
    for k, v in _user_values().items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    note(NAME)


SHIMS: tuple[Shim, ...] = (
    Shim(
        name=NAME,
        upstream="megatron.core.models.common.language_module.language_module",
        why="LanguageModule._set_attention_backend (language_module.py:108-140) writes the model's attention backend "
        "into the process environment (NVTE_*_ATTN) and asserts an earlier value agrees: two models of different "
        "backends (a Gemma, flash, after a Llama, auto) cannot be built in one process",
        probe="a NVTE_FLASH_ATTN / NVTE_FUSED_ATTN / NVTE_UNFUSED_ATTN value differs from the one the process tree "
        "started with (recorded in CKPT_HARNESS_NVTE_USER)",
        retire_when="when megatron-core keeps the attention backend per model instead of in the process environment",
        kind=ADAPTS,
        apply=fresh_attention_env,
        trigger=CALLER,
    ),
)
