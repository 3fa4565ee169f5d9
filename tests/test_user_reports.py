"""Issue 35: a case for every reported checkpoint failure (docs/user-reports.md). Each report's
check is shown going red on a test double: a doctored artefact or a synthetic output."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from doubles import use_doubles

from harness.backends.mcore_dist import McoreDist
from harness.judge.adapter_load import AdapterLoad, adapter_load_problems, peft_load_check


# ------------------------------------------------ redai-studio/Relax #262: a prefix-less adapter
def _adapter(tmp: Path) -> tuple[Path, Path]:
    """A tiny HF Llama base and a LoRA adapter over it, saved by peft itself (nonzero lora_B)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2)
    base, adapter = tmp / "base", tmp / "adapter"
    LlamaForCausalLM(cfg).save_pretrained(base)
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(LlamaForCausalLM.from_pretrained(base), lora).save_pretrained(adapter)
    return base, adapter


def _doctored(adapter: Path, to: Path, rename=lambda k: k, value=lambda k, v: v, init_lora_weights=None) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter, to)
    state = load_file(adapter / "adapter_model.safetensors")
    save_file({rename(k): value(k, v) for k, v in state.items()}, to / "adapter_model.safetensors")
    if init_lora_weights is not None:
        cfg = json.loads((to / "adapter_config.json").read_text())
        cfg["init_lora_weights"] = init_lora_weights
        (to / "adapter_config.json").write_text(json.dumps(cfg))
    return to


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("relax262")
    base, adapter = _adapter(tmp)
    strip = lambda k: k.removeprefix("base_model.model.")  # noqa: E731  (Relax's write_hf_peft_adapter)
    return base, {
        "clean": adapter,
        # what Relax exported: bare HF names, init_lora_weights left true (so every lora_B stays zero)
        "relax-262": _doctored(adapter, tmp / "relax", rename=strip, init_lora_weights=True),
        "prefix-stripped": _doctored(adapter, tmp / "stripped", rename=strip),
        "lora-b-zeroed": _doctored(adapter, tmp / "zeroed", value=lambda k, v: v * 0 if "lora_B" in k else v),
    }


def test_a_clean_adapter_passes_peft_load(adapters):
    from cases.shared.peft import peft_load_problems

    base, dirs = adapters
    assert peft_load_problems(base, dirs["clean"]) == []


def test_relax_262_prefix_less_adapter_goes_red_on_keys_and_no_op(adapters):
    from cases.shared.peft import peft_load_problems

    base, dirs = adapters
    problems = peft_load_problems(base, dirs["relax-262"])
    assert peft_load_check(problems).failed
    assert any(p.startswith("no-op adapter: all 2 lora_B") for p in problems)
    assert any(p.startswith("no-op load: the adapted model's logits are within 0.00e+00") for p in problems)
    assert any(p.startswith("missing: base_model.model.model.layers.0.self_attn.q_proj.lora_A") for p in problems)
    assert any(p.startswith("unexpected: model.layers.0.self_attn.q_proj.lora_A") for p in problems)


def test_prefix_stripped_goes_red_even_with_peft_warnings_silenced(adapters):
    """The load result, not the warning, decides: a stripped adapter whose lora_B init is random."""
    import warnings

    from cases.shared.peft import peft_load_problems

    base, dirs = adapters
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        problems = peft_load_problems(base, dirs["prefix-stripped"])
    assert peft_load_check(problems).failed
    assert [p for p in problems if p.startswith("missing: ")] and [p for p in problems if p.startswith("unexpected: ")]


def test_lora_b_zeroed_goes_red(adapters):
    from cases.shared.peft import peft_load_problems

    base, dirs = adapters
    problems = peft_load_problems(base, dirs["lora-b-zeroed"])
    assert problems == ["no-op adapter: all 2 lora_B of the loaded adapter are zero (the file's max |lora_B| is 0)"]


