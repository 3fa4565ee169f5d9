"""Backend bridge_training (issue 19): Megatron-Bridge's own save_checkpoint / load_checkpoint over
the live job on CPU. Real runs for what Bridge restores, doubles that plant what a defective resume
would do (each check goes red), and the checks' reading of recorded events."""

from __future__ import annotations

from pathlib import Path

import pytest
from doubles import use_doubles

from harness.backends._bridge_state import state_check
from harness.backends.bridge_training import BridgeTrainingOptions
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.orchestration.runner import RunOptions, run_case

_doubles = use_doubles(
    test_bridge_scrambled_rng="doubles:BridgeTrainingScrambledRng",
    test_bridge_sample_off_by_one="doubles:BridgeTrainingSampleOffByOne",
    test_bridge_ft_ignores_path="doubles:BridgeTrainingFinetuneIgnoresPath",
    test_bridge_ft_keeps_optimizer="doubles:BridgeTrainingFinetuneKeepsOptimizer",
    test_bridge_scheduler_not_restored="doubles:BridgeTrainingSchedulerNotRestored",
    test_bridge_peft_saves_base="doubles:BridgeTrainingPeftSavesBase",
    test_bridge_peft_decoy_adapters="doubles:BridgeTrainingPeftKeepsDecoyAdapters",
    test_bridge_noop_load="doubles:BridgeTrainingNoopLoad",
    test_bridge_skip_finalize="doubles:BridgeTrainingSkipFinalize",
    test_bridge_peft_base_not_loaded="doubles:BridgeTrainingPeftBaseNotLoaded",
)


def _spec(src="dp2", dst="dp2", backend="bridge_training", backend_options=None, **opts):
    opts.setdefault("sharding", "fully_reshardable")
    opts.setdefault("lr_schedule", "warmup-cosine")
    return CaseSpec("resume", "gpt-gqa", backend, Topology.parse(src), Topology.parse(dst), options=tuple(sorted(opts.items())),
                    backend_options=tuple(sorted((backend_options or {}).items())), timeout_s=200)


def _checks(r):
    return {c.name: c.status for c in r.checks}


def test_a_bridge_resume_restores_weights_optimizer_schedule_train_state_and_rng(tmp_path):
    r = run_case(_spec(), RunOptions(workdir=tmp_path, keep=True))
    c = _checks(r)
    assert c["losses"] == c["final-weights"] == c["train-state"] == c["rng-state"] == "passed", r.failure_text()
    assert "torch.cuda.get_rng_state on CPU" in r.compat_shims
    # the layout Bridge writes
    ckpt = next(Path(n.split(" at ", 1)[1]) for n in r.notes if n.startswith("scratch kept at")) / "source-save" / "ckpt"  # RunEnv.launch_source, no store
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert {p.name for p in (ckpt / "iter_0000003").iterdir()} >= {"run_config.yaml", "train_state.pt", "metadata.json", ".metadata"}


def test_a_resume_at_another_tp_says_the_rng_is_not_restored(tmp_path):
    r = run_case(_spec(src="tp2", dst="dp2"), RunOptions(workdir=tmp_path))
    assert _checks(r)["rng-state"] == "passed" and "TP/PP changed" in r.check("rng-state").detail
    assert _checks(r)["losses"] == "passed", r.failure_text()


@pytest.mark.parametrize("backend, check, words", [
    ("test_bridge_scrambled_rng", "rng-state", "python not restored"),
    ("test_bridge_sample_off_by_one", "train-state", "consumed_train_samples"),
    ("test_bridge_scheduler_not_restored", "lr", "resumed [0.0001, 0.00055, 0.001]"),
])
def test_a_defective_resume_fails_its_check(tmp_path, backend, check, words):
    r = run_case(_spec(backend=backend), RunOptions(workdir=tmp_path))
    assert r.status == "failed" and _checks(r)[check] == "failed", r.failure_text()
    assert words in r.check(check).detail


