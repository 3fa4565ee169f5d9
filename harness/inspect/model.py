"""The model a checkpoint holds, as harness.plan builds it (a PlanModel): from `--model` when given (a
plan preset, an HF config.json/YAML, or a zoo model name as the corpus records them), else from the
checkpoint's own records, first found wins: Megatron-LM's `args` in the common state (weights_only
with the stdlib record classes; anything else in them needs --allow-unpickle), Bridge's
run_config.yaml (`model:`, the provider's fields), verl's `huggingface/config.json` beside the dist
checkpoint, the golden corpus manifest (`artefacts.<name>.model`, a zoo name)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from harness.inspect import detect
from harness.inspect.part import InspectInputError, Part
from harness.plan.model import PlanInputError, PlanModel, load_model, presets

#: megatron field -> PlanModel field, for Megatron-LM args and Bridge's provider (run_config.yaml `model:`)
_FIELDS = {"num_layers": "num_layers", "hidden_size": "hidden_size", "num_attention_heads": "num_attention_heads",
           "num_query_groups": "num_query_groups", "ffn_hidden_size": "ffn_hidden_size", "seq_length": "seq_length",
           "kv_channels": "kv_channels", "qk_layernorm": "qk_layernorm", "num_moe_experts": "num_moe_experts",
           "moe_router_topk": "moe_router_topk", "moe_ffn_hidden_size": "moe_ffn_hidden_size",
           "moe_shared_expert_intermediate_size": "moe_shared_expert_size",
           "make_vocab_size_divisible_by": "make_vocab_size_divisible_by"}


def from_zoo(name: str) -> PlanModel:
    """A harness zoo model (harness.core.zoo) the planner can build: a GPT of the zoo with SwiGLU,
    RMSNorm, RoPE and no biases, or a Llama / Qwen3-MoE fixture (Bridge builds those so), in fp32 as
    the harness trains and saves them."""
    from harness.core.zoo import ZOO

    m = ZOO[name]
    if m.kind == "gpt":
        if not m.swiglu or m.normalization != "RMSNorm" or m.add_bias_linear or m.add_qkv_bias or m.position_embedding != "rope":
            raise InspectInputError(f"model {name}: only SwiGLU + RMSNorm + RoPE models without biases are built by the planner")
        return PlanModel(name=name, num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
                         num_query_groups=m.num_query_groups, ffn_hidden_size=m.ffn_hidden_size, vocab_size=m.vocab_size,
                         seq_length=m.seq_length, tied=m.tied_embeddings, num_moe_experts=m.num_moe_experts,
                         moe_router_topk=m.moe_router_topk if m.num_moe_experts else 0, moe_ffn_hidden_size=m.moe_ffn_hidden_size,
                         moe_shared_expert_size=m.moe_shared_expert_size, dtype="float32",
                         make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
                         moe_layer_freq=tuple(m.moe_layer_freq) if m.num_moe_experts and m.moe_layer_freq else None)
    if m.arch not in ("llama", "qwen3_moe") or m.pad_vocab or m.overrides:
        raise InspectInputError(f"model {name}: HF fixture of arch {m.arch!r}: only plain Llama and Qwen3-MoE fixtures are built by the planner")
    return PlanModel(name=name, num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
                     num_query_groups=m.num_key_value_heads, ffn_hidden_size=m.intermediate_size, vocab_size=m.vocab_size,
                     seq_length=m.seq_length, tied=m.tied, qk_layernorm=m.arch == "qwen3_moe", num_moe_experts=m.num_experts,
                     moe_router_topk=m.num_experts_per_tok if m.num_experts else 0,
                     moe_ffn_hidden_size=m.moe_intermediate_size if m.num_experts else None, dtype="float32")


def from_ref(ref: str) -> PlanModel:
    """--model: a zoo name, a plan preset, or an HF config file (transformers 5's `dtype` read too)."""
    from harness.core.zoo import ZOO

    if ref in ZOO and ref not in presets():
        return from_zoo(ref)
    try:
        model = load_model(ref)
    except PlanInputError as e:
        raise InspectInputError(f"{e} (or a zoo model name)") from None
    path = Path(ref)
    if path.is_file() and path.suffix == ".json":
        import json

        cfg = json.loads(path.read_text())
        if "torch_dtype" not in cfg and cfg.get("dtype") in ("bfloat16", "float16", "float32"):
            model = replace(model, dtype=cfg["dtype"])
    return model


def from_fields(name: str, fields: dict, megatron_lm: bool) -> PlanModel:
    """A PlanModel from Megatron's own field names: Megatron-LM's args (`megatron_lm`: the vocab is
    `vocab_size` padded by make_vocab_size_divisible_by x tp when the args hold it, else the saved
    padded_vocab_size as is; embeddings tied unless untie_embeddings_and_output_weights) or Bridge's
    provider (vocab padded only with should_pad_vocab; tied with share_embeddings_and_output_weights)."""
    values = {ours: fields[theirs] for theirs, ours in _FIELDS.items() if fields.get(theirs) is not None}
    vocab = fields.get("vocab_size")
    if megatron_lm and not vocab:
        vocab = fields.get("padded_vocab_size")
        values.pop("make_vocab_size_divisible_by", None)  # already padded, at the save's tp
    if not megatron_lm and not fields.get("should_pad_vocab"):
        values.pop("make_vocab_size_divisible_by", None)
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size") if k not in values]
    if missing or not vocab:
        raise InspectInputError(f"{name}: the record lacks {missing or ['vocab_size']}")
    values.setdefault("num_query_groups", values["num_attention_heads"])
    values.setdefault("seq_length", 4096)
    dtype = "bfloat16" if fields.get("bf16") else "float16" if fields.get("fp16") else "float32"
    tied = (not fields.get("untie_embeddings_and_output_weights", False) if megatron_lm
            else bool(fields.get("share_embeddings_and_output_weights", False)))
    try:
        return PlanModel(name=name, vocab_size=int(vocab), dtype=dtype, tied=tied, **values)
    except TypeError as e:
        raise InspectInputError(f"{name}: {e}") from None


def resolve(part: Part, ref: str | None) -> tuple[PlanModel, str]:
    """(model, where it was read from) for the checkpoint `part`; InspectInputError when nothing says."""
    if ref:
        return from_ref(ref), f"--model {ref}"
    args = part.info.get("args")
    if args:
        return from_fields("Megatron-LM args", args, True), "Megatron-LM args (common state)"
    cfg = detect.run_config(part.path)
    if cfg and isinstance(cfg.get("model"), dict):
        return from_fields("run_config.yaml", cfg["model"], False), "Bridge run_config.yaml"
    hf_config = next((r / "huggingface" / "config.json" for r in (part.path, *list(part.path.parents)[:3])
                      if (r / "huggingface" / "config.json").is_file()), None)
    if hf_config is not None:  # verl's actor dir: <actor>/huggingface/ beside <actor>/model/dist_ckpt
        return from_ref(str(hf_config)), f"verl's {hf_config.relative_to(hf_config.parents[2])}"
    found = detect.manifest_entry(part.path)
    if found is not None:
        root, name, entry = found
        if entry.get("model"):
            try:
                return from_zoo(entry["model"]), f"corpus manifest ({name}: {entry['model']})"
            except KeyError:
                raise InspectInputError(f"{root}/manifest.json names model {entry['model']!r}, which this harness's zoo lacks; "
                                        "pass --model") from None
    note = " (Megatron-LM's args were not read: --allow-unpickle)" if any("common state not read" in n for n in part.notes) else ""
    raise InspectInputError(f"{part.path}: the checkpoint records no model{note}; pass --model "
                            f"(a preset: {', '.join(presets())}; an HF config.json; a zoo model name)")
