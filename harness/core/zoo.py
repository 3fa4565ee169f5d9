"""The model zoo: every model a matrix can name, GPT (built by megatron-core) or HF (a fixture the
Megatron-Bridge cases import), in one table with one lookup.

Sizes are chosen so that every topology the matrices use (tp, pp, 2*cp in {1, 2, 4}) divides them.
Values only: building a model is harness.models (GPT) or harness.models.bridge (HF); the weights a model
should hold are harness.core.truth.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, Union

from harness.core.families import FAMILIES, Family


@dataclass(frozen=True)
class ModelSpec:
    """A megatron-core GPTModel configuration (local layer spec)."""

    kind: ClassVar[str] = "gpt"
    name: str
    description: str
    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 8
    num_query_groups: int = 4
    ffn_hidden_size: int = 128
    vocab_size: int = 128
    seq_length: int = 16
    micro_batch_size: int = 2
    swiglu: bool = True
    normalization: str = "RMSNorm"
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    tied_embeddings: bool = False
    position_embedding: str = "rope"
    seed: int = 1234
    #: Megatron-LM's `--make-vocab-size-divisible-by`: None (every zoo model) builds the vocab as is;
    #: a value pads it to `padded_vocab_size(tp)`, which changes with TP (harness.orchestration.explore draws it).
    make_vocab_size_divisible_by: int | None = None
    # MoE (all None/off: a dense model, every existing zoo model). Every layer's MLP becomes a
    # MoELayer: a router (`decoder.layers.mlp.router.weight`), `num_moe_experts` experts of width
    # `moe_ffn_hidden_size` (SequentialMLP on the local spec: checkpoint keys
    # `decoder.layers.mlp.experts.experts.linear_fc{1,2}.weight` with a global expert axis, so every
    # EP size writes the same keys), top-`moe_router_topk` routing, and with
    # `moe_shared_expert_size` a shared expert (a dense MLP split by TP, not EP) beside them.
    num_moe_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_router_topk: int = 2
    moe_shared_expert_size: int | None = None
    #: TEGroupedMLP (Transformer-Engine); harness.models.grouped_gemm_unavailable says why not here.
    moe_grouped_gemm: bool = False
    #: megatron-core's moe_token_dispatcher_type: "alltoall" (what EP training uses) or "allgather"
    moe_token_dispatcher: str = "alltoall"
    #: load-balancing aux loss coefficient (router type "aux_loss"); deterministic, topology-independent
    moe_aux_loss_coeff: float = 0.0
    #: megatron-core's moe_layer_freq as a per-layer pattern (1 MoE, 0 dense: a dense MLP of
    #: `ffn_hidden_size`); None: every layer MoE. Mixed layers are built from megatron-core's
    #: decoder block spec and checkpoint per layer (`decoder.layers.<i>.mlp...`)
    moe_layer_freq: tuple[int, ...] | None = None

    @property
    def is_moe(self) -> bool:
        return bool(self.num_moe_experts)

    def padded_vocab_size(self, tp: int) -> int:
        """The embedding/output rows a model built at TP `tp` holds: Megatron-LM's
        `_vocab_size_with_padding` (ceil(vocab / (divisible_by * tp)) * divisible_by * tp), so the
        checkpoint key's global shape depends on the TP it was saved at; `vocab_size` unpadded."""
        if self.make_vocab_size_divisible_by is None:
            return self.vocab_size
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def with_seed(self, seed: int) -> "ModelSpec":
        return replace(self, seed=seed)


