"""The gated-delta-net stand-ins (harness.models.cpu_gdn) agree with transformers' own torch reference
for Qwen3-Next within GDN_TOLERANCE, and a planted fault (a wrong decay, a dropped conv state) does not."""

import pytest
import torch
import torch.nn.functional as F

from harness.models import cpu_gdn

ref = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


def _agree(a: torch.Tensor, b: torch.Tensor) -> bool:
    assert a.shape == b.shape and a.numel() > 0
    return torch.allclose(a, b, **cpu_gdn.GDN_TOLERANCE)


def _inputs(seed=0, b=2, t=37, h=3, dk=8, dv=6):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(b, t, h, dk, generator=g), torch.randn(b, t, h, dk, generator=g)
    v = torch.randn(b, t, h, dv, generator=g)
    decay = -F.softplus(torch.randn(b, t, h, generator=g))  # log decay, as Core's _compute_g_and_beta gives
    beta = torch.randn(b, t, h, generator=g).sigmoid()
    state = torch.randn(b, h, dk, dv, generator=g) * 0.1
    return q, k, v, decay, beta, state


def test_the_gated_delta_rule_matches_transformers_chunked_reference():
    q, k, v, g, beta, state = _inputs()
    o, final = cpu_gdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, final_ref = ref.torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert _agree(o, o_ref) and _agree(final, final_ref)
    o_rec, _ = ref.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert _agree(o, o_rec)


def test_a_wrong_decay_is_outside_the_tolerance():
    q, k, v, g, beta, state = _inputs(seed=1)
    o_ref, _ = ref.torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, use_qk_l2norm_in_kernel=True)
    wrong, _ = cpu_gdn.chunk_gated_delta_rule(q, k, v, g * 1.01, beta, initial_state=state, use_qk_l2norm_in_kernel=True)
    assert not _agree(wrong, o_ref)
    unnormed, _ = cpu_gdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state)  # l2norm dropped
    assert not _agree(unnormed, o_ref)


def test_the_causal_conv_matches_transformers_prefill_and_its_state_update():
    gen = torch.Generator().manual_seed(2)
    b, t, d, w = 2, 11, 5, 4
    x, weight, bias = torch.randn(b, t, d, generator=gen), torch.randn(d, w, generator=gen), torch.randn(d, generator=gen)
    out, _ = cpu_gdn.causal_conv1d(x, weight, bias, activation="silu")
    # transformers' prefill without the kernel: nn.Conv1d(padding=w-1) cut to t, then silu
    prefill = F.silu(F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=w - 1, groups=d)[..., :t]).transpose(1, 2)
    assert _agree(out, prefill)
    state = torch.randn(b, d, w - 1, generator=gen)
    out, final = cpu_gdn.causal_conv1d(x, weight, bias, activation="silu", initial_state=state, output_final_state=True)
    conv_state = state.clone()
    updated = ref.torch_causal_conv1d_update(x.transpose(1, 2), conv_state, weight, bias, activation="silu").transpose(1, 2)
    assert _agree(out, updated) and _agree(final, conv_state)
    dropped, _ = cpu_gdn.causal_conv1d(x, weight, bias, activation="silu")  # the conv state planted missing
    assert not _agree(dropped, updated)


def test_l2norm_matches_and_packed_sequences_are_refused():
    x = torch.randn(3, 4, 7)
    assert _agree(cpu_gdn.l2norm(x), ref.l2norm(x))
    with pytest.raises(NotImplementedError, match="cu_seqlens"):
        cpu_gdn.chunk_gated_delta_rule(*_inputs()[:5], cu_seqlens=torch.tensor([0, 37]))


def test_install_leaves_a_core_without_a_gated_delta_net_alone(monkeypatch):
    """A gate's candidate or a sweep's release with Core before 0.19 has no megatron.core.ssm.gated_delta_net package:
    install() changes nothing and says so, so every other case of that release still builds (it used to raise in every
    Bridge build). Planted: the import raising anything else still raises."""
    import importlib

    real = importlib.import_module

    def without_gdn(name, *a, **kw):
        if name.startswith("megatron.core.ssm.gated_delta_net"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real(name, *a, **kw)

    monkeypatch.setattr(importlib, "import_module", without_gdn)
    assert cpu_gdn.install() is False

    def broken(name, *a, **kw):
        if name.startswith("megatron.core.ssm.gated_delta_net"):
            raise ImportError("a broken install")
        return real(name, *a, **kw)

    monkeypatch.setattr(importlib, "import_module", broken)
    with pytest.raises(ImportError, match="broken install"):
        cpu_gdn.install()
