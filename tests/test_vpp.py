"""Virtual pipelines (vpp): models are chunk lists with global layer numbers, so a checkpoint's keys do
not depend on pp/vpp; a load or a build that gets the chunks wrong goes red; the vpp case ids are stable.
The vpp matrix cases themselves (and the batched-p2p defect) run with the smoke matrix."""

from pathlib import Path

import pytest
import torch
from doubles import use_doubles

from harness.cases import reshard_optimizer, reshard_weights
from harness.core import truth
from harness.core.parity import Shard
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.core.zoo import get_model
from harness.models.training import TrainOptions, workaround_notes
from harness.orchestration.matrix import load_matrix
from harness.orchestration.runner import RunOptions, run_case
from harness.run.envelope import RunEnv
from harness.run.preload import warm

ROOT = Path(__file__).resolve().parents[1]
GQA = get_model("gpt-gqa")
QKV = "decoder.layers.self_attention.linear_qkv.weight"  # layer-stacked: global shape (layers, 128, 64)



# --------------------------------------------------------------------------- ids

# this module's fault-injecting backends, registered only while its tests run
_doubles = use_doubles(test_first_chunk_only="doubles:LoadFirstChunkOnly")


def test_vpp_case_ids_are_stable():
    cases = [c for m in ("smoke.yaml", "extended.yaml") for c in load_matrix(ROOT / "matrices" / m).cases]
    ids = sorted(c.id for c in cases if "vpp" in c.id)
    assert ids == sorted([
        "reshard-weights[mcore_dist-gpt-gqa-tp1pp2dp1cp1vpp2->tp1pp4dp1cp1]",
        "reshard-weights[mcore_dist-gpt-gqa-tp1pp4dp1cp1->tp1pp2dp1cp1vpp2]",
        "reshard-weights[mcore_dist-gpt-gqa-tp1pp1dp1cp1->tp1pp2dp1cp1vpp2]",
        "reshard-weights[mcore_dist-gpt-gqa-tp1pp2dp1cp1vpp2->tp1pp2dp1cp1]",
        "reshard-weights[mcore_dist-gpt-gqa-tp2pp2dp1cp1vpp2->tp1pp2dp2cp1vpp2]",
        "reshard-weights[mcore_dist-gpt-tied-tp1pp2dp1cp1vpp2->tp1pp1dp1cp1]",
        "reshard-weights[mcore_dist-gpt-gqa-8l-tp1pp2dp1cp1vpp4->tp1pp4dp1cp1vpp2]",
        "reshard-optimizer[mcore_dist-gpt-gqa-tp1pp2dp1cp1vpp2->tp1pp4dp1cp1-fully_reshardable]",
        "reshard-optimizer[mcore_dist-gpt-gqa-tp1pp1dp1cp1->tp1pp2dp1cp1vpp2-fully_reshardable]",
        "reshard-optimizer[mcore_dist-gpt-gqa-tp1pp2dp1cp1vpp2->tp1pp2dp1cp1-dp_reshardable]",
        "reshard-optimizer[mcore_dist-gpt-gqa-tp1pp2dp2cp1vpp2->tp1pp2dp1cp1vpp2-dp_reshardable]",
        "resume[mcore_dist-gpt-gqa-8l-tp1pp2dp1cp1vpp2->tp1pp2dp1cp1vpp4-fully_reshardable]",
        "resume[mcore_dist-gpt-gqa-tp1pp1dp1cp1->tp1pp2dp1cp1vpp2-fully_reshardable-bf16]",
        "resume[mcore_dist-gpt-gqa-tp1pp2dp1cp1->tp1pp2dp1cp1vpp2-defect-vpp-batched-p2p]",
        "hf-roundtrip[bridge_hf-hf-llama-tp1pp1dp1cp1->tp1pp2dp1cp1vpp2]",
        "peft-export[bridge_peft-hf-qwen3moe-tp1pp1dp1cp1->tp1pp2dp1cp1vpp2-lora]",
        "reshard-optimizer[mcore_torch-gpt-gqa-tp1pp2dp1cp1vpp2->tp1pp2dp1cp1vpp2-dp_zero_gather_scatter-bf16-torch-format]",
        "hf-roundtrip[bridge_hf-hf-qwen2_5_vl-tp1pp1dp1cp1->tp1pp2dp1cp1vpp2]",
        "finetune[bridge_training-gpt-gqa-tp1pp1dp2cp1->tp1pp2dp1cp1vpp2-fully_reshardable-bf16-warmup-cosine-load-main-params]",
    ])
    vpp_cases = [c for c in cases if c.source.vpp > 1 or c.target.vpp > 1]
    assert len(vpp_cases) == len(ids) and all("vpp" in c.markers for c in vpp_cases)


