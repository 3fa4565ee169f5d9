"""Backend mcore_fsdp (Megatron-FSDP, fsdp_dtensor checkpoints): every fault below goes red by name
through the usual checks (tests/doubles_fsdp.py), and the pure pieces (the fsdp -> megatron key
mapping of the plain reader, the SwiGLU lookup workaround) do what they say. The passing and
upstream-defect cases run from matrices/smoke.yaml and extended.yaml (`-k fsdp`)."""

from __future__ import annotations

import pytest
import torch
from doubles import use_doubles

from harness.backends._fsdp_keys import megatron_keys
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.orchestration.runner import run_case

_doubles = use_doubles(
    test_fsdp_drop_shard="doubles_fsdp:DropShard",
    test_fsdp_drop_key="doubles_fsdp:DropKey",
    test_fsdp_drop_exp_avg="doubles_fsdp:DropExpAvg",
    test_fsdp_skip_install="doubles_fsdp:SkipInstall",
)

#: megatron's checkpoint key of doubles_fsdp.DROPPED (layer 0 of the stacked linear_proj weight)
PROJ = "decoder.layers.self_attention.linear_proj.weight"


def _spec(backend: str, case: str = "reshard-weights", strict: bool = False) -> CaseSpec:
    return CaseSpec(case, "gpt-gqa", backend, Topology.parse("dp2"), Topology.parse("dp1"), timeout_s=180,
                    backend_options=(("strict", True),) if strict else ())


def _failed(result) -> dict[str, list[str]]:
    """Each failed check and the keys its mismatches name."""
    return {c.name: sorted({m.key for m in c.mismatches}) for c in result.checks if c.status == "failed"}


@pytest.mark.parametrize("strict", [False, True])
def test_a_shard_missing_from_the_checkpoint_fails_the_weight_checks_by_name(strict):
    """One rank's chunk of one DTensor cut from DCP's index: torch DCP loads what is left without a
    word, strict_fsdp_dtensor_load or not (it checks keys, not coverage); the weight checks name it."""
    r = run_case(_spec("test_fsdp_drop_shard", strict=strict))
    assert r.status == "failed", r.failure_text()
    failed = _failed(r)
    assert set(failed) == {"checkpoint-canonical", "loaded-canonical", "resave-plain", "logits"}, failed
    assert len(failed["loaded-canonical"]) == 1 and failed["loaded-canonical"] == failed["checkpoint-canonical"]
    (key,) = failed["loaded-canonical"]
    assert key in r.failure_text() and key.startswith(("decoder.", "embedding.", "output_layer."))


def test_a_tensor_left_out_of_the_saved_state_fails_by_name_or_is_refused_when_strict():
    r = run_case(_spec("test_fsdp_drop_key"))
    assert r.status == "failed", r.failure_text()
    failed = _failed(r)
    assert PROJ in failed["loaded-canonical"] and PROJ in failed["checkpoint-canonical"], failed
    assert r.check("loaded-canonical").mismatches[0].kind == "value"  # the decoy the load never replaced
    strict = run_case(_spec("test_fsdp_drop_key", strict=True))
    assert strict.status == "error"
    assert "Missing key in checkpoint state_dict: model.module.decoder.layers.0.self_attention.linear_proj.weight" in strict.error


def test_an_exp_avg_left_out_fails_the_optimizer_check_by_name_or_is_refused_when_strict():
    r = run_case(_spec("test_fsdp_drop_exp_avg", case="reshard-optimizer"))
    assert r.status == "failed", r.failure_text()
    assert _failed(r) == {"optimizer-state": [f"optimizer.state.exp_avg.{PROJ}"]}
    assert r.check("model-weights").status == "passed" and r.check("step").status == "passed"
    strict = run_case(_spec("test_fsdp_drop_exp_avg", case="reshard-optimizer", strict=True))
    assert strict.status == "error"
    assert "Missing key in checkpoint state_dict: optimizer.state.module.module.decoder.layers.0.self_attention.linear_proj.weight.exp_avg" in strict.error


def test_a_load_megatron_fsdp_never_installs_fails_though_the_dtensors_hold_the_checkpoint():
    """The checks read the weights the forward computes with (Megatron-FSDP's model weight buffers),
    not the DTensors DCP loads into: a load that skips the adapter's load_state_dict leaves them decoy."""
    r = run_case(_spec("test_fsdp_skip_install"))
    assert r.status == "failed", r.failure_text()
    failed = _failed(r)
    assert set(failed) == {"loaded-canonical", "logits"}, failed
    assert len(failed["loaded-canonical"]) == 9  # every gpt-gqa tensor
    assert r.check("checkpoint-canonical").status == "passed" and r.check("resave-plain").status == "passed"


