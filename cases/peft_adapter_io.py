"""peft-adapter-io: an adapter in HF PEFT's own format, saved and loaded the way its users do it.

Once an adapter leaves Megatron it lives in PEFT's format: verl saves its FSDP LoRA adapters with
`save_pretrained`, a Bridge export is loaded and saved again by PEFT, an adapter trained with
transformers + PEFT is handed to a Megatron stack. What decides that round trip is PEFT's
save_and_load (which tensors an adapter's file holds, under which names, when the base's embeddings go
with it, how a file's keys find their modules on load): this case drives it through the forms users
write: LoRA, DoRA and rsLoRA, modules_to_save, an embedding target, trainable tokens, a resized
vocabulary, two adapters in one model, the .bin format, the meta-device load, and PEFT's
base-model state dict.

World "save" (one process): the fixture in transformers, the LoRA config of the options (a second
adapter with rank + 2 when `adapters: 2`), every adapter tensor drawn at random (seeded, so that each
holds values no other tensor has), logits per adapter and without them; saved through the backend
(hf_peft: PeftModel.save_pretrained). World "load" (another process): the fixture again (a resized
vocabulary's new rows drawn anew), the adapters loaded through the backend (PeftModel.from_pretrained,
load_adapter for the second).

Checks, each per adapter (the saved model is the truth; nothing here reads PEFT's naming rules back):
  adapter-file     each adapter tensor of the saved model is in the adapter's file exactly once with the
                   same values, under a key of its own module; every other tensor of the file is a base
                   embedding weight PEFT's documented rule saves (an embedding among the targets: its
                   weight; a resized vocabulary: the input and output embeddings), equal to the base's,
                   and each of those is there
  adapter-load     the loaded model's adapter tensors equal the saved model's, bitwise, name for name
  logits           the loaded model's logits equal the saved model's, per adapter, torch.equal
  adapter-effect   the saved adapter moved the logits (a load that lost it would otherwise pass)
  warnings         the save warned of no invalid adapter tensor, the load of no missing, unexpected or
                   mismatched key
  adapter-config   adapter_config.json's r, lora_alpha, target_modules, use_dora, use_rslora,
                   modules_to_save and trainable_token_indices are the ones the adapter was made with
  base-state       (base_state) PEFT's get_base_model_state_dict gives the base's own keys and values,
                   and set_base_model_state_dict with them restores the logits after the base was disturbed
  invalid-warning, refusal   (save_from zero3 / fsdp: expect: refuse) the LoRA tensors saved as an
                   ungathered rank holds them: the save warns naming them, the load refuses naming each
  mismatch-fresh, mismatch-warning   (load_base unresized) the load with ignore_mismatched_sizes leaves out
                   exactly the tensors of the resized vocabulary, at their fresh values, and says so;
                   adapter-load then covers the other tensors, and logits are not compared
(cases/shared/peft_shapes.py has these judges.)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from .shared import peft_shapes as shapes
from .contract import Case
from .shared.adapter_draw import WARNED
from .ranks.peft_adapter_io import ADAPTERS, Phase, load_rank, of_adapters, save_rank
from harness.core.parity import EXACT, compare_tensors
from harness.core.result import CaseResult, Check
from harness.core.spec import CaseSpec
from harness.core.frames import exception_of
from harness.core.zoo import HFModelSpec, get_model
from harness.judge.checks import refusal_check
from harness.run.envelope import RunEnv

#: PEFT's embedding module names (peft.utils.constants.EMBEDDING_LAYER_NAMES): a target among them
#: makes save_pretrained save its base weight (save_embedding_layers="auto")
EMBEDDINGS = ("embed_tokens", "lm_head")
#: the name segments PEFT puts between a module and its adapter's tensors
PEFT_PARTS = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector",
                        "modules_to_save", "token_adapter"})
MIN_ADAPTER_EFFECT = 1e-3  # max |logits(adapter) - logits(base)| below this: the adapter did nothing
#: what a save or a load must not warn of (PEFT warns of invalid-shape LoRA tensors on save, of missing,
#: unexpected or mismatched keys on load); other warnings (deprecations, the embedding-save notice) pass
SHOWN = 6


@dataclass(frozen=True)
class Options:
    targets: tuple[str, ...] = ("q_proj", "v_proj")  # LoraConfig target_modules: HF module names
    dim: int = 4
    alpha: int = 8
    variant: Literal["lora", "dora", "rslora"] = "lora"
    modules_to_save: tuple[str, ...] = ()
    trainable_token_indices: tuple[int, ...] = ()
    adapters: int = 1  # 2: a second adapter ("second", rank dim + 2) saved beside the first
    resize_vocab: int = 0  # the base's vocabulary resized to this before the adapter is made (0: kept)
    base_state: bool = False  # PEFT's get/set_base_model_state_dict too
    #: the LoRA A/B tensors at save_pretrained: gathered, or as rank 0 of an ungathered DeepSpeed ZeRO-3 or
    #: FSDP1 (use_orig_params) world of two holds them (cases.ranks.peft_adapter_io.ungather); not gathered: expect: refuse
    save_from: Literal["gathered", "zero3", "fsdp"] = "gathered"
    #: "unresized": the load's base is the fixture as shipped, not resized to resize_vocab (the adapter trained on a
    #: resized vocabulary loaded onto the original base, with the backend's ignore_mismatched_sizes)
    load_base: Literal["as-saved", "unresized"] = "as-saved"
    refuse_with: tuple[str, ...] = ("RuntimeError",)  # torch's load_state_dict refuses a size mismatch so


def module_of(name: str) -> str:
    """The module an adapter tensor belongs to: its name up to PEFT's first own segment."""
    parts = name.split(".")
    cut = next((i for i, s in enumerate(parts) if s in PEFT_PARTS or s in ADAPTERS), len(parts))
    return ".".join(parts[:cut])


