"""harness.compat: the TE stand-in answers any name, every shim has a probe and a retirement note,
and the shim record is per process and per case."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import sys

import pytest
import torch

from harness import compat
from harness.compat import _shim, cuda, mcore, noise, te, verl
from harness.run.envelope import RunEnv
from harness.run.preload import warm

warm()  # as the runner does: ranks fork from a parent that already imported megatron-core

needs_no_te = pytest.mark.skipif(te.te_importable(), reason="Transformer-Engine is installed: no stand-in is served")

FAKE_USER = '''
import transformer_engine
import transformer_engine.pytorch as te_pt
import transformer_engine.common.recipe as recipe
from transformer_engine.pytorch import GroupedLinear, Linear, LayerNormLinear
from transformer_engine.pytorch.ops import Sequential
from transformer_engine.common.recipe import DelayedScaling, Format

NAMES = (GroupedLinear, Linear, LayerNormLinear, Sequential, DelayedScaling, Format,
         te_pt.SomethingNoReleaseHasYet, te_pt.ops.BasicLinear, recipe.Float8CurrentScaling,
         transformer_engine.pytorch.fp8.FP8GlobalStateManager)
'''


@needs_no_te
def test_te_stand_in_answers_any_name_with_types_nothing_is_an_instance_of(tmp_path, monkeypatch):
    pkg = tmp_path / "fake_te_user"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "lora.py").write_text(FAKE_USER)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with te.te_stand_in(("fake_te_user.lora",)):
            lora = importlib.import_module("fake_te_user.lora")
            with pytest.raises(ModuleNotFoundError):  # any other importer still finds TE absent
                importlib.import_module("transformer_engine")
        names = lora.NAMES
        assert all(isinstance(n, type) and te.is_stub(n) for n in names)
        assert len({id(n) for n in names}) == len(names)  # one type per name
        assert lora.te_pt.GroupedLinear is lora.GroupedLinear  # cached: read twice, the same type
        assert lora.Sequential is lora.te_pt.ops.Sequential
        for ordinary in (object(), torch.nn.Linear(2, 2), torch.zeros(1), "x", None, 3):
            assert not any(isinstance(ordinary, n) for n in names)
        assert not any(k == "transformer_engine" or k.startswith("transformer_engine.") for k in sys.modules)
        assert not te.te_importable()
    finally:
        for name in [k for k in sys.modules if k.startswith("fake_te_user")]:
            del sys.modules[name]


def test_every_shim_has_a_reason_a_probe_and_a_retirement():
    shims = compat.all_shims()
    assert shims
    for shim in shims:
        assert shim.why and shim.probe and shim.retire_when, shim.name
        assert shim.trigger == "caller" or callable(shim.needed), shim.name
    assert {s.name for s in te.SHIMS} == {te.TE_STUB, te.HAVE_TE_FALSE}
    assert {verl.VERL_RNG_TRACKER, verl.MBRIDGE_TE_SPEC} <= {s.name for s in verl.SHIMS}


def test_no_shim_is_keyed_on_a_version_string():
    from harness.compat import registry

    for module in (compat, _shim, registry, *registry.modules()):
        code = "\n".join(line for line in inspect.getsource(module).splitlines() if not line.lstrip().startswith("#"))
        assert not re.search(r"__version__|importlib\.metadata|metadata\.version|packaging\.version|version\(", code), module


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA probes are read on a machine without CUDA")
def test_without_cuda_every_cuda_probe_finds_its_condition():
    cpu = torch.device("cpu")
    probed = [s for s in cuda.SHIMS if s.trigger != "caller"]  # the import guard also reads the environment
    assert probed and [s.name for s in probed if not s.needed(cpu)] == []


def test_begin_case_keeps_what_install_applied_and_drops_the_rest(monkeypatch):
    monkeypatch.setattr(_shim, "_applied", ["cuda.current_device", "from an earlier case"])
    monkeypatch.setattr(_shim, "_base", ["cuda.current_device"])
    monkeypatch.setattr(_shim, "_record", ["cuda.current_device", "from an earlier case"])
    compat.begin_case()
    assert compat.installed() == ["cuda.current_device"]
    _shim.note("from an earlier case")  # used again by this case: listed again, not applied again
    assert compat.installed() == ["cuda.current_device", "from an earlier case"]
    assert _shim._applied == ["cuda.current_device", "from an earlier case"]


def _gpt_rank(ctx, _):
    return compat.installed()


def _bridge_rank(ctx, _):
    te.import_megatron_bridge()
    return compat.installed()


@needs_no_te
def test_a_gpt_rank_forked_after_the_bridge_import_reports_no_bridge_shim(tmp_path):
    if importlib.util.find_spec("megatron.bridge") is None:
        pytest.skip("megatron-bridge is not installed")
    te.import_megatron_bridge()  # what the parent's preload does for an HF case (harness.run.preload.warm)
    assert te.TE_STUB in compat.installed()  # the parent's own record
    bridge_names = {te.TE_STUB, te.HAVE_TE_FALSE}

    gpt = RunEnv(case_dir=tmp_path / "gpt")
    (value,) = gpt.launch("save", _gpt_rank, None, None)
    assert "cuda.current_device" in gpt.record.compat_shims and value == gpt.record.compat_shims
    assert bridge_names.isdisjoint(gpt.record.compat_shims)

    hf = RunEnv(case_dir=tmp_path / "hf")
    hf.launch("export", _bridge_rank, None, None)
    assert bridge_names <= set(hf.record.compat_shims) and "cuda.current_device" in hf.record.compat_shims


def test_the_stand_in_finds_each_unguarded_importer_by_its_error(tmp_path, monkeypatch):
    """A release that imports TE unguarded from modules nobody listed (Bridge 0.5.1: peft/lora.py as
    well as peft/lora_layers.py) still imports; a guarded TE detection still finds TE absent."""
    pkg = tmp_path / "fake_bridge"
    (pkg / "peft").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from fake_bridge import detect, lora\n")
    (pkg / "detect.py").write_text("try:\n    import transformer_engine\n    HAVE_TE = True\nexcept ImportError:\n    HAVE_TE = False\n")
    (pkg / "lora.py").write_text("import transformer_engine.pytorch as te\nfrom fake_bridge.peft import layers\nG = te.GroupedLinear\n")
    (pkg / "peft" / "__init__.py").write_text("")
    (pkg / "peft" / "layers.py").write_text("from transformer_engine.pytorch import Linear\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        served = te.import_with_stand_in(("fake_bridge", "fake_bridge.peft.layers"))
        import fake_bridge

        assert served and te.is_stub(fake_bridge.lora.G) and te.is_stub(fake_bridge.peft.layers.Linear)
        assert fake_bridge.detect.HAVE_TE is False  # the detection was not served
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("transformer_engine")
    finally:
        for name in [k for k in sys.modules if k.startswith("fake_bridge")]:
            del sys.modules[name]


def test_optimizer_api_fallbacks_follow_the_attribute_not_a_version():
    """Core 0.19's DistributedOptimizer.optimizer_state_keys / prepare_model_params_for_param_sync: used
    where the optimizer has them; on an optimizer without them (Core 0.18) the keys come from the
    param's state and staging is skipped, and the case records the fallback."""
    from harness.compat import _shim, mcore

    class Core19:
        optimizer_state_keys = ("exp_avg",)  # Lion: the property, not the state, decides
        staged = 0

        def prepare_model_params_for_param_sync(self):
            self.staged += 1

    class Core18:
        pass

    state = {"param": 0, "exp_avg": 1, "exp_avg_sq": 2, "step": 3}  # Core 0.18's per-param state holds the step too
    _shim._record.clear()
    new, old = Core19(), Core18()
    assert mcore.optimizer_state_keys(new, state) == ("exp_avg",)
    mcore.prepare_param_sync(new)
    assert new.staged == 1 and _shim._record == []
    assert mcore.optimizer_state_keys(old, state) == ("exp_avg", "exp_avg_sq")
    mcore.prepare_param_sync(old)
    assert _shim._record == [mcore.OPTIMIZER_STATE_KEYS, mcore.PARAM_SYNC_STAGING]
    with pytest.raises(AttributeError):
        mcore.optimizer_state_keys(old)