def _digest(python="a", rest=""):
    """Digests of every RNG: `python` differs per test, `rest` (a decoy) moves the other three too."""
    return {"python": python, "numpy": "n" + rest, "torch": "t" + rest, "tracker": "k" + rest}


def _ev(op, iteration, flops=4.5e9, rng="a", tp=1, before="decoy", **place):
    """A save or load event; a load's pre-load records default to decoys (fresh train state, every
    RNG at another state); `before="a"` is a load whose RNG already equalled the save's."""
    ts = {"step": float(iteration), "consumed_train_samples": 4.0 * iteration, "floating_point_operations_so_far": flops}
    e = {"op": op, "iteration": iteration, "train_state": ts, "rng": _digest(rng), "tp": tp, "pp": 1, "tp_rank": 0, "pp_rank": 0,
         "dp_rank": 0, "backend": "bridge_training", **place}
    if op == "load":
        e["flops"] = flops
        e.setdefault("train_state_before", {"step": 0.0, "consumed_train_samples": 0.0, "floating_point_operations_so_far": 0.0})
        e.setdefault("rng_before", _digest(before, before) if before != rng else e["rng"])
    return e


def _run(o, save, load):
    return {c.name: c for c in state_check(o, {"save": {"0": [save]}, "load": {"0": [load]}})}


def test_the_checks_read_the_events():
    o = BridgeTrainingOptions()
    ok = _run(o, _ev("save", 3), _ev("load", 3))
    assert all(c.status == "passed" for c in ok.values())
    assert _run(o, _ev("save", 3), _ev("load", 2))["train-state"].status == "failed"  # an iteration nobody saved
    assert _run(o, _ev("save", 3), _ev("load", 3, flops=4499999744.0))["flops"].status == "failed"
    assert _run(o, _ev("save", 3), _ev("load", 3, rng="b"))["rng-state"].status == "failed"
    moved = _run(o, _ev("save", 3, tp=2), _ev("load", 3, rng="b", before="b"))["rng-state"]  # left at its decoy
    assert moved.status == "passed" and "by design" in moved.detail and "left at its pre-load decoy" in moved.detail
    touched = _run(o, _ev("save", 3, tp=2), _ev("load", 3, rng="b", before="c"))["rng-state"]  # restored across a TP change
    assert touched.status == "failed" and "must not restore" in touched.detail
    ft = _run(BridgeTrainingOptions(finetune=True), _ev("save", 3), _ev("load", 3, before="a"))
    assert ft["train-state"].status == "failed" and "flops" not in ft  # a finetune that kept the iteration
    fell_back = _run(o, _ev("save", 3), _ev("load", 0, rng="d", before="d", finetune=True, pretrained="ckpt"))  # Bridge set finetune itself
    assert fell_back["train-state"].status == "passed" and "flops" not in fell_back, fell_back
    assert fell_back["rng-state"].status == "passed" and "finetune" in fell_back["rng-state"].detail
    assert _run(o, _ev("save", 3), _ev("load", 3, finetune=True))["train-state"].status == "failed"
    assert state_check(o, {"save": {"0": [_ev("save", 3)]}}) == []


def test_a_load_whose_state_already_equalled_the_saved_one_proves_nothing():
    """No decoy before the load (the RNG, train state or FLOPs already what the save wrote): the
    comparison after the load cannot tell a restore from no load at all, so each check is not-run
    saying so; one rank-load from a decoy is enough to prove the restore."""
    o = BridgeTrainingOptions()
    saved = {"step": 3.0, "consumed_train_samples": 12.0, "floating_point_operations_so_far": 4.5e9}
    same = _run(o, _ev("save", 3), _ev("load", 3, before="a", train_state_before=saved))
    for name in ("rng-state", "train-state", "flops"):
        assert same[name].status == "not-run" and "already equalled the saved one" in same[name].detail, same[name]
    mixed = {c.name: c for c in state_check(o, {"save": {"0": [_ev("save", 3)]},
                                                "load": {"0": [_ev("load", 3)], "1": [_ev("load", 3, before="a", dp_rank=1)]}})}
    assert mixed["rng-state"].status == "passed" and "not proven on some rank-loads" in mixed["rng-state"].detail
    unrecorded = _run(o, _ev("save", 3), {k: v for k, v in _ev("load", 3).items() if k != "rng_before"})
    assert unrecorded["rng-state"].status == "not-run" and "no pre-load RNG record" in unrecorded["rng-state"].detail
    assert state_check(o, {"save": {"0": [_ev("save", 3)]}, "load": {"0": [{**_ev("load", 3), "backend": "mcore_dist"}]}}) == []