@dataclass(frozen=True)
class HFModelSpec:
    """A tiny HF checkpoint written locally (harness.models.hf.write_fixture), no hub."""

    kind: ClassVar[str] = "hf"
    name: str
    description: str
    #: transformers' model_type: "llama" | "qwen2" | "nemotron" | "qwen3_moe" (hand-written configs in
    #: harness.models.hf), or any other (a family of harness.core.families: its config class's
    #: defaults shrunk by harness.models.architectures, plus `overrides`)
    arch: str
    tied: bool = False
    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    intermediate_size: int = 128
    vocab_size: int = 128
    seq_length: int = 16
    seed: int = 4321
    #: Megatron-Bridge's `provider.should_pad_vocab` (False, its default, for every zoo fixture):
    #: True pads the Megatron vocab to a multiple of the Bridge's divisor times TP, so the padded
    #: size changes with TP and the HF export must drop the padded rows (harness.orchestration.explore draws it).
    pad_vocab: bool = False
    #: MoE (arch qwen3_moe): routed experts per layer (every layer an MoE layer), each expert's
    #: ffn size, experts per token. None: a dense model.
    num_experts: int | None = None
    moe_intermediate_size: int = 32
    num_experts_per_tok: int = 2
    #: config fields on top of the derived tiny config (families: their distinctive options)
    overrides: tuple[tuple[str, Any], ...] = ()
    #: the HF architecture config.json names ("" the transformers class's own name): the Bridge dispatches on it
    architecture: str = ""
    #: True: the fixture's tensor names as transformers' save_pretrained writes them; False: as the Hub's
    #: checkpoints hold them, where transformers renames on load and reverses it on save (harness.models.hf.HUB_SPELLING)
    saved_by_transformers: bool = False
    #: a model with MTP layers (num_nextn_predict_layers): each MTP layer also holds copies of the embedding
    #: and the output head (model.layers.<L>.embed_tokens, .shared_head.head), as the Hub's DeepSeek-V3 checkpoints
    #: do; False: without them, as an export that maps only what Megatron's MTP layer owns writes it
    mtp_shared_copies: bool = True
    #: a family whose modeling code is hub remote code (harness.models.remote): the model_type its config.json
    #: says ("" none: `arch` is transformers' own); `arch` is then the layout the weights are written in
    remote_type: str = ""
    #: the remote configuration's own fields (its spelling of what `arch`'s config names otherwise)
    remote_fields: tuple[tuple[str, Any], ...] = ()

    # what Topology.validate reads
    @property
    def num_moe_experts(self) -> int | None:
        return self.num_experts

    @property
    def moe_ffn_hidden_size(self) -> int:
        return self.moe_intermediate_size

    @property
    def num_query_groups(self) -> int:
        return self.num_key_value_heads

    @property
    def ffn_hidden_size(self) -> int:
        return self.intermediate_size

    @property
    def gated(self) -> bool:
        """A gated (SwiGLU) MLP: Megatron's fc1 holds [gate; up]; Nemotron's squared ReLU has no gate."""
        return self.arch not in ("nemotron", "nemotron_h")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


AnyModel = Union[ModelSpec, HFModelSpec]

