"""Loading a damaged or foreign dist checkpoint and judging what the load did (refused, crashed, or
silent with or without corrupt data): what corrupt-load and interrupted-save share."""

from __future__ import annotations

import re
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal, Sequence

import torch

from harness.backends import BackendRef, get_backend
from harness.core import truth
from harness.core.context import RankContext
from harness.core.frames import Frame
from harness.core.parity import NOT_COMPARED, Mismatch, Shard
from harness.core.result import Check
from harness.core.topology import Topology
from harness.core.zoo import ModelSpec
from harness.faults.damage import Damage
from harness.judge.checks import refusal_check, state_check
from harness.models import mcore as models
from harness.run.world import WorldError, WorldTimeout, exception_of


class RefusedLoadError(RuntimeError):
    """Raised by a load-side rank around the backend's load only, so the parent tells a refusal of
    the damaged checkpoint from a harness error elsewhere in the rank. Message: a `_RAISED_AT` line
    naming the load's raising frame (its traceback text cannot: torch DCP's message embeds the
    ranks' tracebacks), then the exception chain."""


_RAISED_AT = "raised at\t"  # path \t line \t function \t code


def frame_of(exc: BaseException) -> Frame | None:
    """Where `exc` itself was raised: the innermost frame of its own traceback with a real file."""
    found = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    return Frame(found[-1].filename, found[-1].lineno or 0, found[-1].name, (found[-1].line or "").strip()) if found else None


def refusal_message(exc: BaseException) -> str:
    """RefusedLoadError's message: the raising frame line, then the chain."""
    f = frame_of(exc)
    head = f"{_RAISED_AT}{f.path}\t{f.line}\t{f.function}\t{f.code}\n" if f else ""
    return head + chain_text(exc)


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


#: What a dist checkpoint load may refuse with where its backend says nothing else: megatron-core's
#: dist_checkpointing error (harness.backends.mcore_dist.McoreDist.refusals).
DIST_REFUSALS: tuple[str, ...] = ("CheckpointingException",)


@dataclass(frozen=True)
class Outcome:
    kind: Literal["refused", "silent", "crashed"]
    text: str = ""  # refused: the exception chain ("Type: message", outermost first); crashed: the world's error
    #: refused: where the outermost exception was raised (None: not known, e.g. a hand-made outcome)
    frame: Frame | None = None

    @property
    def exc_type(self) -> str:
        """The class of the outermost exception of a refusal (what a user's `except` sees): the
        chain's first `Type: message` line."""
        m = _CHAIN_HEAD.match(self.text.strip())
        return m[1].rsplit(".", 1)[-1] if m else ""

    @property
    def message(self) -> str:
        """The outermost exception's message (its first line)."""
        m = _CHAIN_HEAD.match(self.text.strip())
        return m[2] if m else self.text.strip()


#: the first line of chain_text: `Type: message` or `Type (a BaseException: ...): message`
_CHAIN_HEAD = re.compile(r"([\w.]+)(?: \(a BaseException[^)]*\))?: ?(.*)")


def refused(exc: BaseException) -> Outcome:
    """A load that raised `exc` in this process, as an outcome naming its chain and raising frame."""
    return Outcome("refused", chain_text(exc), frame_of(exc))


@dataclass(frozen=True)
class DistPhase:
    model: ModelSpec
    topo: Topology
    backend: BackendRef  # import path + options
    save_to: str | None = None
    load_from: str | None = None
    plant: str | None = None  # a save-time damage of the model's sharded state dict (SAVE_PLANTS)


@dataclass
class LoadOut:
    shards: list[Shard]
    shard_bytes: int


#: the tensor a save-time plant misdescribes: TP-sharded by vocabulary rows on the first PP stage
CLAIMED_KEY = "embedding.word_embeddings.weight"


def claim_whole(model) -> None:
    """Plant Falcon-H1's kind of defect (a module's sharded_state_dict built without its tp_group):
    every TP rank describes its vocabulary shard of the word embeddings as the whole tensor and as
    the main replica. megatron-core's save validation must refuse the overlapping claims; without it
    one rank's rows are written as the whole embedding and the others' are lost."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    chunk = models.as_chunks(model)[0]
    original = chunk.sharded_state_dict

    def planted(*args, **kwargs):
        state = original(*args, **kwargs)
        if CLAIMED_KEY in state:
            state[CLAIMED_KEY] = ShardedTensor.from_rank_offsets(CLAIMED_KEY, state[CLAIMED_KEY].data, replica_id=0)
        return state

    chunk.sharded_state_dict = planted


#: the objects a save-time plant duplicates: every layer's QKV extra state (a ShardedObject per layer)
CLAIMED_OBJECT = "self_attention.linear_qkv._extra_state"


def claim_object(model) -> None:
    """Plant the object form of that defect (a module's extra state built as a ShardedObject without its
    replica id, e.g. `replica_id=0` passed where `make_sharded_object_for_checkpoint` computes one per TP and
    DP rank): every rank describes each layer's QKV `_extra_state` as the main replica. The save's sharding
    validation must refuse the duplicate objects; without it each rank's copy is written under one key and
    the last one wins, so an extra state that differs per rank (fp8 scales) is lost silently."""
    import dataclasses

    from megatron.core.dist_checkpointing.mapping import ShardedObject

    chunk = models.as_chunks(model)[0]
    original = chunk.sharded_state_dict

    def planted(*args, **kwargs):
        state = original(*args, **kwargs)
        for k, v in state.items():
            if isinstance(v, ShardedObject) and v.key.endswith(CLAIMED_OBJECT):
                state[k] = dataclasses.replace(v, replica_id=0)
        return state

    chunk.sharded_state_dict = planted


SAVE_PLANTS = {"claimed-whole": claim_whole, "duplicate-object": claim_object}
#: the plants whose damage a load cannot show (the duplicated objects hold the same bytes): a save that
#: writes them is itself the failure
SAVE_ONLY = frozenset({"duplicate-object"})


@contextmanager
def judged_refusal() -> Iterator[None]:
    """Around the one call under judgement (a load, or a planted save): whatever it raises becomes a
    RefusedLoadError, so the parent tells its refusal from a harness error elsewhere in the rank."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # torch DCP's CheckpointException is a BaseException
        raise RefusedLoadError(refusal_message(exc)) from exc


