"""verl-checkpoint: what only a manager-style training checkpoint has (issue 10), through a backend
with the `manager` capability (verl_manager: verl 0.9.1's MegatronCheckpointManager).

A job (GPT zoo model, or a Megatron-Bridge model from an HF fixture, optionally with LoRA adapters:
option `adapter`, then the base comes from the fixture on both sides, as verl's engine loads it, and
only the adapters, at known values at S and decoys at D, travel in the checkpoint) with a real LR scheduler
trains `steps` steps at S and is saved `saves` times (one more step between saves) the way verl's
trainer saves: `<ckpt>/global_step_<N>/actor`, then the tracker. The RNG state is set to a known,
step-derived value right before the last save. A fresh job at D (decoy weights, a scheduler at step
0, other RNG state) resumes from the tracker through the backend with its `load_contents`.

Checks:
  layout          the step directory holds exactly what save_contents asks (model/dist_ckpt,
                  model/huggingface, optimizer/dist_ckpt, extra/dist_ckpt, transformer_config.json,
                  ckpt_contents.json), each dist_ckpt tree a complete megatron checkpoint
  manifest        ckpt_contents.json: schema 2, the step, save_contents, the backend flags, the
                  contents entries the save implies (model / hf_model / optimizer / lr_scheduler /
                  rng_state / transformer_config / hf_config / tokenizer), every path present
  tracker         latest_checkpointed_iteration.txt names the last step, and verl's own
                  find_latest_ckpt_path resolves it to that step's directory
  retention       (saves > 1) max_ckpt_to_keep removed only the older steps: the newest
                  max_ckpt_to_keep remain (all when 0)
  model-weights   (model or hf_model loaded) the weights at D equal those saved at S, bitwise
  optimizer-state, step   (optimizer loaded) as reshard-optimizer: main params and moments bitwise, step kept
  scheduler       (optimizer loaded, a scheduler) the scheduler's state and the LR it sets equal S's
  rng             (extra loaded) python, numpy, torch and megatron-tracker RNG state at D equal the
                  state saved at the same (PP, TP) coordinate
  hf-export       (HF tree saved, Bridge model, untrained) the HF tree's safetensors equal the
                  fixture's, bitwise (keys, dtypes, bytes)
  export-integrity  (HF tree saved) its files (harness.judge.hf_integrity, headers only): index vs
                  shards both ways, total_size, the fixture's keys/shapes/dtypes, lm_head as tied
                  says; a PEFT job's adapter (model/huggingface/adapter): one file, no index (its
                  keys are peft-load's)
  weights-match-main-params   (bf16) bf16 weights == fp32 main params cast down, at S and after the load
  peft-load, adapter-config, logits   (option `adapter`: a LoRA/CanonicalLoRA job, verl's `peft_cls`, with
                  the HF tree saved) the adapter verl exported (model/huggingface/adapter) loads into
                  transformers+PEFT without missing/unexpected keys, declares the r / lora_alpha /
                  targets asked, and gives Megatron+LoRA's logits at S (as case peft-export)
  refusal         (expect: refuse) the resume raised one of `refuse_with`
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .ranks.train_phase import step_check
from .ranks.verl_checkpoint import Options, VerlOut, VerlPhase, verl_rank
from .shared.verl_state import rng_check, scheduler_check
from .contract import Case
from harness.backends import ref_of
from harness.core.parity import EXACT, NOT_COMPARED
from harness.core.result import CaseResult, Check
from harness.core.spec import CaseSpec
from harness.core.zoo import get_model
from harness.judge.checks import (
    WEIGHTS_MATCH_MAIN_PARAMS,
    assembled,
    refusal_check,
    state_check,
    weights_match_main_params,
)
from harness.judge.hf_integrity import ADAPTER_WEIGHTS, Expected, export_integrity, source_infos
from harness.run.envelope import RunEnv
from harness.run.world import WorldError, exception_of

TRACKER = "latest_checkpointed_iteration.txt"




# --------------------------------------------------------------------------- what is on disk


@dataclass
class OnDisk:
    """The checkpoint root after the saves, as the parent reads it (judge input)."""

    steps_present: list[int]
    tracker: str | None
    resolved: str | None  # verl's find_latest_ckpt_path(root), relative to root
    entries: list[str]  # under global_step_<last>/actor: top-level names and model/optimizer/extra subtrees
    complete: dict[str, bool]  # each dist_ckpt tree: a complete megatron dist checkpoint?
    manifest: dict | None
    hf: dict[str, torch.Tensor] | None = None  # the HF tree's tensors, when there is one
    empty: list[str] = field(default_factory=list)  # empty directories (contents not saved)


def actor_dir(root: Path, step: int) -> Path:
    """Where verl's trainer puts the actor's checkpoint of global step `step`."""
    return root / f"global_step_{step}" / "actor"


def read_disk(root: Path, last: int) -> OnDisk:
    from megatron.core.dist_checkpointing import check_is_distributed_checkpoint

    actor = actor_dir(root, last)
    # what a resume can use: verl's retention removes a step's actor directory (the trainer's
    # global_step_<N>/ itself, which also holds its data.pt, stays)
    steps = sorted(int(d.name.removeprefix("global_step_")) for d in root.glob("global_step_*") if (d / "actor").is_dir())
    tracker = (root / TRACKER).read_text() if (root / TRACKER).exists() else None
    import contextlib
    import io
    import traceback

    from verl.utils.checkpoint.checkpoint_manager import (
        find_latest_ckpt_path,  # a failure here is the harness's: raised
    )

    try:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints what it found
            found = find_latest_ckpt_path(str(root))
        resolved = str(Path(found).relative_to(root)) if found else None
    except (ValueError, OSError) as exc:  # what verl raises on a tracker it cannot read: judged by the tracker check
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        resolved = f"error: {exc!r} (at {Path(frame.filename).name}:{frame.lineno} in {frame.name})"
    entries: list[str] = []
    empty: list[str] = []
    if actor.is_dir():
        for e in sorted(actor.iterdir()):
            if e.is_dir() and not any(e.rglob("*.*")):
                empty.append(e.name)  # verl's path getters mkdir every subtree, saved or not
                continue
            entries.append(e.name)
            if e.is_dir():
                for sub in sorted(e.iterdir()):
                    (entries if any(sub.iterdir()) else empty).append(f"{e.name}/{sub.name}")
    complete = {e: bool(check_is_distributed_checkpoint(str(actor / e))) for e in entries if e.endswith("/dist_ckpt")}
    manifest = json.loads((actor / "ckpt_contents.json").read_text()) if (actor / "ckpt_contents.json").exists() else None
    hf = None
    if any((actor / "model" / "huggingface").glob("*.safetensors")):  # verl mkdirs the subtree even when it saves no HF tree
        from harness.backends._safetensors import read_safetensors

        hf = read_safetensors(actor / "model" / "huggingface")
    return OnDisk(steps, tracker, resolved, entries, complete, manifest, hf, empty)


# --------------------------------------------------------------------------- judging


def expected(save_contents: tuple[str, ...], use_dist: bool, bridge: bool, scheduler: bool, peft: bool = False) -> tuple[set[str], set[str]]:
    """(entries under the step directory, manifest contents keys) that verl 0.9.1 documents for a
    save (MegatronCheckpointManager.save_checkpoint docstring and _build_checkpoint_manifest). A PEFT
    job saving HF also writes its adapter shards to model/dist_ckpt (manifest key peft_adapters)."""
    hf = "hf_model" in save_contents or ("model" in save_contents and not use_dist)
    dist_model = "model" in save_contents and use_dist
    entries, keys = {"ckpt_contents.json"}, set()
    if dist_model or hf:
        entries.add("model")
    if dist_model or (hf and peft):
        entries.add("model/dist_ckpt")
    if dist_model:
        keys.add("model")
    if hf and peft:
        keys.add("peft_adapters")
    if hf:
        entries.add("model/huggingface")
        keys |= {"hf_config"} | ({"tokenizer"} if bridge else set())
        if not dist_model:
            keys.add("model")
        if "hf_model" in save_contents:
            keys.add("hf_model")
    if "optimizer" in save_contents:
        entries |= {"optimizer", "optimizer/dist_ckpt"}
        keys |= {"optimizer"} | ({"lr_scheduler"} if scheduler else set())
    if "extra" in save_contents:
        entries |= {"extra", "extra/dist_ckpt", "transformer_config.json"}
        keys |= {"rng_state", "transformer_config"}
    return entries, keys


@dataclass(frozen=True)
class Judged:
    """Everything the judge needs besides the worlds' outputs: what was asked."""

    src: str
    dst: str
    save_contents: tuple[str, ...]
    load_contents: tuple[str, ...]
    use_dist: bool
    bridge: bool
    scheduler: bool
    saves: int
    keep: int
    trained: bool
    dtype: str = "fp32"
    adapter: str = "none"


