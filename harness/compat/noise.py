"""Log and warning filters: rank output is for failures (CKPT_HARNESS_VERBOSE=1 keeps everything).
verl's own filter is harness.compat.verl.quiet_verl_noise (applied before verl is imported)."""

from __future__ import annotations

import logging
import os
import warnings

from harness.compat._shim import Shim

#: no records here (harness.compat.registry's convention: every compat module lists its own)
SHIMS: tuple[Shim, ...] = ()


class _ErrorsOnly:
    def filter(self, record) -> bool:
        return record.levelno >= logging.ERROR


def quiet_known_noise() -> None:
    """Silence warnings that fire on every save/load, unless CKPT_HARNESS_VERBOSE=1."""
    if os.environ.get("CKPT_HARNESS_VERBOSE") == "1":
        return
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(torch\.distributed|torch\.jit|megatron|harness\.compat)")
    warnings.filterwarnings("ignore", message=".*ShardedTensor.*")
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # fixtures are local; never reach for a hub
    for name in ("transformers", "megatron.bridge", "modelopt"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # megatron-bridge 0.6.2 utils/import_utils.py sets its own logger to INFO and adds a handler at
    # import, so every import without TE prints FP8GlobalStateManager tracebacks; a filter on the
    # (pre-created) logger survives its setLevel.
    bridge_imports = logging.getLogger("megatron.bridge.utils.import_utils")
    if not any(isinstance(f, _ErrorsOnly) for f in bridge_imports.filters):
        bridge_imports.addFilter(_ErrorsOnly())
