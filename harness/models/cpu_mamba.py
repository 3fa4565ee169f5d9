"""CPU stand-ins for the mamba_ssm and causal-conv1d kernels megatron-core's MambaMixer imports
(ssm/mamba_mixer.py: `causal_conv1d_fn`, mamba_ssm's gated `RMSNorm`, `mamba_chunk_scan_combined`,
`mamba_split_conv1d_scan_combined`), with the kernels' call signatures and layouts, so Core's mixer
(Nemotron-H, Falcon-H1) builds and runs unchanged on CPU.

Written from the math, in plain torch and fp32, token by token (the harness's sequences are short).
Mamba-2's SSD (Dao and Gu, 2024) keeps per head h a state S (headdim x d_state) and, per token t,

    dt_t = softplus(dt_t + dt_bias)                      (the step size, clamped to dt_limit)
    S    <- exp(dt_t * A_h) * S + dt_t * x_t B_t^T       (decay, then write: B of the head's group)
    y_t  = S C_t + D_h * x_t                             (read with C, plus the skip)

then `y * silu(z)` where a gate is given. The gated RMSNorm normalises per group of `group_size`
channels, gating with silu(z) before (norm_before_gate False) or after. The causal conv is depthwise
over [batch, dim, time], zero-padded before the first token.

They are not the chunked Triton kernels, and not transformers' chunked torch path either:
tests/test_cpu_mamba.py checks them against transformers' NemotronH `torch_forward` within
MAMBA_TOLERANCE. `install()` binds them into Core only where mamba_ssm is missing (on a machine with
the kernels, Core keeps them).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect

import torch
import torch.nn.functional as F

#: agreement with transformers' chunked torch reference in fp32: the chunked form sums in another order
MAMBA_TOLERANCE = {"atol": 1e-5, "rtol": 1e-4}

_MIXER = "megatron.core.ssm.mamba_mixer"


def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, seq_idx=None,
                     initial_states: torch.Tensor | None = None, return_final_states: bool = False,
                     final_states_out=None, activation: str | None = None, **_: object):
    """causal_conv1d.causal_conv1d_fn: x [b, d, t], weight [d, w]; out[:, :, t] = act(bias + sum_j
    weight[:, j] * x[:, :, t - (w - 1) + j]), zeros (or `initial_states` [b, d, w - 1]) before the first token."""
    if seq_idx is not None:
        raise NotImplementedError("cpu_mamba.causal_conv1d_fn: packed sequences (seq_idx) are not supported by the CPU stand-in")
    from harness.models.cpu_gdn import depthwise_window

    width = weight.shape[-1]
    past = initial_states.to(x.dtype) if initial_states is not None else x.new_zeros(x.shape[0], x.shape[1], width - 1)
    padded = torch.cat([past, x], dim=-1).float()  # in fp32, as the kernel accumulates
    out = depthwise_window(padded, weight.float(), None if bias is None else bias.float(), activation,
                           "cpu_mamba.causal_conv1d_fn").to(x.dtype)
    if return_final_states:
        return out, padded[..., -(width - 1):].to(x.dtype).contiguous()
    return out


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor | None = None, z: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
             dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, float("inf")),
             initial_states: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD recurrence (module docstring): x [b, t, h, p], dt [b, t, h], A [h], B and C [b, t, g, n],
    D [h] or [h, p], z like x. Returns (y like x in x's dtype, the final state [b, h, p, n] in fp32)."""
    dtype = x.dtype
    b, steps, h, p = x.shape
    x, dt, A, B, C = x.float(), dt.float(), A.float(), B.float(), C.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if dt_limit != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    per_group = h // B.shape[2]
    B, C = B.repeat_interleave(per_group, dim=2), C.repeat_interleave(per_group, dim=2)  # each head reads its group's
    state = x.new_zeros(b, h, p, B.shape[-1]) if initial_states is None else initial_states.float().clone()
    out = []
    for t in range(steps):
        decay = torch.exp(dt[:, t] * A)  # b, h
        state = state * decay[..., None, None] + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        out.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    y = torch.stack(out, dim=1)
    if D is not None:
        y = y + x * (D.float()[:, None] if D.dim() == 1 else D.float())
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(dtype), state


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
                              cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False,
                              return_varlen_states=False, **_: object):
    """mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined (the chunk size only tiles the kernel's work)."""
    if seq_idx is not None or cu_seqlens is not None or return_varlen_states:
        raise NotImplementedError("cpu_mamba.mamba_chunk_scan_combined: packed sequences are not supported by the CPU stand-in")
    y, state = ssd_scan(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
                        initial_states=initial_states)
    return (y, state) if return_final_states else y