def test_the_megatron_import_guard_names_an_arch_list_only_where_no_gpu_is_visible(monkeypatch):
    """Core 0.15.x JIT-builds a CUDA allocator at import and dies on torch's empty arch list without
    a GPU: the guard names one, only when none is set and no GPU is visible, and records it."""
    from harness.compat import _shim, cuda

    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(cuda.torch.cuda, "is_available", lambda: True)
    assert cuda.guard_megatron_import() is False and "TORCH_CUDA_ARCH_LIST" not in os.environ
    monkeypatch.setattr(cuda.torch.cuda, "is_available", lambda: False)
    _shim._record.clear()
    assert cuda.guard_megatron_import() is True and os.environ["TORCH_CUDA_ARCH_LIST"]
    assert cuda.JIT_ARCH_LIST in _shim._record
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert cuda.guard_megatron_import() is False and os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0"  # the user's wins


@pytest.mark.parametrize("getter", ["get_write_results_queue", "_get_write_results_queue"])
def test_the_spawn_queue_shim_finds_the_lazy_queue_under_either_name(monkeypatch, getter):
    """megatron-core 0.15 names its lazy spawn-Manager getter `_get_write_results_queue`, 0.19
    `get_write_results_queue`; missed, every rank's first save on 0.15.3 starts a spawn Manager
    (a fresh interpreter, ~7 s a phase: the Core 0.15.3 sweep ran 15-26 s a case instead of ~2 s)."""
    import types

    from harness.compat import mcore

    fs = types.SimpleNamespace(_results_queue=None, **{getter: lambda: None})
    monkeypatch.setattr(mcore, "_filesystem_async", lambda: fs)
    assert mcore._spawn_queue_pending(torch.device("cpu"))
    mcore._patch_results_queue()
    assert not mcore._spawn_queue_pending(torch.device("cpu"))  # applied: nothing pending