ZOO: dict[str, AnyModel] = {
    m.name: m
    for m in (
        ModelSpec("gpt-gqa", "GQA (8 heads, 4 query groups) + SwiGLU + RoPE + RMSNorm, untied embeddings"),
        ModelSpec(
            "gpt-tied",
            "MHA + GeLU + LayerNorm + linear biases + learned positions, tied embeddings",
            num_query_groups=8, swiglu=False, normalization="LayerNorm", add_bias_linear=True, add_qkv_bias=True,
            tied_embeddings=True, position_embedding="learned_absolute",
        ),
        # gpt-gqa with 8 layers: virtual pipelines with more than one layer per chunk or more chunks
        # than pp2vpp2 (pp2vpp4, pp4vpp2, pp2vpp2 with 2 layers per chunk); the 4-layer models keep their ids.
        ModelSpec("gpt-gqa-8l", "gpt-gqa with 8 layers (virtual pipelines: pp2vpp4, pp4vpp2)", num_layers=8),
        # parameters off the distributed optimizer's 64-element alignment (param_and_grad_buffer pads each param's
        # start): the buckets hold gaps between params, which dp_reshardable fills with padding tensors
        ModelSpec("gpt-odd", "gpt-gqa with hidden 48 (6 heads, 2 query groups), ffn 40, vocab 100: params off the 64-element "
                  "alignment", hidden_size=48, num_attention_heads=6, num_query_groups=2, ffn_hidden_size=40, vocab_size=100),
        # Heavier models for memory budgets and the save-memory benchmark (not in the smoke matrix).
        ModelSpec(
            "gpt-25m", "gpt-gqa shape at ~25M params: memory-tier cases",
            num_layers=4, hidden_size=512, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=2048, vocab_size=8192,
        ),
        ModelSpec(
            "gpt-150m", "gpt-gqa shape at ~150M params: the save-memory benchmark",
            num_layers=8, hidden_size=1024, num_attention_heads=16, num_query_groups=8, ffn_hidden_size=4096, vocab_size=16384,
        ),
        # MoE with expert parallelism: 4 experts (ep 1, 2, 4), expert ffn 32 (etp 1, 2, 4), top-2,
        # the alltoall token dispatcher and a load-balancing aux loss, gpt-gqa's attention.
        ModelSpec(
            "gpt-moe", "MoE: router + 4 SequentialMLP experts (ffn 32, SwiGLU), top-2, alltoall dispatcher, aux loss 1e-2",
            num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2, moe_aux_loss_coeff=1e-2,
        ),
        ModelSpec(
            "gpt-moe-shared", "gpt-moe plus a shared expert (ffn 64, split by TP)",
            num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_shared_expert_size=64,
        ),
        # docs/user-reports.md (vime #139, radixark/Megatron-LM #66): parameter sizes as uneven as a
        # real MoE's, so DP slices of the optimizer buffers hold different numbers of params per rank:
        # dense layers 0 and 3 (ffn 512: 98k elements each), MoE layers 1 and 2 (4 experts of ffn 8:
        # 1.5k each, a shared expert of ffn 64), vocab 512 (32k), norms of 64
        ModelSpec(
            "gpt-moe-uneven", "MoE with very uneven parameter sizes: dense ffn-512 layers 0 and 3, MoE layers 1-2 "
            "(4 experts of ffn 8, a shared expert of ffn 64), vocab 512",
            ffn_hidden_size=512, vocab_size=512, num_moe_experts=4, moe_ffn_hidden_size=8, moe_router_topk=2,
            moe_aux_loss_coeff=1e-2, moe_shared_expert_size=64, moe_layer_freq=(0, 1, 1, 0),
        ),
        ModelSpec(
            "gpt-moe-grouped", "gpt-moe with grouped GEMM experts (TEGroupedMLP: needs Transformer-Engine)",
            num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_grouped_gemm=True,
        ),
        # Issue 35's memory budgets (verl #5183, docs/user-reports.md): expert state large enough that a save's host
        # peak stands above the allocator's noise, at 4 and 16 experts (so 4x the expert bytes and sharded tensors)
        *(ModelSpec(f"gpt-moe-mem{s}", f"MoE memory budgets: 2 layers, hidden 256, {e} SequentialMLP experts of ffn 1024",
                    num_layers=2, hidden_size=256, num_moe_experts=e, moe_ffn_hidden_size=1024, moe_router_topk=2)
          for s, e in (("", 4), ("-e16", 16))),
        # The nightly GPU tier's save that takes real time (matrices/nightly-gpu.yaml): ~1.14B params
        # (16 x 62.9M per layer + 2 x 65.5M untied embedding/output), Llama-3.2-1B-like. Divides every
        # tp, pp in {1, 2, 4, 8} and 2*cp up to 128. Too heavy for the 2-core CPU box (the judge holds
        # ~8 full copies of the weights in the parent): its entries require host-memory-gib>=64.
        ModelSpec(
            "gpt-1b", "gpt-gqa shape at ~1.1B params (16 heads, 8 query groups): the nightly GPU tier's timed saves",
            num_layers=16, hidden_size=2048, num_attention_heads=16, num_query_groups=8, ffn_hidden_size=8192,
            vocab_size=32000, seq_length=128,
        ),
        HFModelSpec("hf-llama", "Llama: GQA (8 heads, 4 kv heads), SwiGLU, RMSNorm, untied", "llama"),
        HFModelSpec("hf-qwen2", "Qwen2: GQA with q/k/v biases, untied", "qwen2"),
        HFModelSpec("hf-llama-tied", "Llama with tied input/output embeddings", "llama", tied=True),
        HFModelSpec("hf-qwen3moe", "Qwen3-MoE: 4 routed SwiGLU experts per layer (top-2, ffn 32), QK RMSNorm, GQA, untied; "
                    "transformers 5 keeps the experts fused in memory (gate_up_proj [E, 2F, H]) and per expert on disk",
                    "qwen3_moe", num_experts=4),
        HFModelSpec("hf-nemotron", "Nemotron: non-gated squared-ReLU MLP, LayerNorm1p (zero-centered gamma) with biases, "
                    "partial RoPE (0.5), GQA, untied", "nemotron"),
        # Found by `ckpt-harness explore --kind hf` (docs/measurements.md): the Bridge provider's
        # vocab padding (should_pad_vocab) pads 96 rows to 96 at tp1 and 128 at tp2.
        HFModelSpec("hf-llama-padvocab", "Llama, vocab 96 padded by the Bridge provider (should_pad_vocab)", "llama",
                    vocab_size=96, pad_vocab=True),
        # LoRA layouts (docs/explore-lora.md): 12 layers (a layer filter `*.layers.1.*` meets layers 10 and 11),
        # hidden 48 = 6 heads x 8 (MHA: TP 3 holds it), ffn 72 (not 2 x hidden), so no LoRA rank of the matrices divides both.
        HFModelSpec("hf-llama-odd", "Llama, 12 layers, hidden 48 (6 heads, MHA), ffn 72, vocab 96: LoRA layouts", "llama",
                    num_layers=12, hidden_size=48, num_attention_heads=6, num_key_value_heads=6, intermediate_size=72, vocab_size=96),
        HFModelSpec("hf-llama-ffn23", "Llama, 2 layers, odd ffn 23: the CanonicalLoRA fc1 adapter checkpoint (found by explore)", "llama",
                    num_layers=2, intermediate_size=23),
        # Found by `ckpt-harness explore --kind lora`: transformers' grouped_mm experts on CPU need 16-byte strides
        # verl's model_merger maps these (its Qwen2-MoE shared expert apart); Megatron-Bridge 0.6.2 has no bridge for them,
        # verl's vanilla bridge (mbridge) has: their cases build through backend option `bridge: vanilla`
        HFModelSpec("hf-qwen2_moe", "Qwen2-MoE: 4 routed experts (top-2, ffn 32) and a sigmoid-gated shared expert (ffn 64), "
                    "q/k/v biases; no Megatron-Bridge (mbridge only)", "qwen2_moe", num_experts=4,
                    overrides=(("shared_expert_intermediate_size", 64),), architecture="Qwen2MoeForCausalLM"),
        HFModelSpec("hf-mixtral", "Mixtral: 4 routed experts (top-2, ffn 32), GQA, no shared expert; no Megatron-Bridge "
                    "(mbridge only)", "mixtral", num_experts=4, overrides=(("sliding_window", None),), architecture="MixtralForCausalLM"),
        HFModelSpec("hf-qwen3moe-ffn6", "Qwen3-MoE, expert ffn 6 (fp32 rows of 24 bytes): transformers' CPU grouped_mm", "qwen3_moe",
                    num_experts=4, moe_intermediate_size=6),
    )
}


