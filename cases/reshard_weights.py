"""reshard-weights: save model weights at topology S, load at D, prove nothing changed.

Checks (each can fail on its own; tests/test_judges.py and tests/test_reshard_case.py show it):
  source-canonical      the model built at S holds the canonical weights (guards the harness): keys
                        and shapes from the model's config (truth.gpt_checkpoint_shapes), so a
                        missing, extra or reshaped tensor fails
  checkpoint-canonical  the checkpoint's plain tensors equal the canonical ones, bitwise
  loaded-canonical      every tensor loaded at D, assembled to full shape, equals canonical
                        bitwise; nothing missing, extra, uncovered, or disagreeing between replicas
  resave-plain          Megatron-LM's own pattern: re-save at D, load_plain_tensors of both
                        checkpoints, exact equality
  vocab-padding         only for a model with make_vocab_size_divisible_by (harness.orchestration.explore): the
                        other checks compare the first vocab_size rows of the vocab tensors; this
                        one fails where the checkpoint's or D's row count is not the padded size at
                        that TP, or the checkpoint's padding rows are not the canonical ones built
                        at S; it reports what D's padding rows hold
  logits                logits of a fixed batch at D equal those at S; bitwise when TP is
                        unchanged (and expert TP), else within LOGITS_TP_TOLERANCE (fp32) or
                        LOGITS_TP_TOLERANCE_BF16 (bf16); with the local layer spec not run
                        when CP>1 (a CP forward needs Transformer-Engine attention); with
                        `layer_spec: te` run at every CP, within LOGITS_CP_TOLERANCE(_BF16) when
                        CP changes

Option `dtype` (fp32 | bf16): bf16 builds the model in bf16 inside megatron-core's Float16Module
(harness.models.build_gpt); the truth is then the canonical fp32 tensor cast to bf16, and every
weight check stays bitwise (a checkpoint stores the bf16 bytes as they are).

Option `layer_spec` (local | te): te builds the model from megatron-core's Transformer-Engine spec
(GPU ranks, `requires` te + cuda, derived: on a machine without them the case is not-run) with
CP>1 in the model config, so the logits check runs at CP>1: each CP rank feeds its zigzag chunks
of the batch and the logits are gathered back (harness.models.forward_logits).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .contract import Case
from harness.backends import get_backend, ref_of
from harness.core import truth
from harness.core.context import RankContext
from harness.core.memory import track
from harness.core.parity import NOT_COMPARED, Shard, Tolerance
from harness.core.result import CaseResult, Check
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.core.zoo import ModelSpec, get_model
from harness.judge.checks import assembled, replicated, state_check, tensor_check
from harness.models.mcore import TORCH_DTYPES, DType, LayerSpec
from harness.run.envelope import RunEnv

# A TP change splits row-parallel matmuls into partial sums reduced across ranks and splits the
# vocab-parallel output layer: fp32 results then differ in the last bits. Measured on the zoo:
# max |diff| ~1e-6 on logits of magnitude ~1; the bound leaves 10x headroom and stays far below
# any real weight corruption (a wrong shard moves logits by >1e-2).
LOGITS_TP_TOLERANCE = Tolerance(atol=1e-5, rtol=1e-5, why="TP change reorders fp32 reductions")
# bf16: the same reordering, but every matmul output and every activation handed between layers
# is rounded to bf16 (8 significant bits, relative step 2**-8 = 3.9e-3), so one reordered partial
# sum flips the last bf16 bit of an activation and the flip propagates through 4 layers into the
# bf16 logits. Measured over 14 TP-change pairs (gpt-gqa and gpt-tied: tp1->tp2, tp2->tp4,
# tp4->tp1, tp2pp2->tp1pp4, tp1pp2->tp2pp2, pp2->tp2): max |diff| 1.76e-2, i.e. about one bf16
# ulp of a logit of magnitude 2..4 (1.56e-2); unchanged-TP pairs stay bitwise. The bound is 1.7x
# the measured max in absolute terms and grows with the logit (rtol) to cover one ulp of larger
# logits; loaded-canonical stays bitwise, so a wrong weight never hides behind it.
LOGITS_TP_TOLERANCE_BF16 = Tolerance(atol=3e-2, rtol=3e-2, why="TP change reorders reductions and bf16 rounds every activation")
# A CP change shares the TP rule, on purpose: it splits attention into ring steps whose softmax
# partials are merged in another order (TE's ring attention), the same class of change as a TP
# change (fp32 partial sums reordered, no value altered). It cannot be measured on CPU: a CP
# forward needs TEDotProductAttention (CP_FORWARD_UNSUPPORTED), so on CPU the check is not-run and
# these bounds are never applied. They are the TP numbers by construction (no copy to drift); the
# nightly GPU tier records the real max |diff| in results.json, and a CP pair outside the TP bound
# there fails loudly rather than being widened here (docs/nightly-gpu.md).
LOGITS_CP_TOLERANCE = replace(LOGITS_TP_TOLERANCE, why="a CP change reorders fp32 reductions like a TP change (the TP rule; CP unmeasurable on CPU)")
LOGITS_CP_TOLERANCE_BF16 = replace(LOGITS_TP_TOLERANCE_BF16, why="a CP change reorders reductions like a TP change, bf16 activations (the TP rule)")
CP_FORWARD_UNSUPPORTED = (
    "CP>1 forward not run: megatron-core's local DotProductAttention asserts "
    "context_parallel_size == 1 (only TEDotProductAttention supports CP, needs Transformer-Engine)"
)


@dataclass(frozen=True)
class Options:
    """reshard-weights' options: the precision the model is built, saved and loaded in.

    fp32 (the default) keeps every existing case id and outcome; bf16 is what users train in."""

    dtype: DType = "fp32"
    layer_spec: LayerSpec = "local"


@dataclass(frozen=True)
class _Phase:
    model: ModelSpec
    topo: Topology
    backend: str  # import path
    load_from: str | None
    save_to: str | None
    logits: bool
    dtype: DType = "fp32"
    layer_spec: LayerSpec = "local"


@dataclass
class WeightsOut:
    shards: list[Shard]
    logits: torch.Tensor | None
    shard_bytes: int


def _rank_phase(ctx: RankContext, p: _Phase) -> WeightsOut:
    backend = get_backend(p.backend)
    build = backend.builder()  # megatron-core's plain GPT, or the backend's own (mcore_fsdp: Megatron-FSDP)
    weights = p.model if p.load_from is None else p.model.with_seed(p.model.seed + truth.DECOY_SEED_OFFSET)
    model = build.build_model(p.model, p.topo, p.dtype, p.layer_spec, weights)
    if p.load_from is not None:
        with track("load"):
            backend.load(ctx, model, Path(p.load_from))
    shards = build.model_shards(model)
    logits = build.logits(model, truth.fixed_batch(p.model), ctx.device) if p.logits else None
    out = WeightsOut(shards, logits, sum(s.data.numel() * s.data.element_size() for s in shards))
    if p.save_to is not None:
        with track("save"):
            backend.save(ctx, model, Path(p.save_to))
    return out


def _rank_read(ctx: RankContext, arg: tuple[str, list[str]]) -> dict[str, dict[str, torch.Tensor]]:
    backend_path, dirs = arg
    backend = get_backend(backend_path)
    return {d: backend.read_full(ctx, Path(d)) for d in dirs}


def logits_tolerance(src: Topology, dst: Topology, dtype: DType) -> Tolerance | None:
    """Bitwise when TP, expert TP and CP are unchanged (same reductions in the same order), else
    the dtype's bound (a CP change: the same bound, see LOGITS_CP_TOLERANCE). An etp change splits the
    experts' row-parallel fc2 the way a TP change splits linear_proj (gpt-moe tp2 -> tp2ep2etp1:
    4.2e-7 fp32, 1.6e-2 bf16); an EP change alone moves whole experts between ranks and stays
    bitwise (measured on dp2ep2 -> dp1, dp2ep2 -> dp4ep4, dp4ep4 -> dp4)."""
    if src.cp != dst.cp:
        return LOGITS_CP_TOLERANCE_BF16 if dtype == "bf16" else LOGITS_CP_TOLERANCE
    if src.tp == dst.tp and src.etp == dst.etp:
        return None
    return LOGITS_TP_TOLERANCE_BF16 if dtype == "bf16" else LOGITS_TP_TOLERANCE


def cp_forward(src: Topology, dst: Topology, layer_spec: LayerSpec) -> bool:
    """Whether the logits check can run: always with TE, at CP 1 only with the local layer spec."""
    return layer_spec == "te" or (src.cp == 1 and dst.cp == 1)


def logits_check(saved: list[WeightsOut], loaded: list[WeightsOut], src: Topology, dst: Topology, dtype: DType = "fp32",
                 vocab: int | None = None, layer_spec: LayerSpec = "local") -> Check:
    """Logits at D against logits at S; with `vocab` (a padded model) only the first `vocab` columns,
    the ones a token can take: the padded columns' count changes with TP."""
    if not cp_forward(src, dst, layer_spec):
        return Check("logits", "not-run", CP_FORWARD_UNSUPPORTED, tolerance=NOT_COMPARED)
    ls, src_agree = replicated(saved, "logits")
    ld, dst_agree = replicated(loaded, "logits")
    if ls is None or ld is None:
        return Check("logits", "failed", "no rank returned logits")
    if not (src_agree and dst_agree):
        return Check("logits", "failed", "data-parallel replicas computed different logits")
    if vocab is not None:
        ls, ld = ls[..., :vocab], ld[..., :vocab]
    tol = logits_tolerance(src, dst, dtype)
    return tensor_check("logits", ls, ld, src.id, dst.id, f"{tuple(ld.shape)} logits agree", tol)