def _not_run(name: str, why: str) -> Check:
    return Check(name, "not-run", why, tolerance=NOT_COMPARED)


def layout_checks(a: Judged, disk: OnDisk, last: int) -> list[Check]:
    want_entries, want_keys = expected(a.save_contents, a.use_dist, a.bridge, a.scheduler, a.adapter != "none")
    got = set(disk.entries)
    top_level_or_listed = {e for e in got if "/" not in e or e.split("/")[0] in ("model", "optimizer", "extra")}
    missing, extra = sorted(want_entries - got), sorted(top_level_or_listed - want_entries)
    incomplete = sorted(k for k, ok in disk.complete.items() if not ok)
    problems = ([f"missing {missing}"] if missing else []) + ([f"unexpected {extra}"] if extra else []) + (
        [f"not a complete dist checkpoint: {incomplete}"] if incomplete else [])
    stray = f"; empty directories for contents not saved: {disk.empty}" if disk.empty else ""
    layout = Check("layout", "failed" if problems else "passed",
                   ("; ".join(problems) if problems else f"global_step_{last}/actor holds {sorted(want_entries)}") + stray,
                   tolerance=EXACT)
    m = disk.manifest
    if m is None:
        manifest = Check("manifest", "failed", "no ckpt_contents.json", tolerance=EXACT)
    else:
        wrong = []
        for k, v in (("schema_version", 2), ("global_step", last), ("save_contents", list(a.save_contents))):
            if m.get(k) != v:
                wrong.append(f"{k}={m.get(k)!r}, expected {v!r}")
        backend = m.get("backend", {})
        peft = a.adapter != "none"
        if backend.get("use_dist_checkpointing") != a.use_dist or backend.get("has_bridge") != a.bridge or backend.get("peft", False) != peft:
            wrong.append(f"backend={backend}, expected use_dist_checkpointing={a.use_dist} has_bridge={a.bridge} peft={peft}")
        keys = set(m.get("contents", {}))
        if keys != want_keys:
            wrong.append(f"contents {sorted(keys)}, expected {sorted(want_keys)}")
        unlisted = sorted(v["path"] for v in m.get("contents", {}).values()
                          if isinstance(v, dict) and "path" in v and v["path"].split("/")[0] not in {e.split("/")[0] for e in got})
        if unlisted:
            wrong.append(f"paths not on disk {unlisted}")
        manifest = Check("manifest", "failed" if wrong else "passed",
                         "; ".join(wrong) if wrong else f"schema 2, step {last}, contents {sorted(keys)}", tolerance=EXACT)
    want_resolved = f"global_step_{last}"
    ok = disk.tracker is not None and disk.tracker.strip() == str(last) and disk.resolved == want_resolved
    tracker = Check("tracker", "passed" if ok else "failed",
                    f"{TRACKER} = {disk.tracker!r} (last step {last}); verl find_latest_ckpt_path -> {disk.resolved!r}", tolerance=EXACT)
    if a.saves == 1:
        retention = _not_run("retention", "one save (saves: 1)")
    else:
        steps = list(range(last - a.saves + 1, last + 1))
        want = steps[-a.keep:] if a.keep else steps
        retention = Check("retention", "passed" if disk.steps_present == want else "failed",
                          f"saved steps {steps}, max_ckpt_to_keep={a.keep or None}: present {disk.steps_present}, expected {want}",
                          tolerance=EXACT)
    return [layout, manifest, tracker, retention]


