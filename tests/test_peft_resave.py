"""peft-resave (peft-export, cases.shared.peft_resave): peft's own save_pretrained of the adapter the
Bridge exported must write the export again. The judge on made-up files (names each missing, extra and
differing key, a config field, the logits; nothing compared fails), then the case end to end: unplanted it
passes, and a fault planted in peft's save path (peft.peft_model.get_peft_model_state_dict, what
PeftModel.save_pretrained calls; the config's save) turns it red naming what was changed. The save runs in
the case's parent process (this one), so a monkeypatch reaches it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from harness.cases.shared.peft_resave import resave_check
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.orchestration.runner import run_case

A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
CFG = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA"}
LOGITS = torch.arange(12, dtype=torch.float32).reshape(1, 3, 4)


def _adapter(d, tensors, cfg=CFG):
    d.mkdir(parents=True, exist_ok=True)
    if tensors is not None:
        save_file(tensors, str(d / "adapter_model.safetensors"), metadata={"format": "pt"})
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    return d


E = "base_model.model.model.layers.0.mlp.experts.3.down_proj.lora_A.weight"


def _pair(tmp_path, resaved=None, cfg=None, exported=None):
    state = exported or {A: torch.ones(4, 8), B: torch.full((8, 4), 0.5)}
    return _adapter(tmp_path / "export", state), _adapter(tmp_path / "resave", state if resaved is None else resaved, cfg or CFG)


def test_an_identical_resave_passes_saying_what_it_compared(tmp_path):
    # target_modules is a set; use_rslora and modules_to_save left out read as peft's defaults
    c = resave_check(*_pair(tmp_path, cfg={**CFG, "target_modules": ["v_proj", "q_proj"], "use_rslora": False,
                                            "modules_to_save": None}), LOGITS, LOGITS.clone())
    assert c.status == "passed", c.detail
    assert "2 tensor(s) bitwise equal" in c.detail and "torch.equal" in c.detail and c.max_abs_diff == 0.0


def test_nothing_to_compare_fails(tmp_path):
    c = resave_check(_adapter(tmp_path / "export", {}), _adapter(tmp_path / "resave", {}), LOGITS, LOGITS)
    assert c.status == "failed" and "nothing to judge: no adapter tensor in either" in c.detail
    c = resave_check(_adapter(tmp_path / "e2", None), _adapter(tmp_path / "r2", None), LOGITS, LOGITS)
    assert c.status == "failed" and "no adapter_model.safetensors in" in c.detail
    c = resave_check(*_pair(tmp_path / "x"), LOGITS, None)
    assert c.status == "failed" and "no logits to compare (re-saved load)" in c.detail


@pytest.mark.parametrize("resaved, words", [
    ({A: torch.ones(4, 8)}, f"missing: {B} (bridge-export vs peft-resave) absent from peft-resave"),
    ({A: torch.ones(4, 8), B: torch.full((8, 4), 0.75)}, f"value: {B} (bridge-export vs peft-resave) max|diff|=0.25 not bitwise equal"),
    # narrower, or wider but not the same values: no upcast
    ({A: torch.ones(4, 8), B: torch.full((8, 4), 0.5, dtype=torch.bfloat16)}, f"dtype: {B} (bridge-export vs peft-resave) max|diff|=0"),
    ({A: torch.ones(4, 8), B: torch.full((8, 4), 0.5 + 1e-12, dtype=torch.float64)}, f"dtype: {B} (bridge-export vs peft-resave) max|diff|=1e-12"),
])
def test_each_differing_tensor_is_named(tmp_path, resaved, words):
    c = resave_check(*_pair(tmp_path, resaved), LOGITS, LOGITS)
    assert c.status == "failed" and words in c.detail, c.detail
    assert "1 of " in c.detail and "tensor(s) compared" in c.detail


@pytest.mark.parametrize("resaved, cfg, note", [
    # peft's from_pretrained upcasts a narrower adapter (autocast_adapter_dtype): exactly the same values
    ({A: torch.ones(4, 8), B: torch.full((8, 4), 0.5, dtype=torch.float64)}, {}, "1 tensor(s) re-saved upcast (torch.float32 -> torch.float64"),
    # peft saves the base lm_head/embedding when it is a target, or LoRA of modules the export has none of
    ({A: torch.ones(4, 8), B: torch.full((8, 4), 0.5), "lm_head.base_layer.weight": torch.ones(2)}, {},
     "1 tensor(s) only in the re-save, e.g. lm_head.base_layer.weight: judged by the logits"),
    # transformers 5 renamed the module on load and peft saved the loaded name: the same values
    ({A: torch.ones(4, 8), B.replace("model.model.", "model.model.language_model."): torch.full((8, 4), 0.5)}, {},
     f"1 tensor(s) re-saved under another name with the same values (the module names transformers gives the loaded model), "
     f"e.g. {B} -> {B.replace('model.model.', 'model.model.language_model.')}"),
])
def test_what_peft_writes_on_purpose_is_said_and_judged_by_the_logits(tmp_path, resaved, cfg, note):
    exported, again = _pair(tmp_path, resaved, cfg={**CFG, **cfg} if cfg else None)
    c = resave_check(exported, again, LOGITS, LOGITS)
    assert c.status == "passed" and note in c.detail, c.detail
    c = resave_check(exported, again, LOGITS, LOGITS + 1)  # the logits are what judges it: a changed one fails
    assert c.status == "failed" and "logits" in c.detail, c.detail


def test_an_moe_adapter_peft_moved_into_merged_experts_loses_only_its_per_expert_names(tmp_path):
    """peft moved it on load (target_parameters in the re-save): the per-expert tensors may go, nothing else."""
    moved = {**CFG, "target_parameters": ["down_proj"], "target_modules": ["q_proj"]}
    merged = {A: torch.ones(4, 8), B: torch.full((8, 4), 0.5), "experts.lora_A.weight": torch.ones(2)}
    exported, again = _pair(tmp_path / "ok", merged, cfg=moved, exported={A: torch.ones(4, 8), B: torch.full((8, 4), 0.5), E: torch.ones(3)})
    c = resave_check(exported, again, LOGITS, LOGITS)
    assert c.status == "passed" and f"1 per-expert tensor(s) re-saved in peft's merged-expert layout (target_parameters), not by name, e.g. {E}" in c.detail, c.detail
    exported, again = _pair(tmp_path / "bad", {A: torch.ones(4, 8)}, cfg=moved)  # a dense tensor dropped: no excuse
    c = resave_check(exported, again, LOGITS, LOGITS)
    assert c.status == "failed" and f"missing: {B}" in c.detail, c.detail


def test_a_renamed_tensor_must_hold_the_exports_values(tmp_path):
    exported, again = _pair(tmp_path, {A: torch.ones(4, 8), B.replace("layers.0", "layers.9"): torch.full((8, 4), 0.25)})
    c = resave_check(exported, again, LOGITS, LOGITS)
    assert c.status == "failed" and f"missing: {B}" in c.detail and "re-saved under another name" not in c.detail, c.detail


def test_nothing_compared_by_name_fails_even_with_equal_logits(tmp_path):
    c = resave_check(*_pair(tmp_path, {"other.weight": torch.ones(2)}, cfg={**CFG, "target_parameters": ["down_proj"]},
                            exported={E: torch.ones(3)}), LOGITS, LOGITS)
    assert c.status == "failed" and "no export tensor found in the re-save, by name or by value" in c.detail, c.detail


@pytest.mark.parametrize("field, value", [("lora_alpha", 16), ("r", 8), ("target_modules", ["q_proj"]), ("use_rslora", True),
                                          ("modules_to_save", ["lm_head"])])
def test_a_behaviour_field_of_the_config_is_named(tmp_path, field, value):
    c = resave_check(*_pair(tmp_path, cfg={**CFG, field: value}), LOGITS, LOGITS)
    assert c.status == "failed" and f"adapter_config.json {field}" in c.detail and "2 tensor(s) compared" in c.detail, c.detail


def test_logits_that_are_not_torch_equal_fail_with_their_difference(tmp_path):
    again = LOGITS.clone()
    again[0, 1, 2] += 2 ** -10
    c = resave_check(*_pair(tmp_path), LOGITS, again)
    assert c.status == "failed" and "value: logits (first load vs re-saved load) max|diff|=0.000977 not torch.equal" in c.detail
    assert c.max_abs_diff == pytest.approx(2 ** -10)


# ------------------------------------------------------------------ the case, end to end

V_PROJ_B = "base_model.model.model.layers.2.self_attn.v_proj.lora_B.weight"


def _run():
    spec = CaseSpec("peft-export", "hf-llama", "bridge_peft", Topology.parse("tp1"), Topology.parse("tp1"),
                    options=(("adapter", "lora"),), timeout_s=180)
    return run_case(spec)


def _failed(r):
    return {c.name for c in r.checks if c.failed}


def _plant_in_state_dict(monkeypatch, edit):
    """peft's save path with `edit` applied to the adapter state it would write (a copy: the loaded model,
    which the merge checks read after the save, stays as it was)."""
    import peft.peft_model

    real, calls = peft.peft_model.get_peft_model_state_dict, []

    def planted(*args, **kwargs):
        state = dict(real(*args, **kwargs))
        edit(state)
        calls.append(sorted(state))
        return state

    monkeypatch.setattr(peft.peft_model, "get_peft_model_state_dict", planted)
    return calls


def test_the_case_passes_peft_resave_unplanted():
    r = _run()
    assert r.status == "passed", r.failure_text()
    c = r.check("peft-resave")
    assert c.status == "passed" and "56 tensor(s) bitwise equal" in c.detail, c.detail


def test_one_flipped_bit_in_a_resaved_lora_b_fails_naming_it(monkeypatch):
    def flip(state):
        t = state[V_PROJ_B].detach().clone().contiguous()
        t.view(torch.int32).view(-1)[0] ^= 1  # the lowest mantissa bit of one element
        state[V_PROJ_B] = t

    calls = _plant_in_state_dict(monkeypatch, flip)
    r = _run()
    assert calls and r.status == "failed" and _failed(r) == {"peft-resave"}, r.failure_text()
    c = r.check("peft-resave")
    assert f"value: {V_PROJ_B} (bridge-export vs peft-resave)" in c.detail and "1 of 56 tensor(s) compared" in c.detail, c.detail
    assert [m.key for m in c.mismatches if m.key != "logits"] == [V_PROJ_B]


def test_a_lora_b_the_resave_drops_fails_naming_it(monkeypatch):
    calls = _plant_in_state_dict(monkeypatch, lambda state: state.pop(V_PROJ_B))
    r = _run()
    assert calls and _failed(r) == {"peft-resave"}, r.failure_text()
    c = r.check("peft-resave")
    assert f"missing: {V_PROJ_B} (bridge-export vs peft-resave) absent from peft-resave" in c.detail, c.detail
    # loaded again, the dropped lora_B is peft's zero init: the logits move
    assert "value: logits (first load vs re-saved load)" in c.detail and c.max_abs_diff > 0


def test_a_lora_alpha_the_resave_changes_fails_config_and_logits(monkeypatch):
    import peft.config

    real = peft.config.PeftConfigMixin.save_pretrained

    def planted(self, save_directory, **kwargs):
        real(self, save_directory, **kwargs)
        f = f"{save_directory}/adapter_config.json"
        cfg = json.loads(open(f).read())
        cfg["lora_alpha"] = 2 * cfg["lora_alpha"]
        open(f, "w").write(json.dumps(cfg))

    monkeypatch.setattr(peft.config.PeftConfigMixin, "save_pretrained", planted)
    r = _run()
    assert _failed(r) == {"peft-resave"}, r.failure_text()
    c = r.check("peft-resave")
    assert "adapter_config.json lora_alpha (bridge-export vs peft-resave) exported 8, re-saved 16" in c.detail, c.detail
    assert "56 tensor(s) compared (56 exported, 56 re-saved), all bitwise equal" in c.detail
    assert "value: logits (first load vs re-saved load)" in c.detail


def test_adapter_config_wants_the_causal_lm_task_type_users_loaders_read():
    """The Bridge's adapter_config.json names task_type CAUSAL_LM; without it AutoPeftModelForCausalLM's task
    class pick has nothing to go by (the first campaign's surviving mutant dropped that dict entry)."""
    from cases.shared.peft import CAUSAL_LM, config_check

    asked = {"r": 4, "lora_alpha": 8, "task_type": CAUSAL_LM}
    assert config_check({"r": 4, "lora_alpha": 8, "task_type": "CAUSAL_LM"}, asked).status == "passed"
    c = config_check({"r": 4, "lora_alpha": 8}, asked)
    assert c.status == "failed" and "task_type: asked 'CAUSAL_LM', exported None" in c.detail


def test_an_export_renamed_whole_on_load_passes_by_value(tmp_path):
    """Mistral3 / Gemma3 VL: transformers 5 renames every language-model module on load, so no name is shared."""
    moved = {k.replace("model.model.", "model.model.language_model."): v for k, v in
             {A: torch.ones(4, 8), B: torch.full((8, 4), 0.5)}.items()}
    c = resave_check(*_pair(tmp_path, moved), LOGITS, LOGITS)
    assert c.status == "passed" and "the export's 2 tensor(s)" in c.detail and "2 tensor(s) re-saved under another name" in c.detail, c.detail
