"""Case `convert` (cases/convert.py, harness/judge/convert.py, harness/compat/megatron_lm.py): each
check goes red on a planted fault and names what differed. The green runs and the upstream
findings are the matrix entries (smoke.yaml, extended.yaml: tag/axis `convert`).

In-process: the judge on small synthetic checkpoints (DCP written without a process group). In
real worlds: upstream's converter on a trained gpt-gqa checkpoint, with a rank hook
(`drop_exp_avg_after_conversion`) that drops every exp_avg from its output (what a faulty second
pass would do), and a target backend that loads nothing (doubles:NoopLoad)."""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

import pytest
import torch
from doubles import use_doubles

from harness.cases.convert import CASE, export_check, refused_clearly
from harness.compat import megatron_lm as mlm
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.judge import convert as jc
from harness.orchestration.runner import RunOptions, run_case
from harness.run.world import WorldError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
_doubles = use_doubles(test_noop_load="doubles:NoopLoad")

L, H, F = 2, 4, 3  # layers, hidden, ffn (SwiGLU fc1: 2F rows)


def _source(optimizer: bool = True) -> dict[str, torch.Tensor]:
    """A torch_dist-shaped state: layers stacked on dim 0, SwiGLU fc1 as [gate; up]."""
    g = torch.Generator().manual_seed(0)
    weights = {
        "embedding.word_embeddings.weight": torch.randn(8, H, generator=g),
        "decoder.layers.mlp.linear_fc1.weight": torch.randn(L, 2 * F, H, generator=g),
        "decoder.layers.mlp.linear_fc2.weight": torch.randn(L, H, F, generator=g),
        "decoder.final_layernorm.weight": torch.randn(H, generator=g),
    }
    if not optimizer:
        return weights
    opt = {f"optimizer.state.{kind}.{k}": torch.randn(v.shape, generator=g) for k, v in weights.items()
           for kind in ("exp_avg", "exp_avg_sq", "param")}
    return {**weights, **opt}


def _good(source: dict[str, torch.Tensor], steps=(2.0, 2.0)) -> jc.Contents:
    return jc.Contents({k: v.clone() for k, v in jc.expected_fsdp(source, swiglu=True).items()},
                       {f"optimizer.param_groups.{i}.step": s for i, s in enumerate(steps)})


def _judge(source, converted, steps=(2.0, 2.0), optimizer=True):
    return {c.name: c for c in jc.judge_fsdp(jc.Contents(source), converted, True, list(steps), optimizer)}


# ------------------------------------------------------------------ the documented key mapping


def test_the_mapping_splits_layers_and_swiglu_and_moves_the_optimizer_state_under_its_param():
    source = _source()
    expected = jc.expected_fsdp(source, swiglu=True)
    fc1 = source["decoder.layers.mlp.linear_fc1.weight"]
    assert torch.equal(expected["model.module.decoder.layers.1.mlp.linear_fc1.weight_w"], fc1[1, :F])
    assert torch.equal(expected["model.module.decoder.layers.1.mlp.linear_fc1.weight_v"], fc1[1, F:])
    assert torch.equal(expected["model.module.decoder.layers.0.mlp.linear_fc2.weight"], source["decoder.layers.mlp.linear_fc2.weight"][0])
    key = "optimizer.state.module.module.module.decoder.layers.0.mlp.linear_fc1.weight_v.exp_avg_sq"
    assert torch.equal(expected[key], source["optimizer.state.exp_avg_sq.decoder.layers.mlp.linear_fc1.weight"][0, F:])
    assert "model.module.decoder.layers.0.mlp.linear_fc1.weight" not in expected
    assert len(expected) == 4 * (2 + 2 * L + L)  # embedding, norm, per layer fc1_w, fc1_v, fc2; x (weight + 3 states)
    no_swiglu = jc.expected_fsdp(source, swiglu=False)
    assert "model.module.decoder.layers.0.mlp.linear_fc1.weight" in no_swiglu


