"""hf-roundtrip: HF checkpoint -> Megatron (AutoBridge) at S -> HF export, through Megatron-Bridge.

S == D: export at S (the backend's `save`, `save_hf_pretrained` for bridge_hf). S != D: verl's real
path: save a megatron-core dist checkpoint at S, reload it at D into a model built without HF
weights, export at D.

Checks:
  export-bitwise   the exported safetensors equal the source: same keys, dtypes, bytes
  hf-logits        transformers computes bitwise the same logits from the export as from the source
  megatron-logits  (@topology) the Megatron model's logits equal transformers' within MEGATRON_HF_TOLERANCE
  propagation      the DDP knobs asked of provider.provide_distributed_model reach the built
                   DDP module's ddp_config (verl PR #5775); the built params have the asked
                   dtype, inside Float16Module for bf16
  export-dtype     the export's config.json declares the source config's dtype (`torch_dtype`,
                   transformers 5 `dtype`) and every floating tensor of the export has that dtype
  export-integrity the export's files (harness.judge.hf_integrity, headers only): index vs shard
                   headers both ways and total_size, source keys/shapes/dtypes, lm_head as tied says
  refusal          (expect: refuse) the export raised one of `refuse_with`

Option `shards` (default 1): the fixture is written in that many safetensors shards with an index;
the Bridge keeps the source's sharding in its export, so the index checks meet a real index.
Option `unmapped_source_key` (a key, default none): the fixture also holds this tensor, which no
Bridge mapping produces (as real checkpoints hold persisted buffers or unknown keys). What the
export does with it is the finding: carried (export-bitwise and export-integrity pass), dropped
(both fail naming the key) or refused (`expect: refuse`: the `refusal` check judges the raise).

Option `dtype` (fp32 | bf16, default fp32): bf16 writes the fixture in bf16 (config dtype
bfloat16), builds the Bridge model in bf16 inside Float16Module, and compares Megatron's and
transformers' bf16 logits within MEGATRON_HF_TOLERANCE_BF16; every other check stays bitwise.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .contract import Case
from .shared.hf_tolerance import MEGATRON_HF_TOLERANCE, MEGATRON_HF_TOLERANCE_BF16
from harness.backends import BackendRef, get_backend, ref_of, resolve
from harness.core import truth
from harness.core.context import RankContext
from harness.core.memory import track
from harness.core.parity import EXACT, REFERENCE_ERROR_FACTOR, Tolerance, widened  # noqa: F401 (the factor: its comment, tests)
from harness.core.result import CaseResult, Check
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.core.zoo import HFModelSpec, get_model
from harness.judge.checks import knob_check, not_run_checks, refusal_check, state_check, tensor_check
from harness.judge.hf_integrity import Expected, export_integrity, source_infos
from harness.models import bridge as mb
from harness.models.hf import config_dtype, reference_attention, write_fixture
from harness.models.mcore import DType
from harness.models.remote import is_remote, no_modeling
from harness.run.envelope import RunEnv
from harness.run.world import WorldError, exception_of


# The fp32 bound where the reference itself is less exact than MEGATRON_HF_TOLERANCE: transformers' fp32
# logits are off their own fp64 forward by e (measured per fixture, `reference_error`). Megatron's fp32
# forward runs the same arithmetic on the same weights in another order, so its error is of the same
# order, and |megatron - transformers| <= |megatron - exact| + |transformers - exact| ~ 2e: the bound is
# max(atol, REFERENCE_ERROR_FACTOR x e). Measured (CPU, fp32, tp1): e = 1.19e-5 (hf-gemma3), 2.81e-5
# (hf-gemma4); Megatron's own logits vs that fp64 forward 1.11e-5 and 2.23e-5, i.e. <= e as assumed. A
# dropped op (hf-gemma2's dropped attention soft-cap: 1.2e-3) or a wrong weight stays far above 2e.
# (harness.core.parity.REFERENCE_ERROR_FACTOR, `widened`: peft-export's logits bound widens the same way)


@dataclass(frozen=True)
class DdpKnobs:
    """What is asked of the provider's DDP wrapper (each must reach the built ddp_config)."""

    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    grad_reduce_in_fp32: bool = False


