"""verl-merger: verl's own model_merger turns a verl checkpoint into an HF model (issue 43 item 1).

`python -m verl.model_merger merge --backend megatron --local_dir <ckpt>/global_step_N/actor
--target_dir <hf>` is how verl's docs tell users to get an HF model out of a Megatron checkpoint (the
671B form runs it under torchrun, one pipeline stage per rank). It does not go through
Megatron-Bridge: it builds its own GPT model (verl.models.mcore.init_mcore_model, from the HF config
verl saved in model/huggingface, always as bfloat16), loads model/dist_ckpt into it, and renames the
tensors with its own Megatron -> HF table, splitting QKV and gate/up itself
(verl/model_merger/megatron_model_merger.py).

World "save" at S: a Bridge model from the fixture (untrained: its weights are the fixture's)
saved through verl's MegatronCheckpointManager (backend verl_manager) as verl's trainer saves it.
World "merge" at D (`ppN`: the merger's world is a pipeline over all its ranks, TP 1): each rank
runs the merger's entry point (`verl.model_merger.__main__.main` with its command line) after the
harness's process group is gone, as a torchrun rank would start it: the merger inits its own.

Checks (the fixture is the truth; the merger writes bfloat16, MERGER_DTYPE):
  export-integrity   the merged tree's files (harness.judge.hf_integrity, headers only): config,
                     index vs shards both ways, total_size, the fixture's keys and shapes, lm_head
                     as tied says
  merger-weights     every merged tensor equals the fixture's tensor cast to the merged dtype,
                     bitwise (a wrong split, a swapped or missing tensor, another layer's weights)
  merger-dtype       the merged tensors keep the checkpoint's dtype
  merger-logits      transformers on the merged tree gives the logits of transformers on the
                     fixture with its weights cast to the merged dtype (fp32 compute), bitwise
  refusal            (expect: refuse) the merger raised one of `refuse_with` (a model outside its table)

MoE models are saved through both of verl's bridges: the provider path (its CPU MoE layers save the
pre-MLP norm under TE's key, harness.models.cpu_experts.te_moe_keys, as a GPU run does) and the
vanilla path (mbridge builds the TE spec, harness.compat.te_spec). Merging a LoRA job's checkpoint is
case verl-lora-lifecycle's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from .contract import Case
from .ranks.verl_merger import Merge, merger_rank
from harness.core.parity import EXACT
from harness.core.result import CaseResult, Check
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.core.zoo import HFModelSpec, get_model
from harness.judge.checks import refusal_check, state_check
from harness.run.envelope import RunEnv
from harness.run.world import WorldError, exception_of

#: what verl 0.9.1's merger writes, whatever the checkpoint holds (megatron_model_merger.py:236-241
#: hf_to_mcore_config(self.hf_config, torch.bfloat16); base_model_merger.py:413-415 torch_dtype=bfloat16)
MERGER_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Options:
    sharding: Literal["dp_reshardable", "fully_reshardable"] = "fully_reshardable"
    #: (expect: refuse) what the merger raises for a model outside its table (registry.py get_supported_model)
    refuse_with: tuple[str, ...] = ("NotImplementedError",)


def weights_check(fixture: dict[str, torch.Tensor], merged: dict[str, torch.Tensor], src: str) -> Check:
    """Each merged tensor against the fixture's, cast to the merged tensor's dtype (the merger's
    bfloat16), bitwise; keys on either side alone fail."""
    dtype = next(iter(merged.values())).dtype if merged else MERGER_DTYPE
    truth = {k: v.to(dtype) for k, v in fixture.items()}
    return state_check("merger-weights", truth, merged, f"fixture as {str(dtype).removeprefix('torch.')}",
                       f"merged@{src}", f"{len(truth)} tensors equal the fixture cast to {str(dtype).removeprefix('torch.')}, bitwise",
                       EXACT)


def dtype_check(fixture: dict[str, torch.Tensor], merged: dict[str, torch.Tensor]) -> Check:
    if not fixture or not merged:
        return Check("merger-dtype", "failed", "nothing to compare: no fixture or no merged tensor", tolerance=EXACT)
    changed = sorted({(str(fixture[k].dtype), str(v.dtype)) for k, v in merged.items() if k in fixture and v.dtype != fixture[k].dtype})
    if changed:
        n = sum(1 for k, v in merged.items() if k in fixture and v.dtype != fixture[k].dtype)
        pairs = ", ".join(f"{a.removeprefix('torch.')} -> {b.removeprefix('torch.')}" for a, b in changed)
        return Check("merger-dtype", "failed", f"{n} of {len(merged)} merged tensors changed dtype ({pairs})", tolerance=EXACT)
    return Check("merger-dtype", "passed", f"{len(merged)} merged tensors keep the checkpoint's dtype", tolerance=EXACT)


def integrity_check(fixture_dir: Path, merged_dir: Path) -> Check:
    """export-integrity of the merged tree against the fixture's keys and shapes, each in the dtype the
    merger wrote (merger-dtype judges the dtype)."""
    from dataclasses import replace

    from harness.judge.hf_integrity import Expected, export_integrity, source_infos

    source, wrote = source_infos(fixture_dir), source_infos(merged_dir) if (merged_dir / "config.json").exists() else {}
    dtype = next(iter(wrote.values())).dtype if wrote else None
    expected = {k: replace(v, dtype=dtype) for k, v in source.items()} if dtype else source
    return export_integrity([Expected("merged", merged_dir, expected)])


def logits_check(fixture_dir: Path, merged_dir: Path, dtype: torch.dtype) -> Check:
    """transformers on the merged tree vs transformers on the fixture with its weights rounded to
    `dtype`, both computed in fp32: the same weights and the same code give the same logits."""
    from harness.core.parity import compare_tensors
    from harness.models.hf import hf_logits, quiet_hf
    from harness.models.vl import auto_class_of

    quiet_hf()
    ids = torch.arange(3, 19, dtype=torch.long).view(2, 8)
    try:
        got = hf_logits(merged_dir, ids)
    except Exception as exc:  # the merged tree does not load: what a user of the merged model meets first
        first = (str(exc).splitlines() or [""])[0][:300]
        return Check("merger-logits", "failed", f"transformers cannot load the merged tree: {type(exc).__name__}: {first}",
                     tolerance=EXACT)
    model = auto_class_of(fixture_dir).from_pretrained(fixture_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for t in model.state_dict().values():
            t.copy_(t.to(dtype))
        want = model(input_ids=ids).logits.float()
    bad = compare_tensors("logits", want, got, "fixture (rounded)", "merged", EXACT)
    if bad is not None:
        return Check("merger-logits", "failed", str(bad), bad.max_abs_diff, EXACT, [bad])
    return Check("merger-logits", "passed", f"logits {tuple(got.shape)} equal transformers on the fixture rounded to "
                 f"{str(dtype).removeprefix("torch.")}", 0.0, EXACT)


class VerlMerger(Case):
    name = "verl-merger"
    description = "verl's model_merger (megatron backend) on a verl checkpoint: the HF model it writes vs the fixture"
    model_kind = "hf"
    Options = Options
    needs = frozenset({"manager"})
    refusable = True  # a model outside the merger's table
    checks = ("export-integrity", "merger-weights", "merger-dtype", "merger-logits", "refusal")

    def validate(self, spec: CaseSpec) -> Any:
        opts = super().validate(spec)
        d = spec.target
        if (d.tp, d.dp, d.cp, d.vpp, d.ep) != (1, 1, 1, 1, 1):
            raise ValueError(f"case {self.name}: the merger's world is a pipeline over all its ranks (TP 1, no DP/CP/VPP/EP): "
                             f"write the target as ppN, got {d.id}")
        return opts

    def run(self, spec: CaseSpec, opts: Options, env: RunEnv, result: CaseResult) -> None:
        from .ranks.verl_checkpoint import Options as VerlOptions, VerlPhase, verl_rank
        from harness.backends import ref_of
        from harness.backends.verl_manager import step_dir
        from harness.models.hf import write_fixture

        model: HFModelSpec = get_model(spec.model, "hf")
        hf_dir = env.source_files("fixture", "write_fixture", (model, "fp32", 1, ()), lambda d: write_fixture(model, d))
        ckpt, merged_dir = env.case_dir / "ckpt", env.case_dir / "merged"
        phase = VerlPhase(model=model, topo=spec.source, opts=VerlOptions(steps=0, sharding=opts.sharding), backend=ref_of(spec),
                          ckpt=str(ckpt), hf_dir=str(hf_dir), load=False)
        saved = env.launch("save", verl_rank, phase, spec.source)
        actor = step_dir(ckpt, max(saved[0].saved_steps))
        merged_dir.mkdir(parents=True, exist_ok=True)
        try:
            env.launch("merge", merger_rank, Merge(str(actor), str(merged_dir), model.tied), Topology(pp=spec.target.pp))
        except WorldError as exc:
            if spec.expect != "refuse":
                raise
            exc_type, message = exception_of(exc.rank_traceback or str(exc))
            result.checks.append(refusal_check(exc_type, message, opts.refuse_with, f"{spec.source.id} -> merge@{spec.target.id}",
                                               "the merger's table has no such model", action="merge"))
            return
        if spec.expect == "refuse":
            result.checks.append(refusal_check(None, "", opts.refuse_with, f"{spec.source.id} -> merge@{spec.target.id}", action="merge"))
            return
        with env.timed("compare"):
            from harness.backends._safetensors import read_safetensors

            fixture, merged = read_safetensors(Path(hf_dir)), read_safetensors(merged_dir)
            result.checks.append(integrity_check(Path(hf_dir), merged_dir))
            result.checks.append(weights_check(fixture, merged, spec.target.id))
            result.checks.append(dtype_check(fixture, merged))
            result.checks.append(logits_check(Path(hf_dir), merged_dir, next(iter(merged.values())).dtype if merged else MERGER_DTYPE))


CASE = VerlMerger()
