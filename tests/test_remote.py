"""Remote-code families (harness.models.remote): the fixture a Kimi-K2 / MiMo / Ling user holds (weights in
the layout the hub's modeling writes, a config.json with an auto_map to a configuration file beside it),
loaded as they load it (trust_remote_code), its MTP tensors where the remote modeling has them, and the
round trip's logits checks not-run, said so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.core.families import BY_NAME, FAMILIES
from harness.core.zoo import get_model
from harness.models import architectures as arch
from harness.models.hf import write_fixture

#: MiMo's MTP layer as the hub's remote code builds it (MiMo-7B modeling_mimo.py, class MiMoMTPLayers:
#: input/post-attention/token/hidden/final norms, input_proj Linear(2H, H, bias=False), Qwen2Attention, Qwen2MLP)
MIMO_MTP_NAMES = {f"model.mtp_layers.0.{k}" for k in (
    "input_layernorm.weight", "post_attention_layernorm.weight", "token_layernorm.weight", "hidden_layernorm.weight",
    "final_layernorm.weight", "input_proj.weight", "self_attn.q_proj.weight", "self_attn.q_proj.bias",
    "self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias",
    "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")}


def _keys(directory: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            out.update({k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()})
    return out


def test_remote_families_classify_and_their_layouts_exist():
    remote = [f for f in FAMILIES if f.path == "remote"]
    assert {"kimi_k2", "mimo", "sarvam_mla", "sarvam_moe", "bailing_moe_v2"} <= {f.name for f in remote}
    for f in remote:
        assert f.layout and f.model_type, f.name
        assert arch.classify(f)[0] == "remote", (f.name, arch.classify(f))
    # planted: a layout transformers and the Bridge both lack is "missing", naming it
    from dataclasses import replace

    status, why = arch.classify(replace(BY_NAME["kimi_k2"], layout="no_such_layout"))
    assert status == "missing" and "no_such_layout" in why


def test_kimi_fixture_loads_only_through_its_remote_configuration(tmp_path):
    """transformers has no kimi_k2: the config loads through the fixture's own configuration file, with
    trust_remote_code, as the Bridge's users load it; its remote spelling (scoring_func) survives, and the
    module transformers imports lands in the harness's HF_MODULES_CACHE."""
    import os

    from transformers import AutoConfig

    from harness.models.remote import modules_cache

    d = write_fixture(get_model("hf-kimi_k2"), tmp_path / "kimi")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k2" and cfg["architectures"] == ["KimiK2ForCausalLM"]
    assert cfg["auto_map"]["AutoConfig"] == "configuration_kimi_k2.KimiK2Config"
    assert (d / "configuration_kimi_k2.py").is_file()
    with pytest.raises((ValueError, KeyError)):
        AutoConfig.from_pretrained(str(d))  # without trust_remote_code: transformers does not know it
    loaded = AutoConfig.from_pretrained(str(d), trust_remote_code=True)
    assert type(loaded).__name__ == "KimiK2Config" and loaded.model_type == "kimi_k2"
    assert loaded.scoring_func == "sigmoid" and loaded.q_lora_rank == 32 and loaded.n_routed_experts == 4
    assert modules_cache() == os.environ["HF_MODULES_CACHE"]
    assert any(Path(modules_cache()).rglob("configuration_kimi_k2.py"))
    # the weights are DeepSeek-V3's layout, as the Hub's checkpoints spell it (per-expert names)
    keys = _keys(d)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in keys and "model.layers.1.mlp.gate.e_score_correction_bias" in keys