def test_sequential_mlp_experts_map_to_megatron_fsdp_local_expert_keys():
    experts = torch.arange(L * 3 * 2 * F * H, dtype=torch.float32).reshape(L, 3, 2 * F, H)
    expected = jc.expected_fsdp({"decoder.layers.mlp.experts.experts.linear_fc1.weight": experts}, swiglu=True)
    assert torch.equal(expected["model.module.decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight_v"], experts[1, 2, F:])
    assert len(expected) == L * 3 * 2


# ------------------------------------------------------------------ the checks, red on planted faults


def test_a_faithful_conversion_passes_every_check():
    source = _source()
    checks = _judge(source, _good(source))
    assert {n: c.status for n, c in checks.items()} == dict.fromkeys(jc.CHECKS[1:], "passed")
    assert "exp_avg_sq" in checks["fsdp-optimizer"].detail


def test_a_conversion_that_drops_exp_avg_fails_fsdp_optimizer_naming_each_key():
    source = _source()
    converted = _good(source)
    dropped = [k for k in converted.tensors if k.endswith(".exp_avg")]
    for k in dropped:
        del converted.tensors[k]
    checks = _judge(source, converted)
    opt = checks["fsdp-optimizer"]
    assert opt.status == "failed" and checks["fsdp-weights"].status == "passed"
    assert {m.key for m in opt.mismatches} == set(dropped) and {m.kind for m in opt.mismatches} == {"missing"}
    assert dropped[0].rsplit(".", 1)[0] in opt.detail or "exp_avg" in opt.detail


def test_a_changed_weight_fails_fsdp_weights_with_its_key_and_max_abs_diff():
    source = _source()
    converted = _good(source)
    key = "model.module.decoder.layers.1.mlp.linear_fc1.weight_v"
    converted.tensors[key][0, 0] += 0.5
    check = _judge(source, converted)["fsdp-weights"]
    assert check.status == "failed"
    assert key in check.detail and "max|diff|=0.5" in check.detail and check.max_abs_diff == pytest.approx(0.5)


def test_a_swapped_swiglu_half_and_a_stray_key_fail_fsdp_weights():
    source = _source()
    converted = _good(source)
    w, v = "model.module.decoder.layers.0.mlp.linear_fc1.weight_w", "model.module.decoder.layers.0.mlp.linear_fc1.weight_v"
    converted.tensors[w], converted.tensors[v] = converted.tensors[v], converted.tensors[w]
    converted.tensors["model.module.optimizer.distributed.bucket_idx_0.exp_avg"] = torch.zeros(3)
    check = _judge(source, converted)["fsdp-weights"]
    assert check.status == "failed"
    assert {(m.key, m.kind) for m in check.mismatches} == {(w, "value"), (v, "value"),
                                                           ("model.module.optimizer.distributed.bucket_idx_0.exp_avg", "extra")}


def test_a_lost_step_fails_fsdp_step():
    source = _source()
    check = _judge(source, _good(source, steps=()))["fsdp-step"]
    assert check.status == "failed" and "torch_dist [2.0, 2.0], fsdp_dtensor []" in check.detail


def test_a_dp_reshardable_source_needs_per_parameter_state_the_conversion_lacks():
    """The flat buffers hold every parameter's state: the conversion must hold it per parameter."""
    weights = _source(optimizer=False)
    flat = {f"optimizer.distributed.dp_group_idx_0.gbuf_idx_0.bucket_idx_0.{k}": torch.zeros(10) for k in ("param", "exp_avg")}
    converted = _good(weights)  # the weights converted, the optimizer state nowhere
    checks = {c.name: c for c in jc.judge_fsdp(jc.Contents({**weights, **flat}), converted, True, [2.0], True, "dp_reshardable")}
    opt = checks["fsdp-optimizer"]
    assert opt.status == "failed" and len(opt.mismatches) == 2 * len(jc.expected_fsdp(weights, True))
    assert "flat dp_reshardable buffer" in opt.mismatches[0].detail


