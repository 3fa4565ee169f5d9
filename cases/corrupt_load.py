"""corrupt-load: save a good checkpoint at S, damage it in one named way, load it, classify.

The expensive checkpoint bug is not a load that fails but one that succeeds on a broken or foreign
checkpoint. The damage kinds are harness/faults/damage.py (`damage`, a matrix axis):

  dist checkpoint (a GPT zoo model, backend mcore_dist; loaded at D through the backend):
    truncate-shard, missing-shard, missing-metadata, missing-metadata-json, flip-byte, empty-dir,
    other-hidden / other-layers / other-vocab / other-groups (the checkpoint of the same model with
    that dimension changed, harness.faults.damage.OTHER_MODEL), other-tied / other-bias (tied embeddings
    or linear biases flipped: keys one side lacks, which megatron-core's strict key check refuses), missing-common (refused at matrix load on
    megatron-core >= 0.19: its torch_dist format writes no common.pt, there is nothing to delete),
    claimed-whole (save time, source TP > 1: every TP rank claims its vocabulary shard of the word
    embeddings as the whole tensor and the main replica, the defect class of a sharded_state_dict built
    without its tp_group; the save must refuse it, and a save that does not is loaded at D and judged),
    duplicate-object (save time, source TP > 1: every rank claims each layer's QKV `_extra_state`
    ShardedObject as the main replica; the save must refuse the duplicates, a save that writes them fails)
  HF export (an HF fixture, backend bridge_hf; exported at S by the backend, loaded with
  transformers AutoModelForCausalLM.from_pretrained in the parent, as users do; S == D):
    truncate-safetensors, missing-indexed-shard (the tiny export is one file: split into two shards
    with an index first, harness.faults.damage.split_export)
  HF PEFT adapter (an HF fixture, backend bridge_peft; loaded with peft.PeftModel.from_pretrained
  over the fixture; S == D): adapter-no-config, adapter-config-mismatch (r disagrees with the
  tensors), adapter-config-targets (target_modules lacks a module the tensors hold)
Not here: "a checkpoint written with an older harness-made layout" (issue 11): the harness has
kept one layout, so there is no older one to write; cross-version layouts are the gate's corpus.

Checks:
  outcome          refused (the load raised one of `refuse_with`, by default the backend's
                   `refusals`, in upstream code: passes; the detail quotes the exception and says
                   "clear" when the message names a damaged file or key, "unclear" otherwise, which
                   also goes into the result's notes; any other exception, or one raised in the
                   harness, fails naming its raising frame: refusal_check's rule), silent (the load returned: fails when what
                   was loaded differs from the canonical truth, the corruption the case exists to
                   find; passes as silent-but-intact when bitwise equal, naming the damaged files
                   the loader never read), crashed (a rank died without a Python exception, or the
                   world hung: fails); other-tied / other-bias: a refusal that lists a key under the
                   wrong label of megatron-core's key check (`Missing keys` for one the checkpoint
                   lacks, or the reverse; the job's own checkpoint, saved beside, gives the sides) fails
  loaded-canonical (silent only) what was loaded, assembled to full tensors, against the truth

With option `mismatch: tolerate` (other-tied / other-bias loaded with a strictness that tolerates keys one
side lacks, backend.strict log_all or return_all: a job with new or removed params started from an
old checkpoint) the load must return instead (cases/shared/mismatch_load.py), and the truth of which
keys each side lacks comes from the files (the job's own model is saved beside the foreign one):
  outcome          the load returned (a refusal or crash fails) and loaded-canonical passed
  loaded-canonical every tensor the checkpoint holds is its model's, bitwise; every one it lacks keeps
                   the job's own pre-load value
  mismatch-keys    (a strictness whose load returns the keys: return_all) every rank returned the
                   missing keys the files give, and the ranks' unexpected keys together are the files'
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Literal, get_args

import torch

from .shared.damaged_load import (
    CLAIMED_KEY,
    CLAIMED_OBJECT,
    SAVE_ONLY,
    SAVE_PLANTS,
    DistPhase,
    Outcome,
    judge,
    outcome_of,
    rank_dist,
    refused,
)
from .shared.mismatch_load import expected_state, judge_tolerated, mismatch_truth, wrong_sides
from .contract import Case
from harness.backends import BackendRef, get_backend, ref_of
from harness.core import truth
from harness.core.context import RankContext
from harness.core.parity import NOT_COMPARED
from harness.core.result import CaseResult, Check
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.core.zoo import HFModelSpec, get_model
from harness.faults import damage
from harness.faults.damage import Damage
from harness.judge.checks import assembled
from harness.models import bridge as mb
from harness.models import peft_mapping
from harness.models.hf import quiet_hf, write_fixture
from harness.run.envelope import RunEnv
from harness.run.world import WorldError

DamageKind = Literal[
    "claimed-whole", "duplicate-object", "truncate-shard", "missing-shard", "missing-metadata", "missing-metadata-json", "missing-common", "flip-byte",
    "other-hidden", "other-layers", "other-vocab", "other-groups", "other-tied", "other-bias", "empty-dir",
    "truncate-safetensors", "missing-indexed-shard", "adapter-no-config", "adapter-config-mismatch", "adapter-config-targets",
]
#: foreign checkpoints whose keys differ from the job's (not their shapes): a non-raising strictness may load them
KEY_MISMATCH = frozenset({"other-tied", "other-bias"})
HF_EXPORT_KINDS = frozenset({"truncate-safetensors", "missing-indexed-shard"})
ADAPTER_KINDS = frozenset({"adapter-no-config", "adapter-config-mismatch", "adapter-config-targets"})
#: kind -> (model kind, backend capabilities): the artefact each damage belongs to.
ARTEFACT: dict[str, tuple[str, frozenset[str]]] = {
    **{k: ("gpt", frozenset({"weights"})) for k in get_args(DamageKind) if k not in HF_EXPORT_KINDS | ADAPTER_KINDS},
    **{k: ("hf", frozenset({"hf_export"})) for k in HF_EXPORT_KINDS},
    **{k: ("hf", frozenset({"adapter_export"})) for k in ADAPTER_KINDS},
}


#: Exceptions that are a crash inside a loader, never a refusal (refusal_check's rule): no entry may
#: allow them; a load that fails through one is an upstream finding, a strict xfail naming its frame.
CRASHES = frozenset({"AttributeError", "KeyError", "IndexError", "TypeError", "NameError", "AssertionError",
                     "UnboundLocalError", "ZeroDivisionError", "NotImplementedError"})


@dataclass(frozen=True)
class CorruptOptions:
    damage: DamageKind = "truncate-shard"
    #: the exceptions the load may refuse with (refusal_check's `allowed`); empty: the backend's `refusals`
    refuse_with: tuple[str, ...] = ()
    #: refuse: the load must refuse. tolerate (a key-mismatch damage, loaded with a strictness that
    #: tolerates it, e.g. backend.strict log_all): it must return the checkpoint's tensors and keep the
    #: job's own where the checkpoint lacks them (cases/shared/mismatch_load.py)
    mismatch: Literal["refuse", "tolerate"] = "refuse"


@dataclass(frozen=True)
class _HFPhase:
    spec: HFModelSpec
    hf_dir: str
    topo: Topology
    backend: BackendRef  # import path + options
    out: str
    adapter: mb.AdapterSpec | None


def _rank_hf(ctx: RankContext, p: _HFPhase) -> list[dict]:
    """Export at S through the backend under test; adapter pieces (harness-side truth) for adapters."""
    bm = mb.build(p.hf_dir, p.spec, p.topo, adapter=p.adapter)
    if p.adapter is not None:
        mb.fill_adapters(bm, p.spec, p.adapter)
    get_backend(p.backend).save(ctx, bm, Path(p.out))
    return mb.adapter_pieces(bm, p.spec) if p.adapter is not None else []


# --------------------------------------------------------------------------- the judge


def _hf_outcome(load) -> tuple[Outcome, object]:
    """Run a user's load call: refused with its exception chain, or silent with whatever it warned."""
    import warnings

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = load()
        return Outcome("silent", "; ".join(str(w.message)[:200] for w in caught)), loaded
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # what a user's from_pretrained call raises
        return refused(exc), None


