"""Tiny HF checkpoints made locally (no hub): config, safetensors weights and a tokenizer, and
transformers' logits of such a checkpoint.

Weights are harness.core.truth.canonical_hf_state (norms 1 + noise, non-zero biases, so a mapping that
drops or swaps a norm or a bias shows up); the models are harness.core.zoo's HF entries.
"""

from __future__ import annotations

from pathlib import Path

import torch

from harness.core.truth import canonical_hf_state
from harness.core.zoo import HFModelSpec

#: The precision an HF fixture is written in (the `dtype` option of hf-roundtrip and peft-export).
HF_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: attention options transformers' default sdpa path takes through **kwargs and drops
#: (transformers/integrations/sdpa_attention.py:40-49): a config that sets one is referenced through
#: eager attention, which applies it (Gemma2's attn_logit_softcapping: modeling_gemma2.py:214-217, :293).
#: hf-roundtrip's reference logits and the PEFT cases' transformers+PEFT model (cases.shared.peft.load_peft) use it.
SDPA_DROPS = ("attn_logit_softcapping",)


def reference_attention(directory: Path) -> str | None:
    """"eager" where the checkpoint's config (a VL config: its text_config; an omni one: its thinker's) sets an option
    of SDPA_DROPS, else None (transformers' default)."""
    import json

    cfg = json.loads((Path(directory) / "config.json").read_text())
    cfg = cfg.get("thinker_config", cfg) if isinstance(cfg.get("thinker_config"), dict) else cfg
    cfg = cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg
    return "eager" if any(cfg.get(k) for k in SDPA_DROPS) else None


def hf_config(spec: HFModelSpec):
    """The four hand-written configs (their fixtures' bytes are pinned by goldens); any other
    model_type: harness.models.architectures.tiny_config (its config class shrunk + the spec's overrides)."""
    from transformers import LlamaConfig, NemotronConfig, Qwen2Config, Qwen3MoeConfig

    from harness.models.architectures import HAND_WRITTEN, tiny_config

    if spec.arch not in HAND_WRITTEN or spec.overrides:
        return tiny_config(spec)

    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=4 * spec.seq_length,
        tie_word_embeddings=spec.tied,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if spec.arch == "llama":
        return LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    if spec.arch == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    if spec.arch == "nemotron":  # non-gated squared-ReLU MLP (up_proj, down_proj), LayerNorm1p with biases
        common.pop("rms_norm_eps")
        return NemotronConfig(**common, norm_eps=1e-5, hidden_act="relu2", attention_bias=False, mlp_bias=False)
    if spec.arch == "qwen3_moe":  # every layer MoE (decoder_sparse_step 1), top-k probabilities renormalised
        return Qwen3MoeConfig(**common, head_dim=spec.head_dim, attention_bias=False, num_experts=spec.num_experts,
                              num_experts_per_tok=spec.num_experts_per_tok, moe_intermediate_size=spec.moe_intermediate_size,
                              decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, use_sliding_window=False)
    raise ValueError(f"unknown arch {spec.arch!r}")