def test_a_comparison_over_nothing_fails_instead_of_saying_0_equal():
    """An empty source (or one whose only optimizer state is flat buffers of no weight) compares
    nothing: `0 model weights equal` must not pass."""
    checks = _judge({}, jc.Contents({}, {}), steps=(), optimizer=False)
    assert checks["fsdp-weights"].status == "failed" and "nothing to judge" in checks["fsdp-weights"].detail
    flat = {"optimizer.distributed.dp_group_idx_0.gbuf_idx_0.bucket_idx_0.exp_avg": torch.zeros(4)}
    checks = {c.name: c for c in jc.judge_fsdp(jc.Contents(flat), jc.Contents({}, {}), True, [2.0], True, "dp_reshardable")}
    assert checks["fsdp-optimizer"].status == "failed" and "no optimizer tensor" in checks["fsdp-optimizer"].detail


def test_a_weights_only_save_has_no_optimizer_checks_to_run():
    weights = _source(optimizer=False)
    checks = _judge(weights, _good(weights, steps=()), steps=(), optimizer=False)
    assert checks["fsdp-weights"].status == "passed"
    assert checks["fsdp-optimizer"].status == "not-run" and "optimizer: false" in checks["fsdp-optimizer"].detail
    assert checks["fsdp-step"].status == "not-run"


def test_a_save_that_dropped_its_optimizer_fails_instead_of_passing_as_weights_only():
    """Whether the optimizer must be there comes from the case (it trained and saved one), not from
    the checkpoint under test: a source without optimizer state or step then fails both checks."""
    weights = _source(optimizer=False)
    checks = _judge(weights, _good(weights, steps=()), steps=(), optimizer=True)
    assert checks["fsdp-weights"].status == "passed"
    assert checks["fsdp-optimizer"].status == "failed" and "holds no optimizer state" in checks["fsdp-optimizer"].detail
    assert checks["fsdp-step"].status == "failed" and "records no optimizer step" in checks["fsdp-step"].detail
    source = _source()  # and the other way: optimizer state in what the case saved as weights only
    assert _judge(source, _good(source), optimizer=False)["fsdp-optimizer"].status == "failed"


def test_read_checkpoint_gives_full_tensors_and_the_step_objects(tmp_path):
    import torch.distributed.checkpoint as dcp

    source = _source()
    good = _good(source)
    dcp.save({**good.tensors, **good.objects, "args": {"not": "asked"}}, checkpoint_id=str(tmp_path), no_dist=True)
    read = jc.read_checkpoint(tmp_path, objects=jc.STEP_KEY)
    assert set(read.tensors) == set(good.tensors) and all(torch.equal(read.tensors[k], v) for k, v in good.tensors.items())
    assert read.objects == good.objects  # the asked objects only
    assert jc.converted_steps(read.objects) == [2.0, 2.0]
    assert jc.converted_steps({"optimizer.1.optimizer.param_groups.0.step": 3.0, "optimizer.0.optimizer.param_groups.0.step": 1.0}) == [1.0, 3.0]


def test_source_steps_reads_a_single_and_a_chained_optimizer():
    assert jc.source_steps({"optimizer": {"optimizer": {"param_groups": [{"step": 2.0}, {"step": 2.0}]}}}) == [2.0, 2.0]
    chained = {"optimizer": {0: {"optimizer": {"param_groups": [{"step": 1}]}}, 1: {"optimizer": {"param_groups": [{"step": 3}]}}}}
    assert jc.source_steps(chained) == [1, 3]
    flat = {"optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1": [{"param_groups": [{"step": 2.0}]}]}
    assert jc.flat_steps(flat) == [2.0] and jc.source_steps({}) == []


# ------------------------------------------------------------------ what has no shipped converter


def test_no_reverse_converter_means_not_run_with_every_file_looked_at_named():
    tool = mlm.find_inspector({})
    assert isinstance(tool, mlm.Tool) and "core_v0.19.0" in tool.origin
    names = mlm.command_names(tool)
    assert mlm.TO_FSDP_DTENSOR in names and len(names) == 6 and mlm.reverse_commands(names) == []
    to_td, roundtrip = jc.reverse_not_run(tool.origin, mlm.REVERSE_LOOKED_AT, mlm.reverse_commands(names))
    assert (to_td.name, to_td.status, roundtrip.status) == ("to-torch-dist", "not-run", "not-run")
    for what in ("core_v0.19.0", "checkpoint_inspector.py", "dist_checkpoint_io.py", "gpt_hybrid_conversion.py",
                 "--ckpt-convert-format", "does not write one of its own"):
        assert what in to_td.detail, what


