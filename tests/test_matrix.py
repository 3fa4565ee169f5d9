import textwrap
from pathlib import Path

import pytest

from harness.backends import ref_of
from harness.core.topology import Topology
from harness.orchestration.matrix import MatrixError, load_matrix

ROOT = Path(__file__).resolve().parents[1]


def _write(tmp_path, body: str) -> Path:
    p = tmp_path / "m.yaml"
    p.write_text(textwrap.dedent(body))
    return p


GOOD = """
name: t
entries:
  - case: reshard-weights
    models: [gpt-gqa]
    pairs: ["tp1 -> tp2", {source: pp2, target: tp2}]
    cross: {sources: [dp2], targets: [tp1, pp2]}
"""


def test_pairs_and_cross_product_expand(tmp_path):
    m = load_matrix(_write(tmp_path, GOOD))
    ids = [c.id for c in m.cases]
    assert ids == [
        "reshard-weights[mcore_dist-gpt-gqa-tp1pp1dp1cp1->tp2pp1dp1cp1]",
        "reshard-weights[mcore_dist-gpt-gqa-tp1pp2dp1cp1->tp2pp1dp1cp1]",
        "reshard-weights[mcore_dist-gpt-gqa-tp1pp1dp2cp1->tp1pp1dp1cp1]",
        "reshard-weights[mcore_dist-gpt-gqa-tp1pp1dp2cp1->tp1pp2dp1cp1]",
    ]
    assert m.select("pp2 ->tp2") == [m.cases[1]]


