"""main-params (harness.judge.main_params, the finetune case's bf16 check of a start without optimizer
state, e.g. Bridge's load_main_params_from_ckpt): it passes only on main params that are the saved
bf16 weights widened bitwise, and goes red on each planted fault a reload could leave: the
saving job's unrounded fp32 copy, two params' values swapped (a name map gone wrong), a main
param missing or extra, a bf16 "main" param, a gap in the assembled shards, and empty input."""

from __future__ import annotations

import pytest
import torch

from cases.finetune import main_check
from cases.ranks.train_phase import TrainOut
from harness.core.parity import Mismatch
from harness.judge.main_params import MAIN_PARAMS, MAIN_PREFIX, main_params_check

_g = torch.Generator().manual_seed(7)
FP32 = {k: torch.randn(shape, generator=_g) for k, shape in (("a.weight", (4, 3)), ("b.weight", (4, 3)), ("c.bias", (5,)))}
SAVED = {k: v.to(torch.bfloat16) for k, v in FP32.items()}  # what a bf16 job saves as its weights


def mains(**changed: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {MAIN_PREFIX + k: v.float() for k, v in SAVED.items()}
    out.update({MAIN_PREFIX + k: v for k, v in changed.items()})
    return out


def judge(m: dict[str, torch.Tensor], **kw):
    return main_params_check(SAVED, m, "dp2", "tp2", **kw)


def test_main_params_widened_from_the_saved_weights_pass_and_count_the_unread_fp32_copy():
    c = judge(mains(), saved_mains={MAIN_PREFIX + k: v for k, v in FP32.items()}, path=" (via state dict)")
    assert c.status == "passed" and c.name == MAIN_PARAMS
    assert "3 fp32 main params at tp2 equal the bf16 weights saved at dp2, bitwise (via state dict)" in c.detail
    assert f"differ in {sum(int((v != v.to(torch.bfloat16).float()).sum()) for v in FP32.values())} of 29 elements" in c.detail


@pytest.mark.parametrize("planted, kind", [
    # the saving job's own fp32 main param (not what the model section holds): off in the low bits
    (lambda: mains(**{"a.weight": FP32["a.weight"]}), "value"),
    # one element one fp32 ulp off
    (lambda: mains(**{"c.bias": torch.nextafter(SAVED["c.bias"].float(), torch.tensor(9.0))}), "value"),
    # two params of one shape swapped: a name-to-tensor map that paired them wrongly
    (lambda: mains(**{"a.weight": SAVED["b.weight"].float(), "b.weight": SAVED["a.weight"].float()}), "value"),
    # a "main" param that stayed bf16
    (lambda: mains(**{"a.weight": SAVED["a.weight"]}), "dtype"),
    # a param without its main param, and a main param of no saved weight
    (lambda: {k: v for k, v in mains().items() if not k.endswith("c.bias")}, "missing"),
    (lambda: mains(**{"d.weight": torch.zeros(2)}), "extra"),
])
def test_a_planted_wrong_main_param_fails_naming_it(planted, kind):
    c = judge(planted())
    assert c.status == "failed", c.detail
    assert kind in {m.kind for m in c.mismatches} and "are not the saved weights" in c.detail


def test_an_assembly_problem_fails_even_when_every_value_agrees():
    gap = Mismatch(MAIN_PREFIX + "a.weight", "coverage", "finetune@tp2", "finetune@tp2", None, "2 elements no rank holds")
    c = judge(mains(), problems=[gap])
    assert c.status == "failed" and "coverage" in c.detail


@pytest.mark.parametrize("saved, m, words", [
    ({}, {}, "no saved weights@dp2, main params@tp2"),
    (SAVED, {}, "no main params@tp2"),
    ({}, {MAIN_PREFIX + "a.weight": torch.zeros(4, 3)}, "no saved weights@dp2"),
])
def test_empty_input_fails_unless_the_caller_says_why(saved, m, words):
    c = main_params_check(saved, m, "dp2", "tp2")
    assert c.status == "failed" and "nothing to judge" in c.detail and words in c.detail
    assert main_params_check(saved, m, "dp2", "tp2", empty_ok="a frozen job").status == "passed"


def test_the_finetune_case_records_not_run_without_the_distributed_optimizers_view():
    out = TrainOut([], [], [])
    c = main_check("dp2", "tp2", [out], [out], "")
    assert c.status == "not-run" and "use_distributed_optimizer: false" in c.detail