def judge(a: Judged, saved: list[VerlOut], loaded: list[VerlOut], disk: OnDisk, fixture: dict[str, torch.Tensor] | None) -> list[Check]:
    last = max(saved[0].saved_steps)
    checks = layout_checks(a, disk, last)
    w_s, q_s = assembled(saved, "model_shards", a.src)
    w_d, q_d = assembled(loaded, "model_shards", a.dst)
    opt_s, p_s = assembled(saved, "optimizer_shards", a.src)
    opt_d, p_d = assembled(loaded, "optimizer_shards", a.dst)
    model_loaded = "model" in a.load_contents or "hf_model" in a.load_contents
    if model_loaded:
        checks.append(state_check("model-weights", w_s, w_d, a.src, a.dst, f"{len(w_d)} weights equal", problems=q_s + q_d))
    else:
        checks.append(_not_run("model-weights", f"load_contents {list(a.load_contents)} has no model"))
    if "optimizer" in a.load_contents:
        checks.append(state_check("optimizer-state", opt_s, opt_d, a.src, a.dst, f"{len(opt_d)} optimizer tensors equal", problems=p_s + p_d))
        checks.append(step_check(saved, loaded, a.src, a.dst))
        checks.append(scheduler_check(saved, loaded))
    else:
        why = f"load_contents {list(a.load_contents)} has no optimizer"
        checks += [_not_run("optimizer-state", why), _not_run("step", why), _not_run("scheduler", why)]
    checks.append(rng_check(saved, loaded) if "extra" in a.load_contents else _not_run("rng", f"load_contents {list(a.load_contents)} has no extra"))
    if a.adapter != "none":
        checks.append(_not_run("hf-export", "a PEFT job's HF tree is its adapter (checks peft-load, adapter-config, logits)"))
    elif disk.hf is None:
        checks.append(_not_run("hf-export", "no HF tree saved (model/huggingface)"))
    elif fixture is None or a.trained:
        checks.append(_not_run("hf-export", "the saved weights are trained: the fixture is no longer their truth"))
    else:
        checks.append(state_check("hf-export", fixture, disk.hf, "hf-fixture", "model/huggingface",
                                  f"{len(disk.hf)} tensors, keys and dtypes equal the fixture"))
    sides = [(f"save@{a.src}", w_s, opt_s)]
    if model_loaded and "optimizer" in a.load_contents:
        sides.append((f"load@{a.dst}", w_d, opt_d))
    checks.append(weights_match_main_params(sides, a.dtype))
    return checks