@pytest.mark.parametrize(
    "body, message",
    [
        ("entries: []", "'entries' must be a non-empty list"),
        ("bogus: 1\nentries: [{case: reshard-weights}]", "unknown top-level key(s) ['bogus']"),
        ("entries: [{models: [gpt-gqa], pairs: ['tp1 -> tp2']}]", "entries[0]: missing required key 'case'"),
        ("entries: [{case: nope, models: [gpt-gqa], pairs: ['tp1 -> tp2']}]", "entries[0].case: unknown case 'nope'"),
        ("entries: [{case: reshard-weights, models: [gpt-zzz], pairs: ['tp1 -> tp2']}]", "entries[0].models: unknown model 'gpt-zzz'"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], backends: [zarr], pairs: ['tp1 -> tp2']}]", "unknown backend 'zarr'"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 tp2']}]", "entries[0].pairs[0]: pair 'tp1 tp2' must look like"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tq2']}]", "entries[0].pairs[0]: cannot parse topology 'tq2'"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> pp3']}]", "topology tp1pp3dp1cp1 cannot hold model 'gpt-gqa'"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa]}]", "no topology pairs"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2'], typo: 1}]", "unknown key(s) ['typo']"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2'], markers: [fast]}]", "unknown marker(s) ['fast']"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2'], expect: maybe}]", "must be 'pass' or 'refuse'"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2'], options: {x: 1}}]", "takes dtype, layer_spec; unknown option(s) ['x']"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2'], axes: {dtype: [fp16]}}]", "option 'dtype': expected one of 'fp32', 'bf16', got 'fp16'"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2', 'tp1 -> tp2']}]", "already defined by"),
        ("defaults: {max_world_size: 2}\nentries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp4']}]", "exceeds the 2 ranks"),
        ("entries: [{case: reshard-weights\n", "not valid YAML"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2'], memory_budgets: [{rank: 0}]}]", "memory_budgets[0]: a memory budget is"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2'], memory_budgets: [{phase: save}]}]", "sets no limit"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2'], xfail: {reason: r, checks: step}}]", "entries[0].xfail.checks: expected a list"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2'], xfail: {reason: r, match: '('}}]", "entries[0].xfail.match: bad regex"),
        # values of the wrong type: a MatrixError naming the key, never a traceback
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2'], xfail: {reason: r, match: 5}}]",
         "entries[0].xfail.match: expected a regex string, got 5"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2'], timeout_s: abc}]",
         "entries[0].timeout_s: expected a positive number, got 'abc'"),
        ("defaults: {timeout_s: -3}\nentries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2']}]",
         "defaults.timeout_s: expected a positive number"),
        ("defaults: [1, 2]\nentries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2']}]", "defaults: expected a mapping"),
        ("defaults: {max_world_size: two}\nentries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2']}]",
         "defaults.max_world_size: expected a positive integer"),
        ("entries: [{case: reshard-weights, models: [3], pairs: ['tp1 -> tp2']}]", "entries[0].models: expected names"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2'], tag: [a]}]", "entries[0].tag: expected a string"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2'], memory_budgets: [{phase: save, max_peak_delta_mib: lots}]}]",
         "a limit must be a number"),
        # the case contract: what a case accepts is checked before anything runs
        ("entries: [{case: reshard-weights, models: [gpt-gqa], pairs: ['tp1 -> tp2'], expect: refuse}]",
         "case reshard-weights cannot be expected to refuse"),
        ("entries: [{case: resume, models: [gpt-gqa], pairs: ['tp1 -> tp2'], expect: refuse}]", "case resume cannot be expected to refuse"),
        ("entries: [{case: reshard-weights, models: [gpt-gqa], backends: [bridge_hf], pairs: ['tp1 -> tp2']}]",
         "case reshard-weights needs a backend that can weights; backend 'bridge_hf' can"),
        ("entries: [{case: reshard-optimizer, models: [gpt-gqa], backends: [bridge_peft], pairs: ['dp2 -> dp1']}]",
         "needs a backend that can training_state"),
        ("entries: [{case: hf-roundtrip, models: [hf-llama], backends: [mcore_dist], pairs: ['tp2 -> tp2']}]",
         "needs a backend that can hf_export"),
        ("entries: [{case: hf-roundtrip, models: [gpt-gqa], backends: [bridge_hf], pairs: ['tp2 -> tp2']}]", "takes an HF fixture model"),
        ("entries: [{case: reshard-weights, models: [hf-llama], pairs: ['tp1 -> tp2']}]", "takes a GPT zoo model"),
        ("entries: [{case: reshard-optimizer, models: [gpt-gqa], pairs: ['dp2 -> dp1'], options: {shardng: dp_reshardable}}]",
         "unknown option(s) ['shardng']"),
        ("entries: [{case: reshard-optimizer, models: [gpt-gqa], pairs: ['dp2 -> dp1'], options: {sharding: fully}}]",
         "option 'sharding': expected one of 'dp_reshardable', 'fully_reshardable', 'fully_sharded_model_space', 'dp_zero_gather_scatter', got 'fully'"),
        ("entries: [{case: reshard-optimizer, models: [gpt-gqa], pairs: ['dp2 -> dp1'], options: {steps: two}}]",
         "option 'steps': expected int, got 'two'"),
        ("entries: [{case: reshard-optimizer, models: [gpt-gqa], pairs: ['dp2 -> dp1'], options: {use_distributed_optimizer: 1}}]",
         "option 'use_distributed_optimizer': expected bool, got 1"),
        ("entries: [{case: reshard-optimizer, models: [gpt-gqa], pairs: ['dp2 -> dp1'], options: {workarounds: [prime]}}]",
         "unknown workaround(s) ['prime']"),
        ("entries: [{case: resume, models: [gpt-gqa], pairs: ['dp2 -> dp1'], options: {bucket_size: 4000}}]",
         "'bucket_size' takes effect only with overlap_grad_reduce: true"),
        ("entries: [{case: resume, models: [gpt-gqa], pairs: ['dp2 -> dp1'], options: {refuse_with: [KeyError]}}]",
         "unknown option(s) ['refuse_with']"),
        ("entries: [{case: reshard-optimizer, models: [gpt-gqa], pairs: ['dp2 -> dp1'], options: {refuse_with: [KeyError]}}]",
         "'refuse_with' only means something with expect: refuse"),
        ("entries: [{case: peft-export, models: [hf-llama], backends: [bridge_peft], pairs: ['tp1 -> tp1'], options: {adapter: ia3}}]",
         "option 'adapter': expected one of 'lora', 'canonical_lora', 'dora'"),
        ("entries: [{case: reshard-optimizer, models: [gpt-gqa], pairs: ['dp2 -> dp1'], xfail: {reason: r, checks: [stepp]}}]",
         "xfail.checks names ['stepp'], which case reshard-optimizer never records"),
        ("entries: [{case: reshard-optimizer, models: [gpt-gqa], pairs: ['dp2 -> dp1'], xfail: {reason: r, checks: ['memory-budget:save@rank0']}}]",
         "never records"),
    ],
)
def test_bad_matrices_name_file_entry_and_key(tmp_path, body, message):
    path = _write(tmp_path, body)
    with pytest.raises(MatrixError) as exc:
        load_matrix(path)
    assert message in str(exc.value)
    assert str(path) in str(exc.value)