def rms_norm_gated(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, z: torch.Tensor | None = None,
                   eps: float = 1e-6, group_size: int | None = None, norm_before_gate: bool = True) -> torch.Tensor:
    """mamba_ssm's gated RMSNorm in fp32: silu(z) gates before the norm (norm_before_gate False) or after;
    the RMS is taken per group of `group_size` channels (all of them where None)."""
    dtype = x.dtype
    x = x.float()
    gate = F.silu(z.float()) if z is not None else None
    if gate is not None and not norm_before_gate:
        x = x * gate
    size = x.shape[-1] if group_size is None else group_size
    grouped = x.unflatten(-1, (x.shape[-1] // size, size))
    out = (grouped * torch.rsqrt(grouped.square().mean(-1, keepdim=True) + eps)).flatten(-2) * weight.float()
    if bias is not None:
        out = out + bias.float()
    if gate is not None and norm_before_gate:
        out = out * gate
    return out.to(dtype)


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states=None,
                                     seq_idx=None, dt_limit=(0.0, float("inf")), return_final_states=False, activation="silu",
                                     rmsnorm_weight=None, rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None,
                                     headdim=None, ngroups=1, norm_before_gate=True, **_: object):
    """mamba_ssm's fused training path: split [z, xBC, dt], causal conv over xBC, SSD (gated by z where no
    norm weight is given, else the gated RMSNorm), the optional out projection. zxbcdt [b, t, ...]."""
    if seq_idx is not None:
        raise NotImplementedError("cpu_mamba.mamba_split_conv1d_scan_combined: packed sequences are not supported by the CPU stand-in")
    nheads = D.shape[0]
    headdim = D.shape[1] if D.dim() == 2 else headdim
    dim = nheads * headdim
    dstate = (zxbcdt.shape[-1] - 2 * dim - nheads) // ngroups // 2
    z, xBC, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    xBC = causal_conv1d_fn(xBC.transpose(1, 2), conv1d_weight, conv1d_bias, activation=activation).transpose(1, 2)
    x, B, C = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    b, t = x.shape[:2]
    y, state = ssd_scan(x.reshape(b, t, nheads, headdim), dt.to(x.dtype), A, B.reshape(b, t, ngroups, dstate),
                        C.reshape(b, t, ngroups, dstate), D=D, z=z.reshape(b, t, nheads, headdim) if rmsnorm_weight is None else None,
                        dt_bias=dt_bias, dt_softplus=True, dt_limit=dt_limit, initial_states=initial_states)
    y = y.reshape(b, t, dim)
    if rmsnorm_weight is not None:
        y = rms_norm_gated(y, rmsnorm_weight, None, z=z, eps=rmsnorm_eps, group_size=dim // ngroups, norm_before_gate=norm_before_gate)
    if outproj_weight is not None:
        y = F.linear(y, outproj_weight, outproj_bias)
    return (y, state) if return_final_states else y


class RMSNormGated(torch.nn.Module):
    """mamba_ssm.ops.triton.layernorm_gated.RMSNorm: a `weight` (ones) and no bias, as the kernel's module."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None, norm_before_gate: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        return rms_norm_gated(x, self.weight, self.bias, z=z, eps=self.eps, group_size=self.group_size,
                              norm_before_gate=self.norm_before_gate)


def _rebuild_extended_norm(mixer) -> None:
    """Core's ExtendedRMSNorm subclasses RMSNormGated at import; without mamba_ssm that base is a MagicMock
    and so is the class. Re-run Core's own class statement (its source, from the installed file) over the
    stand-in base, so its sharded_state_dict is the installed Core's, whatever release that is."""
    tree = ast.parse(inspect.getsource(mixer))
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ExtendedRMSNorm"), None)
    if node is None:
        raise RuntimeError(f"{mixer.__file__}: no class ExtendedRMSNorm to rebuild over the CPU RMSNormGated")
    exec(compile(ast.Module(body=[node], type_ignores=[]), mixer.__file__, "exec"), mixer.__dict__)


def install() -> bool:
    """Bind the stand-ins where megatron-core's MambaMixer found no mamba_ssm (its scan functions None), so
    the mixer builds and runs on CPU; True when installed (or already), False where the kernels are there.
    Detects what it fixes: the names Core left None."""
    mixer = importlib.import_module(_MIXER)
    if mixer.mamba_chunk_scan_combined is mamba_chunk_scan_combined:
        return True
    if mixer.mamba_chunk_scan_combined is not None or importlib.util.find_spec("mamba_ssm") is not None:
        return False
    mixer.RMSNormGated = RMSNormGated
    _rebuild_extended_norm(mixer)
    mixer.mamba_chunk_scan_combined = mamba_chunk_scan_combined
    mixer.mamba_split_conv1d_scan_combined = mamba_split_conv1d_scan_combined
    if mixer.causal_conv1d_fn is None:
        mixer.causal_conv1d_fn = causal_conv1d_fn
    mixer.HAVE_MAMBA_SSM = True
    return True
