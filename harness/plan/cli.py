"""`ckpt-harness plan`: its arguments and the run (harness/cli.py only registers it)."""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from harness.core.topology import Topology, TopologyError
from harness.plan import memory, predict, report, validate
from harness.plan.model import PlanInputError, load_model, presets

EXIT_OK, EXIT_INVALID, EXIT_BAD_INPUT = 0, 1, 2


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="predict and validate a checkpoint's save and load plans between two topologies "
                                    "(meta device, fake process group: no GPU)")
    p.add_argument("--model", required=True, help=f"an HF config.json path or a preset: {', '.join(presets())}")
    p.add_argument("--from", dest="src", required=True, help="the save topology, e.g. tp8pp8dp16")
    p.add_argument("--to", dest="dst", required=True, help="the load topology, e.g. tp4pp16dp16")
    p.add_argument("--format", default="fully_reshardable", choices=predict.FORMATS,
                   help="the distributed optimizer's checkpoint format (default fully_reshardable)")
    p.add_argument("--vocab-divisible-by", type=int, default=None,
                   help="pad the vocab as Megatron-LM does (to a multiple of N*tp); default: no padding")
    p.add_argument("--host-device", default="cuda", choices=("cuda", "cpu"),
                   help="where the training state lives, for the host-memory table (default cuda: only what a save "
                        "or load stages is on the host; cpu: the state too, as in this project's CPU worlds)")
    p.add_argument("--bucket-size", type=int, default=None,
                   help="DDP bucket size in parameters (default: one bucket per buffer, megatron-core without "
                        "overlap_grad_reduce); bounds fully_reshardable's gather transient")
    p.add_argument("--ranks-per-node", type=int, default=memory.RANKS_PER_NODE, help="for the per-node host peaks (default 8)")
    p.add_argument("--out", required=True, type=Path, help="folder for plan.md and plan.json")
    p.set_defaults(func=run_cli)
    return p


def plan(model_ref: str, src: str, dst: str, fmt: str = "fully_reshardable", vocab_divisible_by: int | None = None,
         progress=None, setup: memory.Setup | None = None) -> dict:
    """The plan as a dict (raises PlanInputError on bad input)."""
    from harness.plan.collect import topology_records

    t0 = time.perf_counter()
    model = load_model(model_ref, vocab_divisible_by)
    topos = []
    for text in (src, dst):
        try:
            topos.append(Topology.parse(text))
        except TopologyError as e:
            raise PlanInputError(f"topology {text!r}: {e}") from e
    for topo in topos:  # both before building either: a target that cannot hold the model fails in seconds
        try:
            topo.validate(model)
        except ValueError as e:
            raise PlanInputError(f"topology {topo.id} cannot hold model {model.name}: {e}") from e
    # fp32 models: the distributed optimizer's main params are the DDP buffer's params (memory.Setup)
    setup = replace(setup or memory.Setup(), fp32_model=model.dtype == "float32")
    with mla_build(model):
        saved = topology_records(model, topos[0], progress)
        loading = topology_records(model, topos[1], progress)
    return assemble(model.to_json(), topos[0], topos[1], fmt, saved, loading, time.perf_counter() - t0, setup)