def test_missing_file(tmp_path):
    with pytest.raises(MatrixError, match="no such matrix file"):
        load_matrix(tmp_path / "absent.yaml")


def test_smoke_matrix_covers_every_kind_of_change():
    m = load_matrix(ROOT / "matrices" / "smoke.yaml")
    pairs = {(c.source, c.target) for c in m.cases if c.case == "reshard-weights"}
    assert len(pairs) >= 12
    assert all(t.world_size <= 4 for p in pairs for t in p)

    def some(pred):
        return any(pred(s, d) for s, d in pairs)

    assert some(lambda s, d: d.tp > s.tp) and some(lambda s, d: d.tp < s.tp)
    assert some(lambda s, d: d.pp > s.pp) and some(lambda s, d: d.pp < s.pp)
    assert some(lambda s, d: d.dp != s.dp) and some(lambda s, d: d.cp != s.cp)
    assert some(lambda s, d: sum(getattr(s, k) != getattr(d, k) for k in ("tp", "pp", "dp", "cp")) >= 2)
    assert some(lambda s, d: (s.world_size, d.world_size) == (1, 4))
    assert some(lambda s, d: (s.world_size, d.world_size) == (4, 1))
    assert {c.model for c in m.cases} >= {"gpt-gqa", "gpt-tied"}
    assert Topology.parse("tp1") in {s for s, _ in pairs}


def test_budget_checks_may_be_named_by_an_xfail_when_the_entry_sets_the_budget(tmp_path):
    path = _write(tmp_path, "entries: [{case: reshard-optimizer, models: [gpt-gqa], pairs: ['dp2 -> dp1'], "
                            "memory_budgets: [{phase: save, max_peak_delta_mib: 1}], xfail: {reason: r, checks: ['memory-budget:save@rank0']}}]")
    (spec,) = load_matrix(path).cases
    assert spec.xfail.checks == ("memory-budget:save@rank0",)


def test_typed_options_are_coerced_from_yaml(tmp_path):
    from harness.cases import get_case

    path = _write(tmp_path, "entries: [{case: reshard-optimizer, models: [gpt-gqa], pairs: ['dp2 -> dp1'], "
                            "options: {lr: 1e-3, workarounds: [prime_adam]}}]")
    (spec,) = load_matrix(path).cases
    opts = get_case("reshard-optimizer").validate(spec)
    assert opts.lr == 0.001 and opts.workarounds == ("prime_adam",) and opts.steps == 2 and opts.sharding == "dp_reshardable"
    assert opts.config.lr == 0.001 and opts.config.use_distributed_optimizer is True


def test_every_case_declares_its_contract():
    from harness.cases import all_cases
    from harness.backends import CAPABILITIES

    for case in all_cases().values():
        assert case.checks and case.needs and case.needs <= CAPABILITIES, case.name
        kinds = (case.model_kind,) if isinstance(case.model_kind, str) else case.model_kind
        assert kinds and set(kinds) <= {"gpt", "hf"}, case.name
    assert [c.name for c in all_cases().values() if c.refusable] == ["finetune", "hf-roundtrip", "peft-adapter-io", "reshard-optimizer",
                                                                                "verl-checkpoint", "verl-merger"]



@pytest.fixture
def tagged_backend():
    from harness.backends import register, unregister

    register("tagged_dist", "doubles:TaggedDist")
    yield
    unregister("tagged_dist")


def test_backend_options_are_typed_varied_by_axes_and_travel_in_the_ref(tmp_path, tagged_backend):
    from harness.backends import get_backend

    path = _write(tmp_path, "entries: [{case: reshard-weights, models: [gpt-gqa], backends: [tagged_dist], pairs: ['tp1 -> tp2'], "
                            "backend_options: {copies: 2}, axes: {backend.tag: [a, b]}}]")
    specs = load_matrix(path).cases
    assert [s.id for s in specs] == ["reshard-weights[tagged_dist-gpt-gqa-tp1pp1dp1cp1->tp2pp1dp1cp1-a]",
                                     "reshard-weights[tagged_dist-gpt-gqa-tp1pp1dp1cp1->tp2pp1dp1cp1-b]"]
    backend = get_backend(ref_of(specs[1]))
    assert (backend.options.tag, backend.options.copies) == ("b", 2)
    assert get_backend("tagged_dist").options.tag == "plain"  # the registered instance is not mutated