# ------------------------------------------------------------------ provider overrides (audit item 5)


class _Provider:
    tensor_model_parallel_size = 1
    params_dtype = fp16 = bf16 = None

    def __init__(self):
        self.finalized = False

    def finalize(self):
        self.finalized = True


class _NewProvider(_Provider):
    def apply_overrides_and_finalize(self, dtype=None, overrides=None):
        self.called = (dtype, dict(overrides))
        self.finalize()


def test_provider_fields_go_through_apply_overrides_and_finalize_and_an_unknown_field_is_refused():
    import torch

    from harness.models.bridge import finalize_provider

    new = _NewProvider()
    finalize_provider(new, torch.bfloat16, {"tensor_model_parallel_size": 2})
    assert new.called == (torch.bfloat16, {"tensor_model_parallel_size": 2}) and new.finalized
    old = _Provider()  # a Bridge before apply_overrides_and_finalize (0.3, 0.4)
    finalize_provider(old, torch.bfloat16, {"tensor_model_parallel_size": 2})
    assert (old.tensor_model_parallel_size, old.bf16, old.fp16, old.finalized) == (2, True, False, True)
    renamed = _Provider()  # a field a bump renamed: an error, never a silently created attribute
    with pytest.raises(AttributeError, match="no attribute 'tensor_parallel_size'"):
        finalize_provider(renamed, torch.float32, {"tensor_parallel_size": 2})
    assert not renamed.finalized and not hasattr(renamed, "tensor_parallel_size")


# ------------------------------------------------------------------ finetune (pretrained_checkpoint) and interop


def _finetune(src="dp2", dst="tp2", backend="bridge_training", expect="pass", backend_options=None, **opts):
    opts.setdefault("sharding", "fully_reshardable")
    opts.setdefault("lr_schedule", "warmup-cosine")
    return CaseSpec("finetune", "gpt-gqa", backend, Topology.parse(src), Topology.parse(dst), options=tuple(sorted(opts.items())),
                    backend_options=tuple(sorted((backend_options or {}).items())), expect=expect, timeout_s=200)


def test_a_finetune_starts_from_the_weights_only(tmp_path):
    r = run_case(_finetune(), RunOptions(workdir=tmp_path))
    c = _checks(r)
    assert r.status == "passed" and c["pretrained-weights"] == c["fresh-start"] == c["lr"] == c["train-state"] == "passed", r.failure_text()
    assert r.check("pretrained-weights").max_abs_diff == 0.0 and "flops" not in c
    assert "scheduler step 0" in r.check("fresh-start").detail


@pytest.mark.parametrize("backend, failed", [
    ("test_bridge_ft_ignores_path", {"pretrained-weights", "losses", "grad-norm", "final-weights"}),
    ("test_bridge_ft_keeps_optimizer", {"fresh-start", "lr", "losses", "grad-norm", "final-weights", "flops"}),  # flops: Bridge 0.6.2 float32
])
def test_a_defective_finetune_fails_its_checks(tmp_path, backend, failed):
    r = run_case(_finetune(src="dp2", dst="dp2", backend=backend), RunOptions(workdir=tmp_path))
    assert r.status == "failed" and {n for n, st in _checks(r).items() if st == "failed"} == failed, r.failure_text()