def test_the_missing_step_workaround_suits_a_copy_loop_of_either_kind():
    """fully_reshardable loads carry no 'step' (the 0.19 defect the workaround steps around); the
    workaround must leave each param's own step as it is under 0.19's loop (skips a non-tensor)
    and under 0.15's (copies every destination key: None raised `copy_(): ... not NoneType`)."""
    import types

    main = torch.nn.Parameter(torch.zeros(3))
    state = {main: {"exp_avg": torch.zeros(3), "step": torch.tensor(7.0)}}
    opt = types.SimpleNamespace(config=types.SimpleNamespace(), model_param_group_index_map={"w": (0, 0)},
                                optimizer=types.SimpleNamespace(param_groups=[{"params": [main]}], state=state))

    def copy_every_key(self, model_param, tensors):  # megatron-core 0.15.3
        dst = {"param": main, **state[main]}
        with torch.no_grad():
            for key in dst:
                dst[key].copy_(tensors[key])

    def skip_non_tensors(self, model_param, tensors):  # megatron-core 0.19.2
        dst = {"param": main, **state[main]}
        with torch.no_grad():
            for key in dst:
                if isinstance(tensors[key], torch.Tensor):
                    dst[key].copy_(tensors[key])

    loaded = {"param": torch.ones(3), "exp_avg": torch.full((3,), 2.0)}
    for original in (copy_every_key, skip_non_tensors):
        mcore.keep_own_step(original)(opt, "w", dict(loaded))
        assert torch.equal(main.detach(), torch.ones(3)) and torch.equal(state[main]["exp_avg"], torch.full((3,), 2.0))
        assert state[main]["step"].item() == 7.0


def test_the_moe_router_shim_binds_the_name_core_leaves_unbound_without_te(monkeypatch):
    """megatron-core 0.15.3/0.16.1 moe_utils binds te_general_gemm only when TE imports; every MoE
    forward without TE then raised NameError (11 cases of the Core 0.16.1 sweep)."""
    import types

    def router_gating_linear(inp, weight, bias, router_dtype):  # the module's own shape of the call
        return te_module.te_general_gemm is not None

    te_module = types.SimpleNamespace(router_gating_linear=router_gating_linear)
    monkeypatch.setattr(mcore, "_moe_utils", lambda: te_module)
    with pytest.raises(AttributeError):
        router_gating_linear(None, None, None, None)
    assert mcore._router_gemm_unbound(torch.device("cpu"))
    mcore._bind_router_gemm()
    assert not mcore._router_gemm_unbound(torch.device("cpu"))
    assert router_gating_linear(None, None, None, None) is False  # the torch fallback branch


def _socket_inodes(pid: int) -> set[str]:
    import os

    fds = f"/proc/{pid}/fd"
    return {os.readlink(f"{fds}/{n}") for n in os.listdir(fds) if os.readlink(f"{fds}/{n}").startswith("socket:")}


def test_the_async_results_manager_holds_none_of_the_ranks_sockets():
    """A forked Manager that kept the rank's process-group sockets kept them open past a killed rank,
    so its peers waited until the world timeout (last session's finding): the harness's closes them.
    Python's own fork Manager (the control) inherits the socket."""
    import multiprocessing as mp
    import os
    import socket

    from harness.compat.mcore import fork_manager

    a, b = socket.socketpair()
    ours = {os.readlink(f"/proc/self/fd/{a.fileno()}"), os.readlink(f"/proc/self/fd/{b.fileno()}")}
    control, manager = mp.get_context("fork").Manager(), fork_manager()
    try:
        assert ours <= _socket_inodes(control._process.pid)
        assert not ours & _socket_inodes(manager._process.pid)
        q = manager.Queue()
        q.put("written")
        assert q.get(timeout=10) == "written"  # the Manager still serves
    finally:
        control.shutdown(), manager.shutdown(), a.close(), b.close()


def test_the_scoped_current_device_patch_leaves_no_trace_in_the_process():
    """The planner's meta build answers "cpu" inside the block only, and never marks the process-wide
    shim applied: a world forked from this process afterwards must still install it (a marked one is
    skipped there, and the rank's first torch.cuda.current_device() raises)."""
    import torch

    from harness.compat import _shim
    from harness.compat.cuda import current_device_scope

    own = torch.cuda.current_device
    was_applied = _shim.applied("cuda.current_device")
    with current_device_scope():
        assert torch.cuda.current_device() == "cpu"
    assert torch.cuda.current_device is own and _shim.applied("cuda.current_device") == was_applied
