"""The language path of VL / audio / omni families (path "vl-text" in harness.core.families): a tiny
fixture of the FULL ConditionalGeneration model (vision and audio towers too, so the Bridge's import and
export meet every key a real checkpoint has), and the Megatron VL model driven on a text-only
input (no pixel values, no audio features) for logits compared with transformers'.

- `is_vl(config_cls)`: a config with nested text and vision or audio configs, or an omni config
  whose thinker holds them.
- `tiny_vl_config(spec, shrink)`: the text config shrunk as a text family's (the same
  harness.models.architectures shrink, then the family's overrides), the vision config by
  `VISION_SHRINK` and the audio config by `AUDIO_SHRINK` (two blocks, width 32, the output width the
  text width); an omni config's thinker so, its talker and vocoder off.
- `model_class(config)`: the transformers auto class that builds the whole model; `forward_model`:
  the module whose forward gives the text logits (an omni model's thinker).
- `TextOnly`: a Megatron VL model behind GPTModel's positional forward (input_ids, position_ids,
  attention_mask): the VL models take (input_ids, attention_mask, position_ids, ...) and derive
  their own (M-)RoPE positions; harness.models.mcore.forward_logits calls chunks positionally.
- `localize_te_globals(provider)`: TE names a VL modeling module imported itself (Gemma 3 VL's
  projector norm) -> harness.models.cpu_spec's stand-ins; `bias_as_mask(core)`: the CPU core
  attention taking Gemma 3 VL's additive per-layer biases.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

#: The vision tower's generic shrink: every key the vision config class has is set so.
VISION_SHRINK: dict[str, Any] = dict(depth=2, num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_heads=2,
                                     num_attention_heads=2, num_key_value_heads=2, fullatt_block_indexes=[1])
#: The audio tower's generic shrink (Qwen2-Audio's Whisper-like encoder): two layers, width 32; the mel bins and
#: source positions are the class's (the real checkpoints' input layout).
AUDIO_SHRINK: dict[str, Any] = dict(encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32)
#: A tower config's key naming its output width: set to the text width (the projector's or merger's input).
OUTPUT_WIDTH = ("out_hidden_size", "projection_dim", "output_dim")
#: The override naming the text sub-config's model_type where the family ships another than the
#: class default (Mistral3Config defaults to a "mistral" text config, Ministral 3 ships "ministral3").
TEXT_MODEL_TYPE = "text_model_type"
#: Where a multimodal placeholder id the class defaults inside the tiny vocab (EXAONE 4.5's image 67,
#: Mistral3's 10) moves: above the vocab, as in the real checkpoints' vocabularies the text never draws them.
PLACEHOLDER_BASE = 1000


#: The encoder towers a multimodal config nests beside its text_config, each shrunk by its own table below.
TOWERS = ("vision_config", "audio_config")
#: An omni config's sub-config holding the text and towers (Qwen2.5-Omni, Qwen3-Omni: the thinker, beside its talker
#: and vocoder, which the fixture leaves out as a thinker-only checkpoint does: enable_audio_output false)
THINKER = "thinker_config"


def is_vl(config_cls: Any) -> bool:
    """A config class with a nested text_config and a vision or audio tower's config (a ConditionalGeneration
    model: Qwen2-Audio's Whisper-like encoder is such a tower, as a ViT is), or an omni config whose thinker is one."""
    subs = getattr(config_cls, "sub_configs", None) or {}
    if THINKER in subs:
        return is_vl(subs[THINKER])
    return "text_config" in subs and any(t in subs for t in TOWERS)


def _sub_defaults(config_cls: Any, name: str) -> dict[str, Any]:
    """A sub-config's defaults as the top-level class builds it (some declare AutoConfig there)."""
    sub = getattr(config_cls(), name)
    return (sub if sub is not None else config_cls.sub_configs[name]()).to_dict()  # Gemma 4: no vision by default


