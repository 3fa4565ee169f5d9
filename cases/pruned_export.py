"""pruned-export: a pruned or from-scratch student exported to HF with a config the Bridge
synthesizes from its training checkpoint (AutoBridge.from_auto_config(checkpoint, teacher)).

Users who prune a model (Minitron-style: fewer layers, a narrower FFN than the teacher) or train
one from scratch with a Bridge recipe have no HF config of their own: from_auto_config reads the
checkpoint's run_config.yaml, translates the provider to an HF config (megatron_to_hf_config),
fills what it lacks from the teacher's config (conform_config_to_reference) and builds a
config-only bridge, through which they load the checkpoint and export it.

World "save" at S: the matrix model is the teacher (its fixture, written as is); the student is it
with `student_layers` layers and, when given, `student_ffn` as its FFN width. The student's Bridge
model from its own config without weights (the provider's init), `steps` optimizer steps (Adam,
warmup-cosine; `dtype` bf16: mixed precision), saved through the case's backend (bridge_training:
Bridge's save_checkpoint, `iter_NNNNNNN/` with run_config.yaml).
World "export" at D: from_auto_config(checkpoint root, teacher directory), load_megatron_model (with
mp_overrides past TP/PP 1), Megatron's logits of the loaded model, save_hf_pretrained: the calls
export_ckpt makes, in the world's process group.

Checks:
  export-config  config.json has the student's architecture (num_hidden_layers, intermediate_size,
                 hidden_size, heads, kv heads, vocab, tie_word_embeddings) and every other field of
                 the teacher's config.json with the teacher's value
  export-dtype   config.json declares the run's dtype (bf16 -> bfloat16) and every tensor has it
  export-weights the exported tensors equal the checkpoint's model tensors bitwise, through the
                 Llama layout of harness.judge.auto_export (q/k/v per query group, gate/up, norms;
                 tied: lm_head is the embedding): same keys, dtypes, bytes
  tied-output    tied: lm_head.weight written and equal to embed_tokens bitwise (a config-only
                 bridge emits it: model_bridge.py stream_weights_megatron_to_hf); untied: written
  hf-logits      transformers' AutoModelForCausalLM.from_pretrained(export) (in the run's dtype)
                 gives Megatron's logits at D within hf-roundtrip's Megatron-vs-HF bound
  loaded-forward the model load_megatron_model returns runs megatron-core's forward-only schedule as
                 loaded (as Megatron-LM evaluates) and gives the logits it gives once the training
                 hooks its config carries back from run_config.yaml are cleared, bitwise; hf-logits
                 is judged on the cleared forward, so one defect does not hide the other
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from .contract import Case
from .shared.hf_tolerance import MEGATRON_HF_TOLERANCE, MEGATRON_HF_TOLERANCE_BF16
from .ranks.pruned_export import AutoExport, StudentSave, auto_export, student_save
from harness.backends import get_backend, ref_of, resolve
from harness.backends._megatron_lm import iteration_dir
from harness.core import truth
from harness.core.parity import EXACT
from harness.core.result import CaseResult, Check
from harness.core.spec import CaseSpec
from harness.core.zoo import HFModelSpec, get_model
from harness.judge.auto_export import STUDENT_FIELDS, config_check, dtype_check, expected_hf, tied_check
from harness.judge.convert import read_checkpoint
from harness.judge.checks import not_run_checks, state_check, tensor_check
from harness.models.mcore import DType
from harness.run.envelope import RunEnv


CHECKS = ("export-config", "export-dtype", "export-weights", "tied-output", "hf-logits", "loaded-forward")
#: hf-roundtrip's Megatron-vs-transformers bounds (cases/shared/hf_tolerance.py holds their measurements)
MEGATRON_HF = {"fp32": MEGATRON_HF_TOLERANCE, "bf16": MEGATRON_HF_TOLERANCE_BF16}


@dataclass(frozen=True)
class Options:
    #: the student's decoder layers (fewer than the teacher's)
    student_layers: int = 2
    #: the student's FFN width; 0: the teacher's
    student_ffn: int = 0
    dtype: DType = "fp32"
    steps: int = 1


def student_of(teacher: HFModelSpec, opts: Options) -> HFModelSpec:
    """The student: the teacher with fewer layers and, when asked, a narrower FFN."""
    return replace(teacher, name=f"{teacher.name}-student", num_layers=opts.student_layers,
                   intermediate_size=opts.student_ffn or teacher.intermediate_size)


def judge(student: HFModelSpec, dtype: str, exported_cfg: dict, teacher_cfg: dict, exported: dict, checkpoint: dict,
          megatron_logits, hf_logits, dst: str) -> list[Check]:
    """The five checks from the export's config and tensors, the teacher's config, the checkpoint's
    tensors and both logits (`hf_logits` None: transformers could not load the export, a str saying why)."""
    fields = {k: getattr(student, f) for k, f in STUDENT_FIELDS}
    expected = expected_hf(checkpoint, student.num_attention_heads, student.num_key_value_heads, student.tied)
    checks = [config_check(exported_cfg, teacher_cfg, fields),
              dtype_check(exported_cfg.get("dtype") or exported_cfg.get("torch_dtype"), exported, dtype),
              state_check("export-weights", expected, exported, "checkpoint (Llama layout)", f"export@{dst}",
                          f"{len(exported)} exported tensors equal the checkpoint's, bitwise"),
              tied_check(exported, exported_cfg.get("tie_word_embeddings"), student.tied)]
    if megatron_logits is None:
        checks.append(Check("hf-logits", "failed", f"no rank of the export world at {dst} returned Megatron logits"))
    elif not hasattr(hf_logits, "shape"):
        checks.append(Check("hf-logits", "failed", f"transformers cannot load the export: {hf_logits or 'no logits'}"))
    else:
        checks.append(tensor_check("hf-logits", megatron_logits, hf_logits, f"megatron@{dst}", "transformers(export)",
                                   "transformers' logits of the export match Megatron's", MEGATRON_HF[dtype]))
    return checks


def loaded_forward_check(as_loaded, error: str, cleared, hooks: dict[str, str], dst: str) -> Check:
    """The loaded model's forward as load_megatron_model returns it, against the same forward with the
    training hooks cleared (`hooks`: those it carried; `error`: what the as-loaded forward raised)."""
    carried = f" (its config carried the saved job's {', '.join(f'{k}={v}' for k, v in hooks.items())})" if hooks else ""
    if error:
        return Check("loaded-forward", "failed", f"the loaded model's forward-only schedule at {dst} raised {error[:300]}{carried}",
                     tolerance=EXACT)
    if as_loaded is None or cleared is None:
        return Check("loaded-forward", "failed", f"no rank of the export world at {dst} returned both forwards", tolerance=EXACT)
    return tensor_check("loaded-forward", cleared, as_loaded, f"megatron@{dst} (hooks cleared)", f"megatron@{dst} (as loaded)",
                        f"the loaded model runs as loaded, bitwise the cleared forward{carried}", EXACT)


class PrunedExport(Case):
    name = "pruned-export"
    description = "a student's Bridge training checkpoint -> from_auto_config(ckpt, teacher) -> HF export: student config, weights, logits"
    model_kind = "hf"
    Options = Options
    needs = frozenset({"training_state"})
    checks = CHECKS

    def validate_options(self, spec: CaseSpec, opts: Options) -> None:
        teacher = get_model(spec.model, "hf")
        if teacher.arch != "llama" or teacher.num_experts:
            raise ValueError(f"case pruned-export judges the Llama layout: give a dense llama fixture, got {spec.model!r}")
        if not 1 <= opts.student_layers < teacher.num_layers:
            raise ValueError(f"option student_layers: 1 to {teacher.num_layers - 1} (fewer than the teacher's), got {opts.student_layers}")
        if opts.student_ffn < 0 or opts.student_ffn > teacher.intermediate_size:
            raise ValueError(f"option student_ffn: 0 (the teacher's) or at most {teacher.intermediate_size}, got {opts.student_ffn}")
        if opts.steps < 1:
            raise ValueError("option steps: at least 1 (the export must carry trained weights)")
        if spec.source.pp > opts.student_layers or spec.target.pp > opts.student_layers:
            raise ValueError(f"PP {max(spec.source.pp, spec.target.pp)} needs at least that many student layers")

    def run(self, spec: CaseSpec, opts: Options, env: RunEnv, result: CaseResult) -> None:
        from harness.models.hf import write_fixture
        from harness.run.preload import warm

        warm(bridge=True)
        teacher = get_model(spec.model, "hf")
        student = student_of(teacher, opts)
        teacher_dir = env.source_files("teacher", "write_fixture", (teacher, "fp32", 1, ()), lambda d: write_fixture(teacher, d))
        student_dir = env.source_files("student", "write_fixture", (student, "fp32", 1, ()), lambda d: write_fixture(student, d))
        root, _ = env.launch_source("save", student_save, lambda d: StudentSave(
            student, str(student_dir), spec.source, opts.dtype, opts.steps, ref_of(spec), str(d / "ckpt")), spec.source)
        ckpt, export = root / "ckpt", env.case_dir / "hf-export"
        outs = env.launch("export", auto_export, AutoExport(student, str(ckpt), str(teacher_dir), spec.target, str(export)), spec.target)
        if not (export / "config.json").is_file():
            result.checks += not_run_checks(CHECKS, f"the export at {spec.target.id} wrote no config.json")
            return
        with env.timed("compare"):
            hf_logits: object = None
            try:
                hf_logits = hf_logits_of(export, truth.fixed_input_ids(student), opts.dtype)
            except Exception as exc:  # noqa: BLE001 - the export a user's from_pretrained refuses: hf-logits fails naming it
                import traceback

                from harness.core.frames import raised_in_own_code

                if raised_in_own_code(traceback.format_exc()) is not False:  # the harness's own error stays an error
                    raise
                hf_logits = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            megatron = next((o.logits for o in outs if o.logits is not None), None)
            hooks = next((o.hooks for o in outs if o.hooks), {})
            holder = next((o for o in outs if o.logits is not None or o.forward_error), None)
            result.checks.append(loaded_forward_check(holder.as_loaded if holder else None, holder.forward_error if holder else "",
                                                      megatron, hooks, spec.target.id))
            result.checks += judge(student, opts.dtype, _json(export), _json(teacher_dir),
                                   get_backend(resolve("bridge_hf")).read_full(None, export),
                                   read_checkpoint(iteration_dir(ckpt)).tensors, megatron, hf_logits, spec.target.id)


def hf_logits_of(directory: Path, input_ids, dtype: str):
    """What the export's user runs: AutoModelForCausalLM.from_pretrained(export) in the run's dtype, eval logits (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from harness.models.hf import HF_DTYPES, quiet_hf

    quiet_hf()
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=HF_DTYPES[dtype]).eval()
    with torch.no_grad():
        return model(input_ids=input_ids).logits.float()


def _json(directory: Path) -> dict:
    return json.loads((Path(directory) / "config.json").read_text())


CASE = PrunedExport()
