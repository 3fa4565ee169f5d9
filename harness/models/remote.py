"""Fixtures of the families whose modeling code the hub ships only as remote code (`trust_remote_code`):
Kimi-K2, MiMo, Sarvam, ... transformers has no class for them, and the Bridge reads only their
config.json and safetensors.

The fixture is written as the family's checkpoint is laid out: the weights of `spec.arch`, the
transformers model whose layout the remote modeling code writes (Kimi-K2: DeepSeek-V3's), and a
config.json that names the remote model_type, the architecture the Bridge dispatches on, and an
`auto_map` to `configuration_<model_type>.py` in the same directory: a PretrainedConfig subclass of the
harness's writing (the layout's config class under the remote model_type, plus the fields the remote
configuration spells its own way: `spec.remote_fields`). Loading it takes `trust_remote_code=True`, as
a user of these models passes it; transformers then imports the file from HF_MODULES_CACHE, which the
harness keeps in its own cache (`modules_cache`).

No transformers class builds such a checkpoint, so no transformers logits exist for it: a case's
logits checks are not-run, saying so (`no_modeling`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

#: why a remote family's logits (and PEFT) checks are not-run
NO_MODELING = ("no HF modeling class: {arch} ships its modeling code only as hub remote code (the fixture carries its "
               "configuration, of the harness's writing, and {layout}'s weight layout)")
#: the same for a layout the Bridge vendors: its copy writes the fixture, but it is the package under test's own code
NO_MODELING_VENDORED = ("no HF modeling class in transformers: {arch} is hub remote code; the fixture's weights are written by "
                        "the Bridge's vendored copy of it ({layout}), part of the package under test, so no independent "
                        "reference logits exist")


def no_modeling(architecture: str, layout: str) -> str:
    """Why a remote family's logits (and PEFT) checks do not run."""
    return (NO_MODELING_VENDORED if layout in BRIDGE_VENDORED else NO_MODELING).format(arch=architecture, layout=layout)


_CONFIG_PY = '''"""{arch}'s configuration, written by ckpt-harness for a tiny fixture (the hub ships the real one as
remote code): transformers' {layout} configuration under model_type {model_type!r}, plus the fields the
remote configuration spells its own way."""

from transformers.models.auto.configuration_auto import CONFIG_MAPPING

REMOTE_FIELDS = {fields!r}


class {cls}(CONFIG_MAPPING[{layout!r}]):
    model_type = {model_type!r}

    def __init__(self, **kwargs):
        own = {{k: kwargs.pop(k) for k in REMOTE_FIELDS if k in kwargs}}
        super().__init__(**kwargs)
        for k, v in own.items():  # after the base: it would fold e.g. rope_theta into rope_parameters
            setattr(self, k, v)
'''


#: layouts whose classes transformers does not ship but the installed Megatron-Bridge registers with its Auto
#: classes at import, from its vendored copy of the hub's remote code (bailing/bailing_moe2_bridge.py:56-57:
#: AutoConfig / AutoModelForCausalLM.register of modeling_bailing_moe_v2.py): the fixture's weights are that class's
BRIDGE_VENDORED = ("bailing_moe_v2",)


def layout_classes(model_type: str) -> None:
    """Make `model_type`'s config and model classes resolvable: a BRIDGE_VENDORED layout needs the Bridge imported."""
    if model_type in BRIDGE_VENDORED:
        from harness.compat.te import import_megatron_bridge

        import_megatron_bridge()


def is_remote(spec: Any) -> bool:
    return bool(getattr(spec, "remote_type", ""))


def module_name(model_type: str) -> str:
    """The configuration file's module name (a model_type may hold '-': DeciLM's "nemotron-nas")."""
    return "configuration_" + re.sub(r"\W", "_", model_type)


def class_name(model_type: str) -> str:
    return "".join(p[:1].upper() + p[1:] for p in re.split(r"\W|_", model_type)) + "Config"


