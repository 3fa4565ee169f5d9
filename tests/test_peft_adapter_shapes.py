"""peft-adapter-io's shape variants (cases/shared/peft_shapes.py): an adapter saved from ungathered
ZeRO-3 / FSDP shards, and a load with ignore_mismatched_sizes. The judges on planted faults and empty
input, the ungathering itself, and whole cases that go red (tests/doubles_peft_shapes.py)."""

import torch
from doubles import use_doubles

from cases.shared import peft_shapes as shapes
from cases.ranks.peft_adapter_io import ungather
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.orchestration.runner import run_case

_doubles = use_doubles(
    test_peft_no_shape_check="doubles_peft_shapes:SavesWithoutShapeCheck",
    test_peft_bad_shapes_quietly="doubles_peft_shapes:LoadsBadShapesQuietly",
    test_peft_mismatched_corner="doubles_peft_shapes:LoadsMismatchedCorner",
)

P = "base_model.model.model.layers.{}.self_attn.q_proj.lora_{}.default.weight"
BAD = {P.format(i, ab): (0,) for i in range(3) for ab in "AB"}  # six tensors saved empty


def _warning(bad, count=None, more=None, shown=3):
    entries = ", ".join(f"{shapes.file_key(n, 'default')}:{s}" for n, s in list(bad.items())[:shown])
    n = len(bad) if count is None else count
    more = max(0, n - 3) if more is None else more
    return (f"PeftWarning: Adapter 'default': {n} LoRA tensor(s) have invalid shape: {entries}"
            + (f" (+{more} more)" if more else "") + ". A 1-D or zero-sized lora_A / lora_B tensor indicates ...")


def test_invalid_warning_passes_peft_s_warning_and_fails_on_empty_input():
    assert shapes.invalid_warning_check([_warning(BAD)], BAD, "default").status == "passed"
    assert shapes.invalid_warning_check([], {}, "default").status == "failed"
    assert shapes.invalid_warning_check([], BAD, "default").status == "failed"
    assert shapes.invalid_warning_check([_warning(BAD).replace("PeftWarning", "UserWarning")], BAD, "default").status == "failed"


def test_invalid_warning_fails_a_wrong_count_name_shape_or_suffix():
    assert "says 5 invalid" in shapes.invalid_warning_check([_warning(BAD, count=5)], BAD, "default").detail
    assert "(+3 more)" in shapes.invalid_warning_check([_warning(BAD, more=0)], BAD, "default").detail
    other = {P.format(7, "A"): (0,), **dict(list(BAD.items())[1:])}
    assert "not one of the ungathered" in shapes.invalid_warning_check([_warning(other)], BAD, "default").detail
    flat = {n: (96,) for n in BAD}
    assert "it was saved as (0,)" in shapes.invalid_warning_check([_warning(flat)], BAD, "default").detail
    assert "names 2 distinct" in shapes.invalid_warning_check([_warning(BAD, shown=2)], BAD, "default").detail
    assert shapes.invalid_warning_check([_warning(BAD)] * 2, BAD, "default").status == "failed"


def test_a_refusal_that_does_not_name_the_broken_tensors_fails():
    from harness.judge.checks import refusal_check

    msg = "Error(s) in loading state_dict: " + " ".join(f"size mismatch for {n}" for n in BAD)
    assert shapes.names_check(refusal_check("RuntimeError", msg, ("RuntimeError",), "x"), msg, BAD).status == "passed"
    vague = refusal_check("RuntimeError", "load failed", ("RuntimeError",), "x")
    assert shapes.names_check(vague, "load failed", BAD).status == "failed"
    assert shapes.names_check(refusal_check(None, "", ("RuntimeError",), "x"), "", BAD).status == "failed"


def _lora_model():
    m = torch.nn.Module()
    for name in ("q", "v"):
        sub = torch.nn.Module()
        sub.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(5, 2, bias=False)})
        sub.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(2, 3, bias=False)})
        setattr(m, name, sub)
    return m


def test_ungather_leaves_what_a_zero3_or_fsdp_rank_holds():
    m = _lora_model()
    assert set(ungather(m, ("default",), "zero3").values()) == {(0,)}
    assert all(t.numel() == 0 for t in m.parameters())
    m = _lora_model()
    flat = torch.cat([t.detach().reshape(-1) for t in m.parameters()])  # 32 values, rank 0 holds the first 16
    got = ungather(m, ("default",), "fsdp")
    assert list(got.values()) == [(10,), (6,), (0,), (0,)]
    assert torch.equal(torch.cat([t.detach() for t in m.parameters()]), flat[:16])
    assert ungather(torch.nn.Linear(2, 2), ("default",), "zero3") == {}


def _every(**shapes_):
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(*s, generator=g) for n, s in shapes_.items()}


def test_mismatched_are_the_resized_tensors_the_file_holds():
    saved = _every(a=(4, 160), b=(64, 4), lm=(160, 64))
    loaded = {"a": torch.zeros(4, 128), "b": torch.zeros(64, 4), "lm": torch.zeros(128, 64)}
    file = {"x.a": saved["a"].clone(), "x.b": saved["b"].clone()}  # lm_head not in the file
    assert shapes.mismatched(saved, loaded, file) == {"a": ((4, 160), (4, 128))}
    assert shapes.mismatched({}, {}, {}) == {}


