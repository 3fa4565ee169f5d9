"""CPU stand-ins for the three flash-linear-attention (fla) kernels megatron-core's gated delta net
imports (ssm/gated_delta_net/common.py): `causal_conv1d`, `l2norm` and `chunk_gated_delta_rule`,
with fla's call signatures and layouts ([batch, time, ...]) so Core's GatedDeltaNet runs unchanged.

Written from the math, in plain torch and fp32, token by token (the harness's sequences are short):
the gated delta rule of Yang, Kautz and Hatamizadeh (2024) keeps per head a state S (d_k x d_v) and,
for each token t,

    S <- exp(g_t) * S                       (the decay gate)
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T  (the delta rule: write v_t where k_t reads)
    o_t = S^T (q_t / sqrt(d_k))

They are not fla's chunked Triton kernels, and not transformers' chunked torch reference either:
tests/test_cpu_gdn.py checks them against transformers' `torch_chunk_gated_delta_rule` and
`torch_causal_conv1d_update` (qwen3_next) within GDN_TOLERANCE. `install()` puts them into Core only
where fla is missing (on a machine with fla, Core keeps its kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: agreement with transformers' chunked torch reference in fp32: the chunked form sums in another order
GDN_TOLERANCE = {"atol": 1e-5, "rtol": 1e-4}


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) along `dim` (fla.modules.l2norm.l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None,
                  initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                  cu_seqlens: torch.Tensor | None = None, **_: object) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A depthwise causal convolution (fla.modules.convolution.causal_conv1d): x [b, t, d], weight
    [d, w]; out[:, t] = act(bias + sum_j weight[:, j] * x[:, t - (w - 1) + j]), zeros (or
    `initial_state` [b, d, w - 1]) before the first token. Returns (out, the last w - 1 inputs)."""
    if cu_seqlens is not None:
        raise NotImplementedError("cpu_gdn.causal_conv1d: packed sequences (cu_seqlens) are not supported by the CPU stand-in")
    width = weight.shape[-1]
    xt = x.transpose(1, 2)  # b, d, t
    past = initial_state.to(xt.dtype) if initial_state is not None else xt.new_zeros(xt.shape[0], xt.shape[1], width - 1)
    padded = torch.cat([past, xt], dim=-1)
    out = depthwise_window(padded, weight, bias, activation, "cpu_gdn.causal_conv1d")
    final = padded[..., -(width - 1):].contiguous() if output_final_state and width > 1 else None
    return out.transpose(1, 2).contiguous(), final


def depthwise_window(padded: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                     who: str) -> torch.Tensor:
    """The depthwise causal convolution over [b, d, w - 1 + t] inputs already padded with the past: out[..., t] =
    act(bias + sum_j weight[:, j] * padded[..., t + j]), in the dtype of what it is given (fla's and causal-conv1d's
    stand-ins share it). `who` names the stand-in in the error for an activation the kernels do not take."""
    width, steps = weight.shape[-1], padded.shape[-1] - weight.shape[-1] + 1
    out = sum(weight[:, j, None] * padded[..., j:j + steps] for j in range(width))
    if bias is not None:
        out = out + bias[:, None]
    if activation in ("silu", "swish"):
        return F.silu(out)
    if activation is not None:
        raise ValueError(f"{who}: activation {activation!r} (the kernel takes silu/swish or None)")
    return out


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: float | None = None, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           cu_seqlens: torch.Tensor | None = None, **_: object) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule (fla.ops.gated_delta_rule.chunk_gated_delta_rule's contract): q, k [b, t, h,
    d_k], v [b, t, h, d_v], g (log decay) and beta [b, t, h]; returns (o [b, t, h, d_v] in q's dtype,
    the final state [b, h, d_k, d_v] or None). Computed recurrently in fp32 (see the module docstring)."""
    if cu_seqlens is not None:
        raise NotImplementedError("cpu_gdn.chunk_gated_delta_rule: packed sequences (cu_seqlens) are not supported by the CPU stand-in")
    dtype = q.dtype
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    b, steps, h, dk = k.shape
    state = q.new_zeros(b, h, dk, v.shape[-1]) if initial_state is None else initial_state.float().clone()
    out = []
    for t in range(steps):
        state = state * g[:, t].exp()[..., None, None]
        read = torch.einsum("bhk,bhkv->bhv", k[:, t], state)
        delta = (v[:, t] - read) * beta[:, t][..., None]
        state = state + k[:, t][..., :, None] * delta[..., None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, state))
    o = torch.stack(out, dim=1).to(dtype)
    return o, (state if output_final_state else None)


#: the Core modules that bind fla's names at import (common.py defines them, gdn.py and the package re-import)
_CORE_MODULES = ("megatron.core.ssm.gated_delta_net.common", "megatron.core.ssm.gated_delta_net.gdn",
                 "megatron.core.ssm.gated_delta_net")


def install() -> bool:
    """Bind the stand-ins where megatron-core's gated delta net found no fla (its HAVE_FLA False, the
    three names None), so GatedDeltaNet builds and runs on CPU; True when installed, False where fla
    is there or the installed Core has no gated delta net (before 0.19: `megatron.core.ssm.gated_delta_net`
    is no package), nothing changed. Detects what it fixes: the names Core left None."""
    import importlib

    try:
        common = importlib.import_module(_CORE_MODULES[0])
    except ModuleNotFoundError:  # an older Core (a gate's candidate, a sweep's release): nothing to stand in for
        return False
    if getattr(common, "HAVE_FLA", True) and common.chunk_gated_delta_rule is not None:
        return False
    names = {"causal_conv1d": causal_conv1d, "l2norm": l2norm, "chunk_gated_delta_rule": chunk_gated_delta_rule}
    for mod_name in _CORE_MODULES:
        mod = importlib.import_module(mod_name)
        for name, fn in names.items():
            if hasattr(mod, name) and getattr(mod, name) in (None, fn):
                setattr(mod, name, fn)
        if hasattr(mod, "HAVE_FLA"):
            mod.HAVE_FLA = True
    return True