def write_tokenizer(spec: HFModelSpec, directory: Path) -> None:
    """A word-level tokenizer over the model's vocabulary: enough for save_hf_pretrained."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, spec.vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>")
    fast.save_pretrained(directory)


def quiet_hf() -> None:
    """transformers draws a progress bar for every load and save; in a table of 90 cases they
    drown the results (CKPT_HARNESS_VERBOSE=1 keeps them)."""
    import os

    if os.environ.get("CKPT_HARNESS_VERBOSE") == "1":
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def write_fixture(spec: HFModelSpec, directory: Path, dtype: str = "fp32", shards: int = 1,
                  extra_keys: tuple[str, ...] = ()) -> Path:
    """Write config.json, model.safetensors and tokenizer files for `spec` into `directory`.

    `dtype` bf16: the canonical fp32 weights cast to bf16 (round to nearest even, as
    truth.canonical_tensor casts) and saved so, with the config's `dtype` bfloat16, as a bf16
    checkpoint on the hub is. `shards` > 1: transformers' own sharded layout (a shard size of
    1/`shards` of the weights, so at least that many model-0000i-of-0000n.safetensors files and a
    model.safetensors.index.json), as real checkpoints are. `extra_keys`: tensors the model does not
    hold (a persisted buffer such as `rotary_emb.inv_freq`, or an unknown key), added to the last
    file as real checkpoints carry them, for what an exporter does with a source key it does not map.
    Kept across runs by harness.models.fixture_cache (keyed by these arguments, transformers, torch
    and the deriving code): a hit is a copy of the same bytes."""
    from harness.models.fixture_cache import cached

    return cached(directory, (spec, dtype, shards, tuple(extra_keys)), lambda d: _write_fixture(spec, d, dtype, shards, extra_keys))[0]


def _write_fixture(spec: HFModelSpec, directory: Path, dtype: str, shards: int, extra_keys: tuple[str, ...]) -> Path:
    from harness.models.vl import model_class

    quiet_hf()
    directory.mkdir(parents=True, exist_ok=True)
    config = hf_config(spec)
    mtp = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    if mtp:  # the MTP layers' decoder layers, as transformers would build layers L .. L + mtp - 1
        from dataclasses import replace as _replace

        config = hf_config(_replace(spec, num_layers=spec.num_layers + mtp))
    torch.manual_seed(spec.seed)
    model = model_class(config).from_config(config, torch_dtype=torch.float32)  # a VL config: the whole model, vision too
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    state = canonical_hf_state(spec, shapes)
    held = model.state_dict()
    for k, v in held.items():  # integer buffers (counters, indices) keep what the model holds
        if not v.is_floating_point():
            state[k] = v
    if spec.tied:
        for target, source in tied_keys(model).items():
            state[target] = state[source]
    model.load_state_dict(state, strict=True)
    if dtype != "fp32":
        model.to(HF_DTYPES[dtype])
        model.config.dtype = HF_DTYPES[dtype]
    if shards > 1:
        size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        model.save_pretrained(directory, safe_serialization=True, max_shard_size=-(-size // shards))
    else:
        model.save_pretrained(directory, safe_serialization=True)
    if not spec.saved_by_transformers and spec.arch in HUB_SPELLING:
        respell(directory, HUB_SPELLING[spec.arch])
    if extra_keys:
        add_tensors(directory, {k: torch.linspace(0.5, 1.5, 8).to(HF_DTYPES[dtype]) for k in extra_keys})
    if mtp:
        _finish_mtp(spec, directory, config, state, mtp, dtype)
    if top := int(getattr(config, "mtp_num_hidden_layers", 0) or 0):
        _top_level_mtp(spec, directory, config, top, dtype)
    if spec.architecture:  # the spelling the Bridge dispatches on (save_pretrained writes the class's own)
        import json

        cfg = json.loads((directory / "config.json").read_text())
        cfg["architectures"] = [spec.architecture]
        (directory / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if spec.remote_type:  # a family whose modeling is hub remote code: its config.json and configuration file
        from harness.models.remote import finish_fixture

        names, drop, add = finish_fixture(spec, directory)
        if names:
            respell(directory, names)
        if drop or add:
            rewrite_tensors(directory, drop, {k: v.to(HF_DTYPES[dtype]).contiguous() for k, v in add.items()})
    from harness.models.vl import write_side_files

    write_side_files(config, directory)
    write_tokenizer(spec, directory)
    return directory


#: What a DeepSeek-V3-style MTP layer holds beside its decoder layer (the Hub's DeepSeek-V3 checkpoints:
#: model.layers.61.*): name -> shape as a function of the hidden size H
MTP_EXTRAS = {"enorm.weight": lambda h: (h,), "hnorm.weight": lambda h: (h,), "eh_proj.weight": lambda h: (h, 2 * h),
              "shared_head.norm.weight": lambda h: (h,)}


def _finish_mtp(spec: HFModelSpec, directory: Path, config, state: dict, mtp: int, dtype: str) -> None:
    """The MTP layers' own tensors (MTP_EXTRAS, canonical values) and, with `spec.mtp_shared_copies`, the
    copies of the embedding and the output head each one keeps (embed_tokens, shared_head.head, as the
    Hub's checkpoints do), then the config back to the main model's layer count with num_nextn_predict_layers."""
    import json

    from harness.core import truth

    h, extra = config.hidden_size, {}
    for i in range(spec.num_layers, spec.num_layers + mtp):
        shapes = {f"model.layers.{i}.{k}": f(h) for k, f in MTP_EXTRAS.items()}
        extra.update(truth.canonical_hf_state(spec, shapes))
        if spec.mtp_shared_copies:
            extra[f"model.layers.{i}.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
            extra[f"model.layers.{i}.shared_head.head.weight"] = state["lm_head.weight"].clone()
    add_tensors(directory, {k: v.to(HF_DTYPES[dtype]).contiguous() for k, v in extra.items()})
    cfg = json.loads((directory / "config.json").read_text())
    cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"] = spec.num_layers, mtp
    for name in ("mlp_layer_types", "layer_types"):  # per-layer lists of the model the weights were drawn with
        if isinstance(cfg.get(name), list):
            cfg[name] = cfg[name][: spec.num_layers]
    (directory / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _top_level_mtp(spec: HFModelSpec, directory: Path, config, n: int, dtype: str) -> None:
    """Qwen3-Next's MTP layout (its Hub checkpoints; transformers drops `^mtp.*` on load): `mtp.layers.<i>.*`
    a full-attention MoE layer as the model's own are written, and mtp.fc, mtp.pre_fc_norm_embedding,
    mtp.pre_fc_norm_hidden, mtp.norm; canonical values by name."""
    from harness.core import truth
    from harness.judge.hf_integrity import source_infos

    full = [i for i, t in enumerate(config.layer_types) if t == "full_attention"][-1]
    prefix, shapes = f"model.layers.{full}.", {}
    for k, info in source_infos(directory).items():
        if k.startswith(prefix):
            shapes.update({f"mtp.layers.{i}.{k[len(prefix):]}": info.shape for i in range(n)})
    h = config.hidden_size
    shapes.update({"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,), "mtp.pre_fc_norm_hidden.weight": (h,),
                   "mtp.norm.weight": (h,)})
    add_tensors(directory, {k: v.to(HF_DTYPES[dtype]).contiguous() for k, v in truth.canonical_hf_state(spec, shapes).items()})


def tied_keys(model) -> dict[str, str]:
    """{tied key: the key it shares storage with} of a transformers model (lm_head.weight ->
    model.embed_tokens.weight for a Llama), read from the parameters that are one tensor."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    if not out and "lm_head.weight" in model.state_dict():
        out["lm_head.weight"] = "model.embed_tokens.weight"
    return out


#: Tensor names transformers 5 saves otherwise than the Hub's checkpoints hold them (its conversion_mapping
#: renames them on load and reverses that on save): a fixture is respelled as a download holds it, unless its
#: spec is `saved_by_transformers` (what a user's from_pretrained + save_pretrained writes).
HUB_SPELLING: dict[str, dict[str, str]] = {
    # transformers 5.12.1 conversion_mapping.py:1074-1076: "embedding.weight" -> "embeddings.weight" on load;
    # the Hub's Nemotron-H checkpoints (and Megatron-Bridge's mapping, nemotron_h_bridge.py:399) say `embeddings`
    "nemotron_h": {"backbone.embedding.weight": "backbone.embeddings.weight"},
    # transformers 5.12.1 saves Qwen2-Audio's text weights under `language_model.model.model.*`: its save reverses
    # both the qwen2_audio and the Qwen2AudioModel renamings (conversion_mapping.py:567-575), one prefix too many; the
    # Hub's Qwen2-Audio checkpoints (and the Bridge's mapping, qwen2_audio_bridge.py:122-132) say `language_model.model.*`
    "qwen2_audio": {"language_model.model.model.": "language_model.model."},
}


def respelled(key: str, names: dict[str, str]) -> str:
    """`key` renamed by `names`: an exact entry, else an entry ending in "." as a prefix rule."""
    if key in names:
        return names[key]
    for old, new in names.items():
        if old.endswith(".") and key.startswith(old):
            return new + key[len(old):]
    return key


def respell(directory: Path, names: dict[str, str]) -> None:
    """Rename tensors of an HF checkpoint in place (every safetensors file, and its index's weight_map)."""
    import json

    from safetensors.torch import load_file, save_file

    for f in sorted(directory.glob("*.safetensors")):
        state = load_file(str(f))
        if any(respelled(k, names) != k for k in state):
            save_file({respelled(k, names): v for k, v in state.items()}, str(f), metadata={"format": "pt"})
    index = directory / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {respelled(k, names): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2, sort_keys=True))