def test_a_converter_that_gains_a_reverse_command_turns_to_torch_dist_red(tmp_path):
    fake = tmp_path / mlm.INSPECTOR
    fake.parent.mkdir(parents=True)
    fake.write_text('@cli.command()\n@click.argument("x")\ndef convert_fsdp_dtensor_to_torch_dist(x):\n    pass\n')
    tool = mlm.find_inspector({mlm.ENV: str(tmp_path)})
    assert isinstance(tool, mlm.Tool) and tool.origin == f"{mlm.ENV}={tmp_path}"
    found = mlm.reverse_commands(mlm.command_names(tool))
    assert found == ["convert-fsdp-dtensor-to-torch-dist"]
    assert jc.reverse_not_run(tool.origin, mlm.REVERSE_LOOKED_AT, found)[0].status == "failed"


def test_a_missing_converter_is_a_reason_naming_where_it_looked(tmp_path, monkeypatch):
    assert f"{mlm.ENV}={tmp_path}: no {mlm.INSPECTOR}" in mlm.find_inspector({mlm.ENV: str(tmp_path)})
    monkeypatch.setattr(mlm, "VENDORED", tmp_path / "nowhere")
    reason = mlm.find_inspector({})
    assert isinstance(reason, str) and "is missing" in reason and mlm.ENV in reason


def test_the_vendored_converter_is_upstream_s_file_unmodified():
    data = (mlm.VENDORED / mlm.INSPECTOR).read_bytes()
    assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == mlm.VENDORED_BLOB
    provenance = (mlm.VENDORED / "PROVENANCE.md").read_text()
    assert mlm.VENDORED_COMMIT in provenance and mlm.VENDORED_BLOB in provenance and (mlm.VENDORED / "LICENSE").is_file()


# ------------------------------------------------------------------ hf-export's judgement


def _world_error(message: str) -> WorldError:
    tb = ('Traceback (most recent call last):\n  File "/x/site-packages/megatron/core/dist_checkpointing/validation.py", '
          f"line 213, in verify_checkpoint\n    raise CheckpointingException(...)\n{message}\n")
    return WorldError("rank 0 raised", 0, tb)


def test_hf_export_passes_a_refusal_naming_the_format_and_fails_an_unclear_one():
    out = "/tmp/case/fsdp_dtensor"
    unclear = export_check(_world_error(f"megatron.core.dist_checkpointing.core.CheckpointingException: {out} is not a distributed checkpoint"),
                           {}, {}, out)
    assert unclear.status == "failed" and "<checkpoint> is not a distributed checkpoint" in unclear.detail
    assert "validation.py:213" in unclear.detail
    clear = export_check(_world_error("ValueError: also_save_hf_checkpoint=True is not supported together with "
                                      "ckpt_format='fsdp_dtensor'. Use ckpt_format='torch_dist'"), {}, {}, out)
    assert clear.status == "passed"
    assert not refused_clearly("CheckpointingException", "not a distributed checkpoint")


@pytest.mark.parametrize("raised", [
    "KeyError: 'model.module.decoder.layers.0.fsdp_dtensor_shard'",  # a crash in fsdp_dtensor code
    "ValueError: Checkpoint format 'x' is not supported. Supported formats are: 'torch_dist', 'fsdp_dtensor'",
    "RuntimeError: is not supported together with ckpt_format='fsdp_dtensor'",  # the message, another type
])
def test_hf_export_fails_a_raise_that_merely_mentions_fsdp_dtensor(raised):
    check = export_check(_world_error(raised), {}, {}, "/tmp/case/fsdp_dtensor")
    assert check.status == "failed" and "not upstream's documented refusal" in check.detail


def test_hf_export_compares_the_export_with_the_source_s_export_bitwise():
    ref = {"model.embed_tokens.weight": torch.ones(2, 2)}
    assert export_check(None, {k: v.clone() for k, v in ref.items()}, ref).status == "passed"
    bad = export_check(None, {"model.embed_tokens.weight": torch.zeros(2, 2)}, ref)
    assert bad.status == "failed" and bad.mismatches[0].key == "model.embed_tokens.weight"


