"""Would a load at topology D, with the installed megatron-core, find everything it asks for?

The target's sharded state is built as harness.plan builds it (each distinct (tp, pp, ep) rank's
GPTModel on the meta device under torch's fake process group, factories applied), for the model the
checkpoint records or `--model` names (harness.inspect.model), and matched against the checkpoint's
torch DCP metadata, key by key: each key present (else *missing*, with the ranks that ask for it),
the same global shape and dtype (else *mismatched*), and each rank's box held by the saved chunks
(else *uncovered*: a load leaves those elements unset). Saved model keys nobody asks for are
*unexpected* (a strict load refuses them). Optimizer state: fully_reshardable's per-parameter keys
for every parameter the target builds; dp_reshardable only at the save's tp/pp/ep. An adapter-only
checkpoint (Bridge LoRA: `<linear>.adapter.linear_{in,out}.weight`) is matched against the base
linears of the target (the adapter wrapper itself is not built). Integrity findings of the files
(harness.inspect.detect) fail the load too. HF directories: their integrity, and the config's model
split at D."""

from __future__ import annotations

import time
from collections import defaultdict
from math import prod
from pathlib import Path

from harness.core.topology import Topology, TopologyError
from harness.inspect import detect, model as models
from harness.inspect.part import FSDP_DTENSOR, HF, TORCH_DIST, InspectInputError, Inspection, Part
from harness.plan.model import PlanInputError, PlanModel

EXIT_OK, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2
_ADAPTER = ".adapter."
#: sharded with allow_shape_mismatch=True by megatron-core (vocab padding): a larger or smaller vocab loads silently
_VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def parse_topology(text: str) -> Topology:
    try:
        return Topology.parse(text)
    except TopologyError as e:
        raise InspectInputError(f"--to {text!r}: {e}") from None


def target_records(model: PlanModel, topo: Topology) -> list:
    from harness.plan.collect import topology_records

    try:
        return topology_records(model, topo)
    except PlanInputError as e:
        raise InspectInputError(str(e)) from None


def _ranks(ranks) -> str:
    ranks = sorted(set(ranks))
    return ", ".join(map(str, ranks[:8])) + (f", ... ({len(ranks)} ranks)" if len(ranks) > 8 else "")


def _held(box_off: tuple, box_size: tuple, chunks: list) -> int:
    """Elements of the box that the saved chunks hold (DCP chunks do not overlap)."""
    n = 0
    for off, size in chunks:
        inter = 1
        for a, s, b, t in zip(box_off, box_size, off, size):
            lo, hi = max(a, b), min(a + s, b + t)
            if hi <= lo:
                inter = 0
                break
            inter *= hi - lo
        n += inter
    return n


def match(records: list, tensors: dict) -> dict:
    """The target's records against the checkpoint's tensors (key -> (shape, dtype, chunks))."""
    asked: dict[str, list] = defaultdict(list)
    for r in records:
        asked[r.key].append(r)
    saved = {k: v for k, v in tensors.items() if not k.startswith("optimizer.") and _ADAPTER not in k}
    adapters = {k: v for k, v in tensors.items() if not k.startswith("optimizer.") and _ADAPTER in k}
    if adapters and not saved:  # an adapter-only checkpoint (Bridge PEFT): the base comes from elsewhere
        return _match_adapter(asked, adapters)
    missing, mismatched, uncovered = [], [], []
    for key, recs in sorted(asked.items()):
        if key not in saved:
            missing.append({"key": key, "ranks": _ranks(r.rank for r in recs)})
            continue
        shape, dtype, chunks = saved[key]
        want = (tuple(recs[0].global_shape), recs[0].dtype)
        if want != (tuple(shape), dtype):
            vocab = key in _VOCAB_KEYS and tuple(shape[1:]) == want[0][1:] and dtype == want[1]
            mismatched.append(f"{key}: saved {list(shape)} {dtype}, the load asks {list(want[0])} {want[1]}"
                              + (" (megatron-core allows a vocab mismatch here, for padding: it would load the "
                                 "first rows without a word)" if vocab else ""))
            continue
        short = [r for r in recs if _held(r.global_offset, r.local_shape, chunks) < prod(r.local_shape)]
        if short:
            r = short[0]
            uncovered.append({"key": key, "ranks": _ranks(x.rank for x in short),
                              "box": f"offset {list(r.global_offset)} size {list(r.local_shape)}"})
    unexpected = sorted(set(saved) - set(asked))
    if adapters:  # base + adapter in one checkpoint: the adapter tensors against the same base linears
        more = _match_adapter(asked, adapters)
        mismatched, unexpected = mismatched + more["mismatched"], unexpected + more["unexpected"]
    return {"mode": "model", "asked": len(asked), "missing": missing, "mismatched": mismatched, "uncovered": uncovered,
            "unexpected": unexpected, "adapter_tensors": len(adapters)}


def _match_adapter(asked: dict, saved: dict) -> dict:
    """Bridge LoRA keys against the base linears: linear_in (layers, r, in), linear_out (layers, out, r)."""
    mismatched, unexpected, bases = [], [], set()
    for key, (shape, dtype, _) in sorted(saved.items()):
        base, _, leaf = key.partition(_ADAPTER)
        recs = asked.get(f"{base}.weight")
        if recs is None or leaf not in ("linear_in.weight", "linear_out.weight"):
            unexpected.append(key)
            continue
        bases.add(base)
        g = tuple(recs[0].global_shape)
        r = shape[-2] if leaf == "linear_in.weight" else shape[-1]
        want = (*g[:-2], r, g[-1]) if leaf == "linear_in.weight" else (*g[:-1], r)
        if tuple(shape) != want or dtype != recs[0].dtype:
            mismatched.append(f"{key}: saved {list(shape)} {dtype}, the base {base}.weight {list(g)} {recs[0].dtype} "
                              f"needs {list(want)} {recs[0].dtype}")
    return {"mode": "adapter", "asked": len(saved), "adapted_linears": len(bases), "missing": [], "mismatched": mismatched,
            "uncovered": [], "unexpected": unexpected}