@dataclass(frozen=True)
class Options(DdpKnobs):
    """hf-roundtrip's options: the DDP knobs and the precision of fixture, model and export."""

    dtype: DType = "fp32"
    shards: int = 1
    unmapped_source_key: str = ""
    refuse_with: tuple[str, ...] = ("RuntimeError",)  # Bridge's strict export: state.py save_generator
    #: > 0: the first pipeline stage of a side with PP > 1 holds this many layers (uneven stages; harness.models.bridge.build)
    first_stage_layers: int = 0
    #: true: memory nothing writes reads NaN in the case's worlds (torch's deterministic mode fills uninitialized
    #: memory), so a parameter an import skips holds NaN on every run, not whatever the allocator left there: a
    #: partial import's known defect then measures the same on both sides of a gate
    fill_unwritten: bool = False

    def knobs(self) -> DdpKnobs:
        return DdpKnobs(**{k: getattr(self, k) for k in DdpKnobs.__dataclass_fields__})


def megatron_tolerance(dtype: str, reference_error: float | None = None) -> Tolerance:
    """The Megatron-vs-transformers bound: bf16's, else fp32's widened to REFERENCE_ERROR_FACTOR x
    the reference's own measured fp32 error (`reference_error`) where that is larger, naming both."""
    if dtype == "bf16":
        return MEGATRON_HF_TOLERANCE_BF16
    return widened(MEGATRON_HF_TOLERANCE, reference_error)


@torch.no_grad()
def reference_logits(directory: Path, input_ids: torch.Tensor, dtype: str = "fp32", precision: torch.dtype | None = None) -> torch.Tensor:
    """transformers' logits of the checkpoint (harness.models.hf.hf_logits, with eager attention where
    harness.models.hf.reference_attention says (its SDPA_DROPS)); `precision` float64: its fp64 forward, returned in fp64."""
    from harness.models.hf import HF_DTYPES, quiet_hf
    from harness.models.vl import auto_class_of, forward_model

    quiet_hf()
    attn = reference_attention(directory)
    kw: dict[str, Any] = {"attn_implementation": attn} if attn else {}
    if precision is not None:  # the default grouped_mm experts take no fp64 (torch._grouped_mm): the per-expert loop
        kw["experts_implementation"] = "eager"
    model = auto_class_of(directory).from_pretrained(directory, dtype=precision or HF_DTYPES[dtype], **kw)
    logits = forward_model(model.eval())(input_ids=input_ids).logits
    return logits if precision is not None else logits.float()


def reference_error(directory: Path, input_ids: torch.Tensor, fp32_logits: torch.Tensor) -> float:
    """max |transformers fp32 logits - its fp64 forward of the same checkpoint| (one extra forward)."""
    exact = reference_logits(directory, input_ids, precision=torch.float64)
    return float((fp32_logits.double() - exact).abs().max())


def export_dtype_check(source_dtype: str | None, export_dtype: str | None, exported: dict[str, torch.Tensor]) -> Check:
    """The export declares the source config's dtype and holds its floating tensors in it: a
    bf16 model exported as fp32 (or with a config that says another dtype) fails."""
    problems = []
    if source_dtype is None:
        problems.append("the source config declares no dtype")
    if export_dtype != source_dtype:
        problems.append(f"export config dtype {export_dtype!r}, source config {source_dtype!r}")
    held = sorted({str(t.dtype).removeprefix("torch.") for t in exported.values() if t.is_floating_point()})
    wrong = sorted(k for k, t in exported.items() if t.is_floating_point() and str(t.dtype).removeprefix("torch.") != source_dtype)
    if wrong:
        problems.append(f"{len(wrong)} exported tensor(s) not {source_dtype} (hold {', '.join(held)}), e.g. {wrong[0]}")
    if problems:
        return Check("export-dtype", "failed", "; ".join(problems), tolerance=EXACT)
    return Check("export-dtype", "passed", f"config and {len(exported)} tensors {source_dtype}, as the source config", tolerance=EXACT)


@dataclass(frozen=True)
class _Phase:
    spec: HFModelSpec
    hf_dir: str
    topo: Topology
    load_weights: bool
    ddp: DdpKnobs
    export_backend: BackendRef  # import path + options
    dist_backend: BackendRef  # import path + options of the dist checkpoint for the S -> D hop
    dist_load: str | None = None
    dist_save: str | None = None
    export_to: str | None = None
    dtype: DType = "fp32"
    first_stage_layers: int = 0
    fill_unwritten: bool = False


@dataclass
class BridgeOut:
    propagation: list[dict[str, Any]]
    logits: torch.Tensor | None
    #: the bytes of the model's parameters this rank holds: what an `export` memory budget's x-shard limit multiplies
    shard_bytes: int = 0


