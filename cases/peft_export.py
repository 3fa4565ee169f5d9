"""peft-export: LoRA / CanonicalLoRA / DoRA on a Bridge model, exported as an HF PEFT adapter.

S == D: export at S. S != D: the adapter-only dist checkpoint (the state harness.models.bridge.adapter_state
selects, as verl saves it) goes from S to D through mcore_dist, and the adapter exported at D must
equal the one exported directly at S.

Checks:
  peft-load          PeftModel.from_pretrained loads the adapter into the HF base without a
                     missing-key warning; load_adapter reports no missing or unexpected keys
  adapter-derivation every exported tensor equals the harness's own derivation from the Megatron
                     adapter parameters (TP gather, QKV split per query group, fc1 gate/up halves; DoRA's
                     magnitude per output row as lora_magnitude_vector, split as lora_B's rows)
  adapter-config     r, lora_alpha, target_modules, base_model_name_or_path, task_type (CAUSAL_LM: what
                     AutoPeftModelForCausalLM and peft's task classes read) and use_dora (true for dora,
                     false or absent else: peft's default) are what was asked
  merge              the Bridge's merged export equals peft's merge_and_unload() weights (fp32: within
                     MERGE_WEIGHTS_TOLERANCE, the Bridge multiplies B@A on the fused qkv/fc1 lora_B; bf16 bitwise)
  logits             Megatron+LoRA logits equal transformers+PEFT logits (PEFT_TOLERANCE, its fp32 atol
                     scaled by alpha/r past 2) and
                     differ from the base model's (the adapter is not a no-op)
  merged-logits      transformers+PEFT logits after merge_and_unload() equal the unmerged adapter's
                     (MERGE_TOLERANCE) and Megatron+LoRA's (PEFT_TOLERANCE)
  lora-targets-matched  per target entry, the HF modules the PEFT model wraps equal (count and names)
                     the ones the Megatron LoRA wrapped (cases.shared.lora_layout)
  lora-targets-asked per target entry, the Megatron LoRA wrapped what the entry selects in the
                     model's global layer numbering
  resharded-export   (S != D) the adapter exported at D equals the direct export at S, bitwise
  adapter-params     (S != D) the Megatron adapter parameters at D, gathered, equal those at S
  export-integrity   the files of every artefact (harness.judge.hf_integrity, headers only): each
                     adapter one adapter_model.safetensors, no index, holding exactly the derivation's
                     keys with its shapes and dtypes; the merged export's index, shards and keys
                     against the HF base fixture, lm_head as its config's tie_word_embeddings says
  peft-resave        the adapter as peft-load loads it, saved again with peft's own save_pretrained
                     (default arguments, as users and verl save it), gives back the export: every exported
                     tensor found with its values (bitwise; exact after peft's bf16 -> fp32 upcast; under
                     another name where transformers renamed the module); adapter_config.json's r, lora_alpha,
                     target_modules (a set), use_rslora and modules_to_save equal; loaded into a fresh base, its
                     logits torch.equal the first load's; what peft writes in its own layout (merged MoE experts,
                     extra tensors) judged by those logits (cases.shared.peft_resave)

Layout options (cases.shared.peft.PeftOptions, docs/explore-lora.md): `adapter` (lora | canonical_lora | dora:
Megatron-Bridge's DoRA config where LoRA's goes, its magnitudes seeded too: harness.core.truth.magnitude_tensor), `dim` (any rank its
column-parallel targets' TP divides), `alpha`, `targets` (a subset of the kind's base linears) and
`layers` (global layer indices: the Bridge's wildcard entries `*.layers.N.*.<target>`).

Option `dtype` (fp32 | bf16, default fp32): bf16 writes the base fixture in bf16 and builds the
Bridge model (adapters included) in bf16 inside Float16Module; peft and transformers load the base
in bf16. The derivation, merge and reshard checks stay bitwise (in the adapter's dtype); the
logits compare within PEFT_TOLERANCE_BF16.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch

from .shared.lora_layout import megatron_units, targets_checks
from .shared.peft import (
    CAUSAL_LM,
    PeftOptions,
    PeftViews,
    config_check,
    hf_target_modules,
    logits_check,
    logits_tolerance,
    merge_weights_tolerance,
    merged_logits_check,
    peft_load_problems,
    peft_reference_error,
    peft_views,
)
from .shared.peft_resave import resave_check, resave_dir, resaved_logits
from .contract import Case
from harness.backends import BackendRef, get_backend, ref_of, resolve
from harness.core import truth
from harness.core.context import RankContext
from harness.core.parity import EXACT
from harness.core.result import CaseResult, Check
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.core.zoo import HFModelSpec, get_model
from harness.judge.checks import state_check
from harness.judge.hf_integrity import ADAPTER_WEIGHTS, Expected, export_integrity, infos_of, source_infos
from harness.models import bridge as mb
from harness.models import peft_mapping
from harness.models.hf import HUB_SPELLING, HF_DTYPES, hf_logits, write_fixture
from harness.models.vl import is_vl_checkpoint
from harness.models.mcore import DType
from harness.run.envelope import RunEnv


@dataclass(frozen=True)
class _Phase:
    spec: HFModelSpec
    hf_dir: str
    topo: Topology
    adapter: mb.AdapterSpec
    fill: bool
    export_backend: BackendRef  # import path + options
    dist_backend: BackendRef  # import path + options: the adapter-only dist checkpoint
    merge_backend: BackendRef  # import path + options: the merged HF export (save_hf_pretrained merges adapters)
    adapter_load: str | None = None
    adapter_save: str | None = None
    export_to: str | None = None
    merged_to: str | None = None
    dtype: DType = "fp32"
    first_stage_layers: int = 0


@dataclass(frozen=True)
class PeftExportOptions(PeftOptions):
    #: dora: Megatron-Bridge's DoRA (megatron.bridge.peft.dora), LoRA's targets with a trained magnitude per output row
    adapter: Literal["lora", "canonical_lora", "dora"] = "lora"
    #: > 0: the first pipeline stage of a side with PP > 1 holds this many layers (uneven stages; harness.models.bridge.build)
    first_stage_layers: int = 0


@dataclass
class PeftOut:
    pieces: list[dict]
    logits: torch.Tensor | None


def _rank(ctx: RankContext, p: _Phase) -> PeftOut:
    bm = mb.build(p.hf_dir, p.spec, p.topo, adapter=p.adapter, dtype=p.dtype, first_stage_layers=p.first_stage_layers)
    # decoy adapter weights on the load side: the load below must replace every one of them
    mb.fill_adapters(bm, p.spec, p.adapter if p.fill else replace(p.adapter, seed=p.adapter.seed + 1))
    dist = get_backend(p.dist_backend)
    if p.adapter_load:
        state = dist.load_state(ctx, mb.adapter_state(bm), Path(p.adapter_load))
        mb.load_adapter_state(bm, state)
    out = PeftOut(mb.adapter_pieces(bm, p.spec), mb.megatron_logits(bm, p.spec, ctx.device))
    if p.adapter_save:
        dist.save_state(ctx, mb.adapter_state(bm), Path(p.adapter_save))
    if p.export_to:
        get_backend(p.export_backend).save(ctx, bm, Path(p.export_to))
    if p.merged_to:
        get_backend(p.merge_backend).save(ctx, bm, Path(p.merged_to))
    return out


@dataclass
class Exported:
    """What the parent reads back from the artefacts of the source world (files and HF/peft runs)."""

    peft_problems: list[str]
    adapter: dict[str, torch.Tensor]
    config: dict[str, Any]
    peft: PeftViews  # the adapter loaded once: wrapped modules, logits unmerged and merged, merged weights
    bridge_merged: dict[str, torch.Tensor]
    hf_base_logits: torch.Tensor
    layout: peft_mapping.Layout = peft_mapping.TEXT  # where the HF base checkpoint keeps its decoder (a VL model's language path)


def _dtypes(state: dict[str, torch.Tensor]) -> str:
    return ", ".join(sorted({str(t.dtype).removeprefix("torch.") for t in state.values()}))


def derivation(model: HFModelSpec, outs: list[PeftOut], layout: peft_mapping.Layout = peft_mapping.TEXT) -> dict[str, torch.Tensor]:
    """The HF PEFT adapter the harness derives itself from the Megatron adapter pieces of `outs`,
    under the HF base checkpoint's `layout`."""
    return peft_mapping.to_hf_peft(peft_mapping.gather([p for o in outs for p in o.pieces], model.gated), model, layout)


