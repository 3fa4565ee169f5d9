"""C3: a CPU platform for verl's platform layer (verl.plugin.platform), so verl code that asks
`get_nccl_backend()` / `get_torch_device()` runs on a CPU rank.

verl 0.9.1 registers CUDA, NPU and ROCm platforms and falls back to 'nvidia' when none is there
(platform_manager.py `_detect_platform_name`): on a CPU rank the model merger then calls
`init_process_group("nccl")` and `torch.cuda.set_device("cuda:0")`
(megatron_model_merger.py:152-158). verl's own extension point for another device is a
`PlatformBase` subclass registered with `PlatformRegistry.register` and chosen with
`set_platform`; this is one, for CPU: gloo, torch.cpu, no profiler, no IPC."""

from __future__ import annotations

import contextlib
from types import ModuleType
from typing import Any, Optional

import torch

CPU_PLATFORM = "verl: a CPU platform (gloo, torch.cpu)"
SHIMS: tuple = ()  # its record is C3 in harness.compat.verl, beside C1 and C2


def platform_missing() -> bool:
    """The probe: no CUDA here, and verl's detected platform is not available (its fallback 'nvidia')."""
    if torch.cuda.is_available():
        return False
    from verl.plugin.platform import get_platform

    return not get_platform().is_available()


def _cpu_platform_class() -> type:
    from verl.plugin.platform.platform_base import PlatformBase

    class PlatformCPU(PlatformBase):
        """verl's platform interface on a CPU rank (the harness's; verl ships none)."""

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> ModuleType:
            return torch.cpu

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return True

        def current_device(self) -> int:
            return 0

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: Optional[int] = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        def nvtx_range(self, msg: str):
            return contextlib.nullcontext()

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    return PlatformCPU


def use_cpu_platform() -> None:
    """C3 (no CUDA, verl's platform unavailable): verl's platform singleton becomes the CPU one."""
    if not platform_missing():
        return
    from verl.plugin.platform.platform_manager import PlatformRegistry, set_platform

    from harness.compat._shim import note

    cls = PlatformRegistry.get("cpu") or PlatformRegistry.register("cpu")(_cpu_platform_class())
    set_platform(cls())
    note(CPU_PLATFORM)