def expected_extras(opts: Options, plain: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base weights PEFT's documented rule puts in an adapter's file beside the adapter (by the
    base's key): a targeted embedding's weight (not with trainable tokens); else, with a resized
    vocabulary, the input and output embeddings."""
    wanted = set() if opts.trainable_token_indices else {e for e in EMBEDDINGS if e in opts.targets}
    if opts.resize_vocab and not {e for e in EMBEDDINGS if e in opts.targets}:
        wanted |= set(EMBEDDINGS)
    return {k: v for k, v in plain.items() if k.endswith(".weight") and k.split(".")[-2] in wanted}


def file_check(adapter: str, params: dict[str, torch.Tensor], file: dict[str, torch.Tensor],
               extras: dict[str, torch.Tensor]) -> Check:
    """adapter-file: each of `params` (the saved model's adapter tensors) in `file` once, bitwise, under
    a key of its module; the file's other tensors exactly `extras` (base weights, by the base's key)."""
    if not params or not file:
        return Check(f"adapter-file@{adapter}", "failed", f"nothing to compare: {len(params)} adapter tensors, "
                     f"{len(file)} in the file", tolerance=EXACT)
    problems, used = [], set()
    for name, t in sorted(params.items()):
        hits = [k for k, v in file.items() if v.shape == t.shape and v.dtype == t.dtype and torch.equal(v, t)]
        if len(hits) != 1:
            problems.append(f"{name}: {'no' if not hits else len(hits)} tensor(s) of the file hold its values")
            continue
        used.add(hits[0])
        if not hits[0].startswith(module_of(name) + "."):
            problems.append(f"{name}: its values are in the file under {hits[0]}, not under its module {module_of(name)}")
    for key, t in sorted(extras.items()):
        module = key.rsplit(".", 1)[0]
        hits = [k for k, v in file.items() if k not in used and module in k and v.shape == t.shape and torch.equal(v, t)]
        if not hits:
            problems.append(f"base weight {key}: not in the file with the base's values (PEFT's rule saves it)")
        used.update(hits)
    stray = sorted(set(file) - used)
    problems += [f"{k}: in the file, neither an adapter tensor nor a base weight PEFT's rule saves" for k in stray]
    if problems:
        return Check(f"adapter-file@{adapter}", "failed", f"{len(problems)} problem(s): " + "; ".join(problems[:SHOWN]),
                     tolerance=EXACT)
    return Check(f"adapter-file@{adapter}", "passed", f"{len(params)} adapter tensors, each once under its module, bitwise"
                 + (f"; {len(extras)} base weight(s) as PEFT's rule says" if extras else ""), 0.0, EXACT)


def load_check(adapter: str, saved: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> Check:
    """adapter-load: the loaded adapter tensors against the saved ones, name for name, bitwise."""
    if not saved:
        return Check(f"adapter-load@{adapter}", "failed", "nothing to compare: the saved model has no adapter tensor",
                     tolerance=EXACT)
    problems = [f"{n}: not in the loaded model" for n in sorted(set(saved) - set(loaded))]
    problems += [f"{n}: in the loaded model only" for n in sorted(set(loaded) - set(saved))]
    for n in sorted(set(saved) & set(loaded)):
        bad = compare_tensors(n, saved[n], loaded[n], "saved", "loaded", EXACT)
        if bad is not None:
            problems.append(str(bad))
    if problems:
        return Check(f"adapter-load@{adapter}", "failed", f"{len(problems)} of {len(saved)} tensors: " + "; ".join(problems[:SHOWN]),
                     tolerance=EXACT)
    return Check(f"adapter-load@{adapter}", "passed", f"{len(saved)} adapter tensors equal the saved model's, bitwise", 0.0, EXACT)


def logits_check(name: str, want: torch.Tensor, got: torch.Tensor | None, what: str) -> Check:
    if got is None:
        return Check(name, "failed", f"no logits from {what}", tolerance=EXACT)
    bad = compare_tensors("logits", want, got, "saved model", what, EXACT)
    if bad is not None:
        return Check(name, "failed", str(bad), bad.max_abs_diff, EXACT, [bad])
    return Check(name, "passed", f"logits {tuple(got.shape)} of {what} equal the saved model's", 0.0, EXACT)


def effect_check(with_adapter: torch.Tensor, without: torch.Tensor) -> Check:
    moved = float((with_adapter - without).abs().max()) if with_adapter.numel() else 0.0
    ok = moved > MIN_ADAPTER_EFFECT
    return Check("adapter-effect", "passed" if ok else "failed",
                 f"the adapter moves the logits by up to {moved:.3g}" + ("" if ok else f" (<= {MIN_ADAPTER_EFFECT}: it does nothing)"))


def warnings_check(saved: list[str], loaded: list[str] | None) -> Check:
    """warnings: the save warned of no invalid adapter tensor, the load (unless None: judged elsewhere) of no
    missing, unexpected or mismatched key."""
    bad = [f"save: {w}" for w in saved if WARNED.search(w)] + [f"load: {w}" for w in loaded or [] if WARNED.search(w)]
    if bad:
        return Check("warnings", "failed", f"{len(bad)} warning(s): " + "; ".join(w[:300] for w in bad[:3]))
    return Check("warnings", "passed", "no invalid tensor on save" + (", no missing, unexpected or mismatched key on load"
                 if loaded is not None else "") + f" ({len(saved) + len(loaded or [])} warning(s) in all)")


def config_check(adapter: str, cfg: dict[str, Any] | None, opts: Options, dim: int) -> Check:
    if cfg is None:
        return Check(f"adapter-config@{adapter}", "failed", "no adapter_config.json")
    want = {"r": dim, "lora_alpha": opts.alpha, "target_modules": sorted(opts.targets), "use_dora": opts.variant == "dora",
            "use_rslora": opts.variant == "rslora", "modules_to_save": sorted(opts.modules_to_save) or None,
            "trainable_token_indices": sorted(opts.trainable_token_indices) or None}
    have = {**{k: cfg.get(k) for k in want}, "target_modules": sorted(cfg.get("target_modules") or []),
            "modules_to_save": sorted(cfg.get("modules_to_save") or []) or None,
            "trainable_token_indices": sorted(cfg.get("trainable_token_indices") or []) or None}
    wrong = [f"{k}: {have[k]!r}, made with {v!r}" for k, v in want.items() if have[k] != v]
    if wrong:
        return Check(f"adapter-config@{adapter}", "failed", "; ".join(wrong))
    return Check(f"adapter-config@{adapter}", "passed", f"{len(want)} fields as the adapter was made")


def base_state_check(plain: dict[str, torch.Tensor], got: dict[str, torch.Tensor] | None) -> Check:
    """base-state: get_base_model_state_dict's keys and values against the base's own state dict."""
    if not plain or not got:
        return Check("base-state", "failed", "nothing to compare: no base state dict", tolerance=EXACT)
    problems = [f"{k}: missing" for k in sorted(set(plain) - set(got))] + [f"{k}: not a base key" for k in sorted(set(got) - set(plain))]
    for k in sorted(set(plain) & set(got)):
        bad = compare_tensors(k, plain[k], got[k], "base", "get_base_model_state_dict", EXACT)
        if bad is not None:
            problems.append(str(bad))
    if problems:
        return Check("base-state", "failed", f"{len(problems)} problem(s): " + "; ".join(problems[:SHOWN]), tolerance=EXACT)
    return Check("base-state", "passed", f"{len(plain)} tensors under the base's own keys, bitwise", 0.0, EXACT)


class PeftAdapterIo(Case):
    name = "peft-adapter-io"
    description = "an adapter in HF PEFT's own format: saved by PEFT, loaded into a fresh transformers model"
    model_kind = "hf"
    Options = Options
    needs = frozenset({"adapter_io"})
    checks = ("adapter-file", "adapter-load", "logits", "adapter-effect", "warnings", "adapter-config", "base-state",
              "base-state-logits", "invalid-warning", "refusal", "mismatch-fresh", "mismatch-warning")
    refusable = True

    def validate_options(self, spec: CaseSpec, opts: Options) -> None:
        if spec.source.world_size != 1 or spec.target.world_size != 1:
            raise ValueError(f"case {self.name}: one process saves and one loads (transformers + PEFT, no Megatron "
                             f"world): write the pair as tp1 -> tp1, got {spec.source.id} -> {spec.target.id}")
        if opts.adapters not in (1, 2):
            raise ValueError(f"case {self.name}: adapters is 1 or 2, got {opts.adapters}")
        if not opts.targets:
            raise ValueError(f"case {self.name}: targets names no module")
        if (spec.expect == "refuse") != (opts.save_from != "gathered"):
            raise ValueError(f"case {self.name}: expect: refuse goes with save_from zero3 / fsdp (the load of an ungathered "
                             f"adapter is judged as a refusal), and only with it")
        if opts.load_base == "unresized" and not (opts.resize_vocab and spec.backend_opts.get("ignore_mismatched_sizes")):
            raise ValueError(f"case {self.name}: load_base unresized needs resize_vocab and backend option ignore_mismatched_sizes")
        if (opts.save_from != "gathered" or opts.load_base != "as-saved") and (opts.adapters != 1 or opts.base_state):
            raise ValueError(f"case {self.name}: save_from and load_base judge one adapter, without base_state")

    def run(self, spec: CaseSpec, opts: Options, env: RunEnv, result: CaseResult) -> None:
        from harness.backends import get_backend, ref_of
        from harness.models.hf import write_fixture

        model: HFModelSpec = get_model(spec.model, "hf")
        hf_dir = env.source_files("fixture", "write_fixture", (model, "fp32", 1, ()), lambda d: write_fixture(model, d))
        out = env.case_dir / "adapter"
        out.mkdir(parents=True, exist_ok=True)
        phase = Phase(hf_dir=str(hf_dir), out=str(out), opts=opts, backend=ref_of(spec), seed=1234)
        saved = env.launch("save", save_rank, phase, None)[0]
        if opts.save_from != "gathered":
            return self.ungathered(spec, opts, env, result, phase, saved)
        loaded = env.launch("load", load_rank, phase, None)[0]
        names = ADAPTERS[:opts.adapters]
        with env.timed("compare"):
            backend = get_backend(ref_of(spec))
            extras = expected_extras(opts, saved["plain"])
            for i, a in enumerate(names):
                where = out if i == 0 else out / a
                mine = {n: t for n, t in saved["params"].items() if of_adapters(n, (a,))}
                file = backend.read_full(None, where)
                result.checks.append(file_check(a, mine, file, extras))
                got = {n: t for n, t in loaded["params"].items() if of_adapters(n, (a,))}
                if opts.load_base == "unresized":
                    left_out = shapes.mismatched(saved["every"], loaded["every"], file)
                    result.checks += [load_check(a, {n: t for n, t in mine.items() if n not in left_out},
                                                 {n: t for n, t in got.items() if n not in left_out}),
                                      shapes.fresh_check(left_out, loaded["every"], loaded["fresh"]),
                                      shapes.mismatch_warning_check(loaded["warnings"], left_out)]
                else:
                    result.checks.append(load_check(a, mine, got))
                    result.checks.append(logits_check(f"logits@{a}", saved["logits"][a], loaded["logits"].get(a), "the loaded model"))
                cfg = where / "adapter_config.json"
                result.checks.append(config_check(a, json.loads(cfg.read_text()) if cfg.is_file() else None, opts,
                                                  opts.dim + 2 * i))
            result.checks.append(effect_check(saved["logits"][names[0]], saved["without"]))
            result.checks.append(warnings_check(saved["warnings"], None if opts.load_base == "unresized" else loaded["warnings"]))
            if opts.base_state:
                result.checks.append(base_state_check(saved["plain"], saved["base_state"]))
                for a in names:
                    result.checks.append(logits_check(f"base-state-logits@{a}", saved["logits"][a], (loaded["restored"] or {}).get(a),
                                                      "the loaded model after set_base_model_state_dict"))


    def ungathered(self, spec: CaseSpec, opts: Options, env: RunEnv, result: CaseResult, phase: Phase,
                   saved: dict[str, Any]) -> None:
        """save_from zero3 / fsdp: the save's warning, then the load of that file, judged as a refusal."""
        from harness.run.world import WorldError

        try:
            env.launch("load", load_rank, phase, None)
            error = None
        except WorldError as exc:
            error = exc
        with env.timed("compare"):
            a, where = ADAPTERS[0], Path(phase.out)
            result.checks.append(shapes.invalid_warning_check(saved["warnings"], saved["ungathered"], a))
            exc_type, message = exception_of(error.rank_traceback or str(error)) if error else (None, "")
            check = refusal_check(exc_type, message, opts.refuse_with, f"an adapter saved from {opts.save_from} shards",
                                  "the file's LoRA tensors are empty or flat 1-D, not the module's")
            result.checks.append(shapes.names_check(check, message, saved["ungathered"]))
            result.checks.append(effect_check(saved["logits"][a], saved["without"]))
            cfg = where / "adapter_config.json"
            result.checks.append(config_check(a, json.loads(cfg.read_text()) if cfg.is_file() else None, opts, opts.dim))


CASE = PeftAdapterIo()