@pytest.mark.parametrize("extra, message", [
    ("backend_options: {copies: two}", "option 'copies': expected int"),
    ("backend_options: {nope: 1}", "backend tagged_dist takes tag, copies; unknown option"),
    ("axes: {backend.nope: [1]}", "unknown option"),
])
def test_bad_backend_options_name_the_entry_and_option(tmp_path, tagged_backend, extra, message):
    path = _write(tmp_path, "entries: [{case: reshard-weights, models: [gpt-gqa], backends: [tagged_dist], pairs: ['tp1 -> tp2'], "
                            + extra + "}]")
    with pytest.raises(MatrixError, match=message) as exc:
        load_matrix(path)
    assert "entries[0]" in str(exc.value)


def test_a_backend_without_options_refuses_any(tmp_path):
    path = _write(tmp_path, "entries: [{case: peft-export, models: [hf-llama], backends: [bridge_peft], pairs: ['tp1 -> tp2'], "
                            "backend_options: {x: 1}}]")
    with pytest.raises(MatrixError, match="backend bridge_peft takes no options"):
        load_matrix(path)


_XF = "entries: [{case: reshard-optimizer, models: [gpt-gqa], pairs: ['dp2 -> dp1'], tag: defect-x, xfail: %s}]"


@pytest.mark.parametrize("xfail, message", [
    ("{reason: r, match: AssertionError}", "must say where the defect raises: add `raised_in"),
    ("{reason: r, match: 'KeyError', raised_in: harness.backends.mcore_dist}", "is the harness's own code"),
    ("{reason: r, match: 'KeyError', raised_in: 'megatron core'}", "expected a dotted module prefix"),
    # generic torch code, where a harness error surfaces too: name the bumped project's module that called it
    ("{reason: r, match: 'KeyError', raised_in: torch.nn}", "raised_in: 'torch.nn' is torch, generic code"),
    ("{reason: r, match: 'KeyError', raised_in: torch}", "raised_in: 'torch' is torch, generic code"),
    ("{reason: r, match: 'KeyError', raised_in: torch.distributed.checkpoint.default_planner}", "name the module of the bumped"),
    ("{reason: r, checks: [step], raised_in: megatron.core}", "a checks-based xfail never accepts an error"),
    ("{reason: r, match: 'x', checks: [step], raised_in: megatron.core}", "a checks-based xfail never accepts an error"),
])
def test_an_xfail_that_accepts_an_error_must_name_the_upstream_module(tmp_path, xfail, message):
    """An exception class alone accepts a harness bug of that class: the entry must say where the defect raises."""
    path = _write(tmp_path, _XF % xfail)
    with pytest.raises(MatrixError) as exc:
        load_matrix(path)
    assert message in str(exc.value) and str(path) in str(exc.value)
    assert "entries[0].xfail (case reshard-optimizer, tag defect-x)" in str(exc.value)


def test_raised_in_is_read_into_the_xfail(tmp_path):
    m = load_matrix(_write(tmp_path, _XF % "{reason: r, match: \"KeyError: 'step'\", raised_in: megatron.core.optimizer}"))
    assert {c.xfail.raised_in for c in m.cases} == {"megatron.core.optimizer"} and m.cases[0].xfail.accepts_errors


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "matrices").glob("*.yaml") if p.name != "tiers.yaml"))
def test_every_shipped_xfail_that_accepts_an_error_names_its_upstream_module(name):
    """Every matrix the project ships loads under the rule (the loader refuses it otherwise)."""
    m = load_matrix(ROOT / "matrices" / name)
    accepting = [c for c in m.cases if c.xfail and c.xfail.accepts_errors]
    assert all(c.xfail.raised_in and not c.xfail.raised_in.startswith(("harness", "cases")) for c in accepting)


# ----------------------------------------------------------------------------- include


def _files(tmp_path, **bodies) -> dict[str, Path]:
    out = {}
    for name, body in bodies.items():
        out[name] = tmp_path / f"{name}.yaml"
        out[name].write_text(textwrap.dedent(body))
    return out


A = """
name: a
entries:
  - case: reshard-weights
    models: [gpt-gqa]
    pairs: ["tp1 -> tp2", "tp1 -> pp2"]
"""
B = """
name: b
defaults: {markers: [arch], timeout_s: 600}
entries:
  - case: reshard-weights
    models: [gpt-gqa]
    pairs: ["tp1 -> tp2", "tp2 -> tp1"]
"""