def integrity(derived: dict[str, torch.Tensor], hf_dir: Path, adapters: dict[str, Path], merged: Path) -> Check:
    """export-integrity over the adapters (`adapters`: label -> directory, each against the
    derivation) and the merged export (against the HF base fixture)."""
    adapter = infos_of(derived)
    return export_integrity([Expected(label, d, adapter, ADAPTER_WEIGHTS, sharded_ok=False) for label, d in adapters.items()]
                            + [Expected("merged@source", merged, source_infos(hf_dir))])


def judge(model: HFModelSpec, asked: dict[str, Any], src: str, outs: list[PeftOut], ex: Exported, dtype: str = "fp32",
          entries: list | None = None, reference_error: float | None = None) -> list[Check]:
    """The export checks at the source topology (`entries`: the layout's target entries,
    cases.shared.lora_layout; default: the default adapter's; `reference_error`: transformers+PEFT's own fp32
    error, where measured: the logits bound widens to twice it)."""
    problems = ex.peft_problems
    derived = derivation(model, outs, ex.layout)
    peft_merged = ex.peft.merged
    if model.tied:  # the HF model's state dict lists the tied lm_head; safetensors stores it once
        peft_merged = {k: v for k, v in peft_merged.items() if k in ex.bridge_merged or k != "lm_head.weight"}
    meg = next((o.logits for o in outs if o.logits is not None), None)
    return [
        Check("peft-load", "failed" if problems else "passed", "; ".join(problems[:8]) or "no missing or unexpected keys", tolerance=EXACT),
        state_check("adapter-derivation", derived, ex.adapter, "harness-derivation", f"bridge-export@{src}",
                    f"{len(ex.adapter)} adapter tensors ({_dtypes(ex.adapter)}) equal the independent derivation"),
        config_check(ex.config, asked),
        state_check("merge", peft_merged, ex.bridge_merged, "peft merge_and_unload", "bridge merged export",
                    "merged weights equal peft merge_and_unload()", merge_weights_tolerance(dtype)),
        logits_check(ex.peft.lora_logits, ex.hf_base_logits, meg, src, dtype, asked["lora_alpha"] / asked["r"], reference_error)
        if meg is not None
        else Check("logits", "failed", "no rank returned Megatron logits"),
        merged_logits_check(ex.peft.merged_logits, ex.peft.lora_logits, meg, src, dtype, asked["lora_alpha"] / asked["r"]),
        *targets_checks(model, entries if entries is not None else PeftOptions().entries(model), megatron_units(derived, model), ex.peft.units),
    ]


