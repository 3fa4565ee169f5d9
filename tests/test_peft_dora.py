"""DoRA in peft-export: the harness's derivation carries each magnitude as PEFT's lora_magnitude_vector, split
as lora_B's rows; adapter-config asks use_dora; each goes red on a planted fault and on empty input. In-process,
no world (the end-to-end case is extended.yaml's defect-dora-magnitude entries: Megatron-Bridge 0.6.2 leaves the
magnitude out of its export)."""

import pytest
import torch

from harness.cases import peft_export
from harness.cases.shared import peft as _peft
from harness.cases.shared.lora_layout import megatron_units
from harness.core import truth
from harness.core.options import parse_options
from harness.core.zoo import get_model
from harness.judge.checks import state_check
from harness.models import peft_mapping

LLAMA = get_model("hf-llama")
LAYER = "decoder.layers.0"
QKV_ROWS = LLAMA.num_key_value_heads * (LLAMA.num_attention_heads // LLAMA.num_key_value_heads + 2) * LLAMA.head_dim


def _adapter(base: str, rows: int, dim: int = 4, cols: int = 64) -> dict[str, torch.Tensor]:
    """One DoRA adapter's Megatron tensors: lora_B's rows numbered 0..rows-1, the magnitude numbered alike (+1000)."""
    b = torch.arange(rows, dtype=torch.float32)[:, None].repeat(1, dim)
    return {f"{LAYER}.{base}.adapter.linear_in.weight": torch.ones(dim, cols),
            f"{LAYER}.{base}.adapter.linear_out.weight": b,
            f"{LAYER}.{base}.adapter.weight_magnitude": torch.arange(rows, dtype=torch.float32) + 1000}


def _dora() -> dict[str, torch.Tensor]:
    return {**_adapter("self_attention.linear_qkv", QKV_ROWS), **_adapter("self_attention.linear_proj", 64),
            **_adapter("mlp.linear_fc1", 256), **_adapter("mlp.linear_fc2", 64, cols=128)}


def test_each_magnitude_is_split_onto_the_hf_modules_as_its_lora_b_rows():
    """Fused QKV per query group and the gated fc1's [gate; up] halves: every HF module's lora_magnitude_vector
    (1-D, no `.weight`, as peft's save_pretrained writes it) holds the rows its lora_B holds."""
    hf = peft_mapping.to_hf_peft(_dora(), LLAMA)
    mags = {k.removesuffix(".lora_magnitude_vector"): v for k, v in hf.items() if k.endswith(".lora_magnitude_vector")}
    assert sorted(k.rsplit(".", 1)[1] for k in mags) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    for module, m in mags.items():
        assert m.dim() == 1 and torch.equal(m - 1000, hf[f"{module}.lora_B.weight"][:, 0]), module
    assert megatron_units(hf, LLAMA) == megatron_units({k: v for k, v in hf.items() if "magnitude" not in k}, LLAMA)


def test_a_gathered_magnitude_is_de_interleaved_as_lora_b_and_a_row_parallel_one_is_replicated():
    """At TP 2 a gated fc1's magnitude shards are [gate_r; up_r] (de-interleaved as its lora_B); a row-parallel
    base's output is whole, so its magnitude is the same on every TP rank, and replicas that differ are refused."""
    fc1, proj = f"{LAYER}.mlp.linear_fc1.adapter.weight_magnitude", f"{LAYER}.self_attention.linear_proj.adapter.weight_magnitude"
    rows = torch.arange(8.0)
    pieces = [{"name": fc1, "tp_rank": r, "tp": 2, "data": rows[4 * r: 4 * r + 4]} for r in (0, 1)]
    pieces += [{"name": proj, "tp_rank": r, "tp": 2, "data": rows.clone()} for r in (0, 1)]
    full = peft_mapping.gather(pieces)
    assert full[fc1].tolist() == [0, 1, 4, 5, 2, 3, 6, 7] and torch.equal(full[proj], rows)
    pieces[-1] = {**pieces[-1], "data": rows + 1}
    with pytest.raises(ValueError, match="row-parallel DoRA magnitude differs across TP ranks"):
        peft_mapping.gather(pieces)


def test_adapter_derivation_goes_red_when_either_side_lacks_the_magnitude():
    """The Bridge 0.6.2 export (no magnitude) against the derivation, and a derivation that forgot the magnitude
    against a whole export: both name the lora_magnitude_vector key; nothing on both sides fails too."""
    derived = peft_mapping.to_hf_peft(_dora(), LLAMA)
    dropped = {k: v for k, v in derived.items() if "magnitude" not in k}
    assert state_check("adapter-derivation", derived, derived, "derivation", "export", "ok").status == "passed"
    for expected, actual, kind in ((derived, dropped, "missing"), (dropped, derived, "extra")):
        c = state_check("adapter-derivation", expected, actual, "derivation", "export", "ok")
        assert c.status == "failed" and {m.kind for m in c.mismatches} == {kind}
        assert all(m.key.endswith(".lora_magnitude_vector") for m in c.mismatches) and len(c.mismatches) == 7
    assert peft_mapping.to_hf_peft(peft_mapping.gather([]), LLAMA) == {}
    assert state_check("adapter-derivation", {}, {}, "derivation", "export", "ok").status == "failed"


@pytest.mark.parametrize("adapter, config, status", [
    ("dora", {"use_dora": True}, "passed"),
    ("dora", {}, "failed"),  # peft reads an absent use_dora as False: plain LoRA
    ("dora", {"use_dora": False}, "failed"),
    ("lora", {}, "passed"),
    ("lora", {"use_dora": False}, "passed"),
    ("lora", {"use_dora": True}, "failed"),
])
def test_adapter_config_asks_use_dora(adapter, config, status):
    asked = {"r": 4, "lora_alpha": 8, "use_dora": adapter == "dora"}
    c = _peft.config_check({"r": 4, "lora_alpha": 8, **config}, asked)
    assert c.status == status, c.detail
    if status == "failed":
        assert f"use_dora: asked {adapter == 'dora'}, exported {config.get('use_dora', False)}" in c.detail
    assert _peft.config_check({}, asked).status == "failed"


def test_dora_is_a_peft_export_option_built_with_lora_targets_and_the_shared_expert_layout_only():
    opts = parse_options(peft_export.PeftExportOptions, {"adapter": "dora"}, "peft-export")
    spec = opts.spec(LLAMA)
    assert spec.kind == "dora" and [t.rsplit(".", 1)[-1] for t in spec.targets] == list(_peft.ADAPTERS["lora"])
    with pytest.raises(ValueError, match="option 'adapter'"):  # peft-resume's and verl's options do not offer it
        parse_options(_peft.PeftOptions, {"adapter": "dora"}, "peft-resume")
    with pytest.raises(ValueError, match="not DoRA's"):
        parse_options(peft_export.PeftExportOptions, {"adapter": "dora", "experts": "per-expert"}, "peft-export").validate_layout(
            get_model("hf-qwen3moe"), ())
    with pytest.raises(ValueError, match="DoRA has the shared one only"):
        spec.__class__("dora", experts="per-expert").make()


def test_seeded_magnitudes_are_trained_like_and_rebuildable():
    """Positive, inside the fixtures' row-norm range, a function of (seed, name, TP rank): off PEFT's re-init."""
    m = truth.magnitude_tensor(77, f"{LAYER}.mlp.linear_fc1.adapter.weight_magnitude", 0, (256,))
    assert m.min() > 0.3 and m.max() < 0.6 and m.std() > 0.02
    assert torch.equal(m, truth.magnitude_tensor(77, f"{LAYER}.mlp.linear_fc1.adapter.weight_magnitude", 0, (256,)))
    assert not torch.equal(m, truth.magnitude_tensor(78, f"{LAYER}.mlp.linear_fc1.adapter.weight_magnitude", 0, (256,)))