#: The spec fields a family's overrides also set (the zoo's view of the config must match the fixture's).
_SPEC_FIELDS = {"num_key_value_heads": "num_key_value_heads", "num_attention_heads": "num_attention_heads",
                "hidden_size": "hidden_size", "intermediate_size": "intermediate_size", "moe_intermediate_size": "moe_intermediate_size",
                "num_experts_per_tok": "num_experts_per_tok"}


def family_model(f: Family) -> HFModelSpec:
    """`hf-<family>`: a tiny fixture of one architecture the Bridge registers (harness.core.families)."""
    fields = {_SPEC_FIELDS[k]: v for k, v in f.overrides if k in _SPEC_FIELDS}
    remote = dict(remote_type=f.model_type or f.name, remote_fields=f.remote_fields) if f.path == "remote" else {}
    return HFModelSpec(f.zoo_name, f"{f.architecture}: {f.note or f.path}", f.layout or f.model_type or f.name, tied=f.tied,
                       num_layers=f.num_layers, num_experts=f.num_experts, overrides=f.overrides, architecture=f.architecture,
                       **fields, **remote)


# the four hand-written fixtures keep their names (hf-llama, hf-qwen2, hf-nemotron); every other family is hf-<family>
ZOO.update({f.zoo_name: family_model(f) for f in FAMILIES if f.zoo_name not in ZOO})
# Nemotron-H re-saved by transformers 5 (from_pretrained + save_pretrained of a Hub checkpoint): its embedding
# as `backbone.embedding.weight`, where the Hub's checkpoints (and the Bridge's mapping) say `embeddings`
ZOO["hf-nemotron_h-resaved"] = replace(ZOO["hf-nemotron_h"], name="hf-nemotron_h-resaved", saved_by_transformers=True,
                                       description="NemotronHForCausalLM as transformers 5 re-saves it (backbone.embedding.weight)")