def _rank(ctx: RankContext, p: _Phase) -> BridgeOut:
    from megatron.core.distributed import DistributedDataParallelConfig

    knobs = asdict(p.ddp)
    if p.fill_unwritten:  # torch.empty then fills NaN (torch.utils.deterministic.fill_uninitialized_memory)
        torch.use_deterministic_algorithms(True, warn_only=True)
    bm = mb.build(p.hf_dir, p.spec, p.topo, load_weights=p.load_weights, ddp_config=DistributedDataParallelConfig(**knobs),
                  dtype=p.dtype, first_stage_layers=p.first_stage_layers)
    dist = get_backend(p.dist_backend)
    if p.dist_load:
        dist.load(ctx, mb.chunks(bm), Path(p.dist_load))
    out = BridgeOut(mb.ddp_propagation(bm, knobs, p.dtype), mb.megatron_logits(bm, p.spec, ctx.device))
    if p.dist_save:
        dist.save(ctx, mb.chunks(bm), Path(p.dist_save))
    if p.export_to:  # measured as memory phase `export` (`<world>:export` in the load world)
        out.shard_bytes = sum(t.numel() * t.element_size() for c in mb.chunks(bm) for t in c.parameters())
        with track("export"):
            get_backend(p.export_backend).save(ctx, bm, Path(p.export_to))
    return out


def judge(
    src: Topology, dst: Topology, worlds: list[tuple[str, list[BridgeOut]]], source: dict[str, torch.Tensor],
    exported: dict[str, torch.Tensor], ref_logits: torch.Tensor | None, export_logits: torch.Tensor | None,
    config_dtypes: tuple[str | None, str | None], dtype: str = "fp32", ref_error: float | None = None, no_logits: str = "",
    export_refused: str = "",
) -> list[Check]:
    """`worlds`: (topology id, outputs) of each world that built the model (one when S == D);
    `config_dtypes`: the dtype the source's and the export's config.json declare; `ref_error`:
    transformers' own fp32 error on the source (`reference_error`), None where not measured. `ref_logits`
    None: no transformers class builds the checkpoint (harness.models.remote): both logits checks not-run,
    `no_logits` saying why. `export_logits` None with `export_refused`: transformers could not load the export (the
    error, as a user's from_pretrained meets it): hf-logits fails saying so."""
    bound = megatron_tolerance(dtype, ref_error)
    measured = "" if ref_error is None else f" (transformers' own fp32 error {ref_error:.3g} vs fp64; bound atol {bound.atol:.3g})"
    checks = [state_check("export-bitwise", source, exported, "hf-source", f"export@{dst.id}",
                          f"{len(exported)} tensors, keys and dtypes equal the source")]
    if ref_logits is None:
        checks += not_run_checks(("hf-logits", "megatron-logits"), no_logits)
    elif export_logits is None:
        checks.append(Check("hf-logits", "failed", f"transformers cannot load the export@{dst.id}: {export_refused or 'no logits'}"))
    else:
        checks.append(tensor_check("hf-logits", ref_logits, export_logits, "transformers(source)", f"transformers(export@{dst.id})",
                                   "transformers logits equal"))
    for label, outs in worlds if ref_logits is not None else ():
        meg = next((o.logits for o in outs if o.logits is not None), None)
        if meg is None:
            checks.append(Check(f"megatron-logits@{label}", "failed", "no rank returned logits"))
            continue
        checks.append(tensor_check(f"megatron-logits@{label}", ref_logits, meg, "transformers(source)", f"megatron@{label}",
                                   "Megatron logits match transformers" + measured, bound))
    checks.append(knob_check("propagation", [(label, [o.propagation for o in outs]) for label, outs in worlds],
                             f"{', '.join(DdpKnobs.__dataclass_fields__)} reach the provider-built DDP; params {dtype}"))
    checks.append(export_dtype_check(*config_dtypes, exported))
    return checks