def test_include_takes_every_case_once_and_pytest_collects_only_own_entries(tmp_path):
    f = _files(tmp_path, a=A, b=B, both="name: both\ninclude: [a.yaml, b.yaml]\n")
    m = load_matrix(f["both"])
    ids = [c.id for c in m.cases]
    assert len(ids) == 3 == len(set(ids)), ids  # tp1 -> tp2 is in both files, with other markers: once
    assert m.included == [f["a"], f["b"]] and m.own() == []
    assert [c.id for c in load_matrix(f["a"]).own()] == ids[:2]


def test_include_refuses_a_case_that_differs_between_files_and_a_cycle(tmp_path):
    f = _files(tmp_path, a=A, c=B.replace('pairs: ["tp1 -> tp2", "tp2 -> tp1"]', 'pairs: ["tp1 -> tp2"]\n    xfail: {reason: "r", checks: [logits]}'),
               both="name: both\ninclude: [a.yaml, c.yaml]\n", loop="name: loop\ninclude: [loop.yaml]\n")
    with pytest.raises(MatrixError, match=r"reshard-weights\[mcore_dist-gpt-gqa-tp1pp1dp1cp1->tp2pp1dp1cp1\] of .*c.yaml: entries\[0\] differs from its definition in .*a.yaml: entries\[0\]"):
        load_matrix(f["both"])
    with pytest.raises(MatrixError, match="includes itself"):
        load_matrix(f["loop"])
    with pytest.raises(MatrixError, match="no such matrix file"):
        load_matrix(_files(tmp_path, gone="name: g\ninclude: [nowhere.yaml]\n")["gone"])


def test_the_gate_matrix_is_smoke_architectures_faults_hidden_defects_verls_trees_and_peft_io():
    m = load_matrix(ROOT / "matrices" / "gate.yaml")
    ids = {c.id for c in m.cases}
    smoke = {c.id for c in load_matrix(ROOT / "matrices" / "smoke.yaml").cases}
    arch = {c.id for c in load_matrix(ROOT / "matrices" / "architectures.yaml").cases}
    shown = {c.id for f in ("extended.yaml", "verl.yaml") for c in load_matrix(ROOT / "matrices" / f).cases
             if c.tag.startswith(("defect-fsdp-", "verl-F", "verl-hf-moe", "verl-weight-sync", "verify-integrity",
                                                                  "deprecated-optimizer-formats", "torch-format", "transformers-resave",
                                                                  "verl-merger", "verl-lora-lifecycle", "mtp", "peft-io", "peft-tp-load", "defect-dora-magnitude",
                                                                  "shared-outer", "odd-alignment", "pruned-export", "load-main-params"))}
    faults = {c.id for c in load_matrix(ROOT / "matrices" / "faults.yaml").cases}
    assert smoke and arch and faults and smoke | arch | faults < ids <= smoke | arch | faults | shown and len(ids) == len(m.cases)
    assert sum(c.tag == "verify-integrity" for c in m.cases) == 5  # 2 good checkpoints, 3 damaged ones refused
    assert sum(c.tag == "torch-format" for c in m.cases) == 10  # Megatron-LM's --ckpt-format torch (mcore_torch)
    assert sum(c.tag == "transformers-resave" for c in m.cases) == 2  # Nemotron-H re-saved by transformers 5
    assert sum(c.tag == "verl-hf-moe" for c in m.cases) == 12  # four MoE families at EP2, PP2 and EP2 x PP2
    assert sum(c.tag == "verl-weight-sync" for c in m.cases) == 12
    assert sum(c.tag == "verl-merger" for c in m.cases) == 27  # verl's model_merger: 4 dense + MoE, 5 named defects, 1 refusal
    assert sum(c.tag == "verl-lora-lifecycle" for c in m.cases) == 6
    assert sum(c.tag == "shared-outer" for c in m.cases) == 4  # Bridge #6076: OLMoE and GLM-4.5, tp1 and ep2
    assert sum(c.tag == "odd-alignment" for c in m.cases) == 2  # the distributed optimizer's padded buckets
    assert sum(c.tag == "load-main-params" for c in m.cases) == 3  # load_main_params_from_ckpt: dp2, a TP change, into VPP
    assert sum(c.tag == "pruned-export" for c in m.cases) == 6  # from_auto_config exports: fp32 both ways, bf16 (a named xfail)
    assert sum(c.tag == "mtp" for c in m.cases) == 15  # DeepSeek-V3, GLM-4.5, Qwen3-Next: the owned layouts and the Hub's
    assert sum(c.tag == "peft-tp-load" for c in m.cases) == 1  # an adapter onto transformers' own TP (tp_plan="auto")
