"""`ckpt-harness inspect` and `check-load` (harness/inspect/, docs/inspect.md) on real files: one small
corpus made once per module by the golden corpus's own model writer (an MoE model-only torch_dist
checkpoint saved at dp2ep2) plus a tiny HF model directory and PEFT adapter written here, then copies
damaged the faults matrix's ways (harness/faults/damage.py), an MoE checkpoint whose metadata lost one
expert's shards, and a model that does not match. The whole golden corpus (Bridge's HF export and
adapter-only checkpoint included) is checked by hand in docs/inspect.md's table. Also: Bridge, verl and
older megatron-core layouts (common.pt with Megatron-LM's args) built from a copy of the same checkpoint,
and the opt-in rule for unpickling in full."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

from harness import cli
from harness.core.topology import Topology
from harness.faults import damage
from harness.gate import golden
from harness.inspect.check_load import check_load
from harness.inspect.detect import inspect
from harness.inspect.part import HF, PEFT, TORCH_DIST, InspectInputError
from harness.judge.ckpt_content import load_metadata

EXPERTS = "decoder.layers.mlp.experts.experts."


def _hf_dirs(out: Path) -> None:
    """A tiny HF model directory and a PEFT LoRA adapter beside the corpus (written here: no transformers,
    no Bridge import, which would double the module's time; the real ones are in docs/inspect.md's table)."""
    import torch
    from safetensors.torch import save_file

    (out / "hf").mkdir()
    (out / "hf" / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                       "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 8,
                                                       "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 128,
                                                       "tie_word_embeddings": False, "dtype": "float32"}))
    save_file({"model.embed_tokens.weight": torch.zeros(128, 64), "lm_head.weight": torch.zeros(128, 64)},
              str(out / "hf" / "model.safetensors"))
    (out / "adapter").mkdir()
    (out / "adapter" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                                    "target_modules": ["q_proj", "v_proj"]}))
    base = "base_model.model.model.layers.0.self_attn"
    save_file({f"{base}.{m}.lora_{ab}.weight": torch.zeros((4, 64) if ab == "A" else (64, 4))
               for m in ("q_proj", "v_proj") for ab in "AB"}, str(out / "adapter" / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A golden corpus of one artefact (gpt-moe saved at dp2ep2 by the corpus's own model writer)."""
    out = tmp_path_factory.mktemp("inspect") / "corpus"
    moe = golden.Artefact("moe-dist", "gpt-moe", Topology(dp=2, ep=2), Topology(), "MoE model-only torch_dist",
                          golden._model_make, golden._model_check)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(golden, "ARTEFACTS", (moe,))
        results = golden.make(out)
    assert [r.status for r in results] == ["passed"], [r.error for r in results]
    (out / "extra").mkdir()
    _hf_dirs(out / "extra")
    return out


@pytest.fixture
def copy(corpus: Path, tmp_path: Path) -> Path:
    shutil.copytree(corpus, tmp_path / "corpus")
    return tmp_path / "corpus"


def _run(*argv: str, capsys) -> tuple[int, str]:
    rc = cli.main(list(argv))
    return rc, capsys.readouterr().out


def test_formats_and_records(corpus: Path):
    ins = inspect(corpus)
    assert ins.layout == "golden corpus" and ins.all_findings == []
    formats = {str(p.path.relative_to(corpus)): p.format for p in ins.parts}
    assert formats == {"moe-dist/ckpt": TORCH_DIST, "extra/adapter": PEFT, "extra/hf": HF}
    assert ins.info["versions"]["megatron-core"] and ins.info["artefacts"]["moe-dist"]["model"] == "gpt-moe"
    moe = next(p for p in ins.parts if p.path.name == "ckpt" and p.path.parent.name == "moe-dist")
    assert moe.info["optimizer"] == "none" and moe.info["files"]["writer_ranks"] == 2 and moe.info["topology"]["tp"] == 1
    adapter = next(p for p in ins.parts if p.format == PEFT)
    assert adapter.info["adapter_config"]["r"] == 4 and adapter.info["tensors"] > 0