def modules_cache() -> str:
    """Where transformers copies a checkpoint's remote code to import it (HF_MODULES_CACHE): the
    harness's cache, unless the user named one. transformers reads the variable once, at import
    (transformers/utils/hub.py): harness/__init__ sets it before anything imports transformers."""
    home = os.environ.get("CKPT_HARNESS_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "ckpt-harness")
    return os.environ.setdefault("HF_MODULES_CACHE", os.path.join(home, "hf-modules"))


def _shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """The fixture's tensor shapes, from its safetensors headers."""
    from harness.judge.hf_integrity import source_infos

    return {k: info.shape for k, info in source_infos(directory).items()}


def _mimo_mtp(spec: Any, directory: Path, fields: dict[str, Any]) -> tuple[set[str], dict[str, Any]]:
    """MiMo's MTP layers as its remote modeling code holds them (modeling_mimo.py MiMoMTPLayers, under
    `model.mtp_layers.<i>`): a Qwen2 decoder layer's input_layernorm, self_attn (q/k/v with biases), o_proj,
    post_attention_layernorm and mlp, plus token_layernorm, hidden_layernorm, input_proj [H, 2H] and
    final_layernorm; canonical values by name."""
    from harness.core import truth

    n, prefix, shapes, h = int(fields.get("num_nextn_predict_layers") or 0), "model.layers.0.", {}, spec.hidden_size
    for k, shape in _shapes(directory).items():
        if k.startswith(prefix):
            shapes.update({f"model.mtp_layers.{i}.{k[len(prefix):]}": shape for i in range(n)})
    for i in range(n):
        shapes.update({f"model.mtp_layers.{i}.{k}": (h,) for k in ("token_layernorm.weight", "hidden_layernorm.weight",
                                                                    "final_layernorm.weight")})
        shapes[f"model.mtp_layers.{i}.input_proj.weight"] = (h, 2 * h)
    return set(), truth.canonical_hf_state(spec, shapes)


def ffn_width(ffn_mult: float, hidden: int) -> int:
    """DeciLM's MLP width of a block (modeling_decilm.py _ffn_mult_to_intermediate_size: 2/3 of ffn_mult x hidden,
    rounded up to a multiple of 256)."""
    n = int(2 * ffn_mult * hidden / 3)
    return n + (-n % 256)


def _decilm_blocks(spec: Any, directory: Path, fields: dict[str, Any]) -> tuple[set[str], dict[str, Any]]:
    """Llama-Nemotron Super/Ultra (DeciLM) as its remote modeling lays out each block (`block_configs`): a
    block whose attention is a no-op holds no input_layernorm and no self_attn, one whose FFN is a no-op no
    post_attention_layernorm and no mlp, and each MLP is as wide as its ffn_mult says; canonical values by name."""
    from harness.core import truth

    names = set(_shapes(directory))
    drop, shapes, h = set(), {}, spec.hidden_size
    for i, block in enumerate(fields["block_configs"]):
        layer = f"model.layers.{i}."
        if block["attention"].get("no_op"):
            drop |= {n for n in names if n.startswith(layer + "self_attn.") or n == layer + "input_layernorm.weight"}
        if block["ffn"].get("no_op"):
            drop |= {n for n in names if n.startswith(layer + "mlp.") or n == layer + "post_attention_layernorm.weight"}
        elif (width := ffn_width(block["ffn"]["ffn_mult"], h)) != spec.intermediate_size:
            shapes.update({layer + "mlp.gate_proj.weight": (width, h), layer + "mlp.up_proj.weight": (width, h),
                           layer + "mlp.down_proj.weight": (h, width)})
    return drop, truth.canonical_hf_state(spec, shapes)


def _diffusion_names(spec: Any, directory: Path, fields: dict[str, Any]) -> dict[str, str]:
    """NemotronLabsDiffusion's text-only checkpoints: the Ministral 3 model under `encoder.*` and its head as
    `diffusion_head.weight` (the Bridge's text-only mapping reads these: nemotron_labs_diffusion_bridge.py
    _text_only_mappings): the renames of the layout's tensors."""
    return {k: "diffusion_head.weight" if k == "lm_head.weight" else "encoder." + k.removeprefix("model.")
            for k in _shapes(directory) if k == "lm_head.weight" or k.startswith("model.")}


#: what a remote family's checkpoint holds otherwise than its layout's model (more tensors, fewer, other
#: shapes), by remote model_type: (names to drop, fp32 tensors to add)
EXTRA_TENSORS = {"mimo": _mimo_mtp, "nemotron-nas": _decilm_blocks}
#: what it names otherwise, by remote model_type: the layout's name -> the remote one
RENAMES = {"nemotron_labs_diffusion": _diffusion_names}


def finish_fixture(spec: Any, directory: Path) -> tuple[dict[str, str], set[str], dict[str, Any]]:
    """Turn the `spec.arch` checkpoint transformers wrote into `directory` into the remote family's:
    config.json under the remote model_type with its auto_map and own fields, and the configuration file.
    Returns what its tensors need besides: the renames (RENAMES), the names to drop and the fp32 tensors to
    add (EXTRA_TENSORS)."""
    model_type = spec.remote_type
    cls = class_name(model_type)
    fields = {k: list(v) if isinstance(v, tuple) else v.value() if hasattr(v, "value") else v for k, v in spec.remote_fields}
    (directory / f"{module_name(model_type)}.py").write_text(
        _CONFIG_PY.format(arch=spec.architecture, layout=spec.arch, model_type=model_type, cls=cls, fields=tuple(fields)))
    cfg = json.loads((directory / "config.json").read_text())
    cfg.update(fields)
    cfg["model_type"] = model_type
    cfg["auto_map"] = {"AutoConfig": f"{module_name(model_type)}.{cls}"}
    (directory / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    rename, extra = RENAMES.get(model_type), EXTRA_TENSORS.get(model_type)
    return (rename(spec, directory, fields) if rename else {}), *(extra(spec, directory, fields) if extra else (set(), {}))