def optimizer_problems(part: Part, records: list, topo: Topology, source: Topology | None) -> list[str]:
    from harness.plan.predict import optimizer_verdict

    fmt = part.info.get("optimizer", "none")
    if fmt == "fully_reshardable":
        states = sorted({k.split(".")[2] for k in part.tensors if k.startswith("optimizer.state.")})
        keys = {r.key: tuple(r.global_shape) for r in records}
        out = []
        for s in states:
            for key, shape in sorted(keys.items()):
                got = part.tensors.get(f"optimizer.state.{s}.{key}")
                if got is None:
                    out.append(f"optimizer.state.{s}.{key}: missing (the optimizer of the target holds {key})")
                elif tuple(got[0]) != shape:
                    out.append(f"optimizer.state.{s}.{key}: saved {list(got[0])}, the parameter is {list(shape)}")
        return out
    if fmt == "dp_reshardable":
        if source is None:
            return []  # said in the notes: the save's tp/pp/ep are not recorded
        why = optimizer_verdict(fmt, source, topo)
        return [why] if why else []
    return []


def _mp(tp: int, pp: int, ep: int) -> Topology:
    """A topology with the save's model-parallel sizes (dp = ep: only tp/pp/ep decide a dp_reshardable load)."""
    return Topology(tp=int(tp), pp=int(pp), dp=int(ep), ep=int(ep))


def _source(ins: Inspection, part: Part) -> Topology | None:
    """The save's topology where a record says it: Megatron-LM args, Bridge's run_config.yaml, the corpus manifest."""
    t = part.info.get("topology", {})
    if t.get("from") == "Megatron-LM args":
        return _mp(t.get("tp", 1), t.get("pp", 1), t.get("ep", 1))
    cfg = detect.run_config(part.path)
    m = cfg.get("model") if cfg else None
    if isinstance(m, dict) and m.get("tensor_model_parallel_size"):
        return _mp(m["tensor_model_parallel_size"], m.get("pipeline_model_parallel_size") or 1,
                   m.get("expert_model_parallel_size") or 1)
    found = detect.manifest_entry(part.path)
    if found is not None and found[2].get("source"):
        return Topology.parse(found[2]["source"])
    return None


def check_part(ins: Inspection, part: Part, topo: Topology, model_ref: str | None) -> dict:
    out: dict = {"path": str(part.path), "format": part.format, "integrity": list(part.findings), "notes": list(part.notes)}
    if part.format == TORCH_DIST and part.tensors:
        model, where = models.resolve(part, model_ref)
        records = target_records(model, topo)
        out.update(model=model.name, model_from=where, ranks_built=len({r.rank for r in records}), **match(records, part.tensors))
        source = _source(ins, part)
        if part.info.get("optimizer") == "dp_reshardable" and source is None:
            out["notes"].append("dp_reshardable optimizer state: the save's tp/pp/ep are not recorded, so whether "
                                f"{topo.id} may load it is not decided here (only the same tp/pp/ep can)")
        out["optimizer"] = {"format": part.info.get("optimizer"), "saved_at": source.id if source else None,
                            "problems": optimizer_problems(part, records, topo, source) if out["mode"] == "model" else []}
    elif part.format == FSDP_DTENSOR:
        out["notes"].append("fsdp_dtensor: keys are Megatron-FSDP's per-layer names; check-load matches torch_dist keys "
                            "only, so only the files' integrity is judged")
    elif part.format == HF and isinstance(part.info.get("config"), dict):
        try:
            config_model = models.from_ref(str(part.path / "config.json"))
        except InspectInputError as e:
            out["notes"].append(f"config.json not read as a planner model ({e}): its split at {topo.id} is not checked")
        else:
            try:
                topo.validate(config_model)
            except (TopologyError, ValueError) as e:
                out["integrity"].append(f"the config's model cannot be split at {topo.id}: {e}")
    problems = sum(len(out.get(k) or []) for k in ("integrity", "missing", "mismatched", "uncovered", "unexpected"))
    problems += len((out.get("optimizer") or {}).get("problems") or [])
    out["verdict"] = "fails" if problems else "loads"
    return out


def check_load(path: Path, to: str, model_ref: str | None = None, allow_unpickle: bool = False) -> dict:
    """check-load as a dict (InspectInputError on bad input)."""
    t0 = time.perf_counter()
    topo = parse_topology(to)
    ins = detect.inspect(Path(path), allow_unpickle)
    checked = [check_part(ins, p, topo, model_ref) for p in ins.parts if p.format != "safetensors"]
    if not checked and not ins.findings:
        raise InspectInputError(f"{path}: no checkpoint to load here (only loose safetensors files)")
    bad = ins.findings or any(c["verdict"] == "fails" for c in checked)
    return {"root": str(ins.root), "layout": ins.layout, "target": topo.id, "layout_findings": ins.findings,
            "parts": checked, "verdict": "DOES NOT LOAD" if bad else "LOADS", "exit_code": EXIT_FAIL if bad else EXIT_OK,
            "seconds": round(time.perf_counter() - t0, 2)}