# DeepSeek-V3 and GLM-4.5 with one multi-token-prediction layer (num_nextn_predict_layers 1), laid out as the Hub's
# checkpoints hold it: model.layers.<L> a whole decoder layer plus enorm, hnorm, eh_proj, shared_head.norm, and the copies of the
# embedding and output head it predicts with (embed_tokens, shared_head.head) (harness.models.hf.MTP_EXTRAS)
for _base, _arch in (("deepseek_v3", "DeepseekV3ForCausalLM"), ("glm4_moe", "Glm4MoeForCausalLM")):
    _mtp = replace(ZOO[f"hf-{_base}"], name=f"hf-{_base}-mtp",
                   overrides=tuple(sorted(ZOO[f"hf-{_base}"].overrides + (("num_nextn_predict_layers", 1),))),
                   description=f"{_arch} with one MTP layer (model.layers.4), as the Hub's checkpoints hold it")
    ZOO[_mtp.name] = _mtp
    ZOO[f"{_mtp.name}-owned"] = replace(_mtp, name=f"{_mtp.name}-owned", mtp_shared_copies=False,
                                        description=f"{_arch} with one MTP layer, without the layer's embedding and "
                                        "output-head copies (what Megatron's MTP layer owns)")
# Qwen3-Next with its MTP layer as its Hub checkpoints hold it (top-level mtp.*: fc, pre_fc_norm_embedding,
# pre_fc_norm_hidden, norm and a full-attention MoE layer mtp.layers.0; harness.models.hf._top_level_mtp)
ZOO["hf-qwen3_next-mtp"] = replace(ZOO["hf-qwen3_next"], name="hf-qwen3_next-mtp",
                                   overrides=tuple(sorted(ZOO["hf-qwen3_next"].overrides + (("mtp_num_hidden_layers", 1),))),
                                   description="Qwen3NextForCausalLM with one MTP layer (mtp.*), as the Hub's checkpoints")
# Issue 35's memory budgets (verl #6691): GPT-OSS keeps its experts fused on disk (experts.gate_up_proj
# [E, H, 2F]), the Bridge's grouped export; 2 layers, hidden 256, 16 experts (one expert's transient stays
# small beside a layer's whole fused tensor) of ffn 512 and 4x that
ZOO.update({f"hf-gpt_oss-mem{s}": replace(ZOO["hf-gpt_oss"], name=f"hf-gpt_oss-mem{s}", num_layers=2, hidden_size=256,
                                           num_experts=16, intermediate_size=ffn, description=f"GPT-OSS, fused experts: 2 "
                                           f"layers, hidden 256, 16 experts of ffn {ffn} (export memory budgets)")
            for s, ffn in (("", 512), ("-x4", 2048))})

#: Models shaped on purpose not to split evenly (LoRA layouts, the explorer's finds, hf-gemma3(_vl)'s 6
#: layers: one whole 5-local/1-global sliding-window period, and the VL / omni fixtures that keep the real
#: head_dim 128 under M-RoPE's sections or ERNIE-4.5-VL's 3-D RoPE: 2 heads at hidden 256): they fit the topologies their matrix
#: entries name, not every small one (tests/test_topology.py checks both).
ODD_SHAPES: frozenset[str] = frozenset({"gpt-odd", "hf-llama-odd", "hf-llama-ffn23", "hf-qwen3moe-ffn6", "hf-gemma3", "hf-gemma3_vl",
                                        "hf-qwen2_5_vl", "hf-qwen3_vl", "hf-qwen3_vl_moe", "hf-glm4v_moe",
                                        "hf-qwen2_5_omni", "hf-qwen3_omni", "hf-ernie4_5_vl_moe",
                                        # issue 35's 2-layer memory models (more layers dilute the grouped gather per shard)
                                        "gpt-moe-mem", "gpt-moe-mem-e16", "hf-gpt_oss-mem", "hf-gpt_oss-mem-x4"})


def get_model(name: str, kind: str | None = None) -> AnyModel:
    """The zoo model `name`; with `kind`, it must be of that kind ("gpt" or "hf")."""
    if name not in ZOO:
        raise KeyError(f"unknown model {name!r}; the zoo has {sorted(ZOO)}")
    model = ZOO[name]
    if kind is not None and model.kind != kind:
        raise KeyError(f"model {name!r} is a{'n' if model.kind == 'hf' else ''} {model.kind} model, not {kind}")
    return model
