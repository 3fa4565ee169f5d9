"""Case judges on synthetic outputs, in-process: every check passes on good outputs and goes red,
naming the key and the side, on one planted fault. No world, no megatron: seconds, not minutes.
(The end-to-end fault proofs through real worlds are in test_reshard_case/test_training_cases/test_hf_cases.)"""

import pytest
import torch

from harness.cases import (
    hf_roundtrip,
    peft_export,
    reshard_optimizer,
    reshard_weights,
    resume,
)
from harness.cases.ranks.train_phase import TrainOut
from harness.cases.shared import peft as _peft
from harness.core import truth
from harness.core.parity import Shard, compare_tensors
from harness.core.topology import Topology
from harness.core.zoo import get_model
from harness.judge.checks import knob_check, refusal_check, weights_match_main_params

GQA = get_model("gpt-gqa")
KEYS = {"embedding.word_embeddings.weight": (128, 64), "decoder.layers.self_attention.linear_qkv.weight": (4, 128, 64)}
#: every weight gpt-gqa checkpoints: reshard-weights judges against the model's full layout
LAYOUT = truth.gpt_checkpoint_shapes(GQA, 1)


def _canonical(model=GQA, keys=KEYS):
    return {k: truth.canonical_tensor(model, k, s) for k, s in keys.items()}


def _split(full: dict, parts: int, dim: int = 0, replica: int = 0) -> list[list[Shard]]:
    """Per-rank shard lists of `full`, each tensor split in `parts` along `dim`."""
    ranks = [[] for _ in range(parts)]
    for key, t in full.items():
        step = t.shape[dim] // parts
        for r in range(parts):
            index = tuple((r * step, (r + 1) * step) if d == dim else (0, n) for d, n in enumerate(t.shape))
            ranks[r].append(Shard(key, tuple(t.shape), index, replica, t.narrow(dim, r * step, step).clone()))
    return ranks


def _flip(t: torch.Tensor) -> None:
    t.view(-1).view(torch.int32)[0] ^= 1


def _statuses(checks):
    return {c.name: c.status for c in checks}


# --------------------------------------------------------------------------- reshard-weights


def _weights_outs(full, parts, logits):
    return [reshard_weights.WeightsOut(s, logits if r == parts - 1 else None, 0) for r, s in enumerate(_split(full, parts))]


def _weights_judge(saved=None, loaded=None, checkpoint=None, resaved=None, src="tp2", dst="tp1pp2"):
    full = _canonical(keys=LAYOUT)
    logits = torch.randn(2, 16, 128)
    saved = saved or _weights_outs(full, 2, logits)
    loaded = loaded or _weights_outs(full, 2, logits.clone())
    return reshard_weights.judge(GQA, Topology.parse(src), Topology.parse(dst), saved, loaded,
                                 checkpoint or dict(full), resaved or {k: v.clone() for k, v in full.items()})


def test_weights_judge_passes_on_good_outputs():
    assert set(_statuses(_weights_judge()).values()) == {"passed"}


def test_weights_judge_one_bit_after_load_names_key_and_side():
    full = _canonical(keys=LAYOUT)
    loaded = _weights_outs(full, 2, torch.zeros(1))
    _flip(loaded[1].shards[0].data)
    checks = _weights_judge(loaded=loaded)
    assert _statuses(checks)["loaded-canonical"] == "failed" and _statuses(checks)["source-canonical"] == "passed"
    (m,) = next(c for c in checks if c.name == "loaded-canonical").mismatches
    assert m.key == "embedding.word_embeddings.weight"
    assert m.kind == "value" and m.actual == "tp1pp2dp1cp1" and m.max_abs_diff > 0


def test_weights_judge_uncovered_elements_and_extra_keys():
    full = _canonical(keys=LAYOUT)
    loaded = _weights_outs(full, 2, torch.zeros(1))
    loaded[0].shards.pop(0)  # a rank lost its half of one tensor
    checkpoint = {**full, "stray": torch.zeros(1)}
    s = _statuses(_weights_judge(loaded=loaded, checkpoint=checkpoint))
    assert s["loaded-canonical"] == "failed" and s["checkpoint-canonical"] == "failed" and s["resave-plain"] == "failed"