def tiny_vl_config(spec: Any, shrink: Callable[[Any, dict[str, Any]], dict[str, Any]], layer_lists: tuple[str, ...]):
    """The VL config of `spec`: the text sub-config shrunk by `shrink` (the text families' shrink)
    plus the family's overrides (a key of the top-level config only, e.g. image_token_id, goes
    there), each tower sub-config by its table with its output width the text width; an omni
    config's thinker (THINKER) built so, with the talker and vocoder off."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[spec.arch]
    if THINKER in cls.sub_configs:  # omni: the thinker shrunk as a VL config, the talker and vocoder off
        thinker = _tiny_multimodal(cls.sub_configs[THINKER], spec, shrink, layer_lists)
        config = cls(**{THINKER: thinker.to_dict()}, enable_audio_output=False)
    else:
        config = _tiny_multimodal(cls, spec, shrink, layer_lists)
    if spec.architecture:  # the whole model's (an omni thinker's own config keeps none)
        config.architectures = [spec.architecture]
    return config


def _tiny_multimodal(cls: Any, spec: Any, shrink: Callable[[Any, dict[str, Any]], dict[str, Any]], layer_lists: tuple[str, ...]):
    """tiny_vl_config for the config class `cls` holding text_config and the towers."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from harness.core.families import Nested

    top = cls().to_dict()
    text_type = dict(spec.overrides).get(TEXT_MODEL_TYPE)  # another text config than the class's default (Ministral 3)
    text_defaults = CONFIG_MAPPING[text_type]().to_dict() if text_type else _sub_defaults(cls, "text_config")
    text = shrink(spec, text_defaults)
    for k, v in list(text.items()):  # a per-modality list (ERNIE-VL's [text, vision] expert widths): the shrink per entry
        if isinstance(v, int) and isinstance(text_defaults.get(k), list) and text_defaults[k]:
            text[k] = [v] * len(text_defaults[k])
    if text_type:
        text["model_type"] = text_type
    top_kw: dict[str, Any] = {"tie_word_embeddings": spec.tied}
    for k, v in spec.overrides:
        v = list(v) if isinstance(v, tuple) else v.value() if isinstance(v, Nested) else v
        if k.startswith(("vision.", "audio.")) or k == TEXT_MODEL_TYPE:
            continue
        (top_kw if k in top and k not in text_defaults else text)[k] = v
    towers = {name: _tower(cls, name, shrink_table, prefix, spec, text["hidden_size"])
              for name, shrink_table, prefix in (("vision_config", VISION_SHRINK, "vision."), ("audio_config", AUDIO_SHRINK, "audio."))
              if name in cls.sub_configs}
    for k, v in top.items():  # a multimodal placeholder id inside the tiny vocab would turn text tokens into image slots
        if (k.endswith(("_token_id", "_token_index")) and isinstance(v, int) and not isinstance(v, bool)
                and v < text["vocab_size"] and k not in top_kw):
            top_kw[k] = PLACEHOLDER_BASE + v
    config = cls(text_config=text, **towers, **top_kw)
    tc = config.text_config
    tc.tie_word_embeddings = spec.tied
    for name in layer_lists:
        value = getattr(tc, name, None)
        if isinstance(value, list) and len(value) != spec.num_layers:
            setattr(tc, name, (list(text_defaults.get(name) or value) * spec.num_layers)[: spec.num_layers])
    return config


def _tower(cls: Any, name: str, table: dict[str, Any], prefix: str, spec: Any, width: int) -> dict[str, Any]:
    """The tower sub-config `name` of `cls` shrunk by `table` (the keys its class has), its output width the
    text width, then the family's `prefix`-ed overrides ("vision.deepstack_visual_indexes")."""
    defaults = _sub_defaults(cls, name)
    tower = {k: v for k, v in table.items() if k in defaults}
    tower.update({key: width for key in OUTPUT_WIDTH if key in defaults})
    tower.update({k.removeprefix(prefix): (list(v) if isinstance(v, tuple) else v) for k, v in spec.overrides
                  if k.startswith(prefix)})
    return tower


