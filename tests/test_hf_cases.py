"""The HF and PEFT cases fail when an export is wrong: one flipped bit in the HF weights,
one flipped bit in a lora_B, an adapter file missing a tensor, a lost lora_alpha (verl #1821)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness import backends
from harness.backends.bridge_hf import BridgeHF
from harness.backends.bridge_peft import BridgePeft
from harness.matrix import CaseSpec
from harness.runner import run_case
from harness.topology import Topology


def _edit_in_file(directory, key_part, edit):
    """Apply edit(state, key) to the first tensor whose key contains key_part, in place on disk."""
    (f,) = sorted(directory.glob("*.safetensors"))
    state = load_file(str(f))
    key = sorted(k for k in state if key_part in k)[0]
    edit(state, key)
    save_file(state, str(f), metadata={"format": "pt"})


def _flip_in_file(directory, key_part, bit=0):
    def flip(state, key):
        state[key].view(-1).view(torch.int32)[0] ^= 1 << bit

    _edit_in_file(directory, key_part, flip)


class FlipExportedWeight(BridgeHF):
    def save(self, ctx, model, directory):
        super().save(ctx, model, directory)
        if ctx.rank == 0 and directory.name == "hf-export":
            # the top mantissa bit: a lowest-bit flip may round away in the logits, and the
            # logits check must be seen to fail too (export-bitwise catches any bit)
            _flip_in_file(directory, "layers.1.self_attn.k_proj.weight", bit=22)


class FlipLoraB(BridgePeft):
    def save(self, ctx, model, directory):
        super().save(ctx, model, directory)
        if ctx.rank == 0:
            _flip_in_file(directory, "layers.2.self_attn.v_proj.lora_B")


class DropLoraA(BridgePeft):
    def save(self, ctx, model, directory):
        super().save(ctx, model, directory)
        if ctx.rank == 0:
            _edit_in_file(directory, "layers.0.mlp.down_proj.lora_A", lambda state, key: state.pop(key))


class LoseAlpha(BridgePeft):
    def save(self, ctx, model, directory):
        super().save(ctx, model, directory)
        if ctx.rank == 0:
            cfg = json.loads((directory / "adapter_config.json").read_text())
            cfg["lora_alpha"] = 0
            (directory / "adapter_config.json").write_text(json.dumps(cfg))


@pytest.fixture
def override():
    """Swap a backend for a faulty double; forked ranks inherit the swap."""
    saved = dict(backends._extra)

    def swap(name, cls):
        double = cls()
        double.name = name
        backends.register(double)

    yield swap
    backends._extra.clear()
    backends._extra.update(saved)


def _spec(case, backend, src="tp2", dst="tp2", model="hf-llama", **opts):
    return CaseSpec(case, model, backend, Topology.parse(src), Topology.parse(dst), options=tuple(sorted(opts.items())), timeout_s=180)


def _checks(r):
    return {c.name: c.status for c in r.checks}


def test_hf_roundtrip_passes_and_names_its_tolerances():
    r = run_case(_spec("hf-roundtrip", "bridge_hf", src="tp2", dst="pp2", model="hf-qwen2"))
    assert r.status == "passed", r.failure_text()
    assert _checks(r)["export-bitwise"] == "passed" and r.check("hf-logits").max_abs_diff == 0.0
    assert r.check("megatron-logits@tp1pp2dp1cp1").tolerance.startswith("atol=")


def test_one_flipped_bit_in_the_hf_export_fails(override):
    override("bridge_hf", FlipExportedWeight)
    r = run_case(_spec("hf-roundtrip", "bridge_hf"))
    assert r.status == "failed"
    (m,) = r.check("export-bitwise").mismatches
    assert m.key == "model.layers.1.self_attn.k_proj.weight" and m.kind == "value"
    assert _checks(r)["hf-logits"] == "failed"


def test_peft_export_passes_every_check():
    r = run_case(_spec("peft-export", "bridge_peft", adapter="lora"))
    assert r.status == "passed", r.failure_text()
    assert set(_checks(r)) == {"peft-load", "adapter-derivation", "adapter-config", "merge", "logits"}


def _failed_peft_export(override, double):
    override("bridge_peft", double)
    r = run_case(_spec("peft-export", "bridge_peft", src="tp1", dst="tp1", adapter="lora"))
    assert r.status == "failed"
    return r


def test_one_flipped_bit_in_a_lora_b_fails_the_derivation(override):
    r = _failed_peft_export(override, FlipLoraB)
    (m,) = r.check("adapter-derivation").mismatches
    assert m.key == "base_model.model.model.layers.2.self_attn.v_proj.lora_B.weight"


def test_a_lost_lora_alpha_fails_config_and_logits(override):
    r = _failed_peft_export(override, LoseAlpha)
    assert "lora_alpha: asked 8, exported 0" in r.check("adapter-config").detail
    assert _checks(r)["logits"] == "failed"


def test_an_adapter_missing_a_tensor_fails_peft_load(override):
    r = _failed_peft_export(override, DropLoraA)
    assert "missing: base_model.model.model.layers.0.mlp.down_proj.lora_A" in r.check("peft-load").detail
    assert _checks(r)["adapter-derivation"] == "failed"