@pytest.mark.parametrize("fault", ["dropped", "extra", "reshaped"])
def test_weights_judge_expects_the_model_s_layout_not_the_built_one(fault):
    """A tensor the build at S drops, adds or reshapes, and every later side with it: the canonical
    expectation comes from the model's config (truth.gpt_checkpoint_shapes), so all three canonical
    checks fail instead of agreeing with the state under test."""
    full = _canonical(keys=LAYOUT)
    if fault == "dropped":
        del full["output_layer.weight"]
    elif fault == "extra":
        full["decoder.layers.self_attention.q_layernorm.weight"] = torch.ones(4, 8)
    else:
        full["embedding.word_embeddings.weight"] = full["embedding.word_embeddings.weight"][:64].clone()
    logits = torch.randn(2, 16, 128)
    checks = reshard_weights.judge(GQA, Topology.parse("tp2"), Topology.parse("tp1pp2"), _weights_outs(full, 2, logits),
                                   _weights_outs(full, 2, logits.clone()), dict(full), {k: v.clone() for k, v in full.items()})
    s = _statuses(checks)
    assert s["source-canonical"] == s["checkpoint-canonical"] == s["loaded-canonical"] == "failed"
    assert s["resave-plain"] == "passed"  # the two checkpoints agree with each other: only the truth catches it
    kinds = {m.kind for m in next(c for c in checks if c.name == "source-canonical").mismatches}
    assert kinds == {"dropped": {"missing"}, "extra": {"extra"}, "reshaped": {"shape"}}[fault], kinds