def model_class(config: Any):
    """transformers' auto class building `config`'s whole model: image-text-to-text for a VL
    config (its vision tower included), the multimodal LM for an audio-text one (Qwen2-Audio,
    which transformers files there only), the causal LM otherwise."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForMultimodalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    if not is_vl(type(config)):
        return AutoModelForCausalLM
    return AutoModelForImageTextToText if config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES else AutoModelForMultimodalLM


def write_side_files(config: Any, directory: Any) -> list[str]:
    """Files beside the weights that the model's own from_pretrained reads (the names written): Qwen2.5-Omni's
    `spk_dict.pt` (its speakers, loaded whether or not the talker is on: modeling_qwen2_5_omni.py:3739-3751),
    written as the Hub's checkpoints hold it, one speaker of zero tensors."""
    from pathlib import Path

    if getattr(config, "model_type", None) != "qwen2_5_omni":
        return []
    mel = getattr(config.token2wav_config.dit_config, "mel_dim", 80)
    speakers = {"Chelsie": {"bos_token": 0, "cond": torch.zeros(1, 192), "ref_mel": torch.zeros(1, 8, mel)}}
    torch.save(speakers, Path(directory) / "spk_dict.pt")
    return ["spk_dict.pt"]


def forward_model(model: Any) -> Any:
    """The module whose forward gives a multimodal model's text logits: an omni model's thinker (the whole model only
    generates), else the model (a PEFT-wrapped one too: PEFT resolves the attribute on the model it wraps)."""
    return getattr(model, "thinker", model)


def is_vl_checkpoint(directory: Any) -> bool:
    """The HF checkpoint in `directory` is a VL model's (its config.json nests text and vision configs)."""
    from transformers import AutoConfig

    return is_vl(type(AutoConfig.from_pretrained(directory)))


def auto_class_of(directory: Any):
    """model_class of the checkpoint in `directory` (its config.json)."""
    from transformers import AutoConfig

    return model_class(AutoConfig.from_pretrained(directory))