def test_check_load_passes_at_valid_targets(corpus: Path, capsys):
    for d, to in (("moe-dist", "tp2pp2dp1ep1"), ("moe-dist", "tp1pp1dp4ep4"), ("extra", "tp1pp2")):
        rc, out = _run("check-load", str(corpus / d), "--to", to, capsys=capsys)
        assert rc == 0 and "**LOADS**" in out, out
    r = check_load(corpus / "moe-dist", "tp1pp1dp2ep2")
    (part,) = r["parts"]
    assert part["model_from"].startswith("corpus manifest") and part["asked"] > 0 and part["ranks_built"] == 2
    assert not (part["missing"] or part["mismatched"] or part["uncovered"] or part["unexpected"])


def test_damaged_copies_fail(copy: Path, capsys):
    shard = damage.missing_shard(copy / "moe-dist" / "ckpt")
    rc, out = _run("check-load", str(copy / "moe-dist"), "--to", "tp2", capsys=capsys)
    assert rc == 1 and shard.files[0] in out and "missing on disk" in out, out
    cut = copy / "extra" / "adapter" / "adapter_model.safetensors"
    cut.write_bytes(cut.read_bytes()[:20])  # the header itself torn
    r = check_load(copy / "extra", "tp1pp2")
    bad = [f for p in r["parts"] for f in p["integrity"]]
    assert r["exit_code"] == 1 and any("adapter_model.safetensors" in f for f in bad), bad
    rc, out = _run("inspect", str(copy), capsys=capsys)
    assert rc == 1 and "INTEGRITY FINDINGS" in out and shard.files[0] in out


def test_truncated_safetensors_data_and_adapter_config(copy: Path):
    d = copy / "extra" / "hf"
    damage.truncate_safetensors(d)
    ins = inspect(d)
    assert ins.all_findings and "model.safetensors" in ins.all_findings[0]
    a = copy / "extra" / "adapter"
    damage.adapter_config_mismatch(a)
    assert any("adapter_config.json says r 8" in f for f in inspect(a).all_findings)


def _drop_expert(ckpt: Path, expert: int) -> int:
    """Plant: the metadata loses every chunk (and byte range) of one expert; re-saved as torch writes it."""
    md = load_metadata(ckpt / ".metadata")
    dropped = 0
    for key, item in md.state_dict_metadata.items():
        if key.startswith(EXPERTS) and hasattr(item, "chunks"):  # not the experts' _extra_state objects
            keep = [c for c in item.chunks if c.offsets[1] != expert]
            dropped += len(item.chunks) - len(keep)
            item.chunks[:] = keep
    for index in [i for i in md.storage_data if i.fqn.startswith(EXPERTS) and i.offset is not None and i.offset[1] == expert]:
        del md.storage_data[index]
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return dropped


def test_planted_moe_checkpoint_without_one_expert(copy: Path, capsys):
    assert _drop_expert(copy / "moe-dist" / "ckpt", expert=1) > 0
    findings = inspect(copy / "moe-dist").all_findings
    assert any(EXPERTS + "linear_fc1.weight: gap" in f and "index 1 on axis 1" in f for f in findings), findings
    rc, out = _run("check-load", str(copy / "moe-dist"), "--to", "tp1pp1dp2ep2", "--json", capsys=capsys)
    doc = json.loads(out)
    uncovered = {u["key"]: u for u in doc["parts"][0]["uncovered"]}
    assert rc == 1 and set(uncovered) == {EXPERTS + "linear_fc1.weight", EXPERTS + "linear_fc2.weight"}, doc
    assert uncovered[EXPERTS + "linear_fc1.weight"]["ranks"] == "0"  # ep rank 0 holds experts 0 and 1 at ep2


def test_model_that_does_not_match(corpus: Path, tmp_path: Path, capsys):
    cfg = json.loads((corpus / "extra" / "hf" / "config.json").read_text())
    cfg.update(hidden_size=2 * cfg["hidden_size"], num_experts=4, moe_intermediate_size=32, num_experts_per_tok=2)
    (tmp_path / "wide.json").write_text(json.dumps(cfg))
    rc, out = _run("check-load", str(corpus / "moe-dist"), "--to", "tp2", "--model", str(tmp_path / "wide.json"), "--json",
                   capsys=capsys)
    part = json.loads(out)["parts"][0]
    assert rc == 1 and part["model_from"].startswith("--model")
    assert any(m.startswith("embedding.word_embeddings.weight: saved [128, 64]") for m in part["mismatched"]), part["mismatched"]


