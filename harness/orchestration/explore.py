"""Property-based exploration: let hypothesis search (model shape, S, D) triples instead of trusting
the hand-picked zoo shapes (issue 11, item 3).

The zoo's models are powers of two that every matrix topology divides; real models are not (12
heads, 6 layers over pp2 and pp3, a vocab Megatron-LM pads to a multiple of
`make_vocab_size_divisible_by * tp`, so its padded size changes with TP). `triples` draws only
valid triples (every topology passes Topology.validate for the drawn model), each example runs the
reshard-weights worlds and judge (cases.reshard_weights.run_weights, the same code the matrix case
runs) and fails when any check fails; hypothesis then shrinks the failure to the smallest triple
and keeps it in its example database under the report dir, so the next run replays it first.

`kind="hf"` (`--kind hf`) draws HF fixtures instead and runs hf-roundtrip through Megatron-Bridge
(import at S, dist checkpoint, load at D, HF export), where the Bridge's own vocab padding changes
with TP and the export must equal the source bitwise (no padded row may leak into it).
`kind="lora"` (`--kind lora`) draws LoRA layouts too and runs peft-export
(harness.orchestration.explore_lora: rank, alpha, target subsets, layer filters, MoE experts, the
output layer of tied models), looking past the upstream defects the matrices already name unless
`lora_known_defects`.
A drawn model is not in the zoo, so a failure is printed as the ModelSpec to add to harness/core/zoo.py
plus the matrix entry that then reproduces it (matrices name zoo models only; a LoRA layout goes in
the entry's `options`).
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase

from harness.core.topology import Topology, TopologyError
from harness.core.zoo import AnyModel, HFModelSpec, ModelSpec
from harness.orchestration.explore_lora import draws as lora_draws
from harness.orchestration.explore_lora import excused, layout_options, model_name, run_draw
from harness.orchestration.explore_lora import matrix_entry as lora_entry
from harness.orchestration.runner import RunOptions, case_envelope

#: A triple: the model, the topology it is saved at (S) and the one it is loaded at (D).
Triple = tuple[AnyModel, Topology, Topology]
#: What each kind of drawn model runs through: (case, backend of the matrix entry, markers).
CASE_OF = {"gpt": ("reshard-weights", "mcore_dist", ""), "hf": ("hf-roundtrip", "bridge_hf", "hf")}

#: Every drawn model's sequence length (the zoo's): context parallel needs 2*cp | 16, so cp3 is never drawn.
SEQ_LENGTH = 16


def all_topologies(max_world: int) -> list[Topology]:
    """Every (tp, pp, dp, cp) with world size <= max_world, smallest world first: hypothesis
    shrinks a sampled_from towards its first element, so a failure shrinks to the smallest world."""
    sizes = range(1, max_world + 1)
    topos = [Topology(tp=t, pp=p, dp=d, cp=c) for t in sizes for p in sizes for d in sizes for c in sizes
             if t * p * d * c <= max_world]
    return sorted(topos, key=lambda x: (x.world_size, x.cp, x.dp, x.pp, x.tp))


def valid_topologies(model: ModelSpec, max_world: int) -> list[Topology]:
    """The topologies Topology.validate accepts for `model` (never empty: tp1pp1dp1cp1 holds any
    model whose seq_length is even, and every drawn one is)."""
    out = []
    for topo in all_topologies(max_world):
        try:
            topo.validate(model, available_ranks=max_world)
        except TopologyError:
            continue
        out.append(topo)
    return out


@st.composite
def models(draw: st.DrawFn, tp: int = 1, pp: int = 1) -> ModelSpec:
    """A GPT shape that fits TP `tp` and PP `pp` (the lcm of S's and D's), with sizes mostly not
    powers of two: heads = tp * {1, 2, 3, 4, 6} (so 3, 6, 12...), query groups a multiple of tp
    dividing heads, hidden = heads * head_dim with head_dim in {8, 12, 16}, ffn = tp * 2..24,
    layers = pp * 1..3 (6 layers when S is pp2 and D pp3), a vocab padded with
    `make_vocab_size_divisible_by` in {1, 8, 128} (any size, odd included) or unpadded (then a
    multiple of tp, as Topology.validate requires), and the zoo flavours' switches (tied,
    SwiGLU, norm, biases, position embedding) drawn independently. Every size is a small
    multiplier, so hypothesis shrinks a failure towards the smallest model that still fails."""
    heads = tp * draw(st.sampled_from([1, 2, 3, 4, 6]))
    groups = draw(st.sampled_from([g for g in range(tp, heads + 1, tp) if heads % g == 0]))
    divisible_by = draw(st.sampled_from([None, 1, 8, 128]))
    vocab = tp * draw(st.integers(8, 100)) if divisible_by is None else draw(st.integers(32, 200))
    values: dict[str, Any] = dict(
        num_layers=pp * draw(st.integers(1, 3)),
        hidden_size=heads * draw(st.sampled_from([8, 12, 16])),
        num_attention_heads=heads,
        num_query_groups=groups,
        ffn_hidden_size=tp * draw(st.integers(2, 24)),
        vocab_size=vocab,
        make_vocab_size_divisible_by=divisible_by,
        tied_embeddings=draw(st.booleans()),
        swiglu=draw(st.booleans()),
        normalization=draw(st.sampled_from(["RMSNorm", "LayerNorm"])),
        add_bias_linear=draw(st.booleans()),
        add_qkv_bias=draw(st.booleans()),
        position_embedding=draw(st.sampled_from(["rope", "learned_absolute"])),
    )
    return ModelSpec(model_name(values), "drawn by harness.orchestration.explore", **values)


@st.composite
def hf_models(draw: st.DrawFn, tp: int = 1, pp: int = 1, pad_vocab: bool = True) -> HFModelSpec:
    """An HF fixture (Llama or Qwen2, tied or not) with the same non-power-of-two sizes as `models`.
    The HF vocab is a multiple of tp (Topology.validate's rule); with `pad_vocab` drawn True the
    Bridge provider pads it inside Megatron (should_pad_vocab: to a multiple of the largest power
    of two <= 128 dividing the vocab, times tp), so the padded size changes with TP there and
    export-bitwise proves the padded rows do not leak into the exported HF files. `pad_vocab=False`
    keeps the Bridge's default (no padding): Megatron-Bridge 0.6.2 does leak them (docs/explore.md, the
    `padvocab` xfails), and a search that should look past that known defect turns it off."""
    heads = tp * draw(st.sampled_from([1, 2, 3, 4, 6]))
    values: dict[str, Any] = dict(
        arch=draw(st.sampled_from(["llama", "qwen2"])),
        tied=draw(st.booleans()),
        num_layers=pp * draw(st.integers(1, 3)),
        hidden_size=heads * draw(st.sampled_from([8, 12, 16])),
        num_attention_heads=heads,
        num_key_value_heads=draw(st.sampled_from([g for g in range(tp, heads + 1, tp) if heads % g == 0])),
        intermediate_size=tp * draw(st.integers(2, 24)),
        vocab_size=tp * draw(st.integers(8, 100)),
        pad_vocab=draw(st.booleans()) if pad_vocab else False,
    )
    return HFModelSpec(model_name(values), "drawn by harness.orchestration.explore", **values)


def _fits(triple: Triple, max_world: int) -> bool:
    """Topology.validate's verdict on both topologies (a guard: `triples` builds only valid ones)."""
    model, src, dst = triple
    try:
        src.validate(model, available_ranks=max_world)
        dst.validate(model, available_ranks=max_world)
    except TopologyError:
        return False
    return True