def add_tensors(directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Add `tensors` to an HF checkpoint's last safetensors file, keeping its index (weight_map,
    metadata.total_size) true to the files."""
    import json

    from safetensors.torch import load_file, save_file

    last = sorted(directory.glob("*.safetensors"))[-1]
    state = load_file(str(last))
    state.update(tensors)
    save_file(state, str(last), metadata={"format": "pt"})
    index = directory / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].update({k: last.name for k in tensors})
        data["metadata"]["total_size"] += sum(t.numel() * t.element_size() for t in tensors.values())
        index.write_text(json.dumps(data, indent=2, sort_keys=True))


def rewrite_tensors(directory: Path, drop: set[str], add: dict[str, torch.Tensor]) -> None:
    """Drop `drop` and add (or replace) `add` in an HF checkpoint's safetensors files, in place; the
    index, if any, follows (weight_map, metadata.total_size as the sum of the tensors' bytes)."""
    import json

    from safetensors.torch import load_file, save_file

    files = sorted(directory.glob("*.safetensors"))
    where: dict[str, str] = {}
    size = 0
    for i, f in enumerate(files):
        state = {k: v for k, v in load_file(str(f)).items() if k not in drop and k not in add}
        if i == len(files) - 1:
            state.update(add)
        where.update({k: f.name for k in state})
        size += sum(t.numel() * t.element_size() for t in state.values())
        save_file(state, str(f), metadata={"format": "pt"})
    index = directory / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = dict(sorted(where.items()))
        data["metadata"]["total_size"] = size
        index.write_text(json.dumps(data, indent=2, sort_keys=True))


@torch.no_grad()
def hf_logits(directory: Path, input_ids: torch.Tensor, adapter: Path | None = None, dtype: str = "fp32") -> torch.Tensor:
    """Logits of transformers (optionally + a PEFT adapter) on CPU in `dtype`, returned as fp32."""
    from harness.models.vl import auto_class_of, forward_model

    quiet_hf()
    # a VL checkpoint: its ConditionalGeneration model, on text tokens alone
    model = auto_class_of(directory).from_pretrained(directory, dtype=HF_DTYPES[dtype])
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    return forward_model(model)(input_ids=input_ids).logits.float()


def config_dtype(directory: Path) -> str | None:
    """The dtype an HF checkpoint's config.json declares (`dtype`, or transformers 4's
    `torch_dtype`), e.g. "bfloat16"; None when it declares none."""
    import json

    cfg = json.loads((Path(directory) / "config.json").read_text())
    return cfg.get("dtype") or cfg.get("torch_dtype")