def test_bad_input_is_exit_2(tmp_path: Path, corpus: Path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    assert cli.main(["inspect", str(tmp_path)]) == 2
    assert "no checkpoint here" in capsys.readouterr().err
    assert cli.main(["inspect", str(tmp_path / "absent")]) == 2
    assert cli.main(["check-load", str(corpus / "moe-dist"), "--to", "tp3"]) == 2  # 4 layers x 8 heads: tp3 cannot hold it
    assert cli.main(["check-load", str(corpus / "moe-dist"), "--to", "tpx"]) == 2
    solo = tmp_path / "solo"
    shutil.copytree(corpus / "moe-dist" / "ckpt", solo)  # outside the corpus: no record of its model
    assert cli.main(["check-load", str(solo), "--to", "tp2"]) == 2
    assert "records no model" in capsys.readouterr().err
    with pytest.raises(InspectInputError, match="not a checkpoint directory"):
        inspect(tmp_path / "notes.txt")


def test_untrusted_metadata_needs_the_flag(copy: Path, tmp_path: Path, capsys):
    class Plant:
        def __reduce__(self):
            return (open, (str(tmp_path / "marker"), "w"))

    ckpt = copy / "moe-dist" / "ckpt"
    md = load_metadata(ckpt / ".metadata")
    md.planner_data = Plant()
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)
    assert cli.main(["inspect", str(ckpt)]) == 2
    assert "--allow-unpickle" in capsys.readouterr().err and not (tmp_path / "marker").exists()
    cli.main(["inspect", str(ckpt), "--allow-unpickle"])
    assert (tmp_path / "marker").exists()


def test_a_bridge_training_dir_records_its_model(corpus: Path, tmp_path: Path):
    """Bridge's layout (iter_<N>/ + run_config.yaml + the tracker): the model comes from run_config.yaml's
    `model:` (the provider's fields), and the tracker must name an iteration on disk."""
    run = tmp_path / "run"
    shutil.copytree(corpus / "moe-dist" / "ckpt", run / "iter_0000002")
    (run / "latest_checkpointed_iteration.txt").write_text("2")
    model = dict(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=128,
                 vocab_size=128, seq_length=16, num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
                 share_embeddings_and_output_weights=False, tensor_model_parallel_size=1, expert_model_parallel_size=2)
    import yaml

    (run / "iter_0000002" / "run_config.yaml").write_text(yaml.safe_dump({"model": model}))
    r = check_load(run, "tp2pp2")
    assert r["exit_code"] == 0 and r["layout"] == "Bridge training dir", r
    assert r["parts"][0]["model_from"] == "Bridge run_config.yaml"
    (run / "latest_checkpointed_iteration.txt").write_text("3")
    assert inspect(run).findings == ["latest_checkpointed_iteration.txt names iter_0000003, which is not on disk"]
    (run / "iter_0000002" / "run_config.yaml").write_text(yaml.safe_dump({"model": {**model, "hidden_size": 96}}))
    assert any("saved [4, 64]" in m for m in check_load(run, "tp2pp2")["parts"][0]["mismatched"])


def test_megatron_lm_args_vocab_and_tie():
    from harness.inspect.model import from_fields

    args = dict(num_layers=4, hidden_size=64, num_attention_heads=8, ffn_hidden_size=128, padded_vocab_size=256,
                make_vocab_size_divisible_by=128, bf16=True, untie_embeddings_and_output_weights=True)
    m = from_fields("args", args, megatron_lm=True)
    assert (m.vocab_size, m.make_vocab_size_divisible_by, m.dtype, m.tied, m.num_query_groups) == (256, None, "bfloat16", False, 8)
    m = from_fields("args", {**args, "vocab_size": 100, "untie_embeddings_and_output_weights": False}, megatron_lm=True)
    assert (m.padded_vocab(2), m.tied) == (256, True)
    with pytest.raises(InspectInputError, match="lacks"):
        from_fields("args", {"hidden_size": 64}, megatron_lm=True)