@st.composite
def _raw_triples(draw: st.DrawFn, max_world: int, kind: str, hf_pad_vocab: bool = True) -> Triple:
    # hf: no CP (hf-roundtrip's Megatron forward has no CP path, and no matrix names one)
    topos = [t for t in all_topologies(max_world) if SEQ_LENGTH % (2 * t.cp) == 0 and (kind == "gpt" or t.cp == 1)]
    src = draw(st.sampled_from(topos))
    dst = draw(st.sampled_from([t for t in topos if t != src]))
    tp, pp = math.lcm(src.tp, dst.tp), math.lcm(src.pp, dst.pp)
    model = draw(models(tp, pp) if kind == "gpt" else hf_models(tp, pp, hf_pad_vocab))
    return model, src, dst


def triples(max_world: int = 4, kind: str = "gpt", hf_pad_vocab: bool = True) -> st.SearchStrategy[Triple]:
    """Two different topologies of <= `max_world` ranks (drawn first from a fixed list, smallest world
    first, so they shrink independently of the model), then a model both hold (`kind` "gpt": a
    megatron-core GPT for reshard-weights; "hf": an HF fixture for hf-roundtrip through
    Megatron-Bridge), filtered through Topology.validate."""
    return _raw_triples(max_world, kind, hf_pad_vocab).filter(lambda t: _fits(t, max_world))