def lora_reference_error(hf_dir: Path, adapter: Path, ids: torch.Tensor, lora_logits: torch.Tensor, outs: list[PeftOut],
                         dtype: str, asked: dict[str, Any]) -> float | None:
    """transformers+PEFT's own fp32 error (cases.shared.peft.peft_reference_error), measured only where the fixed fp32
    bound does not hold (the verdict is the same as measuring always: the bound is the larger of the two); None else."""
    meg = next((o.logits for o in outs if o.logits is not None), None)
    if dtype != "fp32" or meg is None:
        return None
    if (lora_logits - meg).abs().max() <= logits_tolerance(dtype, asked["lora_alpha"] / asked["r"]).atol:
        return None
    return peft_reference_error(hf_dir, adapter, ids, lora_logits)


def judge_resharded(src: str, dst: str, first: list[PeftOut], again: list[PeftOut],
                    at_source: dict[str, torch.Tensor], at_target: dict[str, torch.Tensor], gated: bool = True) -> list[Check]:
    return [
        state_check("resharded-export", at_source, at_target, f"adapter-export@{src}", f"adapter-export@{dst}",
                    f"{len(at_target)} adapter tensors exported at {dst} equal the export at {src}"),
        state_check("adapter-params", peft_mapping.gather([p for o in first for p in o.pieces], gated),
                    peft_mapping.gather([p for o in again for p in o.pieces], gated), src, dst,
                    "Megatron adapter parameters at D equal those at S"),
    ]


