"""Tiny HF checkpoints made locally (no hub): config, safetensors weights and a tokenizer.

Weights are a pure function of (seed, HF parameter name): norms are 1 + noise and biases are
non-zero, so a mapping that drops or swaps a norm or a bias shows up. Sizes divide every TP/PP
the matrices use (layers 4, heads 8, kv heads 4, hidden 64, intermediate 128, vocab 128).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class HFModelSpec:
    name: str
    description: str
    arch: str  # "llama" | "qwen2"
    tied: bool = False
    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    intermediate_size: int = 128
    vocab_size: int = 128
    seq_length: int = 16
    seed: int = 4321

    # what Topology.validate reads
    @property
    def num_query_groups(self) -> int:
        return self.num_key_value_heads

    @property
    def ffn_hidden_size(self) -> int:
        return self.intermediate_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


HF_ZOO: dict[str, HFModelSpec] = {
    m.name: m
    for m in (
        HFModelSpec("hf-llama", "Llama: GQA (8 heads, 4 kv heads), SwiGLU, RMSNorm, untied", "llama"),
        HFModelSpec("hf-qwen2", "Qwen2: GQA with q/k/v biases, untied", "qwen2"),
        HFModelSpec("hf-llama-tied", "Llama with tied input/output embeddings", "llama", tied=True),
    )
}


def get_hf_model(name: str) -> HFModelSpec:
    try:
        return HF_ZOO[name]
    except KeyError:
        raise KeyError(f"unknown HF model {name!r}; the HF zoo has {sorted(HF_ZOO)}") from None


def hf_config(spec: HFModelSpec):
    from transformers import LlamaConfig, Qwen2Config

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
    raise ValueError(f"unknown arch {spec.arch!r}")


def _param_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def canonical_hf_state(spec: HFModelSpec, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(_param_seed(spec.seed, name)))
        if "norm" in name:
            out[name] = 1.0 + 0.1 * noise
        elif name.endswith(".bias"):
            out[name] = 0.05 * noise
        else:
            out[name] = 0.05 * noise
    return out


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


def write_fixture(spec: HFModelSpec, directory: Path) -> Path:
    """Write config.json, model.safetensors and tokenizer files for `spec` into `directory`."""
    from transformers import AutoModelForCausalLM

    quiet_hf()
    directory.mkdir(parents=True, exist_ok=True)
    config = hf_config(spec)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    state = canonical_hf_state(spec, shapes)
    if spec.tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer(spec, directory)
    return directory


def read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in `directory`, by HF key."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            if k in out:
                raise ValueError(f"{directory}: key {k} appears in two safetensors files")
            out[k] = v
    return out


def fixed_input_ids(spec: HFModelSpec, batch: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(spec.seed + 11)
    return torch.randint(4, spec.vocab_size, (batch, spec.seq_length), generator=g)


@torch.no_grad()
def hf_logits(directory: Path, input_ids: torch.Tensor, adapter: Path | None = None) -> torch.Tensor:
    """Logits of transformers (optionally + a PEFT adapter) on CPU in fp32."""
    from transformers import AutoModelForCausalLM

    quiet_hf()
    model = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    return model(input_ids=input_ids).logits.float()