def test_adapter_load_judge_on_synthetic_loads():
    ok = AdapterLoad(loaded_lora_b=4, loaded_lora_b_max=0.3, saved_lora_b=4, saved_lora_b_max=0.3, effect=1.7)
    assert adapter_load_problems(ok) == [] and not peft_load_check([]).failed
    # no warning at all (a silenced or logged-away one), only the load result's keys
    assert adapter_load_problems(AdapterLoad(**{**ok.__dict__, "missing": ["a.lora_A.default.weight"]})) == [
        "missing: a.lora_A.default.weight"]
    assert adapter_load_problems(AdapterLoad(**{**ok.__dict__, "unexpected": ["x"]})) == ["unexpected: x"]
    # the logits say no-op although lora_B is nonzero (a load that lost its way another way)
    lost = adapter_load_problems(AdapterLoad(**{**ok.__dict__, "effect": 0.0}))
    assert len(lost) == 1 and lost[0].startswith("no-op load")
    # the file itself is a no-op: the logits rule does not fire, the lora_B rule does
    zero = AdapterLoad(loaded_lora_b=4, loaded_lora_b_max=0.0, saved_lora_b=4, saved_lora_b_max=0.0, effect=0.0)
    assert [p.split(":")[0] for p in adapter_load_problems(zero)] == ["no-op adapter"]
    assert adapter_load_problems(AdapterLoad(effect=1.0))[0] == "no-op adapter: the loaded model holds no lora_B"


# ------------------------------------------------ Megatron-Bridge #5706: save_optim false, load_optim true
def test_optimizer_absent_judge():
    from harness.judge.optimizer_absent import optimizer_absent_check

    clear = optimizer_absent_check("CheckpointingException", "Unexpected keys (not found in the checkpoint): "
                                   "{'optimizer.state.exp_avg.decoder.final_layernorm.weight'}", "dp2 -> dp2")
    assert clear.status == "passed"
    silent = optimizer_absent_check(None, "", "dp2 -> dp2", fresh="Adam step values after the load: [0.0]")
    assert silent.failed and "training goes on from fresh optimizer state" in silent.detail
    crash = optimizer_absent_check("KeyError", "'optimizer'", "dp2 -> dp2",
                                   "megatron/bridge/training/checkpointing.py:3093 in _load_checkpoint_from_path")
    assert crash.failed and "crashed with KeyError" in crash.detail and "checkpointing.py:3093" in crash.detail
    vague = optimizer_absent_check("RuntimeError", "something went wrong", "dp2 -> dp2")
    assert vague.failed and "does not name the missing optimizer state" in vague.detail


def _training_spec(case: str, src: str, dst: str, backend: str = "mcore_dist", **opts):
    from harness.core.spec import CaseSpec
    from harness.core.topology import Topology

    opts.setdefault("sharding", "fully_reshardable")
    return CaseSpec(case, "gpt-gqa", backend, Topology.parse(src), Topology.parse(dst), options=tuple(sorted(opts.items())),
                    timeout_s=180)


class FreshOptimizerLoad(McoreDist):
    """A training load that asks only for what the checkpoint holds when it lacks the optimizer (what
    Megatron-Bridge #5706 makes Bridge's load do): the job trains on from its fresh optimizer."""

    def load_training(self, ctx, job, directory):
        from megatron.core import dist_checkpointing

        has_optimizer = any(k.startswith("optimizer.") for k in dist_checkpointing.load_tensors_metadata(str(directory)))
        state = job.sharded_state(is_loading=True)
        if not has_optimizer:
            state.pop("optimizer")
        job.restore(self.load_state(ctx, state, directory))


_doubles = use_doubles(test_fresh_optimizer="test_user_reports:FreshOptimizerLoad")


def test_no_save_optim_refusal_passes_and_a_silent_fresh_start_goes_red():
    """mcore_dist loads strictly (RAISE_ALL): the missing optimizer keys refuse. The double
    (FreshOptimizerLoad) completes the load and keeps the fresh optimizer: red."""
    from harness.orchestration.runner import run_case

    ok = run_case(_training_spec("reshard-optimizer", "dp2", "dp2", save_optim=False))
    assert ok.status == "passed", ok.failure_text()
    assert ok.check("optimizer-absent").detail.startswith("refused across tp1pp1dp2cp1 -> tp1pp1dp2cp1: CheckpointingException")
    silent = run_case(_training_spec("reshard-optimizer", "dp2", "dp2", backend="test_fresh_optimizer", save_optim=False))
    assert silent.status == "failed" and "from fresh optimizer state" in silent.check("optimizer-absent").detail, silent.failure_text()