@contextmanager
def mla_build(model):
    """While planning a multi-latent-attention model (DeepSeek-V3), collect builds it as megatron-core
    does: an MLATransformerConfig (the first `first_k_dense` layers dense, `moe_layer_freq`), the
    decoder block spec of that config (per-layer specs: dense and MoE layers differ) with the CPU
    MLA core attention (harness/models/cpu_attention.py: the local DotProductAttention takes no
    k/v channels), and torch.cuda.current_device answering "cpu" (MLA's RotaryEmbedding asks for it,
    rotary_pos_embedding.py:78; the harness's `cuda.current_device` shim). Scoped here because
    harness/plan/collect.py builds ordinary attention only; its owner can fold this into
    `transformer_config`/`rank_records` (two call sites) and drop the context."""
    if not getattr(model, "multi_latent_attention", False):
        yield
        return
    import torch
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from harness.models.cpu_attention import localize_mla
    from harness.plan import collect

    built: dict = {}
    own_config, own_spec, own_device = collect.transformer_config, gpt_layer_specs.get_gpt_layer_local_spec, torch.cuda.current_device

    def config(m, topo):
        base = own_config(m, topo)
        kw = {k: getattr(base, k) for k in (
            "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "tensor_model_parallel_size",
            "pipeline_model_parallel_size", "gated_linear_unit", "normalization", "add_bias_linear", "use_cpu_initialization",
            "perform_initialization", "bf16", "fp16", "params_dtype", "pipeline_dtype", "num_moe_experts", "moe_router_topk",
            "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "expert_model_parallel_size", "moe_grouped_gemm",
            "moe_token_dispatcher_type")}
        built["config"] = MLATransformerConfig(
            **kw, multi_latent_attention=True, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
            qk_head_dim=m.qk_head_dim, qk_pos_emb_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
            rope_type="rope", qk_layernorm=True,  # DeepSeek's q_a / kv_a layernorms
            moe_layer_freq=[0] * m.first_k_dense + [1] * (m.num_layers - m.first_k_dense))
        return built["config"]

    def spec(**_):
        gpt_layer_specs.get_gpt_layer_local_spec = own_spec  # the block spec builds its layers with it
        try:
            block = gpt_layer_specs.get_gpt_decoder_block_spec(built["config"], use_transformer_engine=False,
                                                               normalization="RMSNorm")
        finally:
            gpt_layer_specs.get_gpt_layer_local_spec = spec
        return localize_mla(block)

    collect.transformer_config, gpt_layer_specs.get_gpt_layer_local_spec = config, spec
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        collect.transformer_config, gpt_layer_specs.get_gpt_layer_local_spec = own_config, own_spec
        torch.cuda.current_device = own_device


def assemble(model: dict, src: Topology, dst: Topology, fmt: str, saved: list, loading: list, seconds: float,
             setup: memory.Setup | None = None) -> dict:
    """The plan from the two topologies' records (pure: tests feed planted records)."""
    save_problems, load_problems = validate.coverage_problems(saved), validate.coverage_problems(loading)
    keys = validate.load_problems(saved, loading)
    optimizer = predict.optimizer_verdict(fmt, src, dst)
    bad = save_problems or load_problems or keys["missing"] or keys["mismatched"] or optimizer
    return {
        "model": model, "format": fmt, "seconds": round(seconds, 2),
        "verdict": "INVALID" if bad else "VALID", "exit_code": EXIT_INVALID if bad else EXIT_OK,
        "save": predict.summary(saved, src, setup), "load": predict.summary(loading, dst, setup),
        "save_problems": save_problems, "load_problems": load_problems, "keys": keys, "optimizer": optimizer,
        "layout": {"save": validate.layout(saved), "load": validate.layout(loading)},
    }


def run_cli(args: argparse.Namespace) -> int:
    def progress(topo, i, n):
        if i == n or i % 16 == 0:
            print(f"plan: {topo.id}: {i}/{n} model-parallel coordinates built", file=sys.stderr, flush=True)

    try:
        if args.vocab_divisible_by is not None and args.vocab_divisible_by < 1:
            raise PlanInputError(f"--vocab-divisible-by {args.vocab_divisible_by}: must be >= 1")
        for name in ("bucket_size", "ranks_per_node"):
            if getattr(args, name) is not None and getattr(args, name) < 1:
                raise PlanInputError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
        setup = memory.Setup(device=args.host_device, bucket_numel=args.bucket_size, ranks_per_node=args.ranks_per_node)
        result = plan(args.model, args.src, args.dst, args.format, args.vocab_divisible_by, progress, setup)
    except PlanInputError as e:
        print(f"ckpt-harness plan: bad input: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    md, js = report.write(result, args.out)
    s = result["save"]
    print(f"{result['verdict']}: {s['topology']} -> {result['load']['topology']}: checkpoint weights "
          f"{report.gib(s['checkpoint_weight_bytes'])}, max written/rank {report.gib(s['max_written_per_rank'])}, "
          f"max read/rank {report.gib(result['load']['max_read_per_rank'])}; {md} and {js} ({result['seconds']:.1f} s)")
    return result["exit_code"]