# --------------------------------------------------------------------------- the public steps
# What PeftExport.run runs, one world each; the golden corpus (harness.gate.golden) runs them too,
# on adapter checkpoints another environment wrote.


def _paths(export_backend: BackendRef, dtype: DType) -> dict[str, Any]:
    return dict(export_backend=export_backend, dist_backend=resolve("mcore_dist"), merge_backend=resolve("bridge_hf"), dtype=dtype)


def _opt(path: Path | None) -> str | None:
    return str(path) if path else None


def save_step(env: RunEnv, result: CaseResult, model: HFModelSpec, hf_dir: Path, topo: Topology, adapter: mb.AdapterSpec,
              export_backend: BackendRef, *, adapter_save: Path | None = None, export_to: Path | None = None,
              merged_to: Path | None = None, dtype: DType = "fp32", first_stage_layers: int = 0) -> list[PeftOut]:
    """World "save" at `topo`: build the Bridge model from the HF base `hf_dir` with `adapter`
    (filled with the harness's seeded adapter weights), save the adapter-only dist checkpoint
    (mcore_dist) into `adapter_save`, export the HF PEFT adapter through `export_backend` into
    `export_to` and the merged HF model (bridge_hf) into `merged_to`, each when given. Each rank's
    PeftOut (adapter pieces, Megatron logits)."""
    return env.launch("save", _rank, save_phase(model, hf_dir, topo, adapter, export_backend, adapter_save=adapter_save,
                                                        export_to=export_to, merged_to=merged_to, dtype=dtype,
                                                        first_stage_layers=first_stage_layers), topo)


def save_phase(model: HFModelSpec, hf_dir: Path, topo: Topology, adapter: mb.AdapterSpec, export_backend: BackendRef, *,
               adapter_save: Path | None = None, export_to: Path | None = None, merged_to: Path | None = None,
               dtype: DType = "fp32", first_stage_layers: int = 0) -> _Phase:
    """What save_step's world runs (PeftExport.run hands it to RunEnv.launch_source)."""
    return _Phase(model, str(hf_dir), topo, adapter, True, adapter_save=_opt(adapter_save), export_to=_opt(export_to),
                  merged_to=_opt(merged_to), first_stage_layers=first_stage_layers, **_paths(export_backend, dtype))


def load_step(env: RunEnv, result: CaseResult, model: HFModelSpec, hf_dir: Path, topo: Topology, adapter: mb.AdapterSpec,
              export_backend: BackendRef, adapter_load: Path, *, export_to: Path | None = None, dtype: DType = "fp32",
              first_stage_layers: int = 0) -> list[PeftOut]:
    """World "load" at `topo`: build the Bridge model with `adapter` holding decoy adapter weights,
    load the adapter-only dist checkpoint `adapter_load`, export the HF PEFT adapter into
    `export_to` when given. A load that raises fails the world."""
    return env.launch("load", _rank, _Phase(
        model, str(hf_dir), topo, adapter, False, adapter_load=str(adapter_load), export_to=_opt(export_to),
        first_stage_layers=first_stage_layers, **_paths(export_backend, dtype)), topo)


