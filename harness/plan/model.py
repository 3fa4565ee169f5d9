"""The model a plan is for: an HF config.json (or a preset shipped as one, harness/plan/presets/),
read into the few numbers that decide a GPT's checkpoint layout."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import yaml

PRESETS = Path(__file__).resolve().parent / "presets"


class PlanInputError(ValueError):
    """Bad input to a plan: an unreadable config, a missing key, a topology the model cannot take."""


@dataclass(frozen=True)
class PlanModel:
    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int
    kv_channels: int | None = None
    tied: bool = False
    qk_layernorm: bool = False
    num_moe_experts: int | None = None
    moe_router_topk: int = 0
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_size: int | None = None
    dtype: str = "bfloat16"
    make_vocab_size_divisible_by: int | None = None  # None: the vocab as HF has it (no padding)
    # multi-latent attention (DeepSeek-V2/V3: HF kv_lora_rank, q_lora_rank, qk_nope/rope_head_dim,
    # v_head_dim); None: ordinary attention
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_head_dim: int | None = None
    qk_pos_emb_head_dim: int | None = None
    v_head_dim: int | None = None
    first_k_dense: int = 0  # HF first_k_dense_replace: the first layers have a dense MLP, the rest MoE
    #: megatron-core's moe_layer_freq as a per-layer pattern (1 MoE, 0 a dense MLP of ffn_hidden_size),
    #: as harness.core.zoo's GPT specs carry it; None: every layer of an MoE model is MoE
    moe_layer_freq: tuple[int, ...] | None = None

    @property
    def multi_latent_attention(self) -> bool:
        return self.kv_lora_rank is not None

    def padded_vocab(self, tp: int) -> int:
        """Megatron-LM's padding: up to a multiple of make_vocab_size_divisible_by * tp."""
        if not self.make_vocab_size_divisible_by:
            return self.vocab_size
        step = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // step) * step

    def to_json(self) -> dict:
        return asdict(self)


def presets() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


_REQUIRED = {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size",
             "num_attention_heads": "num_attention_heads", "ffn_hidden_size": "intermediate_size",
             "vocab_size": "vocab_size"}


def load_model(ref: str, vocab_divisible_by: int | None = None) -> PlanModel:
    """`ref`: a preset name (presets()) or a path to an HF config.json (or .yaml)."""
    path = PRESETS / f"{ref}.yaml"
    if not path.is_file():
        path = Path(ref)
        if not path.is_file():
            raise PlanInputError(f"model {ref!r}: neither a preset ({', '.join(presets())}) nor a config file")
    try:
        text = path.read_text(encoding="utf-8")
        cfg = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise PlanInputError(f"{path}: cannot read it as an HF config: {e}") from e
    if not isinstance(cfg, dict):
        raise PlanInputError(f"{path}: an HF config is a mapping, got {type(cfg).__name__}")
    missing = [hf for hf in _REQUIRED.values() if hf not in cfg]
    if missing:
        raise PlanInputError(f"{path}: missing key(s) {missing}")
    try:
        values = {ours: int(cfg[hf]) for ours, hf in _REQUIRED.items()}
        experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
        shared = cfg.get("n_shared_experts") or 0
        moe_ffn = cfg.get("moe_intermediate_size")
        model = PlanModel(
            name=path.stem if path.parent == PRESETS else str(path), **values,
            num_query_groups=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
            seq_length=int(cfg.get("max_position_embeddings") or 4096),
            kv_channels=int(cfg["head_dim"]) if cfg.get("head_dim") else None,
            tied=bool(cfg.get("tie_word_embeddings", False)),
            qk_layernorm=bool(cfg.get("qk_layernorm") or "Qwen3" in str(cfg.get("architectures", ""))),
            num_moe_experts=int(experts) if experts else None,
            moe_router_topk=int(cfg.get("num_experts_per_tok") or 0),
            moe_ffn_hidden_size=int(moe_ffn) if moe_ffn else None,
            moe_shared_expert_size=int(shared) * int(moe_ffn) if shared and moe_ffn else None,
            dtype=str(cfg.get("torch_dtype") or "bfloat16"),
            make_vocab_size_divisible_by=vocab_divisible_by,
        )
    except (TypeError, ValueError) as e:
        raise PlanInputError(f"{path}: a value is not a number: {e}") from e
    if "kv_lora_rank" in cfg:
        try:
            model = replace(model, kv_lora_rank=int(cfg["kv_lora_rank"]),
                            q_lora_rank=int(cfg["q_lora_rank"]) if cfg.get("q_lora_rank") else None,
                            qk_head_dim=int(cfg["qk_nope_head_dim"]), qk_pos_emb_head_dim=int(cfg["qk_rope_head_dim"]),
                            v_head_dim=int(cfg["v_head_dim"]), first_k_dense=int(cfg.get("first_k_dense_replace") or 0),
                            num_query_groups=model.num_attention_heads)  # MLA has no kv groups
        except KeyError as e:
            raise PlanInputError(f"{path}: multi-latent attention needs key {e.args[0]!r}") from e
        except (TypeError, ValueError) as e:
            raise PlanInputError(f"{path}: a multi-latent attention value is not a number: {e}") from e
    if model.num_moe_experts:
        model = replace(model, moe_layer_freq=_moe_layers(cfg, model.num_layers, path))
    if model.dtype not in ("bfloat16", "float16", "float32"):
        raise PlanInputError(f"{path}: torch_dtype {model.dtype!r} is not bfloat16/float16/float32")
    return model


def _moe_layers(cfg: dict, layers: int, path: Path) -> tuple[int, ...] | None:
    """Which layers are MoE, from HF's fields (DeepSeek first_k_dense_replace and moe_layer_freq: layer
    i >= k with i % freq == 0; Qwen-MoE mlp_only_layers and decoder_sparse_step: (i + 1) % step == 0) or
    a megatron-style list `moe_layer_freq`; None when every layer is MoE. Why: a mixed model planned
    as all-MoE asks for expert keys on its dense layers."""
    freq = cfg.get("moe_layer_freq", 1)
    try:
        if isinstance(freq, list):
            if len(freq) != layers or set(freq) - {0, 1}:
                raise PlanInputError(f"{path}: moe_layer_freq {freq} is not {layers} zeros and ones")
            pattern = [int(f) for f in freq]
        else:
            k, step = int(cfg.get("first_k_dense_replace") or 0), int(cfg.get("decoder_sparse_step") or 1)
            dense = {int(i) for i in cfg.get("mlp_only_layers") or []}
            pattern = [int(i >= k and i % int(freq) == 0 and (i + 1) % step == 0 and i not in dense) for i in range(layers)]
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise PlanInputError(f"{path}: a MoE layer field is not a number: {e}") from e
    return None if all(pattern) else tuple(pattern)