def real_rows(model: ModelSpec, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with every padded vocab tensor cut to its first `vocab_size` rows.

    With `make_vocab_size_divisible_by` the checkpoint key of the embedding (and untied output
    layer) has global shape (padded_vocab_size(tp_S), hidden) at S and (padded_vocab_size(tp_D),
    hidden) at D: the padded size changes with TP. What a correct reshard must preserve is the real
    rows; padding rows hold nothing a token can reach and may differ, so they are compared apart
    (`padding_check`). A model without padding comes back unchanged."""
    return {k: v[: model.vocab_size] if truth.is_padded_vocab(model, k, tuple(v.shape)) else v for k, v in state.items()}


def padding_check(model: ModelSpec, src: Topology, dst: Topology, checkpoint: dict[str, torch.Tensor],
                  dst_full: dict[str, torch.Tensor], dtype: DType) -> Check:
    """The vocab tensors' padding, against the truth: the other checks compare real rows only, so this
    one fails where a vocab tensor is missing, the checkpoint's or D's row count is not Megatron-LM's
    padded size at that TP, or the checkpoint's padding rows are not the ones the model at S was built
    with (a save writes them as they are). What D's padding rows hold is reported, not judged: they
    carry no token, and a load at another padded size has nothing to fill them from."""
    parts, wrong = [], []
    for key in sorted(k for k in truth.gpt_checkpoint_shapes(model, src.tp) if k.endswith(truth.VOCAB_KEYS)):
        rows_s, rows_d = model.padded_vocab_size(src.tp), model.padded_vocab_size(dst.tp)
        saved, at_d = checkpoint.get(key), dst_full.get(key)
        if saved is None or at_d is None:
            wrong.append(f"{key}: missing {'from the checkpoint' if saved is None else f'at {dst.id}'}")
            continue
        text = f"{key}: vocab {model.vocab_size}, padded {rows_s} at {src.id}, {rows_d} at {dst.id}"
        if saved.shape[0] != rows_s:
            wrong.append(f"{key}: the checkpoint holds {saved.shape[0]} rows, {src.id} pads to {rows_s}")
        elif not torch.equal(saved[model.vocab_size:], truth.canonical_tensor(model, key, tuple(saved.shape), TORCH_DTYPES[dtype])[model.vocab_size:]):
            wrong.append(f"{key}: the checkpoint's padding rows are not the ones built at {src.id}")
        if at_d.shape[0] != rows_d:
            wrong.append(f"{key}: {at_d.shape[0]} rows loaded at {dst.id}, which pads to {rows_d}")
        elif rows_d > model.vocab_size:
            pad = at_d[model.vocab_size:]
            decoy = truth.canonical_tensor(model.with_seed(model.seed + truth.DECOY_SEED_OFFSET), key, tuple(at_d.shape),
                                           TORCH_DTYPES[dtype])[model.vocab_size:]
            if torch.equal(truth.canonical_tensor(model, key, tuple(at_d.shape), TORCH_DTYPES[dtype])[model.vocab_size:], pad):
                text += "; padding rows at D equal the canonical ones"
            elif torch.equal(decoy, pad):
                text += "; padding rows at D kept their pre-load values (the load did not touch them)"
            elif not pad.any():
                text += "; padding rows at D are zero"
            else:
                text += "; padding rows at D hold other values"
        parts.append(text)
    if wrong:
        return Check("vocab-padding", "failed", "; ".join(wrong))
    return Check("vocab-padding", "passed", "; ".join(parts))


def judge(
    model: ModelSpec, src: Topology, dst: Topology, saved: list[WeightsOut], loaded: list[WeightsOut],
    checkpoint: dict[str, torch.Tensor], resaved: dict[str, torch.Tensor], dtype: DType = "fp32", layer_spec: LayerSpec = "local",
) -> list[Check]:
    """The five checks, from the worlds' outputs and the two checkpoints read plainly.

    The canonical tensors are asked in the case's dtype, never in the dtype the model happened to
    hold: a bf16 case whose model (or checkpoint) came back fp32 fails on dtype."""
    src_full, src_problems = assembled(saved, "shards", src.id)
    dst_full, dst_problems = assembled(loaded, "shards", dst.id)
    # keys and shapes from the model's config, never from what was built or saved: a tensor every
    # side drops (or reshapes) alike then fails all three canonical checks
    canonical = {k: truth.canonical_tensor(model, k, shape, TORCH_DTYPES[dtype])
                 for k, shape in truth.gpt_checkpoint_shapes(model, src.tp).items()}
    padded = model.make_vocab_size_divisible_by is not None
    if padded:  # compare the real vocab rows only (see `real_rows`); zoo models skip this
        full_ckpt = checkpoint
        canonical, src_full, checkpoint, resaved = (real_rows(model, t) for t in (canonical, src_full, checkpoint, resaved))
        dst_full_all, dst_full = dst_full, real_rows(model, dst_full)
    checks = [
        state_check("source-canonical", canonical, src_full, "canonical", src.id,
                    f"{len(src_full)} tensors built at {src.id} equal canonical", problems=src_problems),
        state_check("checkpoint-canonical", canonical, checkpoint, "canonical", f"checkpoint@{src.id}",
                    f"{len(checkpoint)} tensors in the checkpoint equal canonical"),
        state_check("loaded-canonical", canonical, dst_full, "canonical", dst.id,
                    f"{len(dst_full)} tensors loaded at {dst.id} equal canonical, none missing or extra", problems=dst_problems),
        state_check("resave-plain", checkpoint, resaved, f"saved@{src.id}", f"resaved@{dst.id}",
                    "load_plain_tensors(original) == load_plain_tensors(re-saved at target)"),
        logits_check(saved, loaded, src, dst, dtype, model.vocab_size if padded else None, layer_spec),
    ]
    if padded:
        checks.append(padding_check(model, src, dst, full_ckpt, dst_full_all, dtype))
    return checks


# --------------------------------------------------------------------------- the public steps
# What run_weights runs, one world each; the golden corpus (harness.gate.golden) runs them too, on
# checkpoints another environment wrote.


def save_step(env: RunEnv, result: CaseResult, model: ModelSpec, topo: Topology, backend: str, save_to: Path, *,
              logits: bool = False, dtype: DType = "fp32", layer_spec: LayerSpec = "local") -> list[WeightsOut]:
    """World "save" at `topo`: build `model` with the canonical weights and save it through
    `backend` (an import path, harness.backends.resolve) into `save_to`. Each rank's WeightsOut:
    its shards as built, its logits of the fixed batch when `logits`."""
    return env.launch("save", _rank_phase, save_phase(model, topo, backend, save_to, logits, dtype, layer_spec), topo)


def save_phase(model: ModelSpec, topo: Topology, backend: str, save_to: Path, logits: bool, dtype: DType,
               layer_spec: LayerSpec) -> _Phase:
    """What save_step's world runs (run_weights hands it to RunEnv.launch_source)."""
    return _Phase(model, topo, backend, None, str(save_to), logits, dtype, layer_spec)


def load_step(env: RunEnv, result: CaseResult, model: ModelSpec, topo: Topology, backend: str, load_from: Path, *,
              save_to: Path | None = None, logits: bool = False, dtype: DType = "fp32",
              layer_spec: LayerSpec = "local") -> list[WeightsOut]:
    """World "load" at `topo`: build `model` holding decoy weights, load `load_from` through
    `backend` (so a tensor the load misses keeps its decoy), re-save into `save_to` when given. Each
    rank's WeightsOut: its shards as loaded, its logits when `logits`. A load that raises fails the
    world (harness.run.world.WorldError, with the rank's traceback)."""
    return env.launch("load", _rank_phase, _Phase(model, topo, backend, str(load_from), str(save_to) if save_to else None,
                                                          logits, dtype, layer_spec), topo)


def read_step(env: RunEnv, result: CaseResult, backend: str, dirs: list[Path]) -> dict[str, dict[str, torch.Tensor]]:
    """World "read" (one rank, no model): every checkpoint of `dirs` read plainly through
    `backend`'s read_full, keyed by str(directory)."""
    return env.launch("read", _rank_read, (backend, [str(d) for d in dirs]), None)[0]


def run_weights(model: ModelSpec, src: Topology, dst: Topology, backend: str, dtype: DType, env: RunEnv,
                result: CaseResult, layer_spec: LayerSpec = "local") -> None:
    """The three worlds (save at S, load and re-save at D, read both checkpoints) and the judge,
    for any ModelSpec: the matrix case and harness.orchestration.explore (which draws models outside the zoo)
    run exactly this."""
    ckpt_b = env.case_dir / "ckpt-resaved"
    knobs = dict(logits=cp_forward(src, dst, layer_spec), dtype=dtype, layer_spec=layer_spec)
    # the save at S is the same for every target: once per run (harness.run.reuse), read-only after
    root, saved = env.launch_source("save", _rank_phase, lambda d: save_phase(
        model, src, backend, d / "ckpt-source", knobs["logits"], dtype, layer_spec), src)
    ckpt_a = root / "ckpt-source"
    loaded = load_step(env, result, model, dst, backend, ckpt_a, save_to=ckpt_b, **knobs)
    plain = read_step(env, result, backend, [ckpt_a, ckpt_b])
    with env.timed("compare"):
        result.checks.extend(judge(model, src, dst, saved, loaded, plain[str(ckpt_a)], plain[str(ckpt_b)], dtype, layer_spec))


class ReshardWeights(Case):
    name = "reshard-weights"
    description = "model weights saved at S, reloaded at D: bitwise, plus Megatron-LM's re-save check and logits"
    Options = Options
    needs = frozenset({"weights", "read_plain"})
    checks = ("source-canonical", "checkpoint-canonical", "loaded-canonical", "resave-plain", "logits", "vocab-padding")

    def run(self, spec: CaseSpec, opts: Options, env: RunEnv, result: CaseResult) -> None:
        run_weights(get_model(spec.model, "gpt"), spec.source, spec.target, ref_of(spec), opts.dtype, env, result,
                    opts.layer_spec)


CASE = ReshardWeights()