class VerlCheckpoint(Case):
    name = "verl-checkpoint"
    description = "a manager-style training checkpoint (verl): contents, layout, manifest, tracker, retention, scheduler, RNG, HF tree"
    model_kind = ("gpt", "hf")
    Options = Options
    needs = frozenset({"training_state", "manager"})
    checks = ("layout", "manifest", "tracker", "retention", "model-weights", "optimizer-state", "step", "scheduler", "rng",
              "hf-export", WEIGHTS_MATCH_MAIN_PARAMS, "peft-load", "adapter-config", "logits", "export-integrity", "refusal")
    refusable = True

    def validate_options(self, spec: CaseSpec, opts: Options) -> None:
        from harness.backends import get_backend

        if spec.expect != "refuse" and "refuse_with" in spec.opts:
            raise ValueError("option 'refuse_with' only means something with expect: refuse")
        b = get_backend(ref_of(spec)).options
        hf = get_model(spec.model).kind == "hf"
        vanilla = getattr(b, "bridge", "provider") == "vanilla"
        if vanilla:
            from harness.models.mbridge import MBRIDGE_MODEL_TYPES

            if not hf or get_model(spec.model).arch not in MBRIDGE_MODEL_TYPES:
                raise ValueError(f"backend option bridge 'vanilla' (mbridge) needs an HF fixture of a model type mbridge 0.15.1 maps "
                                 f"({', '.join(MBRIDGE_MODEL_TYPES)}), got {spec.model!r}")
        wants_hf = "hf_model" in b.save_contents + b.load_contents or (not b.use_dist_checkpointing and "model" in b.save_contents + b.load_contents)
        if wants_hf and not hf:
            raise ValueError("HF-format model contents (hf_model, or model without use_dist_checkpointing) need a Megatron-Bridge "
                             f"model (an HF fixture), got {spec.model!r}")
        if opts.adapter != "none" and (not hf or vanilla):
            raise ValueError(f"option adapter {opts.adapter!r} (verl's peft_cls) needs a Megatron-Bridge model built by the provider "
                             f"(an HF fixture, backend option bridge: provider), got {spec.model!r}")
        if hf and opts.dtype != "fp32":
            raise ValueError("a Bridge model is built fp32 (harness.models.bridge); dtype bf16 takes a GPT zoo model")
        if hf and opts.steps:
            raise ValueError("a Bridge model is saved untrained here (steps: 0): the HF tree is then checked against the fixture")

    def run(self, spec: CaseSpec, opts: Options, env: RunEnv, result: CaseResult) -> None:
        from harness.backends import get_backend
        from harness.models.hf import write_fixture
        from harness.models.training import workaround_notes

        model, ref = get_model(spec.model), ref_of(spec)
        b = get_backend(ref)
        result.notes += workaround_notes(opts)
        ckpt, hf_dir = env.case_dir / "ckpt", None
        if model.kind == "hf":
            hf_dir = env.case_dir / "hf-source"
            with env.timed("fixture"):
                write_fixture(model, hf_dir)
        phase = dict(model=model, opts=opts, backend=ref, ckpt=str(ckpt), hf_dir=str(hf_dir) if hf_dir else None)
        saved = env.launch("save", verl_rank, VerlPhase(topo=spec.source, load=False, **phase), spec.source)
        try:
            loaded, error = env.launch("load", verl_rank, VerlPhase(topo=spec.target, load=True, **phase), spec.target), None
        except WorldError as exc:
            loaded, error = None, exc
        if spec.expect == "refuse":
            exc_type, message = exception_of(error.rank_traceback or str(error)) if error else (None, "")
            result.checks.append(refusal_check(exc_type, message, opts.refuse_with, f"{spec.source.id} -> {spec.target.id}",
                                               refusal_meaning(spec, b.options, opts)))
            if loaded is None:
                return
        elif error is not None:
            raise error
        with env.timed("compare"):
            last = max(saved[0].saved_steps)
            disk = read_disk(ckpt, last)
            fixture = None
            if hf_dir is not None:
                from harness.backends._safetensors import read_safetensors

                fixture = read_safetensors(hf_dir)
            a = Judged(spec.source.id, spec.target.id, b.options.save_contents, b.options.load_contents, b.options.use_dist_checkpointing,
                       model.kind == "hf", opts.lr_schedule != "none", opts.saves, b.options.max_ckpt_to_keep, opts.steps > 0, opts.dtype,
                       opts.adapter)
            result.checks.extend(judge(a, saved, loaded, disk, fixture))
            tree = actor_dir(ckpt, last) / "model" / "huggingface"
            saved_hf = "model/huggingface" in expected(a.save_contents, a.use_dist, a.bridge, a.scheduler)[0]
            result.checks.append(tree_integrity(tree, hf_dir, saved_hf, opts.adapter != "none"))
            adapter_dir = tree / "adapter"
            result.checks.extend(adapter_checks(model, opts, hf_dir, adapter_dir, saved, spec.source.id))