def test_a_pretrained_checkpoint_that_is_not_there_is_refused_and_a_silent_start_fails(tmp_path):
    r = run_case(_finetune(src="dp2", dst="dp2", expect="refuse", pretrained="missing"), RunOptions(workdir=tmp_path))
    assert r.status == "passed" and "FileNotFoundError" in r.check("refusal").detail, r.failure_text()
    silent = run_case(_finetune(src="dp2", dst="dp2", backend="test_bridge_ft_ignores_path", expect="refuse", pretrained="empty"),
                      RunOptions(workdir=tmp_path))
    assert silent.status == "failed" and "expected to refuse but completed" in silent.check("refusal").detail


def test_a_megatron_lm_layout_is_written_and_bridge_resumes_it(tmp_path):
    spec = CaseSpec("resume", "gpt-gqa", "mcore_dist", Topology.parse("dp2"), Topology.parse("tp2"),
                    options=(("load_with", "bridge_training"), ("lr_schedule", "warmup-cosine"), ("sharding", "fully_reshardable")),
                    backend_options=(("layout", "megatron-lm"),), timeout_s=200)
    r = run_case(spec, RunOptions(workdir=tmp_path, keep=True))
    c = _checks(r)
    assert r.status == "passed" and c["losses"] == c["lr"] == "passed" and c["train-state"] == "not-run", r.failure_text()
    ckpt = next(Path(n.split(" at ", 1)[1]) for n in r.notes if n.startswith("scratch kept at")) / "source-save" / "ckpt"  # RunEnv.launch_source, no store
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3" and (ckpt / "iter_0000003" / "metadata.json").is_file()
    from megatron.core.dist_checkpointing import load_common_state_dict

    common = load_common_state_dict(str(ckpt / "iter_0000003"))
    assert common["iteration"] == 3 and common["args"].tensor_model_parallel_size == 1 and "opt_param_scheduler" in common


def test_backend_refs_in_case_options_parse_or_name_what_is_wrong():
    from harness.backends import parse_ref

    ref = parse_ref("mcore_dist strict=assume_ok_unexpected cache_metadata=true")
    assert dict(ref.options) == {"strict": "assume_ok_unexpected", "cache_metadata": True}
    for bad, words in (("mcore_dist strict", "is not key=value"), ("nope", "unknown backend"),
                       ("mcore_dist strict=sometimes", "option 'strict'")):
        with pytest.raises(ValueError, match=words):
            parse_ref(bad)


# ------------------------------------------------------------------ PEFT training checkpoints (case peft-resume)


def _peft(backend="bridge_training", src="tp2", dst="dp2"):
    return CaseSpec("peft-resume", "hf-llama", backend, Topology.parse(src), Topology.parse(dst), timeout_s=200)


def test_a_lora_run_resumes_from_its_adapter_only_checkpoint(tmp_path):
    r = run_case(_peft(), RunOptions(workdir=tmp_path))
    c = _checks(r)
    assert r.status == "passed", r.failure_text()
    assert c["adapter-only"] == c["adapters-restored"] == c["base-restored"] == c["frozen-base"] == c["peft-load"] == "passed"
    assert c["export-integrity"] == "passed"
    assert r.check("adapters-restored").max_abs_diff == 0.0


@pytest.mark.parametrize("backend, failed, words", [
    ("test_bridge_peft_saves_base", {"adapter-only"}, "base tensor(s)"),
    ("test_bridge_peft_decoy_adapters", {"adapters-restored", "losses", "grad-norm", "final-adapters"}, "adapter-export@load"),
    ("test_bridge_peft_base_not_loaded", {"base-restored", "losses", "grad-norm", "final-adapters"}, "base after the load"),
])
def test_a_defective_peft_checkpoint_fails_its_check(tmp_path, backend, failed, words):
    r = run_case(_peft(backend=backend, dst="tp2"), RunOptions(workdir=tmp_path))
    got = {n for n, st in _checks(r).items() if st == "failed"}
    assert r.status == "failed" and got == failed, r.failure_text()
    assert words in r.check(sorted(failed)[0]).detail + str(r.check(sorted(failed)[0]).mismatches)