class PeftExport(Case):
    name = "peft-export"
    description = "Megatron-Bridge LoRA/CanonicalLoRA/DoRA -> HF PEFT adapter, checked against peft and an independent derivation"
    model_kind = "hf"
    Options = PeftExportOptions
    needs = frozenset({"adapter_export", "read_plain"})
    checks = ("peft-load", "adapter-derivation", "adapter-config", "merge", "logits", "merged-logits", "lora-targets-matched",
              "lora-targets-asked", "resharded-export", "adapter-params", "export-integrity", "peft-resave")

    def validate_options(self, spec: CaseSpec, opts: PeftExportOptions) -> None:
        opts.validate_layout(get_model(spec.model, "hf"), (spec.source, spec.target))
        mb.validate_first_stage_layers(get_model(spec.model, "hf"), (spec.source, spec.target), opts.first_stage_layers)

    def run(self, spec: CaseSpec, opts: PeftExportOptions, env: RunEnv, result: CaseResult) -> None:
        model = get_model(spec.model, "hf")
        adapter = opts.spec(model)
        src, dst = spec.source, spec.target
        d = env.case_dir
        dtype, fsl = opts.dtype, opts.first_stage_layers
        # the base fixture and the world at S are the same for every target: once per run (harness.run.reuse)
        hf_dir = env.source_files("fixture", "write_fixture", (model, dtype, 1, ()), lambda p: write_fixture(model, p, dtype))
        resharded = src != dst
        root, first = env.launch_source("save", _rank, lambda p: save_phase(
            model, hf_dir, src, adapter, ref_of(spec), adapter_save=p / "adapter-dist-ckpt" if resharded else None,
            export_to=p / "adapter@source", merged_to=p / "merged@source", dtype=dtype, first_stage_layers=fsl), src)
        direct, merged, ckpt = root / "adapter@source", root / "merged@source", root / "adapter-dist-ckpt"
        if resharded:
            again = load_step(env, result, model, hf_dir, dst, adapter, ref_of(spec), ckpt, export_to=d / "adapter@target", dtype=dtype,
                              first_stage_layers=fsl)
        with env.timed("compare"):
            adapters = {"adapter@source": direct} | ({"adapter@target": d / "adapter@target"} if resharded else {})
            layout = peft_mapping.checkpoint_layout(source_infos(hf_dir))
            result.checks.append(integrity(derivation(model, first, layout), hf_dir, adapters, merged))
            export = get_backend(ref_of(spec))
            ids = truth.fixed_input_ids(model)
            resaved = resave_dir(d)  # peft's own save_pretrained of the adapter peft_views loads (peft-resave)
            ex = Exported(
                peft_load_problems(hf_dir, direct, dtype), export.read_full(None, direct),
                json.loads((direct / "adapter_config.json").read_text()),
                # what save_pretrained writes (the checkpoint's names) where memory's differ: fused experts, a VL layout
                peft_views(hf_dir, direct, ids, dtype,
                           d / "peft-merged" if model.num_experts or is_vl_checkpoint(hf_dir) or model.arch in HUB_SPELLING else None,
                           resave_to=resaved),
                get_backend("bridge_hf").read_full(None, merged), hf_logits(hf_dir, ids, dtype=dtype), layout,
            )
            asked = {"r": opts.dim, "lora_alpha": opts.alpha, "target_modules": hf_target_modules(model, opts),
                     "base_model_name_or_path": str(hf_dir), "task_type": CAUSAL_LM, "use_dora": opts.adapter == "dora"}
            result.checks.extend(judge(model, asked, src.id, first, ex, dtype, opts.entries(model),
                                       lora_reference_error(hf_dir, direct, ids, ex.peft.lora_logits, first, dtype, asked)))
            result.checks.append(resave_check(direct, resaved, ex.peft.lora_logits, resaved_logits(hf_dir, resaved, ids, dtype)))
            if resharded:
                result.checks.extend(judge_resharded(src.id, dst.id, first, again, ex.adapter, export.read_full(None, d / "adapter@target"),
                                                           model.gated))


CASE = PeftExport()
