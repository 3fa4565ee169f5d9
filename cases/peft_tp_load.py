"""peft-tp-load: a PEFT adapter loaded onto a transformers tensor-parallel model, the way users serve or
evaluate one exported from Megatron (or trained with PEFT): under torchrun each rank loads the base with
`AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")`, holding a shard, then
`PeftModel.from_pretrained(tp_model, adapter_dir)`. PEFT then cuts the adapter to match the base's shard
(peft/utils/save_and_load.py:430-546, `_maybe_shard_state_dict_for_tp`, the pre-DTensor TP integration
transformers 5.x still has), and gathers it again when the TP model saves it (save_and_load.py:203-223).

World "save" (one process): the fixture in transformers, a LoRA adapter on the options'
targets with every tensor drawn at random (seeded, each tensor's values its own), its logits with and without
the adapter; saved by the backend (hf_peft: save_pretrained). World "load" at the target (tpN, one process
per rank): the base loaded with tp_plan="auto", the adapter loaded through the backend (from_pretrained),
logits, each rank's adapter tensors, then the adapter saved back by every rank into its own directory.

Checks (the single-process model that made the adapter is the truth):
  logits          every rank's logits within TP_LOGITS_TOLERANCE of the single-process model's
  adapter-effect  every rank's logits off the base's by more than MIN_ADAPTER_EFFECT (a no-op adapter fails)
  shards          each rank's lora_A / lora_B equal, bitwise, the slice of the saved tensor that the module's
                  TP style implies (SPLIT; the style is the base's own TP plan, read from the loaded base); the
                  other of the pair whole; at least one tensor split (a base TP left unsharded proves nothing)
  warnings        the TP load warned of no missing, unexpected or mismatched key, the save of no invalid tensor
  resave          the adapter each rank saves back from the TP model (peft gathers the shards) equals the
                  saved adapter's file, key for key, bitwise
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from .contract import Case
from .shared.adapter_draw import WARNED
from .shared.peft import MIN_ADAPTER_EFFECT
from .ranks.peft_tp_load import RESAVED, MakePhase, TpPhase, make_rank, tp_load_rank
from harness.core.parity import EXACT, Tolerance, compare_state, compare_tensors
from harness.core.result import CaseResult, Check
from harness.core.spec import CaseSpec
from harness.core.zoo import HFModelSpec, get_model
from harness.run.envelope import RunEnv

#: measured max 6.8e-7 (hf-llama, tp2, fp32, every projection targeted): a rowwise layer (o_proj, down_proj)
#: all-reduces each rank's partial fp32 sum, one process sums the whole row in another order
TP_LOGITS_TOLERANCE = Tolerance(atol=1e-5, rtol=1e-5, why="transformers TP vs one process: rowwise layers all-reduce partial fp32 sums")
#: which LoRA tensor a TP style splits, on which dim (lora_A is (r, in), lora_B (out, r)): colwise splits a
#: layer's output features, so lora_B's rows (peft utils/save_and_load.py:516-517 picks lora_B; transformers
#: integrations/tensor_parallel.py:731-739 ColwiseParallel.shard_tensor, dim -2); rowwise its input features,
#: so lora_A's columns (save_and_load.py:518-519 picks lora_A; tensor_parallel.py:891-899 RowwiseParallel, dim -1)
SPLIT = {"colwise": ("lora_A", None, "lora_B", 0), "rowwise": ("lora_A", 1, "lora_B", None)}
PREFIX = "base_model.model."
#: what a load must not warn of (PEFT warns of missing, unexpected or mismatched keys on load, of invalid-shape
#: LoRA tensors on save); other warnings pass (as peft-adapter-io)
SHOWN = 6


@dataclass(frozen=True)
class Options:
    #: LoraConfig target_modules: hf-llama's colwise (q/k/v, gate/up) and rowwise (o, down) projections
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    dim: int = 4
    alpha: int = 8


def rank_slice(full: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s piece of `full` split `size` ways on `dim`, torch.chunk style (the `Shard` placement
    transformers' get_tensor_shard follows, tensor_parallel.py:335-400: ceil-sized pieces, the last ones short
    or empty)."""
    n = full.shape[dim]
    step = -(-n // size)
    start = min(rank * step, n)
    return full.narrow(dim, start, min(step, n - start))


def style_of(name: str, plan: dict[str, str]) -> tuple[str, str | None]:
    """(the module of adapter tensor `name` as the base names it, its TP style in `plan` or None): the
    plan's keys are module names with every layer index a `*`."""
    module = re.split(r"\.lora_[AB]\.", name, maxsplit=1)[0].removeprefix(PREFIX)
    return module, plan.get(re.sub(r"\d+", "*", module))


def expected_shard(name: str, full: torch.Tensor, style: str | None, rank: int, size: int) -> torch.Tensor | str:
    """What rank `rank` should hold of adapter tensor `name` (saved whole as `full`) under `style`; a string
    saying why when the case knows no rule for the style."""
    if style is None:
        return full
    if style not in SPLIT:
        return f"TP style {style!r}: no rule here for which LoRA tensor it splits"
    a, a_dim, b, b_dim = SPLIT[style]
    dim = a_dim if f".{a}." in name else b_dim if f".{b}." in name else None
    return full if dim is None else rank_slice(full, dim, rank, size)


def shards_check(saved: dict[str, torch.Tensor], ranks: list[dict[str, torch.Tensor]], plan: dict[str, str]) -> Check:
    """shards: each rank's adapter tensors against the slices of the saved ones that their module's style implies."""
    if not saved or not ranks:
        return Check("shards", "failed", f"nothing to compare: {len(saved)} saved adapter tensors, {len(ranks)} ranks", tolerance=EXACT)
    problems, split = [], set()
    for r, got in enumerate(ranks):
        problems += [f"rank {r}: {n}: not loaded" for n in sorted(set(saved) - set(got))]
        problems += [f"rank {r}: {n}: loaded, not saved" for n in sorted(set(got) - set(saved))]
        for n in sorted(set(saved) & set(got)):
            module, style = style_of(n, plan)
            want = expected_shard(n, saved[n], style, r, len(ranks))
            if isinstance(want, str):
                problems.append(f"{module}: {want}")
                continue
            if want.shape != saved[n].shape:
                split.add((n, style))
            bad = compare_tensors(n, want, got[n], f"saved, {style or 'unsplit'} slice of rank {r}", f"rank {r}")
            if bad is not None:
                problems.append(f"rank {r}: {bad}")
    if not problems and not split:
        problems.append(f"no adapter tensor is split on any rank (TP plan {plan or 'empty'}): the base was not sharded, "
                        "so the check proves nothing")
    if problems:
        return Check("shards", "failed", f"{len(problems)} problem(s): " + "; ".join(problems[:SHOWN]), tolerance=EXACT)
    styles = sorted({s for _, s in split})
    return Check("shards", "passed", f"{len(saved)} adapter tensors on each of {len(ranks)} ranks, bitwise; {len(split)} split "
                 f"by their style ({', '.join(styles)}), the rest whole", 0.0, EXACT)


def logits_check(want: torch.Tensor, ranks: list[torch.Tensor | None], tol: Tolerance = TP_LOGITS_TOLERANCE) -> Check:
    """logits: every rank's logits within `tol` of the single-process model's."""
    if not ranks or want.numel() == 0:
        return Check("logits", "failed", "nothing to compare: no logits", tolerance=tol)
    bad, worst = [], 0.0
    for r, got in enumerate(ranks):
        if got is None:
            bad.append(f"rank {r}: no logits")
            continue
        m = compare_tensors(f"logits@rank{r}", want, got, "one process", f"rank {r}", tol)
        if m is not None:
            bad.append(m)
        elif got.shape == want.shape:
            worst = max(worst, float((got.double() - want.double()).abs().max()))
    if bad:
        mism = [m for m in bad if not isinstance(m, str)]
        diffs = [m.max_abs_diff for m in mism if m.max_abs_diff is not None]
        return Check("logits", "failed", "; ".join(str(m) for m in bad), max(diffs) if diffs else None, tol, mism)
    return Check("logits", "passed", f"logits {tuple(want.shape)} of {len(ranks)} TP ranks equal the single process's", worst, tol)


def effect_check(ranks: list[torch.Tensor], without: torch.Tensor) -> Check:
    """adapter-effect: every rank's adapted logits off the base's (a no-op adapter would pass `logits` when
    the reference were no-op too, and pass `shards` when the file held zeros)."""
    moved = [float((t - without).abs().max()) if t.shape == without.shape and t.numel() else 0.0 for t in ranks]
    least = min(moved, default=0.0)
    ok = bool(moved) and least > MIN_ADAPTER_EFFECT
    return Check("adapter-effect", "passed" if ok else "failed",
                 f"the adapter moves each rank's logits, the least moved by max |diff| {least:.3g}"
                 + ("" if ok else f" (<= {MIN_ADAPTER_EFFECT}: it does nothing on some rank)"))


def warnings_check(loaded: list[list[str]], saved: list[list[str]]) -> Check:
    """warnings: per rank, the TP load warned of no missing, unexpected or mismatched key, the save of no invalid tensor."""
    bad = [f"rank {r} load: {w}" for r, ws in enumerate(loaded) for w in ws if WARNED.search(w)]
    bad += [f"rank {r} save: {w}" for r, ws in enumerate(saved) for w in ws if WARNED.search(w)]
    if not loaded:
        return Check("warnings", "failed", "nothing to judge: no rank reported")
    if bad:
        return Check("warnings", "failed", f"{len(bad)} warning(s): " + "; ".join(w[:300] for w in bad[:3]))
    return Check("warnings", "passed", f"no missing, unexpected or mismatched key on {len(loaded)} ranks' loads, no invalid "
                 f"tensor on their saves ({sum(map(len, loaded)) + sum(map(len, saved))} warning(s) in all)")


def resave_check(original: dict[str, torch.Tensor], resaved: list[dict[str, torch.Tensor]]) -> Check:
    """resave: each rank's save from the TP model against the adapter's file, key for key, bitwise."""
    if not original or not resaved:
        return Check("resave", "failed", f"nothing to compare: {len(original)} tensors in the file, {len(resaved)} re-saves",
                     tolerance=EXACT)
    problems = [f"rank {r}: {m}" for r, got in enumerate(resaved) for m in compare_state(original, got, "adapter file", f"rank {r}")]
    if problems:
        return Check("resave", "failed", f"{len(problems)} problem(s): " + "; ".join(problems[:SHOWN]), tolerance=EXACT)
    return Check("resave", "passed", f"{len(original)} tensors saved back from each of {len(resaved)} TP ranks equal the file, "
                 "bitwise", 0.0, EXACT)


class PeftTpLoad(Case):
    name = "peft-tp-load"
    description = "a PEFT adapter loaded onto a transformers tensor-parallel model (tp_plan='auto'), as users serve it"
    model_kind = "hf"
    Options = Options
    needs = frozenset({"adapter_io"})
    checks = ("logits", "adapter-effect", "shards", "warnings", "resave")

    def validate_options(self, spec: CaseSpec, opts: Options) -> None:
        t = spec.target
        if spec.source.world_size != 1 or t.tp < 2 or t.world_size != t.tp:
            raise ValueError(f"case {self.name}: one process saves, a TP-only world loads (transformers' tp_plan, no other "
                             f"parallelism): write the pair as tp1 -> tpN with N >= 2, got {spec.source.id} -> {t.id}")
        if not opts.targets:
            raise ValueError(f"case {self.name}: targets names no module")

    def run(self, spec: CaseSpec, opts: Options, env: RunEnv, result: CaseResult) -> None:
        from harness.backends import get_backend, ref_of
        from harness.models.hf import write_fixture

        model: HFModelSpec = get_model(spec.model, "hf")
        hf_dir = env.source_files("fixture", "write_fixture", (model, "fp32", 1, ()), lambda d: write_fixture(model, d))
        adapter, out = env.case_dir / "adapter", env.case_dir / "tp"
        adapter.mkdir(parents=True, exist_ok=True)
        make = MakePhase(str(hf_dir), str(adapter), opts.targets, opts.dim, opts.alpha, ref_of(spec), seed=1234)
        saved = env.launch("save", make_rank, make, None)[0]
        ranks = env.launch("load", tp_load_rank, TpPhase(str(hf_dir), str(adapter), str(out), ref_of(spec)), spec.target)
        with env.timed("compare"):
            backend = get_backend(ref_of(spec))
            result.checks.append(logits_check(saved["logits"], [r["logits"] for r in ranks]))
            result.checks.append(effect_check([r["logits"] for r in ranks], saved["without"]))
            result.checks.append(shards_check(saved["params"], [r["shards"] for r in ranks], ranks[0]["plan"]))
            result.checks.append(warnings_check([r["load_warnings"] for r in ranks], [r["save_warnings"] for r in ranks]))
            resaved = [out / RESAVED.format(rank=i) for i in range(len(ranks))]
            result.checks.append(resave_check(backend.read_full(None, adapter),
                                              [backend.read_full(None, d) if d.is_dir() else {} for d in resaved]))


CASE = PeftTpLoad()
