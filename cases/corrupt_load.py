"""corrupt-load: save a good checkpoint at S, damage it in one named way, load it, classify.

The expensive checkpoint bug is not a load that fails but one that succeeds on a broken or foreign
checkpoint. The damage kinds are harness/faults/damage.py (`damage`, a matrix axis):

  dist checkpoint (a GPT zoo model, backend mcore_dist; loaded at D through the backend):
    truncate-shard, missing-shard, missing-metadata, missing-metadata-json, flip-byte, empty-dir,
    other-hidden / other-layers / other-vocab / other-groups (the checkpoint of the same model with
    that dimension changed, harness.faults.damage.OTHER_MODEL), missing-common (refused at matrix load on
    megatron-core >= 0.19: its torch_dist format writes no common.pt, there is nothing to delete)
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
  outcome          refused (the load raised: passes; the detail quotes the exception and says
                   "clear" when the message names a damaged file or key, "unclear" otherwise, which
                   also goes into the result's notes), silent (the load returned: fails when what
                   was loaded differs from the canonical truth, the corruption the case exists to
                   find; passes as silent-but-intact when bitwise equal, naming the damaged files
                   the loader never read), crashed (a rank died without a Python exception, or the
                   world hung: fails)
  loaded-canonical (silent only) what was loaded, assembled to full tensors, against the truth
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Literal, get_args

import torch

from cases.contract import Case
from harness.backends import BackendRef, get_backend, ref_of
from harness.core import truth
from harness.core.context import RankContext
from harness.core.parity import Mismatch, Shard
from harness.core.result import CaseResult, Check
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.core.zoo import HFModelSpec, ModelSpec, get_model
from harness.faults import damage
from harness.faults.damage import Damage
from harness.judge.checks import assembled, state_check
from harness.models import bridge as mb
from harness.models import mcore as models
from harness.models import peft_mapping
from harness.models.hf import quiet_hf, write_fixture
from harness.run.envelope import RunEnv, timed
from harness.run.world import WorldError, WorldTimeout, exception_of

DamageKind = Literal[
    "truncate-shard", "missing-shard", "missing-metadata", "missing-metadata-json", "missing-common", "flip-byte",
    "other-hidden", "other-layers", "other-vocab", "other-groups", "empty-dir",
    "truncate-safetensors", "missing-indexed-shard", "adapter-no-config", "adapter-config-mismatch", "adapter-config-targets",
]
HF_EXPORT_KINDS = frozenset({"truncate-safetensors", "missing-indexed-shard"})
ADAPTER_KINDS = frozenset({"adapter-no-config", "adapter-config-mismatch", "adapter-config-targets"})
#: kind -> (model kind, backend capabilities): the artefact each damage belongs to.
ARTEFACT: dict[str, tuple[str, frozenset[str]]] = {
    **{k: ("gpt", frozenset({"weights"})) for k in get_args(DamageKind) if k not in HF_EXPORT_KINDS | ADAPTER_KINDS},
    **{k: ("hf", frozenset({"hf_export"})) for k in HF_EXPORT_KINDS},
    **{k: ("hf", frozenset({"adapter_export"})) for k in ADAPTER_KINDS},
}


@dataclass(frozen=True)
class CorruptOptions:
    damage: DamageKind = "truncate-shard"


class RefusedLoadError(RuntimeError):
    """Raised by a load-side rank around the backend's load only, so the parent tells a refusal of
    the damaged checkpoint from a harness error elsewhere in the rank. Message: the exception chain."""


def chain_text(exc: BaseException) -> str:
    """`Type: message` of an exception and every cause/context below it, outermost first (what a
    user's traceback shows)."""
    parts, seen = [], set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        odd = "" if isinstance(cur, Exception) else " (a BaseException: `except Exception` does not catch it)"
        parts.append(f"{type(cur).__name__}{odd}: {cur}")
        cur = cur.__cause__ or cur.__context__
    return "\n".join(parts)


@dataclass(frozen=True)
class Outcome:
    kind: Literal["refused", "silent", "crashed"]
    text: str = ""  # refused: the exception chain ("Type: message", outermost first); crashed: the world's error


@dataclass(frozen=True)
class _Phase:
    model: ModelSpec
    topo: Topology
    backend: BackendRef  # import path + options
    save_to: str | None = None
    load_from: str | None = None


@dataclass
class LoadOut:
    shards: list[Shard]
    shard_bytes: int


def _rank_dist(ctx: RankContext, p: _Phase) -> LoadOut:
    backend = get_backend(p.backend)
    model = models.build_gpt(p.model, p.topo)
    if p.load_from is None:
        models.fill_canonical(model, p.model)
        backend.save(ctx, model, Path(p.save_to))
    else:
        models.fill_canonical(model, p.model.with_seed(p.model.seed + truth.DECOY_SEED_OFFSET))
        try:
            backend.load(ctx, model, Path(p.load_from))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # torch DCP's CheckpointException is a BaseException
            raise RefusedLoadError(chain_text(exc)) from exc
    shards = models.local_shards(model)
    return LoadOut(shards, sum(s.data.numel() * s.data.element_size() for s in shards))


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


def named(dmg: Damage, text: str) -> list[str]:
    """The damaged files and keys the refusal's text names (empty: an unclear refusal)."""
    return [n for n in dmg.names if n and n in text]


def quote(text: str) -> str:
    """The first line of a refusal, and its last when they differ (torch DCP's CheckpointException
    says only `ranks:dict_keys([0])` first; the rank's root cause is its last line)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    return lines[0][:240] + (f" ... {lines[-1][:240]}" if len(lines) > 1 and lines[-1] != lines[0] else "")


def judge(
    dmg: Damage, outcome: Outcome, expected: dict[str, torch.Tensor] | None = None,
    loaded: dict[str, torch.Tensor] | None = None, problems: list[Mismatch] | None = None, label: str = "loaded",
) -> list[Check]:
    """`outcome` and `loaded-canonical` from what the load did. `expected`/`loaded`/`problems`
    (silent loads only): the truth, the loaded tensors (assembled), and assembly problems."""
    what = f"{dmg.kind} ({dmg.detail})"
    if outcome.kind == "refused":
        hits = named(dmg, outcome.text)
        clarity = f"clear, names {', '.join(hits[:3])}" if hits else f"unclear, names none of {list(dmg.names[:3])}"
        return [
            Check("outcome", "passed", f"refused ({clarity}): {quote(outcome.text)} [damage: {what}]", tolerance="-"),
            Check("loaded-canonical", "not-run", "the load refused: nothing was loaded", tolerance="-"),
        ]
    if outcome.kind == "crashed":
        return [
            Check("outcome", "failed", f"crashed: {quote(outcome.text)} [damage: {what}]", tolerance="-"),
            Check("loaded-canonical", "not-run", "no rank returned from the load", tolerance="-"),
        ]
    loaded_check = state_check("loaded-canonical", expected or {}, loaded or {}, "canonical", label,
                               f"{len(loaded or {})} tensors loaded equal canonical", problems=problems or [])
    if loaded_check.failed:
        keys = sorted({m.key for m in loaded_check.mismatches})
        warned = f"; it only warned: {outcome.text[:300]}" if outcome.text else ""
        detail = (f"silent: the load of a damaged or foreign checkpoint returned and {len(keys)} tensor(s) differ from canonical "
                  f"({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}): data corruption{warned} [damage: {what}]")
        return [Check("outcome", "failed", detail, tolerance="-"), loaded_check]
    unread = (f"the damaged {', '.join(dmg.files)} {'was' if len(dmg.files) == 1 else 'were'} never read" if dmg.files
              else "nothing the foreign checkpoint changes was read")
    return [
        Check("outcome", "passed", f"silent-but-intact: the load returned everything bitwise canonical; "
                                   f"{unread} [damage: {what}]", tolerance="-"),
        loaded_check,
    ]


def outcome_of(exc: WorldError) -> Outcome | None:
    """A failed load world as an outcome; None when a rank failed outside the load (a harness error)."""
    if isinstance(exc, WorldTimeout):
        return Outcome("crashed", f"hung: {exc}")
    tb = exc.rank_traceback or ""
    marker = f"{RefusedLoadError.__name__}: "  # outermost, so last; its message may hold more "X: y" lines
    if marker in tb:
        return Outcome("refused", tb.rsplit(marker, 1)[1].strip())
    if not exception_of(tb)[0]:
        return Outcome("crashed", str(exc))
    return None


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
        return Outcome("refused", chain_text(exc)), None


# --------------------------------------------------------------------------- the case


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
    checks = ("outcome", "loaded-canonical")

    def requirements(self, opts: CorruptOptions) -> tuple[str, frozenset[str], str]:
        kind, needs = ARTEFACT[opts.damage]
        return kind, needs, f" with damage {opts.damage!r}"

    def validate_options(self, spec: CaseSpec, opts: CorruptOptions) -> None:
        kind = opts.damage
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
        if ARTEFACT[opts.damage][0] == "gpt":
            checks = self._run_dist(spec, opts.damage, env, result)
        else:
            checks = self._run_hf(spec, opts.damage, env, result)
        result.checks.extend(checks)
        detail = checks[0].detail
        if detail.startswith("refused (unclear"):
            result.notes.append(f"unclear refusal: the message names no damaged file or key: {detail}")

    def _run_dist(self, spec: CaseSpec, kind: str, env: RunEnv, result: CaseResult) -> list[Check]:
        model = get_model(spec.model, "gpt")
        src, dst = spec.source, spec.target
        backend = ref_of(spec)
        ckpt = env.case_dir / "ckpt"
        saved = damage.other_model(model, kind) if kind in damage.OTHER_MODEL else model
        env.launch(result, "save", _rank_dist, _Phase(saved, src, backend, save_to=str(ckpt)), src)
        with timed(result, "damage"):
            dmg = damage.foreign(ckpt, kind, saved, model) if kind in damage.OTHER_MODEL else damage.FUNCTIONS[kind](ckpt)
        try:
            outs = env.launch(result, "load", _rank_dist, _Phase(model, dst, backend, load_from=str(ckpt)), dst)
        except WorldError as exc:
            outcome = outcome_of(exc)
            if outcome is None:
                raise
            return judge(dmg, outcome)
        with timed(result, "compare"):
            full, problems = assembled(outs, "shards", dst.id)
            canonical = {k: truth.canonical_tensor(model, k, tuple(v.shape), v.dtype) for k, v in full.items()}
            return judge(dmg, Outcome("silent"), canonical, full, problems, dst.id)

    def _run_hf(self, spec: CaseSpec, kind: str, env: RunEnv, result: CaseResult) -> list[Check]:
        from peft import PeftModel, get_peft_model_state_dict
        from transformers import AutoModelForCausalLM

        model = get_model(spec.model, "hf")
        hf_dir, out = env.case_dir / "hf-source", env.case_dir / "artefact"
        adapter = mb.AdapterSpec() if kind in ADAPTER_KINDS else None
        with timed(result, "fixture"):
            write_fixture(model, hf_dir)
        outs = env.launch(result, "save", _rank_hf, _HFPhase(model, str(hf_dir), spec.source, ref_of(spec), str(out), adapter),
                          spec.source)
        with timed(result, "damage"):
            dmg = damage.FUNCTIONS[kind](out)
        quiet_hf()

        def load_model():  # str paths, as users pass them
            return AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32)

        def load_adapter():
            base = AutoModelForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float32)
            return PeftModel.from_pretrained(base, str(out))

        with timed(result, "load"):
            outcome, loaded_model = _hf_outcome(load_adapter if adapter else load_model)
        if outcome.kind == "refused":
            return judge(dmg, outcome)
        with timed(result, "compare"):
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