class TextOnly(torch.nn.Module):
    """A Megatron VL model called as a GPTModel chunk: forward(input_ids, position_ids,
    attention_mask) -> the VL model on the text tokens alone (no pixel values), position_ids left
    to the model (it derives its own M-RoPE positions, as in training)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self.config = module.config

    def set_input_tensor(self, tensor) -> None:
        self.module.set_input_tensor(tensor)

    def forward(self, input_ids, position_ids, attention_mask):
        kw = {}
        if "mm_token_type_ids" in _parameters(self.module):  # GLM-4.5V takes the token types from its data step: all text
            kw["mm_token_type_ids"] = torch.zeros_like(input_ids, dtype=torch.int)
        out = self.module(input_ids=input_ids, attention_mask=attention_mask, **kw)
        return out[0] if isinstance(out, tuple) else out  # Ministral3Model returns (logits, loss_mask)


def _parameters(module: torch.nn.Module) -> set[str]:
    """The forward parameters of the VL model under any wrappers (Float16Module, TextOnly)."""
    import inspect

    while hasattr(module, "module") and not hasattr(module, "language_model"):
        module = module.module
    return set(inspect.signature(module.forward).parameters)


def localize_te_globals(provider: Any) -> list[str]:
    """A VL provider's modeling modules build some modules from Transformer-Engine names they
    imported (Gemma 3 VL's projector norm: TENorm, modeling_gemma3_vl.py:315): each such global that
    is a TE placeholder here is swapped for its harness.models.cpu_spec stand-in, in the provider's
    own package only (a text provider is left alone). The names swapped, as module.name."""
    import sys

    from harness.models.cpu_spec import localize_globals

    if getattr(provider, "vision_config", None) is None and getattr(provider, "thinker_config", None) is None:
        return []  # a text provider (an omni one carries its towers in the thinker's config)
    package = type(provider).__module__.rsplit(".", 1)[0]
    done = [f"{name}.{key}" for name, mod in list(sys.modules.items())
            if mod is not None and (name == package or name.startswith(package + "."))
            for key in localize_globals(mod) + localize_te_spec_builders(mod)]
    if any(d.rsplit(".", 1)[1] in TE_SPEC_BUILDERS for d in done):
        import megatron.core.transformer.transformer_block as block
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        from harness.models.cpu_spec import Norm

        if block.LayerNormImpl is WrappedTorchNorm:  # the final norm of a block built from one layer spec: TENorm with TE,
            block.LayerNormImpl = Norm  # which takes sequence parallelism (Qwen3-VL-MoE turns it on at TP > 1); torch's refuses
            done.append("megatron.core.transformer.transformer_block.LayerNormImpl")
    return done


#: megatron-core's Transformer-Engine-only spec builders a VL provider's modules call whatever transformer_layer_spec
#: says (Qwen3-VL: get_gpt_layer_with_transformer_engine_spec for the language layers, qwen3_vl_provider.py:148;
#: get_vit_layer_with_transformer_engine_spec for the ViT, modelling_qwen3_vl/model.py:305)
TE_SPEC_BUILDERS = ("get_gpt_layer_with_transformer_engine_spec", "get_vit_layer_with_transformer_engine_spec")
#: A VL provider's own spec module's TE-or-local class picker (ERNIE-4.5-VL, ernie_decoder_layer_spec.py:60-89): without
#: TE it returns plain ColumnParallelLinear for the fused norm + linear, so the Bridge's `layer_norm_weight` mappings meet
#: no parameter; swapped (where the module found no TE) for the CPU stand-ins under TE's names, TE's order
TE_PICKER = "_get_linear_modules"


def localize_te_spec_builders(mod: Any) -> list[str]:
    """Each TE_SPEC_BUILDERS function `mod` imported, wrapped (in `mod` only, this process) so that the spec it
    builds has every TE class swapped for its CPU stand-in under TE's names (harness.models.cpu_spec.localize), and
    Core's gated-DeltaNet block builder (Qwen3.5-VL's language block) replaced by harness.models.cpu_hybrid's, and a
    module's own TE-or-local picker (TE_PICKER) made to pick the CPU stand-ins; the names replaced, each once. Only where TE is missing: its classes are then placeholders that cannot build."""
    import functools

    from harness.compat.te import te_importable
    from harness.models.cpu_spec import local_te_spec_provider, localize

    if te_importable():
        return []
    done: list[str] = []
    from harness.models.cpu_hybrid import HYBRID_BLOCK_SPEC, hybrid_block
    from harness.models.cpu_spec import te_linear_stand_ins

    def block_on_cpu(config: Any, vp_stage: int | None = None, pp_rank: int | None = None) -> Any:
        return hybrid_block(config, vp_stage)  # Qwen3.5 VL's own block builder (qwen35_vl_provider.py:460): TE-only

    def built_on_cpu(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with local_te_spec_provider():  # the GPT builder's backend (None without TE), for this call only
                return localize(fn(*args, **kwargs))

        return wrapped

    _replace_once(mod, HYBRID_BLOCK_SPEC, lambda _own: block_on_cpu, done)
    if getattr(mod, "HAVE_TE", True) is False:  # the picker's module found no TE: its local branch lacks the fused norm
        _replace_once(mod, TE_PICKER, lambda _picker: lambda: te_linear_stand_ins(), done)
    for key in TE_SPEC_BUILDERS:
        _replace_once(mod, key, built_on_cpu, done)
    return done


def _replace_once(mod: Any, key: str, make: Callable[[Any], Any], done: list[str]) -> None:
    """mod.`key` (a callable) replaced by make(it), marked so that a second pass leaves it; `key` added to `done`."""
    held = getattr(mod, key, None)
    if callable(held) and not getattr(held, "_ckpt_harness_localized", False):
        new = make(held)
        new._ckpt_harness_localized = True
        setattr(mod, key, new)
        done.append(key)


def language_model(module: torch.nn.Module) -> Any:
    """The GPT language model inside a Megatron VL model, or inside an omni model's thinker (None for a plain
    GPTModel)."""
    return getattr(getattr(module, "thinker", module), "language_model", None)


def bias_as_mask(core_attention: type) -> type:
    """`core_attention` (a local, non-TE DotProductAttention stand-in) taking an additive
    `attention_bias` as its boolean mask: Gemma 3 VL hands each layer its (local or global) bias
    of 0 / finfo.min fills instead of a window (modeling_gemma3_vl.py:237-273, picked per layer at
    gemma3_provider.py:201-209), which TE's core attention adds; megatron-core's local one asserts
    it is None (dot_product_attention.py:157). Filled entries are exactly the masked ones."""

    class BiasAsMask(core_attention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
            if attention_bias is not None:
                attention_mask = attention_bias < 0
            return super().forward(query, key, value, attention_mask, attn_mask_type, None, packed_seq_params)

    BiasAsMask.__name__ = BiasAsMask.__qualname__ = f"BiasAsMask{core_attention.__name__}"
    return BiasAsMask