def test_a_zoo_model_keeps_its_moe_layer_pattern():
    """check-load plans gpt-moe-uneven with layers 0 and 3 dense (the zoo's moe_layer_freq reaches the planner)."""
    from harness.inspect.model import from_zoo

    assert from_zoo("gpt-moe-uneven").moe_layer_freq == (0, 1, 1, 0)
    assert from_zoo("gpt-moe").moe_layer_freq is None and from_zoo("gpt-25m").moe_layer_freq is None


def test_a_verl_dir_and_its_hf_config(corpus: Path, tmp_path: Path):
    """verl's layout (global_step_<N>/actor/model/dist_ckpt + actor/huggingface/config.json + the tracker):
    the dist checkpoint is found four levels down and the model read from the HF config beside it."""
    run = tmp_path / "verl"
    actor = run / "global_step_2" / "actor"
    shutil.copytree(corpus / "moe-dist" / "ckpt", actor / "model" / "dist_ckpt")
    (run / "latest_checkpointed_iteration.txt").write_text("2")
    cfg = {"architectures": ["MixtralForCausalLM"], "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 8,
           "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 128, "num_local_experts": 4,
           "moe_intermediate_size": 32, "num_experts_per_tok": 2, "dtype": "float32"}
    (actor / "huggingface").mkdir()
    (actor / "huggingface" / "config.json").write_text(json.dumps(cfg))
    r = check_load(run, "tp1pp2dp2ep2")
    assert r["layout"] == "verl checkpoint dir" and r["exit_code"] == 0, r
    assert r["parts"][0]["model_from"] == "verl's actor/huggingface/config.json"
    (actor / "huggingface" / "config.json").write_text(json.dumps({**cfg, "num_local_experts": 8}))
    part = check_load(run, "tp1pp2dp2ep2")["parts"][0]
    assert any(m.startswith(EXPERTS + "linear_fc1.weight: saved [4, 4,") for m in part["mismatched"]), part


class _Hook:
    """A value of the user's own class in Megatron-LM's args; unpickling it creates `marker`."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_megatron_lm_args_and_the_unpickle_flag(corpus: Path, tmp_path: Path, capsys):
    """An older megatron-core layout (common.pt beside the .distcp files) holding Megatron-LM's args: an
    argparse.Namespace of plain values is read weights_only (the model comes from it); args holding a
    global weights_only refuses stay unread without the flag (no model known: exit 2 naming the flag, and
    nothing ran), and are unpickled in full with it."""
    import argparse

    import torch

    ckpt = tmp_path / "ckpt"
    shutil.copytree(corpus / "moe-dist" / "ckpt", ckpt)
    md = load_metadata(ckpt / ".metadata")
    for key in [k for k in md.state_dict_metadata if k.startswith("common_state")]:
        del md.state_dict_metadata[key]
    for index in [i for i in md.storage_data if i.fqn.startswith("common_state")]:
        del md.storage_data[index]
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)
    args = argparse.Namespace(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=128,
                              padded_vocab_size=128, seq_length=16, num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
                              untie_embeddings_and_output_weights=True, tensor_model_parallel_size=1,
                              pipeline_model_parallel_size=1, expert_model_parallel_size=2, world_size=2)
    torch.save({"args": args, "iteration": 7, "checkpoint_version": 3.0}, ckpt / "common.pt")
    part = inspect(ckpt).parts[0]
    assert part.info["common"] == {"iteration": 7, "checkpoint_version": 3.0} and part.info["topology"]["ep"] == 2
    r = check_load(ckpt, "tp2")
    assert r["exit_code"] == 0 and r["parts"][0]["model_from"] == "Megatron-LM args (common state)", r
    marker = tmp_path / "marker"
    args.hook = _Hook(str(marker))
    torch.save({"args": args, "iteration": 7}, ckpt / "common.pt")
    assert cli.main(["check-load", str(ckpt), "--to", "tp2"]) == 2
    assert "--allow-unpickle" in capsys.readouterr().err and not marker.exists()
    assert cli.main(["check-load", str(ckpt), "--to", "tp2", "--allow-unpickle"]) == 0
    assert marker.exists()