def rank_dist(ctx: RankContext, p: DistPhase) -> LoadOut:
    backend = get_backend(p.backend)
    model = models.build_gpt(p.model, p.topo)
    if p.load_from is None:
        models.fill_canonical(model, p.model)
        if p.plant is not None:
            SAVE_PLANTS[p.plant](model)
        with judged_refusal() if p.plant is not None else nullcontext():  # a planted save's refusal is the outcome
            backend.save(ctx, model, Path(p.save_to))
    else:
        models.fill_canonical(model, p.model.with_seed(p.model.seed + truth.DECOY_SEED_OFFSET))
        with judged_refusal():
            backend.load(ctx, model, Path(p.load_from))
    shards = models.local_shards(model)
    return LoadOut(shards, sum(s.data.numel() * s.data.element_size() for s in shards))


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
    allowed: Sequence[str] = DIST_REFUSALS,
) -> list[Check]:
    """`outcome` and `loaded-canonical` from what the load did. `expected`/`loaded`/`problems`
    (silent loads only): the truth, the loaded tensors (assembled), and assembly problems.
    A refusal passes only as refusal_check's rule has it: through one of `allowed` (the loader's own
    error), raised in upstream code; another exception (a KeyError or AttributeError in the loader is
    a crash, not a refusal) fails naming its raising frame, and so does one raised in the harness."""
    what = f"{dmg.kind} ({dmg.detail})"
    if outcome.kind == "refused":
        not_loaded = Check("loaded-canonical", "not-run", "refused: nothing was loaded", tolerance=NOT_COMPARED)
        if outcome.frame is not None and outcome.frame.own:
            return [Check("outcome", "failed", f"raised in the harness's own code at {outcome.frame}: a harness error, not the "
                                               f"loader's refusal: {quote(outcome.text)} [damage: {what}]", tolerance=NOT_COMPARED),
                    not_loaded]
        verdict = refusal_check(outcome.exc_type, outcome.message, allowed, f"{dmg.kind} damage", frame=str(outcome.frame or ""))
        if verdict.failed:
            return [Check("outcome", "failed", f"{verdict.detail}; chain: {quote(outcome.text)} [damage: {what}]",
                          tolerance=NOT_COMPARED), not_loaded]
        hits = named(dmg, outcome.text)
        clarity = f"clear, names {', '.join(hits[:3])}" if hits else f"unclear, names none of {list(dmg.names[:3])}"
        return [
            Check("outcome", "passed", f"refused ({clarity}): {quote(outcome.text)} [damage: {what}]", tolerance=NOT_COMPARED),
            not_loaded,
        ]
    if outcome.kind == "crashed":
        return [
            Check("outcome", "failed", f"crashed: {quote(outcome.text)} [damage: {what}]", tolerance=NOT_COMPARED),
            Check("loaded-canonical", "not-run", "no rank returned from the load", tolerance=NOT_COMPARED),
        ]
    loaded_check = state_check("loaded-canonical", expected or {}, loaded or {}, "canonical", label,
                               f"{len(loaded or {})} tensors loaded equal canonical", problems=problems or [])
    if loaded_check.failed:
        keys = sorted({m.key for m in loaded_check.mismatches})
        warned = f"; it only warned: {outcome.text[:300]}" if outcome.text else ""
        detail = (f"silent: the load of a damaged or foreign checkpoint returned and {len(keys)} tensor(s) differ from canonical "
                  f"({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}): data corruption{warned} [damage: {what}]")
        return [Check("outcome", "failed", detail, tolerance=NOT_COMPARED), loaded_check]
    unread = (f"the damaged {', '.join(dmg.files)} {'was' if len(dmg.files) == 1 else 'were'} never read" if dmg.files
              else "nothing the foreign checkpoint changes was read")
    return [
        Check("outcome", "passed", f"silent-but-intact: the load returned everything bitwise canonical; "
                                   f"{unread} [damage: {what}]", tolerance=NOT_COMPARED),
        loaded_check,
    ]


def outcome_of(exc: WorldError) -> Outcome | None:
    """A failed load world as an outcome; None when a rank failed outside the load (a harness error)."""
    if isinstance(exc, WorldTimeout):
        return Outcome("crashed", f"hung: {exc}")
    tb = exc.rank_traceback or ""
    marker = f"{RefusedLoadError.__name__}: "  # outermost, so last; its message may hold more "X: y" lines
    if marker in tb:
        text = tb.rsplit(marker, 1)[1].strip()
        frame = None
        if text.startswith(_RAISED_AT):
            line, text = (text.split("\n", 1) + [""])[:2]
            path, lineno, function, code = (line[len(_RAISED_AT):].split("\t") + ["", "", ""])[:4]
            frame = Frame(path, int(lineno) if lineno.isdigit() else 0, function, code)
        return Outcome("refused", text.strip(), frame)
    if not exception_of(tb)[0]:
        return Outcome("crashed", str(exc))
    return None