class HFRoundtrip(Case):
    name = "hf-roundtrip"
    description = "HF -> Megatron at S (-> dist ckpt -> D) -> HF export equals the source bitwise"
    model_kind = "hf"
    Options = Options
    needs = frozenset({"hf_export", "read_plain"})
    checks = ("export-bitwise", "hf-logits", "megatron-logits", "propagation", "export-dtype", "export-integrity", "refusal")
    refusable = True

    def validate_options(self, spec: CaseSpec, opts: Options) -> None:
        if spec.expect == "refuse" and not opts.unmapped_source_key:
            raise ValueError("expect: refuse means the export refuses a source tensor it cannot map: name it (option unmapped_source_key)")
        if spec.expect != "refuse" and "refuse_with" in spec.opts:
            raise ValueError("option 'refuse_with' only means something with expect: refuse")
        if opts.shards < 1:
            raise ValueError(f"option 'shards' must be >= 1, got {opts.shards}")
        mb.validate_first_stage_layers(get_model(spec.model, "hf"), (spec.source, spec.target), opts.first_stage_layers)

    def run(self, spec: CaseSpec, opts: Options, env: RunEnv, result: CaseResult) -> None:
        run_roundtrip(get_model(spec.model, "hf"), spec.source, spec.target, ref_of(spec), opts, env, result, expect=spec.expect)


# --------------------------------------------------------------------------- the public steps
# What run_roundtrip runs, one world each; the golden corpus (harness.gate.golden) runs them too,
# on checkpoints and exports another environment wrote.


def save_step(env: RunEnv, result: CaseResult, model: HFModelSpec, hf_dir: Path, topo: Topology, export_backend: BackendRef, *,
              dist_save: Path | None = None, export_to: Path | None = None, ddp: DdpKnobs = DdpKnobs(), dtype: DType = "fp32",
              dist_backend: BackendRef | None = None, phase: str = "save", first_stage_layers: int = 0,
              fill_unwritten: bool = False) -> list[BridgeOut]:
    """World `phase` at `topo`: build the Bridge model from the HF checkpoint `hf_dir` (its
    weights, AutoBridge), save its megatron-core dist checkpoint into `dist_save` (through
    `dist_backend`, mcore_dist when None) and export it through `export_backend` into `export_to`,
    each when given. Each rank's BridgeOut (DDP knob propagation, Megatron logits)."""
    return env.launch(phase, _rank, save_phase(model, hf_dir, topo, export_backend, dist_save=dist_save, export_to=export_to,
                                                       ddp=ddp, dtype=dtype, dist_backend=dist_backend,
                                                       first_stage_layers=first_stage_layers, fill_unwritten=fill_unwritten), topo)


def save_phase(model: HFModelSpec, hf_dir: Path, topo: Topology, export_backend: BackendRef, *, dist_save: Path | None = None,
               export_to: Path | None = None, ddp: DdpKnobs = DdpKnobs(), dtype: DType = "fp32",
               dist_backend: BackendRef | None = None, first_stage_layers: int = 0, fill_unwritten: bool = False) -> _Phase:
    """What save_step's world runs (run_roundtrip hands it to RunEnv.launch_source)."""
    return _Phase(model, str(hf_dir), topo, True, ddp, export_backend=export_backend, dist_backend=dist_backend or resolve("mcore_dist"),
                  dist_save=str(dist_save) if dist_save else None, export_to=str(export_to) if export_to else None, dtype=dtype,
                  first_stage_layers=first_stage_layers, fill_unwritten=fill_unwritten)


def load_step(env: RunEnv, result: CaseResult, model: HFModelSpec, hf_dir: Path, topo: Topology, export_backend: BackendRef,
              dist_load: Path, *, export_to: Path | None = None, ddp: DdpKnobs = DdpKnobs(), dtype: DType = "fp32",
              dist_backend: BackendRef | None = None, first_stage_layers: int = 0, fill_unwritten: bool = False) -> list[BridgeOut]:
    """World "load" at `topo`: build the Bridge model from `hf_dir`'s config without its weights,
    load the dist checkpoint `dist_load` (through `dist_backend`, mcore_dist when None), export it
    through `export_backend` into `export_to` when given. A load that raises fails the world."""
    return env.launch("load", _rank, _Phase(
        model, str(hf_dir), topo, False, ddp, export_backend=export_backend, dist_backend=dist_backend or resolve("mcore_dist"),
        dist_load=str(dist_load), export_to=str(export_to) if export_to else None, dtype=dtype,
        first_stage_layers=first_stage_layers, fill_unwritten=fill_unwritten), topo)