# ------------------------------------------------------------------ what the case accepts


def _spec(src="tp1", dst="tp1", model="gpt-gqa", backend="mcore_dist", requires=(), **opts):
    return CaseSpec("convert", model, backend, Topology.parse(src), Topology.parse(dst), options=tuple(sorted(opts.items())),
                    requires=requires, timeout_s=120)


@pytest.mark.parametrize("spec, words", [
    (_spec(dst="dp2"), "gloo refuses"),
    (_spec(backend="test_noop_load"), "converts the torch_dist checkpoints backend mcore_dist writes"),
    (_spec(converter_workarounds=("nope",)), "unknown converter_workarounds ['nope']"),
    (_spec(target_backend="no_such_backend"), "option target_backend 'no_such_backend'"),
    (_spec(model="gpt-tied", optimizer=False, export_hf="hf-llama"), "give an HF llama fixture"),
    (_spec(export_hf="hf-llama"), "give optimizer: false"),
    (_spec(optimizer=False, sharding="dp_reshardable"), "not with optimizer: false"),
])
def test_validation_refuses_what_the_case_cannot_judge(spec, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        CASE.validate(spec)


def test_a_multi_rank_conversion_is_accepted_where_nccl_is_required():
    assert CASE.validate(_spec(dst="dp2", requires=("cuda", "nccl"))).optimizer


# ------------------------------------------------------------------ real worlds


def drop_exp_avg_after_conversion() -> None:
    """Rank hook: the converter's output loses every exp_avg (rewritten without them)."""
    from harness.compat import megatron_lm

    original = megatron_lm.run_command

    def run_then_drop(module, argv, workarounds=()):
        import torch.distributed.checkpoint as dcp

        original(module, argv, workarounds)
        out = Path(argv[2])
        kept = jc.read_checkpoint(out, objects=re.compile("."))
        state = {k: v for k, v in {**kept.tensors, **kept.objects}.items() if not k.endswith(".exp_avg")}
        shutil.rmtree(out)
        dcp.save(state, checkpoint_id=str(out), no_dist=True)

    megatron_lm.run_command = run_then_drop


def test_upstream_s_conversion_with_exp_avg_dropped_after_it_fails_by_name():
    r = run_case(_spec(), RunOptions(rank_hooks=("test_convert:drop_exp_avg_after_conversion",)))
    assert r.status == "failed", r.failure_text()
    assert {c: r.check(c).status for c in ("to-fsdp-dtensor", "fsdp-weights", "fsdp-step")} == dict.fromkeys(
        ("to-fsdp-dtensor", "fsdp-weights", "fsdp-step"), "passed")
    opt = r.check("fsdp-optimizer")
    assert opt.status == "failed" and opt.mismatches and all(m.kind == "missing" and m.key.endswith(".exp_avg") for m in opt.mismatches)
    assert r.check("to-torch-dist").status == "not-run" and r.check("target-load").status == "not-run"
    assert mlm.JOIN_WORLD in r.compat_shims and mlm.COMMON_STATE in r.compat_shims


def test_a_target_backend_that_loads_nothing_fails_target_load():
    r = run_case(_spec(optimizer=False, target_backend="test_noop_load"))
    assert r.status == "failed", r.failure_text()
    assert r.check("fsdp-weights").status == "passed"
    load = r.check("target-load")
    assert load.status == "failed" and load.mismatches and {m.kind for m in load.mismatches} == {"value"}


def test_a_conversion_names_where_it_broke_as_every_verdict_does():
    """One traceback reader (core.frames): the frame from its package root on, interpreter frames skipped."""
    from harness.judge.convert import raise_site

    tb = ('Traceback (most recent call last):\n  File "/v/lib/python3.12/site-packages/megatron/core/x.py", line 7, in f\n'
          '    raise ValueError("no")\n  File "<frozen importlib._bootstrap>", line 1, in _call\nValueError: no\n')
    assert raise_site(tb) == 'megatron/core/x.py:7 in f: raise ValueError("no")'
    assert raise_site("no traceback") == "no frame in the traceback"