# --------------------------------------------------------------------------- in-process: meaning, notes, judge


def _spec(src: str, dst: str) -> CaseSpec:
    return CaseSpec("reshard-optimizer", "gpt-gqa", "mcore_dist", Topology.parse(src), Topology.parse(dst))


def test_dp_reshardable_refusal_meaning_names_a_vpp_change():
    opts = TrainOptions(sharding="dp_reshardable")
    assert "VPP change at the same PP" in reshard_optimizer.refusal_meaning(_spec("pp2vpp2", "pp2"), opts)
    assert "TP/PP/EP/ETP and VPP change" in reshard_optimizer.refusal_meaning(_spec("pp2vpp2", "pp4"), opts)
    assert reshard_optimizer.refusal_meaning(_spec("tp2", "tp1"), opts).endswith("a TP/PP/EP/ETP change needs fully_reshardable")
    assert reshard_optimizer.refusal_meaning(_spec("pp2vpp2dp2", "pp2vpp2"), opts) == ""
    assert reshard_optimizer.refusal_meaning(_spec("pp2vpp2", "pp2"), TrainOptions(sharding="fully_reshardable")) == ""


def test_the_vpp_p2p_workaround_is_noted_only_where_a_topology_has_vpp():
    opts = TrainOptions()
    assert "vpp_overlap_p2p" in opts.workarounds
    assert not any("vpp_overlap_p2p" in n for n in workaround_notes(opts, Topology.parse("pp2"), Topology.parse("tp2")))
    assert any("vpp_overlap_p2p" in n for n in workaround_notes(opts, Topology.parse("pp2"), Topology.parse("pp2vpp2")))


#: gpt-gqa's other weights, whole: the judge expects the model's full layout (truth.gpt_checkpoint_shapes)
REST = {k: truth.canonical_tensor(GQA, k, shape) for k, shape in truth.gpt_checkpoint_shapes(GQA, 1).items() if k != QKV}


def _chunked(full: torch.Tensor, layers_of_rank: list[list[int]]) -> list[reshard_weights.WeightsOut]:
    """Per-rank outputs of a layer-stacked tensor held one layer per chunk, as local_shards gives them
    (the first rank also holds every other weight whole)."""
    outs = []
    for r, layers in enumerate(layers_of_rank):
        shards = [Shard(QKV, tuple(full.shape), (layer, (0, full.shape[1]), (0, full.shape[2])), 0, full[layer].clone())
                  for layer in layers]
        if not r:
            shards += [Shard(k, tuple(t.shape), tuple((0, n) for n in t.shape), 0, t.clone()) for k, t in REST.items()]
        outs.append(reshard_weights.WeightsOut(shards, None, 0))
    return outs


def test_a_chunk_at_the_wrong_layer_offset_turns_loaded_canonical_red():
    """pp2vpp2: pp rank 0 holds layers 0 and 2, rank 1 layers 1 and 3. A chunk built at its first
    chunk's offset holds layer 0 again and nobody holds layer 2: a coverage hole at D."""
    full = truth.canonical_tensor(GQA, QKV, (4, 128, 64))
    src, dst = Topology.parse("pp4"), Topology.parse("pp2vpp2")
    saved = _chunked(full, [[0], [1], [2], [3]])
    good = _chunked(full, [[0, 2], [1, 3]])
    bad = _chunked(full, [[0, 0], [1, 3]])
    plain = {QKV: full.clone(), **REST}
    ok = {c.name: c for c in reshard_weights.judge(GQA, src, dst, saved, good, plain, dict(plain))}
    assert ok["loaded-canonical"].status == "passed"
    red = {c.name: c for c in reshard_weights.judge(GQA, src, dst, saved, bad, plain, dict(plain))}
    assert red["loaded-canonical"].status == "failed" and red["source-canonical"].status == "passed"
    assert {m.key for m in red["loaded-canonical"].mismatches} == {QKV}
    assert "coverage" in {m.kind for m in red["loaded-canonical"].mismatches}