def adapter_checks(model: Any, opts: Options, hf_dir: Path, adapter_dir: Path, saved: list[VerlOut], src: str) -> list[Check]:
    """The HF PEFT adapter verl exported, as a user loads it (case peft-export's checks): peft-load,
    adapter-config (r, lora_alpha, targets, base model), logits (transformers+PEFT vs Megatron+LoRA at S)."""
    from .shared.peft import (
        CAUSAL_LM,
        PeftOptions,
        config_check,
        hf_target_modules,
        logits_check,
        peft_load_problems,
    )
    from harness.core import truth
    from harness.models.hf import hf_logits

    names = ("peft-load", "adapter-config", "logits")
    if opts.adapter == "none":
        return [_not_run(n, "no adapter (option adapter: none)") for n in names]
    if not (adapter_dir / "adapter_config.json").exists():
        return [_not_run(n, f"no HF adapter exported ({adapter_dir.name} under model/huggingface: hf_model not saved)") for n in names]
    po = PeftOptions(adapter=opts.adapter)
    problems = peft_load_problems(hf_dir, adapter_dir)
    asked = {"r": po.dim, "lora_alpha": po.alpha, "target_modules": hf_target_modules(model), "base_model_name_or_path": str(hf_dir),
             "task_type": CAUSAL_LM}
    ids = truth.fixed_input_ids(model)
    meg = next((o.logits for o in saved if o.logits is not None), None)
    return [
        Check("peft-load", "failed" if problems else "passed", "; ".join(problems[:8]) or "no missing or unexpected keys", tolerance=EXACT),
        config_check(json.loads((adapter_dir / "adapter_config.json").read_text()), asked),
        logits_check(hf_logits(hf_dir, ids, adapter=adapter_dir), hf_logits(hf_dir, ids), meg, src) if meg is not None
        else Check("logits", "failed", "no rank returned Megatron+LoRA logits"),
    ]


def tree_integrity(tree: Path, hf_dir: Path | None, saved: bool, peft: bool) -> Check:
    """export-integrity of the HF tree the save wrote (`saved`: save_contents asks one): its weights
    against the fixture `hf_dir`; a PEFT job's tree is its adapter, judged for layout only."""
    if not saved:
        return _not_run("export-integrity", "no HF tree saved (model/huggingface)")
    if peft:
        return export_integrity([Expected("model/huggingface/adapter", tree / "adapter", None, ADAPTER_WEIGHTS, sharded_ok=False)])
    return export_integrity([Expected("model/huggingface", tree, source_infos(hf_dir) if hf_dir else None)])


def refusal_meaning(spec: CaseSpec, b: Any, opts: Options) -> str:
    tp_pp_changed = (spec.source.tp, spec.source.pp) != (spec.target.tp, spec.target.pp)
    if tp_pp_changed and "extra" in b.load_contents:
        return "verl saves the RNG state as a ShardedObject per (PP, TP) rank: `extra` cannot be loaded at another TP/PP"
    if tp_pp_changed and opts.sharding == "dp_reshardable" and "optimizer" in b.load_contents:
        return "a dp_reshardable optimizer checkpoint (verl's default) can change DP only; a TP/PP change needs fully_reshardable"
    return ""


CASE = VerlCheckpoint()