def test_adapter_only_reads_the_checkpoint_keys():
    from harness.cases.peft_resume import adapter_only_check

    adapters = ["decoder.layers.self_attention.linear_qkv.adapter.linear_in.weight", "optimizer.state.exp_avg.decoder.x.adapter.w",
                "rng_state/shard_0.0_1.2", "common_state/shard_0_1"]
    assert adapter_only_check(adapters).status == "passed"
    assert "embedding.word_embeddings.weight" in adapter_only_check(adapters + ["embedding.word_embeddings.weight"]).detail
    assert "no adapter tensor" in adapter_only_check(["rng_state/shard_0.0_1.2"]).detail


# ------------------------------------------------------------------ Bridge checkpoint -> HF export -> HF import


def _interop(backend="bridge_training", src="tp2", dst="pp2"):
    return CaseSpec("bridge-hf-interop", "hf-llama", backend, Topology.parse(src), Topology.parse(dst), timeout_s=200)


def test_a_bridge_checkpoint_exports_and_imports_the_trained_weights(tmp_path):
    r = run_case(_interop(), RunOptions(workdir=tmp_path))
    assert r.status == "passed", r.failure_text()
    assert r.check("export-after-load").max_abs_diff == r.check("hf-import").max_abs_diff == 0.0


def test_a_resume_that_reads_nothing_fails_export_after_load(tmp_path):
    r = run_case(_interop(backend="test_bridge_noop_load", dst="tp2"), RunOptions(workdir=tmp_path))
    assert r.status == "failed" and {n for n, st in _checks(r).items() if st == "failed"} == {"export-after-load"}, r.failure_text()


def test_the_interop_judge_fails_a_lossy_import_and_an_untrained_export():
    import torch

    from harness.cases.bridge_hf_interop import judge
    from harness.core.result import Check

    fixture = {"a": torch.zeros(3), "b": torch.ones(2)}
    trained = {"a": torch.full((3,), 0.5), "b": torch.ones(2) * 2}
    ok = Check("export-integrity", "passed", "")
    s = {c.name: c.status for c in judge({"save": trained, "load": trained, "import": trained}, fixture, ok, "tp2", "pp2")}
    assert set(s.values()) == {"passed"}
    lossy = {**trained, "b": trained["b"].clone().add_(1e-3)}
    assert {c.name: c.status for c in judge({"save": trained, "load": trained, "import": lossy}, fixture, ok, "tp2", "pp2")}["hf-import"] == "failed"
    s = {c.name: c.status for c in judge({"save": fixture, "load": fixture, "import": fixture}, fixture, ok, "tp2", "pp2")}
    assert s["trained"] == "failed"


# ------------------------------------------------------------------ async saves


def test_an_async_bridge_save_is_complete_only_after_its_finalize(tmp_path):
    opts = {"async_save": True, "use_persistent_ckpt_worker": False}
    r = run_case(_spec(src="dp2", dst="tp2", backend_options=opts), RunOptions(workdir=tmp_path))
    c = _checks(r)
    assert c["async-finalize"] == c["losses"] == c["lr"] == "passed", r.failure_text()
    skipped = run_case(_spec(src="dp2", dst="tp2", backend="test_bridge_skip_finalize", backend_options=opts), RunOptions(workdir=tmp_path))
    assert _checks(skipped)["async-finalize"] == "failed", skipped.failure_text()


def test_the_persistent_async_worker_is_not_run_on_a_cpu_rank(tmp_path):
    import torch

    r = run_case(_spec(backend_options={"async_save": True}), RunOptions(workdir=tmp_path))
    if torch.cuda.is_available():
        pytest.skip("a GPU machine runs the persistent worker")
    assert r.status == "not-run" and "persistent checkpoint worker" in r.not_run_reason