def test_megatron_keys_stack_layers_and_experts_merge_swiglu_halves_and_rename_norms():
    t = lambda *shape: torch.arange(float(torch.Size(shape).numel())).reshape(shape)  # noqa: E731
    on_disk = {"model.module.embedding.word_embeddings.weight": t(8, 4)}
    for layer in range(2):
        p = f"model.module.decoder.layers.{layer}."
        on_disk[p + "input_layernorm.weight"] = t(4) + layer
        on_disk[p + "mlp.linear_fc1.weight_w"] = t(3, 4) + layer
        on_disk[p + "mlp.linear_fc1.weight_v"] = -t(3, 4) - layer
        for e in range(2):
            on_disk[p + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = t(4, 2) + 10 * layer + e
    out = megatron_keys(on_disk)
    assert sorted(out) == ["decoder.layers.mlp.experts.experts.linear_fc2.weight", "decoder.layers.mlp.linear_fc1.weight",
                           "decoder.layers.self_attention.linear_qkv.layer_norm_weight", "embedding.word_embeddings.weight"]
    assert out["decoder.layers.mlp.linear_fc1.weight"].shape == (2, 6, 4)
    assert torch.equal(out["decoder.layers.mlp.linear_fc1.weight"][1], torch.cat([t(3, 4) + 1, -t(3, 4) - 1]))  # w rows, then v
    assert out["decoder.layers.mlp.experts.experts.linear_fc2.weight"].shape == (2, 2, 4, 2)
    assert torch.equal(out["decoder.layers.mlp.experts.experts.linear_fc2.weight"][1, 0], t(4, 2) + 10)
    # a layer missing from the checkpoint: nothing is stacked over the hole, each part keeps its own name
    del on_disk["model.module.decoder.layers.0.input_layernorm.weight"]
    holed = megatron_keys(on_disk)
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" not in holed
    assert "decoder.layers.1.input_layernorm.weight" in holed


def test_swiglu_lookup_resolves_what_the_upstream_lookup_cannot():
    """handle_swiglu_in_state_dict asks the adapter for 'module.<key>' one wrapper short (workaround fsdp_swiglu_lookup)."""
    from harness.compat.fsdp import swiglu_lookup

    class Wrap(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.module = inner

    gpt = torch.nn.Module()
    gpt.decoder = torch.nn.Linear(2, 2)
    adapter = Wrap(Wrap(gpt))  # FullyShardedDataParallel > MegatronFSDP > GPTModel
    with pytest.raises(AttributeError, match="has no attribute `decoder`"):
        adapter.get_parameter("module.decoder.weight")
    with swiglu_lookup(adapter):
        assert adapter.get_parameter("module.decoder.weight") is gpt.decoder.weight
        with pytest.raises(AttributeError):
            adapter.get_parameter("module.decoder.nothing")  # still upstream's error for a name nothing ends with
    with pytest.raises(AttributeError):
        adapter.get_parameter("module.decoder.weight")  # the lookup is gone after the block


@pytest.mark.parametrize("entry, message", [
    ("{case: reshard-weights, models: [gpt-gqa], pairs: ['pp2 -> dp2']}", "pp > 1: an fsdp_dtensor checkpoint names parameters"),
    ("{case: reshard-weights, models: [gpt-gqa], pairs: ['dp2 -> dp1'], options: {dtype: bf16}}", "holds a bf16 model's fp32 main weights"),
    ("{case: reshard-optimizer, models: [gpt-gqa], pairs: ['dp2 -> dp1'], options: {use_distributed_optimizer: false}}",
     "Megatron-FSDP always steps megatron-core's distributed optimizer"),
    ("{case: resume, models: [gpt-gqa], pairs: ['dp2 -> dp1'], options: {sharding: fully_reshardable}}",
     "optimizer sharding is always 'fsdp_dtensor'"),
    ("{case: reshard-optimizer, models: [gpt-gqa], pairs: ['dp2 -> dp1'], backend_options: {workarounds: [nope]}}",
     "unknown workaround(s) ['nope']"),
    ("{case: reshard-optimizer, models: [gpt-gqa], pairs: ['dp2 -> dp1'], backend_options: {sharding_strategy: zero3}}",
     "sharding_strategy"),
])
def test_the_matrix_refuses_what_an_fsdp_dtensor_case_cannot_mean(tmp_path, entry, message):
    from harness.orchestration.matrix import MatrixError, load_matrix

    path = tmp_path / "m.yaml"
    path.write_text(f"defaults: {{backends: [mcore_fsdp]}}\nentries: [{entry}]\n")
    with pytest.raises(MatrixError, match=None) as exc:
        load_matrix(path)
    assert message in str(exc.value)