# --------------------------------------------------------------------------- the case


def _planted(kind: str) -> Damage:
    """The record of a save-time plant (the save must refuse it; a save that does not is loaded and judged,
    or, for a plant no load can show, fails as it is)."""
    if kind == "duplicate-object":
        return Damage(kind, (), (CLAIMED_OBJECT,), f"every rank claimed each layer's {CLAIMED_OBJECT} as the main replica "
                      "(a ShardedObject built with replica_id=0 instead of one per TP and DP rank)")
    return Damage(kind, (), (CLAIMED_KEY,), f"every TP rank claimed its vocabulary shard of {CLAIMED_KEY} whole, as the main "
                  "replica (a sharded_state_dict built without its tp_group, as Falcon-H1's pre-norm)")


def _mcore_writes_common_pt() -> bool:
    """Whether megatron-core's dist_checkpointing.save writes common.pt beside the .distcp files:
    read from what its `save` does (it calls the common strategy's `save_common`, as releases before
    0.19 did; 0.19 saves the common state as the "common_state" sharded object inside them), never
    from the version string, so a release that brings common.pt back is seen."""
    import inspect

    from megatron.core.dist_checkpointing import serialization

    return "save_common" in inspect.getsource(serialization.save)


class CorruptLoad(Case):
    name = "corrupt-load"
    description = "a good checkpoint damaged one named way: the load must refuse (clearly), never return damaged data"
    Options = CorruptOptions
    model_kind, needs = ARTEFACT["truncate-shard"]  # the default damage's; requirements() decides per damage
    checks = ("outcome", "loaded-canonical", "mismatch-keys")

    def requirements(self, opts: CorruptOptions) -> tuple[str, frozenset[str], str]:
        kind, needs = ARTEFACT[opts.damage]
        return kind, needs, f" with damage {opts.damage!r}"

    def validate_options(self, spec: CaseSpec, opts: CorruptOptions) -> None:
        kind = opts.damage
        crashes = sorted(CRASHES & set(opts.refuse_with))
        if crashes:
            raise ValueError(f"option 'refuse_with': {crashes} is a crash inside the loader, never a refusal; a load that "
                             "fails through it is an upstream finding: a strict xfail naming the raising frame")
        if opts.mismatch == "tolerate" and kind not in KEY_MISMATCH:
            raise ValueError(f"option 'mismatch: tolerate' needs a damage of keys one side lacks ({sorted(KEY_MISMATCH)}), "
                             f"not {kind!r}: any other damage must be refused")
        if kind in SAVE_PLANTS and spec.source.tp < 2:
            raise ValueError(f"damage {kind!r} claims a TP rank's state as the only main replica: it needs a source with TP > 1, "
                             f"not {spec.source.id}")
        if kind == "missing-common" and not _mcore_writes_common_pt():
            raise ValueError(
                f"damage 'missing-common': megatron-core {metadata.version('megatron-core')} torch_dist writes no common.pt "
                "(its dist_checkpointing.save keeps the common state inside the .distcp files), so there is nothing to delete")
        if ARTEFACT[kind][0] == "hf" and spec.source != spec.target:
            raise ValueError(f"damage {kind!r} is loaded by transformers/peft, which have no topology: give source == target")
        if kind in damage.OTHER_MODEL:
            other = damage.other_model(get_model(spec.model, "gpt"), kind)
            try:
                spec.source.validate(other)
            except ValueError as exc:  # TopologyError
                raise ValueError(f"damage {kind!r}: the other model does not fit the source topology: {exc}") from None

    def run(self, spec: CaseSpec, opts: CorruptOptions, env: RunEnv, result: CaseResult) -> None:
        allowed = opts.refuse_with or get_backend(ref_of(spec)).refusals
        if ARTEFACT[opts.damage][0] == "gpt":
            checks = self._run_dist(spec, opts.damage, env, result, allowed, tolerate=opts.mismatch == "tolerate")
        else:
            checks = self._run_hf(spec, opts.damage, env, result, allowed)
        result.checks.extend(checks)
        detail = checks[0].detail
        if detail.startswith("refused (unclear"):
            result.notes.append(f"unclear refusal: the message names no damaged file or key: {detail}")

    def _run_dist(self, spec: CaseSpec, kind: str, env: RunEnv, result: CaseResult, allowed: tuple[str, ...],
                  tolerate: bool = False) -> list[Check]:
        """Save at S (a save-time plant: the save is what must refuse), damage, load at D. A key-mismatch
        damage saves the job's own model beside (its key sets are the truth of which side lacks what);
        `tolerate` judges the load as one told to tolerate those keys (cases/shared/mismatch_load.py)."""
        model = get_model(spec.model, "gpt")
        src, dst = spec.source, spec.target
        backend = ref_of(spec)
        ckpt = env.case_dir / "ckpt"
        saved = damage.other_model(model, kind) if kind in damage.OTHER_MODEL else model
        plant = kind if kind in SAVE_PLANTS else None
        try:
            env.launch("save", rank_dist, DistPhase(saved, src, backend, save_to=str(ckpt), plant=plant), src)
        except WorldError as exc:
            outcome = outcome_of(exc) if plant else None
            if outcome is None:
                raise
            return judge(_planted(kind), outcome, allowed=allowed)
        if kind in SAVE_ONLY:
            return [Check("outcome", "failed", f"silent save: the save wrote {_planted(kind).detail}; megatron-core's "
                          "sharding validation (validate_sharding_integrity) must refuse duplicate main replicas")]
        if kind in KEY_MISMATCH:
            own = env.case_dir / "ckpt-job"
            env.launch("save-job", rank_dist, DistPhase(model, src, backend, save_to=str(own)), src)
        with env.timed("damage"):
            dmg = (damage.foreign(ckpt, kind, saved, model) if kind in damage.OTHER_MODEL
                   else _planted(kind) if plant else damage.FUNCTIONS[kind](ckpt))
            missing, unexpected = mismatch_truth(ckpt, own) if kind in KEY_MISMATCH else (set(), set())
        what = f"{dmg.kind} ({dmg.detail})"
        try:
            outs = env.launch("load", rank_dist, DistPhase(model, dst, backend, load_from=str(ckpt)), dst)
        except WorldError as exc:
            outcome = outcome_of(exc)
            if outcome is None:
                raise
            if tolerate:
                return judge_tolerated(what, outcome, missing, unexpected)
            checks = judge(dmg, outcome, allowed=allowed)
            wrong = wrong_sides(outcome.text, missing, unexpected) if kind in KEY_MISMATCH else []
            if wrong and not checks[0].failed:
                checks[0] = Check("outcome", "failed", f"refused, but on the wrong side of the key check: {'; '.join(wrong)} "
                                                       f"(the files give the sides) -- {checks[0].detail}", tolerance=NOT_COMPARED)
            return checks
        with env.timed("compare"):
            full, problems = assembled(outs, "shards", dst.id)
            if tolerate:
                return judge_tolerated(what, Outcome("silent"), missing, unexpected, expected_state(full, saved, model, unexpected),
                                       full, problems, env.record.backend_events, dst.id)
            canonical = {k: truth.canonical_tensor(model, k, tuple(v.shape), v.dtype) for k, v in full.items()}
            return judge(dmg, Outcome("silent"), canonical, full, problems, dst.id)

    def _run_hf(self, spec: CaseSpec, kind: str, env: RunEnv, result: CaseResult, allowed: tuple[str, ...]) -> list[Check]:
        from peft import PeftModel, get_peft_model_state_dict
        from transformers import AutoModelForCausalLM

        model = get_model(spec.model, "hf")
        hf_dir, out = env.case_dir / "hf-source", env.case_dir / "artefact"
        adapter = mb.AdapterSpec() if kind in ADAPTER_KINDS else None
        with env.timed("fixture"):
            write_fixture(model, hf_dir)
        outs = env.launch("save", _rank_hf, _HFPhase(model, str(hf_dir), spec.source, ref_of(spec), str(out), adapter),
                          spec.source)
        with env.timed("damage"):
            dmg = damage.FUNCTIONS[kind](out)
        quiet_hf()

        def load_model():  # str paths, as users pass them
            return AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32)

        def load_adapter():
            base = AutoModelForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float32)
            return PeftModel.from_pretrained(base, str(out))

        with env.timed("load"):
            outcome, loaded_model = _hf_outcome(load_adapter if adapter else load_model)
        if outcome.kind == "refused":
            return judge(dmg, outcome, allowed=allowed)
        with env.timed("compare"):
            if adapter:
                expected = peft_mapping.to_hf_peft(peft_mapping.gather([p for rank in outs for p in rank], model.gated), model)
                loaded = {k: v.detach().clone() for k, v in get_peft_model_state_dict(loaded_model).items()}
            else:
                loaded = {k: v.detach().clone() for k, v in loaded_model.state_dict().items()}
                expected = truth.canonical_hf_state(model, {k: tuple(v.shape) for k, v in loaded.items()})
                if model.tied:
                    expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
            return judge(dmg, outcome, expected, loaded, [], "transformers" if not adapter else "peft")


CASE = CorruptLoad()