# ------------------------------------------------ resume, one step past the load (betas 0): next-step
def _out(losses, model, optimizer):
    from cases.ranks.train_phase import TrainOut
    from harness.core.parity import Shard

    shards = lambda d: [Shard(k, tuple(v.shape), tuple((0, n) for n in v.shape), 0, v.clone()) for k, v in d.items()]  # noqa: E731
    return TrainOut([], [], list(losses), next_model=shards(model), next_optimizer=shards(optimizer))


def test_next_step_judge_goes_red_on_a_reset_moment():
    import torch

    from cases.resume import next_step_check

    w, m = {"w": torch.arange(6.0).reshape(2, 3)}, {"optimizer.state.exp_avg.w": torch.full((2, 3), 0.5)}
    ref = [_out([1.25, 1.0], w, m)]
    assert next_step_check(3, "dp2", "dp2", ref, [_out([1.25, 1.0], w, m)]).status == "passed"
    reset = next_step_check(3, "dp2", "dp2", ref, [_out([1.25, 1.0], w, {"optimizer.state.exp_avg.w": torch.zeros(2, 3)})])
    assert reset.failed and "exp_avg" in reset.detail
    moved = next_step_check(3, "dp2", "dp1", ref, [_out([1.26, 1.0], w, m)])
    assert moved.failed and "steps 4..4" in moved.detail
    missing = next_step_check(3, "dp2", "dp2", ref, [_out([1.25, 1.0], {}, m)])
    assert missing.failed


def test_betas_and_optimizer_options_are_checked():
    from harness.models.training import TrainOptions, optimizer_config

    cfg = TrainOptions(betas=(0.0, 0.0))
    oc = optimizer_config(cfg.config)
    assert (oc.adam_beta1, oc.adam_beta2, oc.optimizer) == (0.0, 0.0, "adam")
    assert optimizer_config(TrainOptions(optimizer_type="sgd").config).optimizer == "sgd"
    with pytest.raises(ValueError, match="betas"):
        TrainOptions(betas=(0.9,))
    with pytest.raises(ValueError, match="Adam's"):
        TrainOptions(optimizer_type="sgd", betas=(0.0, 0.0))


# ------------------------------------------------ AReaL #1468 / verl #5154: the load's optimizer template
@pytest.mark.parametrize("how, is_loading, metadata", [("megatron-lm", True, "found"), ("no-is-loading", False, "found"),
                                                       ("no-metadata", True, {})])
def test_load_template_builds_the_template_as_the_client_does(monkeypatch, tmp_path, how, is_loading, metadata):
    """Each `load_template` asks the job for the template its client builds: Megatron-LM's
    (is_loading, the checkpoint's content metadata), AReaL before #1468's (is_loading False), and a
    client passing no metadata ({}: Core's default sharding type). A backend that ignored the option
    would build Megatron-LM's every time: the other two rows go red."""
    from dataclasses import replace

    from megatron.core import dist_checkpointing

    asked = []

    class Job:
        def sharded_state(self, is_loading, metadata=None):
            asked.append((is_loading, metadata))
            return {}

        def restore(self, state):
            pass

        def content_metadata(self):
            return {"distrib_optim_sharding_type": "fully_reshardable"}

    monkeypatch.setattr(dist_checkpointing, "load_content_metadata", lambda checkpoint_dir: "found")
    backend = McoreDist(replace(McoreDist.Options(), load_template=how))
    monkeypatch.setattr(backend, "load_state", lambda ctx, state, directory: {})
    monkeypatch.setattr("harness.backends.mcore_dist.restore_scheduler", lambda job, state: None)
    backend.load_training(None, Job(), tmp_path)
    assert asked == [(is_loading, metadata)]