# --------------------------------------------------------------------------- real worlds


def _layout(ctx, arg) -> list[tuple]:
    from harness.models import mcore as models

    spec, topo = arg
    return [(i, s.key, s.global_shape, s.index[0] if s.key.startswith("decoder.layers.") else None)
            for i, chunk in enumerate(models.build_gpt(spec, topo)) for s in models.local_shards([chunk])]


def test_checkpoint_keys_are_global_and_chunks_interleave_as_megatron(tmp_path):
    """What the model at pp1, pp4 and pp2vpp2 offers dist_checkpointing: the same keys and global
    shapes; with vpp, chunk v of pp rank r holds layer v * pp + r (one layer per chunk)."""
    warm()  # forked ranks inherit megatron-core's imports, as run_case does
    env = RunEnv(tmp_path, timeout_s=120)
    layouts = {t: env.launch(t, _layout, (GQA, Topology.parse(t)), Topology.parse(t)) for t in ("pp1", "pp4", "pp2vpp2")}
    keys = {t: {(k, shape) for rank in ranks for _, k, shape, _ in rank} for t, ranks in layouts.items()}
    assert keys["pp1"] == keys["pp4"] == keys["pp2vpp2"] and (QKV, (4, 128, 64)) in keys["pp1"]
    held = [sorted({(chunk, layer) for chunk, k, _, layer in rank if k == QKV}) for rank in layouts["pp2vpp2"]]
    assert held == [[(0, 0), (1, 2)], [(0, 1), (1, 3)]]
    assert [sorted({layer for _, k, _, layer in rank if k == QKV}) for rank in layouts["pp4"]] == [[0], [1], [2], [3]]


def _weights(backend="mcore_dist", src="pp4", dst="pp2vpp2"):
    return CaseSpec("reshard-weights", "gpt-gqa", backend, Topology.parse(src), Topology.parse(dst), timeout_s=120)


def test_a_load_that_fills_only_the_first_chunk_is_caught():
    r = run_case(_weights("test_first_chunk_only"))
    assert r.status == "failed", r.failure_text()
    statuses = {c.name: c.status for c in r.checks}
    assert statuses["source-canonical"] == statuses["checkpoint-canonical"] == "passed"
    assert statuses["loaded-canonical"] == statuses["logits"] == "failed"
    wrong = {m.key for m in r.check("loaded-canonical").mismatches}
    assert QKV in wrong and "output_layer.weight" in wrong and "embedding.word_embeddings.weight" not in wrong


def test_chunks_at_rotated_layer_offsets_only_the_logits_see():
    """Every layer held once under its own key, in the wrong chunk: the weight checks cannot see it
    (the checkpoint is self-consistent), the forward pass through the interleaved schedule does."""
    r = run_case(_weights(), RunOptions(rank_hooks=("doubles:rotate_vpp_chunks",)))
    statuses = {c.name: c.status for c in r.checks}
    assert r.status == "failed", r.failure_text()
    assert statuses == {"source-canonical": "passed", "checkpoint-canonical": "passed", "loaded-canonical": "passed",
                        "resave-plain": "passed", "logits": "failed"}


def test_vpp_training_that_the_interleaved_schedule_refuses_is_a_matrix_load_error(tmp_path):
    """pp4vpp2 at dp2 leaves 2 micro-batches per DP rank, fewer than PP: named at load, not a run error."""
    from harness.orchestration.matrix import MatrixError

    path = tmp_path / "m.yaml"
    path.write_text("defaults: {max_world_size: 8}\nentries: [{case: resume, models: [gpt-gqa-8l], "
                    "pairs: ['pp4vpp2dp2 -> pp4'], options: {sharding: fully_reshardable}}]")
    with pytest.raises(MatrixError, match="interleaved schedule needs a multiple of PP=4"):
        load_matrix(path)