# --------------------------------------------------------------------------- running one triple


#: Each world's limit in one example (the smallest worlds run in seconds; a hang must not eat the budget).
EXAMPLE_TIMEOUT_S = 240.0


def run_triple(model: AnyModel, src: Topology, dst: Topology, workdir: Path, options: RunOptions | None = None):
    """One run of the triple (reshard-weights for a GPT model, hf-roundtrip for an HF fixture),
    through the runner's case envelope (scratch dir under `workdir`, timing, the error text with its
    traceback and the API-not-available line): a CaseResult with status passed, failed or error.
    `options`: launcher, hooks and timeout (default: EXAMPLE_TIMEOUT_S per world)."""
    from harness.backends import resolve
    from harness.core.result import CaseResult

    options = replace(options or RunOptions(timeout_s=EXAMPLE_TIMEOUT_S), workdir=workdir)
    case, backend, _ = CASE_OF[model.kind]
    result = CaseResult(f"explore[{model.name}-{src.id}->{dst.id}]", case, model.name, backend, src.id, dst.id)
    with case_envelope(result, options) as env:
        if isinstance(model, HFModelSpec):
            from harness.cases.hf_roundtrip import DdpKnobs, run_roundtrip

            run_roundtrip(model, src, dst, resolve(backend), DdpKnobs(), env, result)
        else:
            from harness.cases.reshard_weights import run_weights

            run_weights(model, src, dst, resolve(backend), "fp32", env, result)
        if not result.checks:  # a run that judged nothing must not count as a pass
            result.error = "no check was recorded"
            result.status = "error"
    return result


def zoo_entry(model: AnyModel) -> str:
    """The ModelSpec/HFModelSpec line to add to harness/core/zoo.py's ZOO: the fields that differ from
    their defaults (and every required one)."""
    args = [f'"{model.name}"', '"found by ckpt-harness explore"']
    for f in fields(type(model)):
        if f.name in ("name", "description"):
            continue
        value = getattr(model, f.name)
        if f.default is MISSING or value != f.default:
            args.append(f"{f.name}={value!r}")
    return f"{type(model).__name__}({', '.join(args)}),"


def matrix_entry(model: AnyModel, src: Topology, dst: Topology) -> str:
    """The matrices/*.yaml entry that reproduces the triple once `zoo_entry(model)` is in the zoo."""
    case, backend, marker = CASE_OF[model.kind]
    markers = f"\n    markers: [{marker}]" if marker else ""
    return (f"  - case: {case}\n    models: [{model.name}]\n    backends: [{backend}]{markers}\n"
            f"    pairs: [\"{src.id} -> {dst.id}\"]")


# --------------------------------------------------------------------------- the search


class BudgetSpent(BaseException):
    """Raised inside an example when the wall-time budget is used up. A BaseException, so hypothesis
    does not take it for a failure to shrink: it ends the run."""


@dataclass
class Example:
    model: dict[str, Any]
    source: str
    target: str
    status: str
    seconds: float
    failure: str = ""
    checks: list[str] = field(default_factory=list)  # name:status of each check recorded
    options: dict[str, Any] = field(default_factory=dict)  # kind lora: the layout (peft-export's options)
    excused: str = ""  # kind lora: the known upstream defects that explain a failure (then status "xfailed")


@dataclass
class ExploreReport:
    """What a run of `explore` did: every example it ran, and the smallest failing triple."""

    seed: int | None
    max_world: int
    budget_s: float
    wall_s: float = 0.0
    stopped_by: str = ""  # "budget" | "max_examples" | "failure"
    examples: list[Example] = field(default_factory=list)
    minimal: Example | None = None
    zoo_entry: str = ""
    matrix_entry: str = ""

    @property
    def failures(self) -> list[Example]:
        return [e for e in self.examples if e.status not in ("passed", "xfailed")]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "failures": len(self.failures), "ran": len(self.examples)}


