"""convert: a megatron-core torch_dist checkpoint (what backend mcore_dist writes: DDP + distributed
optimizer) converted to Megatron-FSDP's fsdp_dtensor and back, through the converters Megatron-LM
ships (tools/checkpoint/, not in the megatron-core wheel: harness.compat.megatron_lm), and the
fsdp_dtensor checkpoint exported to HF through Megatron-Bridge. docs/convert.md has the findings.

World "save" at S: train `steps` steps and save model + optimizer (reshard-optimizer's save, so a
run that has both writes it once), or (`optimizer: false`) save the canonical weights only.
World "convert": the target's world size of ranks runs upstream's
`checkpoint_inspector.py convert-torch-dist-to-fsdp-dtensor IN OUT [--swiglu]`, as `torchrun
--nproc_per_node N` would. Then the parent compares the two checkpoints model-free
(harness.judge.convert).

Checks:
  to-fsdp-dtensor  upstream's converter ran to completion (a raise fails it, naming the exception,
                   message and raise site)
  fsdp-weights     every model weight of the source is in the converted checkpoint under its
                   Megatron-FSDP key (layers split, experts split, SwiGLU fc1 split into _w/_v), bitwise,
                   and nothing else is under `model.module.`
  fsdp-optimizer   likewise exp_avg, exp_avg_sq and the main params (`param`, fp32 in a bf16 run
                   too) under `optimizer.state.module.module.module.<param>.<state>`; not-run with
                   `optimizer: false`; a source without optimizer state where the case saved one fails
  fsdp-step        the optimizer step of every param group survives (a source without one fails
                   where the case saved an optimizer)
  to-torch-dist    fsdp_dtensor -> torch_dist through a shipped converter: not-run while none
                   ships (the reason names every file and option looked at); failed when the
                   converter gains a command for it, so the harness gets wired to drive it
  roundtrip        the back-converted torch_dist equals the original: not-run without to-torch-dist
  target-load      option `target_backend`: the converted checkpoint loaded through that backend
                   at the target topology equals the source's weights, bitwise
  hf-export        option `export_hf` (an HF fixture of the model's architecture, e.g. hf-llama for
                   gpt-gqa; weights-only sources): Megatron-Bridge exports the fsdp_dtensor
                   checkpoint (AutoBridge.load_megatron_model + save_hf_pretrained) and the HF
                   tensors equal the Bridge's export of the source weights, or it refuses as the
                   Bridge documents it (REFUSAL_TYPE, REFUSAL: config.py:606's ValueError "... is not
                   supported together with ckpt_format='fsdp_dtensor'"). Any other raise fails, even
                   one that mentions fsdp_dtensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .ranks.convert import Conversion, HFExport, TargetLoad, WeightsSave, convert, hf_export, target_load, weights_save
from .ranks.train_phase import phase_of, train_phase
from .contract import Case
from harness.backends import BackendRef, get_backend, parse_ref, ref_of, resolve
from harness.backends._megatron_lm import iteration_dir
from harness.compat import megatron_lm as mlm
from harness.compat import registry
from harness.core.parity import NOT_COMPARED, assemble
from harness.core.result import CaseResult, Check
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.core.zoo import HFModelSpec, ModelSpec, get_model
from harness.judge.checks import not_run_checks, state_check
from harness.judge.convert import (
    CHECKS,
    FLAT_GROUPS,
    STEP_KEY,
    flat_steps,
    judge_fsdp,
    raise_site,
    read_checkpoint,
    reverse_not_run,
    source_steps,
)
from harness.models.training import TrainOptions, untrainable
from harness.run.envelope import RunEnv
from harness.run.world import WorldError, exception_of

FSDP_CHECKS = CHECKS[1:]
HF_SHAPE = (("num_layers", "num_layers"), ("hidden_size", "hidden_size"), ("num_attention_heads", "num_attention_heads"),
            ("num_query_groups", "num_key_value_heads"), ("ffn_hidden_size", "intermediate_size"), ("vocab_size", "vocab_size"),
            ("tied_embeddings", "tied"))


@dataclass(frozen=True)
class Options(TrainOptions):
    sharding: str = "fully_reshardable"  # what the converter reads per parameter (dp_reshardable: a finding)
    #: False: a weights-only torch_dist source (the canonical weights, no optimizer state)
    optimizer: bool = True
    converter_workarounds: tuple[str, ...] = registry.defaults("converter")
    #: a backend (with options, harness.backends.parse_ref) that loads the converted checkpoint at
    #: the target: Megatron-FSDP's fsdp_dtensor backend once it is registered; "" = not-run
    target_backend: str = ""
    #: an HF fixture of the model's architecture: export the fsdp_dtensor checkpoint through the Bridge
    export_hf: str = ""


#: The refusal Megatron-Bridge documents for HF weights from an fsdp_dtensor checkpoint (0.6.2
#: training/config.py:606, `also_save_hf_checkpoint` in training): this exception type with this
#: message. Only an export refusing the same way passes hf-export; any other raise fails, whatever
#: it mentions (a crash in fsdp_dtensor code, or "Supported formats are: 'torch_dist', 'fsdp_dtensor'").
REFUSAL_TYPE = "ValueError"
REFUSAL = re.compile(r"is not supported together with ckpt_format='fsdp_dtensor'")


def refused_clearly(exc_type: str, message: str) -> bool:
    """The export refused as upstream documents it (REFUSAL_TYPE and REFUSAL), naming the format."""
    return exc_type == REFUSAL_TYPE and bool(REFUSAL.search(message))


def export_check(error: WorldError | None, exported: dict, reference: dict, checkpoint: str = "") -> Check:
    """hf-export from the export world's outcome (`error`) and both exports' tensors; `checkpoint`
    (the exported directory) is taken out of the message before judging it."""
    if error is not None:
        tb = error.rank_traceback or str(error)
        exc_type, message = exception_of(tb)
        message = message.replace(checkpoint, "<checkpoint>") if checkpoint else message
        first = (message.splitlines() or [""])[0][:300]
        where = f" (raised at {raise_site(tb)})"
        if refused_clearly(exc_type, message):
            return Check("hf-export", "passed", f"refused, naming the format: {exc_type}: {first}{where}", tolerance=NOT_COMPARED)
        return Check("hf-export", "failed", f"the export of an fsdp_dtensor checkpoint failed with {exc_type}: {first}{where}; "
                     f"not upstream's documented refusal ({REFUSAL_TYPE} '... {REFUSAL.pattern}')", tolerance=NOT_COMPARED)
    return state_check("hf-export", reference, exported, "HF export of the torch_dist source", "HF export of the fsdp_dtensor checkpoint",
                       f"{len(exported)} HF tensors exported from the fsdp_dtensor checkpoint equal the source's export, bitwise")


class Convert(Case):
    name = "convert"
    description = "torch_dist -> fsdp_dtensor (-> torch_dist) through Megatron-LM's converters, judged model-free; fsdp_dtensor -> HF"
    Options = Options
    needs = frozenset({"weights"})  # and training_state with optimizer state (requirements)
    checks = CHECKS + ("to-torch-dist", "roundtrip", "target-load", "hf-export")

    def requirements(self, opts: Options) -> tuple[str, frozenset[str], str]:
        return ("gpt", frozenset({"training_state"}), "") if opts.optimizer else ("gpt", frozenset({"weights"}), " with optimizer: false")

    def backends(self, spec: CaseSpec, opts: Options) -> list[BackendRef]:
        return [ref_of(spec)] + ([parse_ref(opts.target_backend)] if opts.target_backend else [])

    def validate_options(self, spec: CaseSpec, opts: Options) -> None:
        if spec.backend != "mcore_dist":
            raise ValueError(f"case convert converts the torch_dist checkpoints backend mcore_dist writes; got backend {spec.backend!r}")
        registry.check("converter", opts.converter_workarounds, "converter_workarounds")
        if opts.optimizer:
            untrainable(spec)
        elif "sharding" in spec.opts or "mem_efficient" in spec.opts:
            raise ValueError("options 'sharding' / 'mem_efficient' shape the optimizer state: not with optimizer: false")
        if spec.target.world_size > 1 and not {"nccl", "cuda"} & set(spec.requires):
            raise ValueError(f"target {spec.target.id}: the conversion runs on {spec.target.world_size} ranks, and upstream's "
                             "converter gathers unevenly sharded DTensors with dist.all_gather (megatron_fsdp uneven_dtensor.py:338), "
                             "which gloo refuses ('ProcessGroupGloo::allgather: invalid tensor size'): give requires: [nccl] "
                             "(matrices/nightly-gpu.yaml) or a one-rank target")
        if opts.target_backend:
            try:
                get_backend(parse_ref(opts.target_backend))
            except (KeyError, ValueError) as exc:
                raise ValueError(f"option target_backend {opts.target_backend!r}: {exc.args[0]}") from None
        if opts.export_hf:
            self._validate_export(spec, opts)

    @staticmethod
    def _validate_export(spec: CaseSpec, opts: Options) -> None:
        hf, gpt = get_model(opts.export_hf), get_model(spec.model, "gpt")
        if not isinstance(hf, HFModelSpec) or hf.arch != "llama" or not gpt.swiglu or gpt.normalization != "RMSNorm":
            raise ValueError(f"option export_hf {opts.export_hf!r}: give an HF llama fixture for a SwiGLU/RMSNorm model "
                             f"(the Bridge's export of {spec.model} is judged against that architecture)")
        differ = [f"{g}={getattr(gpt, g)} vs {h}={getattr(hf, h)}" for g, h in HF_SHAPE if getattr(gpt, g) != getattr(hf, h)]
        if differ or gpt.num_moe_experts:
            raise ValueError(f"option export_hf {opts.export_hf!r} does not have {spec.model}'s shape: {', '.join(differ) or 'MoE'}")
        if opts.optimizer:
            raise ValueError("option export_hf exports a pretrained (weights-only) checkpoint: give optimizer: false")

    def run(self, spec: CaseSpec, opts: Options, env: RunEnv, result: CaseResult) -> None:
        model, backend = get_model(spec.model, "gpt"), ref_of(spec)
        if opts.optimizer:  # the training save reshard-optimizer runs too: once per run (harness.run.reuse)
            root, _ = env.launch_source("save", train_phase, lambda d: phase_of(
                model, opts, backend, topo=spec.source, save_to=str(d / "ckpt"), steps_before_save=opts.steps), spec.source)
        else:
            root, _ = env.launch_source("save", weights_save, lambda d: WeightsSave(model, spec.source, backend, str(d / "ckpt")),
                                        spec.source)
        source_dir = iteration_dir(root / "ckpt")
        tool = mlm.find_inspector()
        if isinstance(tool, str):
            result.checks += not_run_checks(self.checks, f"no Megatron-LM converter to run: {tool}")
            return
        result.notes.append(f"converter: {tool.path} ({tool.origin})")
        out = env.case_dir / "converted"
        converted = self._convert(spec, opts, env, result, model, tool, source_dir, out)
        if converted:
            with env.timed("compare"):
                result.checks += self._judge(model, source_dir, out, opts.optimizer)
        else:
            result.checks += not_run_checks(FSDP_CHECKS, "the conversion to fsdp_dtensor did not complete (to-fsdp-dtensor)")
        result.checks += reverse_not_run(tool.origin, mlm.REVERSE_LOOKED_AT, mlm.reverse_commands(mlm.command_names(tool)))
        result.checks.append(self._target_load(spec, opts, env, result, model, source_dir, out, converted))
        if opts.export_hf:
            result.checks.append(self._export(spec, opts, env, result, source_dir, out, converted))

    def _convert(self, spec: CaseSpec, opts: Options, env: RunEnv, result: CaseResult, model: ModelSpec, tool: mlm.Tool,
                 source_dir: Path, out: Path) -> bool:
        argv = (mlm.TO_FSDP_DTENSOR, str(source_dir), str(out)) + (("--swiglu",) if model.swiglu else ())
        command = f"{Path(tool.path).name} {' '.join(argv)}".replace(str(source_dir), "SOURCE").replace(str(out), "OUT")
        try:
            env.launch("convert", convert, Conversion(tool.path, tool.origin, argv, tuple(opts.converter_workarounds)), spec.target)
        except WorldError as exc:
            tb = exc.rank_traceback or str(exc)
            exc_type, message = exception_of(tb)
            first = (message.splitlines() or [""])[0][:300]
            result.checks.append(Check("to-fsdp-dtensor", "failed", f"{command} on {spec.target.world_size} rank(s) raised "
                                       f"{exc_type}: {first} (at {raise_site(tb)})", tolerance=NOT_COMPARED))
            return False
        result.checks.append(Check("to-fsdp-dtensor", "passed", f"{command} on {spec.target.world_size} rank(s) completed",
                                   tolerance=NOT_COMPARED))
        return True

    @staticmethod
    def _judge(model: ModelSpec, source_dir: Path, out: Path, optimizer: bool) -> list[Check]:
        from megatron.core.dist_checkpointing.serialization import load_common_state_dict

        common = load_common_state_dict(str(source_dir))
        sharding = (common.get("content_metadata") or {}).get("distrib_optim_sharding_type")
        source = read_checkpoint(source_dir, objects=FLAT_GROUPS)
        return judge_fsdp(source, read_checkpoint(out, objects=STEP_KEY), model.swiglu,
                          source_steps(common) or flat_steps(source.objects), optimizer, sharding)

    def _target_load(self, spec: CaseSpec, opts: Options, env: RunEnv, result: CaseResult, model: ModelSpec,
                     source_dir: Path, out: Path, converted: bool) -> Check:
        if not opts.target_backend:
            return Check("target-load", "not-run", "option target_backend not set (e.g. mcore_fsdp: Megatron-FSDP); "
                         "the model-free checks above stand for a load",
                         tolerance=NOT_COMPARED)
        if not converted:
            return Check("target-load", "not-run", "nothing to load: the conversion did not complete", tolerance=NOT_COMPARED)
        outs = env.launch("target-load", target_load, TargetLoad(model, spec.target, parse_ref(opts.target_backend), str(out)),
                          spec.target)
        loaded, problems = assemble([s for shards in outs for s in shards], spec.target.id)
        with env.timed("compare"):
            weights = {k: v for k, v in read_checkpoint(source_dir).tensors.items() if not k.startswith("optimizer.")}
        return state_check("target-load", weights, loaded, "torch_dist source", f"{opts.target_backend} at {spec.target.id}",
                           f"{len(loaded)} weights loaded from the fsdp_dtensor checkpoint equal the source, bitwise", problems=problems)

    def _export(self, spec: CaseSpec, opts: Options, env: RunEnv, result: CaseResult, source_dir: Path, out: Path,
                converted: bool) -> Check:
        if not converted:
            return Check("hf-export", "not-run", "no fsdp_dtensor checkpoint to export: the conversion did not complete", tolerance=NOT_COMPARED)
        from harness.models.hf import write_fixture
        from harness.run.preload import warm

        warm(bridge=True)  # the Bridge imported once in the parent (as for an HF case), not in every export world
        hf_model = get_model(opts.export_hf)
        hf_dir = env.source_files("fixture", "write_fixture", (hf_model, "fp32", 1, ()), lambda d: write_fixture(hf_model, d))
        exported, reference = env.case_dir / "hf-export", env.case_dir / "hf-reference"
        phase = HFExport(hf_model, str(hf_dir), str(out), str(exported), str(source_dir), str(reference), ref_of(spec))
        try:
            env.launch("export", hf_export, phase, Topology())
            error = None
        except WorldError as exc:
            error = exc
        if not (reference / "config.json").is_file():  # the reference export is the world's first step
            raise error or RuntimeError(f"the reference export left no {reference}/config.json")
        read = get_backend(resolve("bridge_hf")).read_full
        with env.timed("compare"):
            return export_check(error, read(None, exported) if error is None else {}, read(None, reference), str(out))


CASE = Convert()