def run_roundtrip(model: HFModelSpec, src: Topology, dst: Topology, export_backend: BackendRef, opts: DdpKnobs, env: RunEnv,
                  result: CaseResult, expect: str = "pass") -> None:
    """The fixture, the worlds (export at S, or save at S -> load at D -> export) and the judge, for
    any HFModelSpec: the matrix case and harness.orchestration.explore (which draws shapes outside the zoo) run this.
    `opts`: DdpKnobs (fp32) or Options (knobs, dtype, fixture shards, an unmapped source key)."""
    full = opts if isinstance(opts, Options) else Options(**asdict(opts))
    dtype, opts, fsl, fill = full.dtype, full.knobs(), full.first_stage_layers, full.fill_unwritten
    extra = (full.unmapped_source_key,) if full.unmapped_source_key else ()
    export = env.case_dir / "hf-export"
    # the fixture and the save at S are the same for every target: once per run (harness.run.reuse)
    hf_dir = env.source_files("fixture", "write_fixture", (model, dtype, full.shards, extra),
                              lambda d: write_fixture(model, d, dtype, shards=full.shards, extra_keys=extra))
    worlds = []
    try:
        if src == dst:
            outs = save_step(env, result, model, hf_dir, src, export_backend, export_to=export, ddp=opts, dtype=dtype, phase="export",
                             first_stage_layers=fsl, fill_unwritten=fill)
            worlds = [(src.id, outs)]
        else:
            root, first = env.launch_source("save", _rank, lambda d: save_phase(
                model, hf_dir, src, export_backend, dist_save=d / "dist-ckpt", ddp=opts, dtype=dtype, first_stage_layers=fsl,
                fill_unwritten=fill), src)
            ckpt = root / "dist-ckpt"
            worlds = [(src.id, first)]
            outs = load_step(env, result, model, hf_dir, dst, export_backend, ckpt, export_to=export, ddp=opts, dtype=dtype,
                             first_stage_layers=fsl, fill_unwritten=fill)
            worlds.append((dst.id, outs))
    except WorldError as exc:
        if expect != "refuse" or len(worlds) != (src != dst):  # only the exporting world (the last) may refuse
            raise
        exc_type, message = exception_of(exc.rank_traceback or str(exc))
        left = sorted(p.name for p in export.iterdir()) if export.is_dir() else []
        result.notes.append(f"the refused export left {export.name}/ holding {left}")
        result.checks.append(refusal_check(exc_type, message, full.refuse_with, f"{dst.id} of a source holding {extra[0]}",
                                           "the Bridge exports no tensor it does not map", action="export"))
        result.checks += not_run_checks(("export-bitwise", "hf-logits", "megatron-logits", "propagation", "export-dtype",
                                         "export-integrity"), "the export refused")
        return
    if expect == "refuse":
        result.checks.append(refusal_check(None, "", full.refuse_with, f"{dst.id} of a source holding {extra[0]}", action="export"))
    with env.timed("compare"):
        # first: headers only, and judged even where transformers then cannot load the export
        result.checks.append(export_integrity([Expected(f"export@{dst.id}", export, source_infos(hf_dir))]))
        backend = get_backend(export_backend)
        if is_remote(model):  # no transformers class builds it: weights, reshard and export only
            result.checks += judge(src, dst, worlds, backend.read_full(None, hf_dir), backend.read_full(None, export), None, None,
                                   (config_dtype(hf_dir), config_dtype(export)), dtype,
                                   no_logits=no_modeling(model.architecture, model.arch))
            return
        ids = truth.fixed_input_ids(model)
        ref = reference_logits(hf_dir, ids, dtype=dtype)
        ref_error = None
        if dtype == "fp32":
            try:
                ref_error = reference_error(hf_dir, ids, ref)
            except Exception as exc:  # noqa: BLE001 - no fp64 forward: the fixed (stricter) bound applies, said so
                result.notes.append(f"transformers' fp64 forward failed ({type(exc).__name__}: {exc}): the fixed fp32 bound applies")
        export_logits, refused = None, ""
        try:
            export_logits = reference_logits(export, ids, dtype=dtype)
        except Exception as exc:  # noqa: BLE001 - the export a user's from_pretrained refuses: hf-logits fails, naming it
            import traceback

            from harness.core.frames import raised_in_own_code

            if raised_in_own_code(traceback.format_exc()) is not False:  # the harness's own error stays an error
                raise
            refused = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        result.checks.extend(judge(src, dst, worlds, backend.read_full(None, hf_dir), backend.read_full(None, export),
                                   ref, export_logits, (config_dtype(hf_dir), config_dtype(export)), dtype, ref_error,
                                   export_refused=refused))


CASE = HFRoundtrip()