def explore(
    budget_s: float = 60.0,
    seed: int | None = None,
    max_world: int = 4,
    report_dir: Path | None = None,
    max_examples: int = 100_000,
    derandomize: bool = False,
    shrink_budget_s: float | None = None,
    on_example: Any = None,
    kind: str = "gpt",
    hf_pad_vocab: bool = True,
    lora_known_defects: bool = False,
) -> ExploreReport:
    """Draw triples until `budget_s` of wall time is used (or `max_examples` ran), shrink a failure.

    The budget is checked before each example, so one already running finishes (a run may overrun
    by one example, ~10-30 s on 2 cores). Once a failure is seen, shrinking may use
    `shrink_budget_s` more (default: another `budget_s`); the last failing example hypothesis ran is
    the smallest it reached. Without `seed` the example database REPORT/hypothesis replays known
    failures first and keeps new ones; `seed` (or `derandomize`, which means seed 0) fixes
    hypothesis' random stream so a run draws the same triples again, and then, by hypothesis' own
    rule for @seed, the database is neither read nor written (explore.json still records it all)."""
    from harness.run.preload import warm

    warm(bridge=kind in ("hf", "lora"))  # megatron-core (and the Bridge) imported once here, so each forked rank starts in ~1 s, not ~6 s
    report_dir = Path(report_dir or tempfile.mkdtemp(prefix="ckpt-explore-"))
    report_dir.mkdir(parents=True, exist_ok=True)
    workdir = report_dir / "scratch"
    workdir.mkdir(exist_ok=True)
    report = ExploreReport(seed, max_world, budget_s)
    start = time.perf_counter()
    shrink_until: list[float] = []
    last_failure: list[tuple[Triple, Example]] = []

    @settings(
        database=DirectoryBasedExampleDatabase(str(report_dir / "hypothesis")),
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink),
        print_blob=False,
        verbosity=Verbosity.quiet,  # explore prints its own report (hypothesis would call a spent budget a failure)
        report_multiple_bugs=False,
    )
    @given(lora_draws(max_world, lora_known_defects) if kind == "lora" else triples(max_world, kind, hf_pad_vocab))
    def prop(triple: Triple) -> None:
        now = time.perf_counter() - start
        if not shrink_until and now >= budget_s:
            raise BudgetSpent()
        if shrink_until and now >= shrink_until[0]:
            raise BudgetSpent()
        model, src, dst, *layout = triple
        if layout:
            result = run_draw(model, src, dst, layout[0], workdir, EXAMPLE_TIMEOUT_S)
        else:
            result = run_triple(model, src, dst, workdir)
        why = excused(triple, result) if layout and result.status != "passed" and not lora_known_defects else ""
        status = "xfailed" if why else result.status
        ex = Example({f.name: getattr(model, f.name) for f in fields(type(model))}, src.id, dst.id, status,
                     result.phases.get("total", 0.0), "" if result.status == "passed" else result.failure_text(),
                     [f"{c.name}:{c.status}" for c in result.checks], layout_options(layout[0]) if layout else {}, why)
        report.examples.append(ex)
        if on_example is not None:
            on_example(len(report.examples), ex)
        if status not in ("passed", "xfailed"):
            if not shrink_until:
                shrink_until.append(now + (budget_s if shrink_budget_s is None else shrink_budget_s))
            last_failure[:] = [(triple, ex)]
            raise AssertionError(ex.failure)

    if seed is None and derandomize:
        seed = 0  # hypothesis' own derandomize=True forbids a database; a fixed seed keeps it
    if seed is not None:
        prop = hypothesis_seed(seed)(prop)
    try:
        prop()
        report.stopped_by = "max_examples"
    except BudgetSpent:
        report.stopped_by = "budget"
    except AssertionError:
        report.stopped_by = "failure"
    report.wall_s = round(time.perf_counter() - start, 1)
    if last_failure:
        (model, src, dst, *layout), ex = last_failure[0]
        entry = lora_entry(model, src, dst, layout[0]) if layout else matrix_entry(model, src, dst)
        report.minimal, report.zoo_entry, report.matrix_entry = ex, zoo_entry(model), entry
    shutil.rmtree(workdir, ignore_errors=True)
    (report_dir / "explore.json").write_text(json.dumps(report.to_dict(), indent=2, default=str))
    return report