def test_mimo_fixture_holds_the_remote_mtp_layer(tmp_path):
    d = write_fixture(get_model("hf-mimo"), tmp_path / "mimo")
    keys = _keys(d)
    mtp = {k for k in keys if k.startswith("model.mtp_layers.")}
    assert mtp == MIMO_MTP_NAMES
    h = get_model("hf-mimo").hidden_size
    assert keys["model.mtp_layers.0.input_proj.weight"] == (h, 2 * h)
    assert keys["model.mtp_layers.0.self_attn.q_proj.weight"] == keys["model.layers.0.self_attn.q_proj.weight"]
    assert json.loads((d / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_bailing_layout_is_the_bridges_vendored_model(tmp_path):
    """Ling 2.0 / Sarvam-MoE: written by the Bridge's vendored copy of the hub code (registered with
    transformers' Auto classes when the Bridge is imported); Sarvam-MoE names its config apart."""
    d = write_fixture(get_model("hf-sarvam_moe"), tmp_path / "sarvam")
    keys = _keys(d)
    assert "model.word_embeddings.weight" in keys and "model.layers.0.attention.query_key_value.weight" in keys
    assert "model.layers.1.mlp.gate.expert_bias" in keys
    assert json.loads((d / "config.json").read_text())["model_type"] == "sarvam_moe"


def test_roundtrip_of_a_remote_family_runs_its_weights_and_says_why_no_logits(tmp_path):
    """tp1 -> pp2 of Kimi-K2 in the default tier: export bitwise through a dist checkpoint at D; the logits checks
    not-run naming the missing modeling class (never passed, never dropped)."""
    from harness.orchestration.runner import RunOptions, run_case

    spec = next(s for s in _smoke() if s.model == "hf-kimi_k2")
    res = run_case(spec, RunOptions(workdir=tmp_path))
    checks = {c.name.split("@")[0]: c for c in res.checks}
    assert res.status == "passed", [(c.name, c.status, c.detail[:200]) for c in res.checks] or res.error
    assert checks["export-bitwise"].status == "passed"
    for name in ("hf-logits", "megatron-logits"):
        assert checks[name].status == "not-run" and "remote code" in checks[name].detail


def _smoke():
    from harness.orchestration.matrix import load_matrix

    return load_matrix(Path(__file__).resolve().parents[1] / "matrices" / "smoke.yaml").cases


def test_decilm_fixture_is_heterogeneous_as_its_block_configs_say(tmp_path):
    """A block without attention holds no self_attn, MLP widths follow ffn_mult (DeciLM's rounding to 256), a
    block without MLP holds none: what megatron-core's heterogeneous spec must build for the export to match."""
    from harness.models.remote import ffn_width

    assert (ffn_width(2.625, 64), ffn_width(7.0, 64), ffn_width(2.625, 8192)) == (256, 512, 14336)  # Super-49B's 14336
    d = write_fixture(get_model("hf-llama_nemotron"), tmp_path / "deci")
    keys = _keys(d)
    assert not any(k.startswith("model.layers.1.self_attn.") for k in keys) and "model.layers.1.input_layernorm.weight" not in keys
    assert keys["model.layers.0.mlp.up_proj.weight"] == (256, 64) and keys["model.layers.2.mlp.up_proj.weight"] == (512, 64)
    assert not any(k.startswith("model.layers.3.mlp.") for k in keys) and "model.layers.3.self_attn.q_proj.weight" in keys
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "nemotron-nas" and cfg["auto_map"]["AutoConfig"] == "configuration_nemotron_nas.NemotronNasConfig"
    assert [b["attention"]["no_op"] for b in cfg["block_configs"]] == [False, True, False, False]


def test_diffusion_fixture_is_the_text_only_layout_and_needs_its_memory(tmp_path):
    """NemotronLabsDiffusion's text-only checkpoint: Ministral 3 under encoder.* with a diffusion_head; its cases ask
    for the host memory its attention's block mask takes, so a small machine says not-run, naming it."""
    from harness.core import requires

    d = write_fixture(get_model("hf-nemotron_labs_diffusion"), tmp_path / "dlm")
    keys = _keys(d)
    assert "diffusion_head.weight" in keys and "encoder.embed_tokens.weight" in keys and "encoder.layers.3.mlp.up_proj.weight" in keys
    assert not any(k.startswith(("model.", "lm_head.")) for k in keys)
    small = requires.Machine(0, False, "no transformer_engine", 24.0, None)
    assert requires.unmet(("host-memory-gib>=96",), 2, machine=small) == ["needs 96 GiB of host memory; this machine has 24.0 GiB"]