def test_the_canonical_layout_follows_the_model_config():
    tied, moe = truth.gpt_checkpoint_shapes(get_model("gpt-tied"), 1), truth.gpt_checkpoint_shapes(get_model("gpt-moe-shared"), 2)
    assert "output_layer.weight" not in tied and tied["embedding.position_embeddings.weight"] == (16, 64)
    assert tied["decoder.layers.self_attention.linear_qkv.bias"] == (4, 192) and "decoder.final_layernorm.bias" in tied
    assert moe["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == (4, 4, 64, 64)
    assert moe["decoder.layers.mlp.shared_experts.linear_fc2.weight"] == (4, 64, 64) and moe["decoder.layers.mlp.router.weight"] == (4, 4, 64)
    uneven = truth.gpt_checkpoint_shapes(get_model("gpt-moe-uneven"), 1)  # mixed layers: one key per layer
    assert uneven["decoder.layers.0.mlp.linear_fc1.weight"] == (1024, 64) and "decoder.layers.1.mlp.router.weight" in uneven
    assert len(uneven) == 33  # what megatron-core 0.19.2 checkpoints for it (a dp2ep2 save, read back)


def test_weights_judge_resave_and_logits():
    full = _canonical(keys=LAYOUT)
    resaved = {k: v.clone() for k, v in full.items()}
    _flip(resaved["embedding.word_embeddings.weight"])
    assert _statuses(_weights_judge(resaved=resaved))["resave-plain"] == "failed"
    logits = torch.randn(2, 16, 128)
    near = _weights_outs(full, 2, logits + 1e-7)
    far = _weights_outs(full, 2, logits + 1e-2)
    saved = _weights_outs(full, 2, logits)
    assert _statuses(_weights_judge(saved=saved, loaded=near))["logits"] == "passed"  # TP changed: tolerance
    assert _statuses(_weights_judge(saved=saved, loaded=near, dst="tp2"))["logits"] == "failed"  # same TP: bitwise
    assert _statuses(_weights_judge(saved=saved, loaded=far))["logits"] == "failed"
    assert _statuses(_weights_judge(src="cp2"))["logits"] == "not-run"
    diverged = _weights_outs(full, 2, logits)
    diverged[0].logits = logits + 1.0  # two DP replicas computed different logits
    assert _statuses(_weights_judge(saved=saved, loaded=diverged))["logits"] == "failed"


# --------------------------------------------------------------------------- training cases


def _knobs(ok=True):
    return [{"knob": "use_distributed_optimizer", "asked": False, "actual": False if ok else True, "ok": ok}]


def _train_outs(parts=2, step=2.0, shared=0, flip=False, losses=None, knobs_ok=True):
    opt = {f"optimizer.state.exp_avg.{k}": v * 0.1 for k, v in _canonical().items()}
    model = _canonical()
    o_split, m_split = _split(opt, parts), _split(model, parts)
    if flip:
        _flip(o_split[0][0].data)
    return [
        TrainOut(_knobs(knobs_ok), [], losses if r == parts - 1 else [None] * len(losses or []),
                 optimizer_shards=o_split[r], steps={"values": [step], "shared_step_tensors": shared},
                 model_shards=m_split[r], final_shards=m_split[r], trace_after=_trace(len(losses or [])))
        for r in range(parts)
    ]


def test_optimizer_judge():
    good = reshard_optimizer.judge("dp2", "dp1", _train_outs(), _train_outs(parts=1))
    assert {n: st for n, st in _statuses(good).items() if st != "passed"} == {"weights-match-main-params": "not-run"}  # fp32
    bad = _statuses(reshard_optimizer.judge("dp2", "dp1", _train_outs(), _train_outs(parts=1, flip=True)))
    assert bad["optimizer-state"] == "failed" and bad["model-weights"] == "passed"
    assert _statuses(reshard_optimizer.judge("dp2", "dp1", _train_outs(), _train_outs(step=0.0)))["step"] == "failed"
    shared = reshard_optimizer.judge("dp2", "dp1", _train_outs(), _train_outs(shared=26))
    assert _statuses(shared)["step"] == "failed" and "share another param's Adam step" in shared[2].detail
    knobs = reshard_optimizer.judge("dp2", "dp1", _train_outs(), _train_outs(knobs_ok=False))
    assert _statuses(knobs)["propagation"] == "failed" and "asked False, built True" in knobs[0].detail


def test_refusal_check():
    assert refusal_check(None, "", ["CheckpointingException"], "tp2 -> tp1").status == "failed"
    ok = refusal_check("CheckpointingException", "Global shape mismatch\nmore", ["CheckpointingException"], "tp2 -> tp1", "why")
    assert ok.status == "passed" and "Global shape mismatch" in ok.detail and "meaning: why" in ok.detail
    assert "no clear reason" in refusal_check("KeyError", "'x'", ["CheckpointingException"], "a -> b").detail


def test_resume_judge_tolerance_by_topology():
    base = [2.0, 1.9, 1.8]
    same = resume.judge(3, "dp2", "dp2", _train_outs(losses=base), _train_outs(losses=list(base)))
    assert {n: st for n, st in _statuses(same).items() if st != "passed"} == {"weights-match-main-params": "not-run"}  # fp32
    assert same[1].tolerance.kind == "bitwise" and same[1].max_abs_diff == 0
    nudged = [x + 1e-7 for x in base]
    assert _statuses(resume.judge(3, "dp2", "dp2", _train_outs(losses=base), _train_outs(losses=nudged)))["losses"] == "failed"
    assert _statuses(resume.judge(3, "dp2", "dp1", _train_outs(losses=base), _train_outs(parts=1, losses=nudged)))["losses"] == "passed"
    drift = [x + 3e-3 for x in base]  # what a reset Adam step does in 3 steps
    assert _statuses(resume.judge(3, "dp2", "dp1", _train_outs(losses=base), _train_outs(parts=1, losses=drift)))["losses"] == "failed"
    assert _statuses(resume.judge(3, "dp2", "dp1", _train_outs(losses=base), _train_outs(parts=1, losses=base[:2])))["losses"] == "failed"
    moved = _train_outs(parts=1, losses=base)
    _flip(moved[0].final_shards[1].data)
    assert _statuses(resume.judge(3, "dp2", "dp2", _train_outs(losses=base), moved))["final-weights"] == "failed"


# --------------------------------------------------------------------------- bf16 mixed precision


def _trace(n, norm_delta=0.0, lrs=None):
    """A per-step trace as train_steps records it: the LR each step used and its grad norm."""
    return [{"lr": (lrs or [1e-3] * n)[i], "grad_norm": 2.8 + 0.2 * i + norm_delta} for i in range(n)]


def _bf16_outs(parts=2, step=2.0, losses=None, weights_delta=None, norm_delta=0.0, lrs=None):
    """Training outputs of a bf16 job: fp32 main params (the distributed optimizer's `param`
    entries), fp32 moments, and bf16 model weights that are the main params cast down."""
    main = {k: v + 1e-4 for k, v in _canonical().items()}  # not bf16-representable: the cast rounds
    opt = {**{f"optimizer.state.param.{k}": v for k, v in main.items()},
           **{f"optimizer.state.exp_avg.{k}": v * 0.1 for k, v in main.items()}}
    weights = {k: v.to(torch.bfloat16) for k, v in main.items()}
    final = {k: v + (weights_delta or 0.0) for k, v in weights.items()}
    o_split, m_split, f_split = _split(opt, parts), _split(weights, parts), _split(final, parts)
    return [
        TrainOut(_knobs(), [], losses if r == parts - 1 else [None] * len(losses or []),
                 optimizer_shards=o_split[r], steps={"values": [step], "shared_step_tensors": 0},
                 model_shards=m_split[r], final_shards=f_split[r], trace_after=_trace(len(losses or []), norm_delta, lrs))
        for r in range(parts)
    ]


def _find(outs, key_part):
    """The first shard whose key contains key_part (rank order)."""
    return next(s for o in outs for s in o.optimizer_shards + o.model_shards if key_part in s.key)


def test_weights_match_main_params_judge():
    good = reshard_optimizer.judge("dp2", "tp2", _bf16_outs(), _bf16_outs(), "bf16")
    assert set(_statuses(good).values()) == {"passed"}
    assert "weights-match-main-params" in _statuses(good) and good[-1].tolerance.kind == "bitwise"
    # a bf16 weight that disagrees with its main param (one ulp, main param untouched): only this check
    # and model-weights (the weight also differs from S) go red; the optimizer state is fine
    loaded = _bf16_outs()
    w = next(s for s in loaded[1].model_shards if s.key == "decoder.layers.self_attention.linear_qkv.weight")
    w.data.view(-1).view(torch.int16)[0] ^= 1
    checks = reshard_optimizer.judge("dp2", "tp2", _bf16_outs(), loaded, "bf16")
    s = _statuses(checks)
    assert s["weights-match-main-params"] == "failed" and s["optimizer-state"] == "passed"
    (m,) = checks[-1].mismatches
    assert m.key == "decoder.layers.self_attention.linear_qkv.weight" and m.kind == "value"
    assert m.actual == "bf16 weights@tp2" and m.expected == "fp32 main params@tp2 cast to bf16" and m.max_abs_diff > 0
    # fp32 training: no main/model split, recorded as not run, with why
    fp32 = reshard_optimizer.judge("dp2", "dp1", _train_outs(), _train_outs(parts=1))
    assert fp32[-1].status == "not-run" and "no separate fp32 main copy" in fp32[-1].detail


def test_weights_match_main_params_missing_and_wrong_dtype_mains():
    full = {k: v.to(torch.bfloat16) for k, v in _canonical().items()}
    mains = {f"optimizer.state.fp32_param.{k}": v.float() for k, v in full.items()}  # the non-distributed optimizer's name
    assert weights_match_main_params([("tp1", full, mains)], "bf16").status == "passed"
    lost = dict(mains)
    lost.pop("optimizer.state.fp32_param.embedding.word_embeddings.weight")
    c = weights_match_main_params([("tp1", full, lost)], "bf16")
    assert c.status == "failed" and {m.kind for m in c.mismatches} == {"extra"}  # a weight without its main param
    half = {k: v.to(torch.bfloat16) for k, v in mains.items()}  # "main" params that are bf16 are no fp32 copy
    c = weights_match_main_params([("tp1", full, half)], "bf16")
    assert c.status == "failed" and {m.kind for m in c.mismatches} == {"dtype"}


def test_corrupted_main_param_fails_optimizer_state_in_bf16():
    # the lowest bit of an fp32 main param: its bf16 cast usually hides it, the bitwise optimizer-state does not
    loaded = _bf16_outs()
    _find(loaded, "optimizer.state.param.embedding").data.view(-1).view(torch.int32)[0] ^= 1
    s = _statuses(reshard_optimizer.judge("dp2", "tp2", _bf16_outs(), loaded, "bf16"))
    assert s["optimizer-state"] == "failed" and s["model-weights"] == "passed"
    # a main param off by far more than a bf16 ulp fails the model/main agreement as well
    far = _bf16_outs()
    _find(far, "optimizer.state.param.embedding").data.add_(0.5)
    s = _statuses(reshard_optimizer.judge("dp2", "tp2", _bf16_outs(), far, "bf16"))
    assert s["optimizer-state"] == "failed" and s["weights-match-main-params"] == "failed"


def test_resume_bf16_tolerances_are_measured_bounds():
    base = [4.9, 4.91, 5.0]
    ref = _bf16_outs(losses=base)
    measured = [x + 7.6e-4 for x in base]  # the measured bf16 max across a topology change
    ok = resume.judge(3, "dp2", "dp1", ref, _bf16_outs(parts=1, losses=measured, weights_delta=2.9e-3, norm_delta=6.0e-3), "bf16")
    s = _statuses(ok)
    assert s == {"propagation": "passed", "losses": "passed", "lr": "passed", "grad-norm": "passed", "final-weights": "passed",
                 "weights-match-main-params": "passed"}
    checks = {c.name: c for c in ok}
    assert checks["losses"].tolerance.label.startswith("atol=0.002") and checks["final-weights"].tolerance.label.startswith("atol=0.005")
    assert checks["grad-norm"].tolerance.label.startswith("atol=0.01")
    reset = [x + 3.7e-3 for x in base]  # what a reset Adam step does in bf16 (dp_reshardable, measured: grad norm 6.2e-2 off)
    s = _statuses(resume.judge(3, "dp2", "dp1", ref, _bf16_outs(parts=1, losses=reset, weights_delta=7.8e-3, norm_delta=6.2e-2), "bf16"))
    assert s["losses"] == "failed" and s["final-weights"] == "failed" and s["grad-norm"] == "failed"
    # a scheduler saved but not restored: the resumed steps replay the warmup's LRs
    replay = _bf16_outs(parts=1, losses=measured, lrs=[1e-4, 5.5e-4, 1e-3])
    s = _statuses(resume.judge(3, "dp2", "dp1", ref, replay, "bf16"))
    assert s["lr"] == "failed" and s["grad-norm"] == "passed"
    # same topology: bitwise in bf16 too; fp32 keeps RESUME_TOLERANCE and records the new check not-run
    assert _statuses(resume.judge(3, "dp2", "dp2", ref, _bf16_outs(losses=measured), "bf16"))["losses"] == "failed"
    fp32 = resume.judge(3, "dp2", "dp1", _train_outs(losses=base), _train_outs(parts=1, losses=base))
    assert fp32[1].tolerance == resume.RESUME_TOLERANCE and _statuses(fp32)["weights-match-main-params"] == "not-run"
    assert {c.name: c for c in fp32}["grad-norm"].tolerance == resume.RESUME_TOLERANCE


def test_reshard_weights_bf16_judge():
    full = {k: v.to(torch.bfloat16) for k, v in _canonical(keys=LAYOUT).items()}
    logits = torch.randn(2, 16, 128)

    def run(loaded_full=None, loaded_logits=None, dst="tp1pp2", checkpoint=None):
        saved = _weights_outs(full, 2, logits)
        loaded = _weights_outs(loaded_full or full, 2, logits if loaded_logits is None else loaded_logits)
        return _statuses(reshard_weights.judge(GQA, Topology.parse("tp2"), Topology.parse(dst), saved, loaded,
                                               checkpoint or dict(full), {k: v.clone() for k, v in full.items()}, "bf16"))

    assert set(run().values()) == {"passed"}
    # the truth is the canonical fp32 tensor cast to bf16: an fp32 load (or checkpoint) fails on dtype
    assert run(loaded_full={k: v.float() for k, v in full.items()})["loaded-canonical"] == "failed"
    assert run(checkpoint={k: v.float() for k, v in full.items()})["checkpoint-canonical"] == "failed"
    # an fp32 case judging the bf16 model fails source-canonical: the dtype is the case's, not the model's
    fp32 = reshard_weights.judge(GQA, Topology.parse("tp2"), Topology.parse("tp2"), _weights_outs(full, 2, logits),
                                 _weights_outs(full, 2, logits), dict(full), dict(full))
    assert _statuses(fp32)["source-canonical"] == "failed"
    assert run(loaded_logits=logits + 1.76e-2)["logits"] == "passed"  # measured bf16 max across a TP change
    assert run(loaded_logits=logits + 1.76e-2, dst="tp2")["logits"] == "failed"  # same TP: bitwise
    assert run(loaded_logits=logits + 0.5)["logits"] == "failed"


def test_knob_check_names_side_and_rank():
    c = knob_check("propagation", [("tp2", [_knobs(), _knobs(ok=False)])], "ok")
    assert c.status == "failed" and c.detail.startswith("tp2 rank 1: use_distributed_optimizer")


# --------------------------------------------------------------------------- HF and PEFT


def test_hf_roundtrip_judge():
    state = {"model.embed_tokens.weight": torch.randn(128, 64)}
    logits = torch.randn(2, 16, 128)
    outs = [hf_roundtrip.BridgeOut([{"knob": "overlap_grad_reduce", "asked": False, "actual": False, "ok": True}], logits + 1e-7)]
    src, dst = Topology.parse("tp2"), Topology.parse("pp2")
    dtypes = ("float32", "float32")
    good = hf_roundtrip.judge(src, dst, [("a", outs), ("b", outs)], state, dict(state), logits, logits.clone(), dtypes)
    assert set(_statuses(good).values()) == {"passed"} and {"megatron-logits@a", "megatron-logits@b"} <= set(_statuses(good))
    flipped = {k: v.clone() for k, v in state.items()}
    _flip(flipped["model.embed_tokens.weight"])
    bad = _statuses(hf_roundtrip.judge(src, dst, [("a", outs)], state, flipped, logits, logits + 1e-3, dtypes))
    assert bad["export-bitwise"] == "failed" and bad["hf-logits"] == "failed"
    far = [hf_roundtrip.BridgeOut(outs[0].propagation, logits + 1e-2)]
    assert _statuses(hf_roundtrip.judge(src, dst, [("a", far)], state, state, logits, logits, dtypes))["megatron-logits@a"] == "failed"
    # no transformers class (a remote-code family): the logits checks not-run with why, the weights still judged
    remote = _statuses(hf_roundtrip.judge(src, dst, [("a", outs)], state, flipped, None, None, dtypes, no_logits="no HF class"))
    assert remote["hf-logits"] == remote["megatron-logits"] == "not-run" and remote["export-bitwise"] == "failed"
    # transformers refuses the export (a file its from_pretrained needs is missing): hf-logits fails naming the error,
    # Megatron's logits are still judged against the source's
    refused = hf_roundtrip.judge(src, dst, [("a", outs)], state, dict(state), logits, None, dtypes,
                                 export_refused="OSError: no file named spk_dict.pt")
    checks = {c.name: c for c in refused}
    assert checks["hf-logits"].status == "failed" and "spk_dict.pt" in checks["hf-logits"].detail
    assert checks["megatron-logits@a"].status == "passed"


def test_hf_export_dtype_judge():
    bf16 = {"model.norm.weight": torch.ones(4, dtype=torch.bfloat16), "model.embed_tokens.weight": torch.ones(8, 4, dtype=torch.bfloat16)}
    assert hf_roundtrip.export_dtype_check("bfloat16", "bfloat16", bf16).status == "passed"
    # the tensors right, the config wrong: only export-dtype can see it (export-bitwise reads tensors)
    c = hf_roundtrip.export_dtype_check("bfloat16", "float32", bf16)
    assert c.status == "failed" and "export config dtype 'float32', source config 'bfloat16'" in c.detail
    upcast = {k: v.float() for k, v in bf16.items()}
    c = hf_roundtrip.export_dtype_check("bfloat16", "bfloat16", upcast)
    assert c.status == "failed" and "2 exported tensor(s) not bfloat16" in c.detail
    assert hf_roundtrip.export_dtype_check(None, None, bf16).status == "failed"  # a source without a dtype proves nothing


@pytest.mark.parametrize("bound", [hf_roundtrip.megatron_tolerance, _peft.logits_tolerance])
def test_bf16_hf_logits_tolerances(bound):
    """The bf16 bound on Megatron-vs-transformers logits: one bf16 ulp at |logit| 2..4 passes, a
    wrong weight's O(1e-1) does not; fp32 keeps its 1e-5 bound."""
    logits = torch.full((1, 2, 4), 3.0)
    ulp = logits + 1.5625e-2
    assert compare_tensors("l", logits, ulp, "a", "b", bound("bf16")) is None
    assert compare_tensors("l", logits, logits + 0.2, "a", "b", bound("bf16")) is not None
    assert compare_tensors("l", logits, ulp, "a", "b", bound("fp32")) is not None


def test_the_peft_logits_bound_widens_to_twice_peft_s_own_fp32_error_and_no_further():
    """peft-export's fp32 logits bound with transformers+PEFT's measured fp32 error e: max(1e-5, 2e), named; a
    difference past 2e still fails; bf16 ignores e (its bound already covers rounding)."""
    logits, base = torch.zeros(1, 2, 4), torch.full((1, 2, 4), 1.0)
    c = _peft.logits_check(logits, base, logits + 1.76e-5, "tp1", "fp32")
    assert c.status == "failed"  # the fixed 1e-5
    c = _peft.logits_check(logits, base, logits + 1.76e-5, "tp1", "fp32", reference_error=2.2e-5)
    assert c.status == "passed" and c.tolerance.atol == pytest.approx(4.4e-5) and "2.2e-05" in c.tolerance.why
    assert _peft.logits_check(logits, base, logits + 5e-5, "tp1", "fp32", reference_error=2.2e-5).status == "failed"
    assert _peft.logits_check(logits, base, logits + 1.76e-5, "tp1", "fp32", reference_error=1e-7).status == "failed"
    assert _peft.logits_check(logits, base, logits + 0.2, "tp1", "bf16", reference_error=1.0).status == "failed"


def test_peft_config_logits_and_reshard_judges():
    asked = {"r": 4, "lora_alpha": 8, "target_modules": ["k_proj", "q_proj"], "base_model_name_or_path": "/x"}
    assert _peft.config_check({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj"],
                                     "base_model_name_or_path": "/x"}, asked).status == "passed"
    lost = _peft.config_check({"r": 4, "lora_alpha": 0, "target_modules": ["q_proj", "k_proj"], "base_model_name_or_path": "/x"}, asked)
    assert lost.status == "failed" and "lora_alpha: asked 8, exported 0" in lost.detail  # verl #1821
    base, lora = torch.zeros(2, 4), torch.ones(2, 4)
    assert _peft.logits_check(lora, base, lora.clone(), "tp1").status == "passed"
    assert "no-op adapter" in _peft.logits_check(base, base, base.clone(), "tp1").detail
    assert _peft.logits_check(lora, base, lora + 1e-3, "tp1").status == "failed"
    a = {"base_model.model.layers.0.q_proj.lora_A.weight": torch.randn(4, 64)}
    b = {k: v.clone() for k, v in a.items()}
    _flip(next(iter(b.values())))
    piece = {"name": "decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight", "tp_rank": 0, "tp": 1, "data": torch.randn(4, 64)}
    outs = [peft_export.PeftOut([piece], None)]
    s = _statuses(peft_export.judge_resharded("tp2", "pp2", outs, outs, a, b))
    assert s == {"resharded-export": "failed", "adapter-params": "passed"}


def test_peft_mapping_splits_a_gated_fc1_and_keeps_a_non_gated_one():
    """At TP 2 a SwiGLU fc1's lora_B shards are [gate_r; up_r] and must be de-interleaved into
    gate_proj/up_proj; a non-gated fc1 (Nemotron) is up_proj alone, a plain column-parallel concat."""
    from harness.models import peft_mapping

    name = "decoder.layers.0.mlp.linear_fc1.adapter.linear_out.weight"
    rows = torch.arange(8.0).unsqueeze(1)  # global rows 0..7; rank r holds rows 4r..4r+3
    pieces = [{"name": name, "tp_rank": r, "tp": 2, "data": rows[4 * r: 4 * r + 4]} for r in (0, 1)]
    gated = peft_mapping.gather(pieces)[name].flatten().tolist()
    assert gated == [0, 1, 4, 5, 2, 3, 6, 7]  # [gate_0; gate_1; up_0; up_1]
    assert peft_mapping.gather(pieces, gated=False)[name].flatten().tolist() == list(range(8))
    hf = peft_mapping.to_hf_peft({name: rows}, get_model("hf-nemotron"))
    assert list(hf) == ["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"] and torch.equal(next(iter(hf.values())), rows)
    llama = peft_mapping.to_hf_peft({name: rows}, get_model("hf-llama"))
    assert sorted(k.split(".")[-3] for k in llama) == ["gate_proj", "up_proj"]


def test_expert_adapters_get_global_expert_indices_and_per_expert_hf_names():
    """An expert's adapter on EP rank 1 of ep2 (local expert 0 of 2 per rank) is global expert 2; its
    fused SwiGLU fc1 lora_B splits into that expert's gate_proj/up_proj, fc2 is its down_proj."""
    from harness.models import peft_mapping
    from harness.models.bridge import global_name

    local = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.adapter.linear_out.weight"
    name = global_name(local, offset=2, expert_offset=2)
    assert name == "decoder.layers.3.mlp.experts.local_experts.2.linear_fc1.adapter.linear_out.weight"
    b = torch.arange(8.0).unsqueeze(1)
    fc2_a = name.replace("linear_fc1", "linear_fc2").replace("linear_out", "linear_in")
    hf = peft_mapping.to_hf_peft({name: b, fc2_a: torch.ones(4, 2)}, get_model("hf-qwen3moe"))
    prefix = "base_model.model.model.layers.3.mlp.experts.2"
    assert torch.equal(hf[f"{prefix}.gate_proj.lora_B.weight"], b[:4]) and torch.equal(hf[f"{prefix}.up_proj.lora_B.weight"], b[4:])
    assert set(hf) == {f"{prefix}.gate_proj.lora_B.weight", f"{prefix}.up_proj.lora_B.weight", f"{prefix}.down_proj.lora_A.weight"}


def test_pooled_expert_adapters_number_the_vision_pool_after_the_text_pool():
    """ERNIE-4.5-VL: Megatron's text_moe_layer / vision_moe_layer experts are one HF list (text 0..N-1, vision
    N..2N-1) in the checkpoint, and two pools from 0 in transformers' memory (peft_mapping.memory_name)."""
    from harness.models import peft_mapping
    from harness.models.bridge import global_name

    spec = get_model("hf-ernie4_5_vl_moe")
    n = spec.num_experts
    local = "language_model.decoder.layers.1.mlp.vision_moe_layer.experts.local_experts.0.linear_fc2.adapter.linear_in.weight"
    name = global_name(local, offset=0, expert_offset=1)  # EP rank 1 of ep2 with 2 local experts would give 2; here 1
    assert ".vision_moe_layer.experts.local_experts.1." in name
    hf = peft_mapping.to_hf_peft({name: torch.ones(4, 2), name.replace("vision_moe_layer", "text_moe_layer"): torch.zeros(4, 2)}, spec)
    assert set(hf) == {f"base_model.model.model.layers.1.mlp.experts.{n + 1}.down_proj.lora_A.weight",
                       "base_model.model.model.layers.1.mlp.experts.1.down_proj.lora_A.weight"}
    assert torch.equal(hf[f"base_model.model.model.layers.1.mlp.experts.{n + 1}.down_proj.lora_A.weight"], torch.ones(4, 2))
    memory = peft_mapping.memory_name
    assert memory(f"model.layers.1.mlp.experts.{n + 1}.down_proj", spec.arch, n) == "model.layers.1.mlp.vision_moe.experts.1.down_proj"
    assert memory("model.layers.1.mlp.experts.1.down_proj", spec.arch, n) == "model.layers.1.mlp.text_moe.experts.1.down_proj"
    assert memory("model.layers.1.mlp.experts.1.down_proj", "qwen3_moe", 4) == "model.layers.1.mlp.experts.1.down_proj"


@pytest.mark.parametrize("name", ["hf-llama", "hf-qwen2"])
def test_truth_is_a_pure_function_of_seeds(name):
    model = get_model(name)
    assert torch.equal(truth.fixed_input_ids(model), truth.fixed_input_ids(model))
    shapes = {"model.norm.weight": (64,), "model.layers.0.self_attn.q_proj.bias": (64,)}
    a, b = truth.canonical_hf_state(model, shapes), truth.canonical_hf_state(model, shapes)
    assert all(torch.equal(a[k], b[k]) for k in shapes) and float(a["model.norm.weight"].mean()) > 0.5


class _FakeModel(torch.nn.Module):
    """named_parameters of a model holding `experts` local experts (and a router where asked) besides a
    dense weight, in `dtype` (no process group needed)."""

    def __init__(self, experts: int, dtype=torch.float32, router: bool = False):
        super().__init__()
        self.p = {f"decoder.layers.0.mlp.experts.local_experts.{i}.linear_fc1.weight": torch.nn.Parameter(torch.zeros(1, dtype=dtype))
                  for i in range(experts)}
        self.p["decoder.layers.0.self_attention.linear_proj.weight"] = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        if router:
            self.p["decoder.layers.0.mlp.router.weight"] = torch.nn.Parameter(torch.zeros(1, dtype=dtype))

    def named_parameters(self, *a, **k):
        return iter(self.p.items())

    def parameters(self, *a, **k):
        return iter(self.p.values())


def test_bridge_propagation_names_a_wrong_dtype_and_unsplit_experts():
    from harness.models import bridge as mb

    def bad(records):
        return sorted(r["knob"] for r in records if not r["ok"])

    assert bad(mb.ddp_propagation(mb.BridgeModel(None, [_FakeModel(2)], local_experts_asked=2), {}, "fp32")) == []
    # ep2 asked, but every rank holds all 4 experts: the provider never got expert_model_parallel_size
    assert bad(mb.ddp_propagation(mb.BridgeModel(None, [_FakeModel(4)], local_experts_asked=2), {}, "fp32")) == ["local experts (num_experts/ep)"]
    # a stage of dense layers only (an uneven first stage of a DeepSeek-style model) holds no experts, rightly;
    # a stage with a router but no local expert does not
    assert bad(mb.ddp_propagation(mb.BridgeModel(None, [_FakeModel(0)], local_experts_asked=2), {}, "fp32")) == []
    assert bad(mb.ddp_propagation(mb.BridgeModel(None, [_FakeModel(0, router=True)], local_experts_asked=2), {}, "fp32")) == \
        ["local experts (num_experts/ep)"]
    # bf16 asked, fp32 params and no Float16Module
    assert bad(mb.ddp_propagation(mb.BridgeModel(None, [_FakeModel(2)], local_experts_asked=2), {}, "bf16")) == ["Float16Module", "params_dtype"]