def test_fresh_check_fails_a_tensor_that_was_loaded_into_or_is_absent():
    want = {"a": ((4, 160), (4, 128))}
    fresh = {"a": torch.zeros(4, 128)}
    assert shapes.fresh_check(want, {"a": torch.zeros(4, 128)}, fresh).status == "passed"
    assert shapes.fresh_check({}, {}, {}).status == "failed"
    assert shapes.fresh_check(want, {"a": torch.ones(4, 128)}, fresh).status == "failed"
    assert "not in the loaded model" in shapes.fresh_check(want, {}, fresh).detail


def _listing(items):
    body = "\n".join(f"- {k}: found shape torch.Size([{', '.join(map(str, a))}]) in the checkpoint and "
                     f"torch.Size([{', '.join(map(str, b))}]) in the model instantiated" for k, (a, b) in items.items())
    return f"UserWarning: Some weights of PeftModel were not initialized ... `ignore_mismatched_sizes=True`: {body}."


def test_mismatch_warning_wants_exactly_the_mismatched_keys_with_their_shapes():
    e = "base_model.model.model.embed_tokens.lora_embedding_A.default"
    w = "base_model.model.model.embed_tokens.base_layer.weight"
    want = {e: ((4, 160), (4, 128)), w: ((160, 64), (128, 64))}
    missing = f"UserWarning: Found missing adapter keys while loading the checkpoint: ['{e}']."
    assert shapes.mismatch_warning_check([_listing(want), missing], want).status == "passed"
    assert shapes.mismatch_warning_check([], {}).status == "failed"
    assert shapes.mismatch_warning_check([missing], want).status == "failed"
    assert "mismatched, not listed" in shapes.mismatch_warning_check([_listing({e: want[e]})], want).detail
    extra = {**want, P.format(0, "A"): ((4, 64), (4, 32))}
    assert "listed, not mismatched" in shapes.mismatch_warning_check([_listing(extra)], want).detail
    assert "listed as" in shapes.mismatch_warning_check([_listing({**want, e: ((4, 128), (4, 160))})], want).detail
    other = f"UserWarning: Found missing adapter keys while loading the checkpoint: ['{P.format(0, 'A')}']."
    assert "another warning names" in shapes.mismatch_warning_check([_listing(want), other], want).detail


def _spec(backend, expect="pass", backend_options=(), **opts):
    one = Topology.parse("tp1")
    return CaseSpec("peft-adapter-io", "hf-llama", backend, one, one, options=tuple(sorted(opts.items())), timeout_s=120,
                    expect=expect, backend_options=backend_options)


def _checks(r):
    return {c.name: c.status for c in r.checks}


def test_an_ungathered_save_without_the_warning_fails_invalid_warning_alone():
    r = run_case(_spec("test_peft_no_shape_check", expect="refuse", save_from="zero3"))
    assert r.status == "failed"
    assert _checks(r) | {"source-unchanged": "passed"} == {"invalid-warning": "failed", "refusal": "passed", "adapter-effect": "passed",
                                                            "adapter-config@default": "passed", "source-unchanged": "passed"}


def test_an_ungathered_adapter_that_loads_quietly_fails_the_refusal():
    r = run_case(_spec("test_peft_bad_shapes_quietly", expect="refuse", save_from="fsdp"))
    assert _checks(r)["refusal"] == "failed" and _checks(r)["invalid-warning"] == "passed"
    assert "expected to refuse but completed" in r.check("refusal").detail


MISMATCH = dict(targets=("q_proj", "v_proj", "embed_tokens"), resize_vocab=160, load_base="unresized")
IGNORE = (("ignore_mismatched_sizes", True),)


def test_a_mismatched_load_without_its_warning_fails_mismatch_warning():
    r = run_case(_spec("test_peft_bad_shapes_quietly", backend_options=IGNORE, **MISMATCH))
    c = _checks(r)
    assert c["mismatch-warning"] == "failed" and c["mismatch-fresh"] == "passed" and c["adapter-load@default"] == "passed"


def test_a_mismatched_tensor_loaded_by_slicing_fails_mismatch_fresh():
    r = run_case(_spec("test_peft_mismatched_corner", backend_options=IGNORE, **MISMATCH))
    c = _checks(r)
    assert c["mismatch-fresh"] == "failed" and c["adapter-load@default"] == "passed" and c["mismatch-warning"] == "passed"
    assert "lora_embedding_A" in r.check("mismatch-fresh").detail


def test_load_base_unresized_is_refused_without_ignore_mismatched_sizes():
    r = run_case(_spec("hf_peft", **MISMATCH))
    assert r.status == "error" and "ignore_mismatched_sizes" in r.error


def test_a_targeted_embedding_alone_is_saved_when_the_vocabulary_was_resized_too():
    from cases import peft_adapter_io as pio

    plain = {"model.embed_tokens.weight": torch.zeros(1), "lm_head.weight": torch.ones(1)}
    opts = pio.Options(targets=("q_proj", "embed_tokens"), resize_vocab=160)
    assert set(pio.expected_extras(opts, plain)) == {"model.embed_tokens.weight"}
