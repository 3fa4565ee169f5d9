"""A load told to tolerate keys one side lacks (megatron-core's non-raising strictness: Megatron-LM's
`--dist-ckpt-strictness log_all`, `return_all`): what it must give back, judged against the truth of
two checkpoints' key sets rather than anything the loader says.

The workflow: a job with new or removed parameters (untied embeddings, linear biases) starts from a
checkpoint of the model before the change. The load must return; every tensor the checkpoint holds
is the checkpoint's, bitwise; every one it lacks keeps the job's own value (nothing invented, no
neighbour's rows); and a returning strictness names exactly the keys each side lacks."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

import torch

from harness.core import truth
from harness.core.parity import EXACT, NOT_COMPARED, Mismatch
from harness.core.result import Check
from harness.core.zoo import ModelSpec
from harness.judge.checks import state_check
from harness.run.events import each_event

from .damaged_load import Outcome, quote


def checkpoint_keys(d: Path) -> set[str]:
    """The sharded keys a torch_dist checkpoint holds (torch DCP's metadata of the harness's own
    save; a sharded object's `key/shard_...` entries under their key)."""
    from torch.distributed.checkpoint import FileSystemReader

    return {k.split("/shard_", 1)[0] for k in FileSystemReader(str(d)).read_metadata().state_dict_metadata}


def mismatch_truth(ckpt: Path, job_ckpt: Path) -> tuple[set[str], set[str]]:
    """(missing, unexpected) in megatron-core's words, from the files: the keys the checkpoint holds
    that the job's own checkpoint does not (no rank asks for them), and the reverse."""
    held, asked = checkpoint_keys(ckpt), checkpoint_keys(job_ckpt)
    return held - asked, asked - held


#: how megatron-core's key check labels the two sides (validation.py maybe_report_missing_and_unexpected_keys)
_SIDES = {"missing": r"Missing keys \(for all ranks\): (\{[^}]*\}|set\(\))",
          "unexpected": r"Unexpected keys \(for this rank\): (\{[^}]*\}|set\(\))"}


def wrong_sides(text: str, missing: set[str], unexpected: set[str]) -> list[str]:
    """The keys a refusal lists under the wrong side of megatron-core's key check: a key the job asks
    for and the checkpoint lacks called missing, or the reverse (the user is sent to the wrong side to
    fix it). Empty when the text has no such labelled lists (another wording says nothing here)."""
    truth = {"missing": missing, "unexpected": unexpected}
    out = []
    for side, pattern in _SIDES.items():
        for listed in re.findall(pattern, text):
            out += [f"{k!r} listed as {side}" for k in re.findall(r"'([^']+)'", listed) if k not in truth[side]]
    return sorted(set(out))


def expected_state(loaded: dict[str, torch.Tensor], saved: ModelSpec, job: ModelSpec, unexpected: set[str]) -> dict[str, torch.Tensor]:
    """The truth of each loaded key: the checkpoint's model where it holds the key, the job's own
    pre-load value (its decoy fill) where it does not."""
    decoy = job.with_seed(job.seed + truth.DECOY_SEED_OFFSET)
    return {k: truth.canonical_tensor(decoy if k in unexpected else saved, k, tuple(v.shape), v.dtype) for k, v in loaded.items()}


def judge_tolerated(what: str, outcome: Outcome, missing: set[str], unexpected: set[str],
                    expected: dict[str, torch.Tensor] | None = None, loaded: dict[str, torch.Tensor] | None = None,
                    problems: Sequence[Mismatch] = (), events: dict | None = None, label: str = "loaded") -> list[Check]:
    """`outcome`, `loaded-canonical` and (when the load returned its key sets) `mismatch-keys`."""
    if outcome.kind != "silent":
        said = "refused" if outcome.kind == "refused" else "crashed"
        return [Check("outcome", "failed", f"{said}: a load told to tolerate the keys one side lacks (the checkpoint lacks "
                                           f"{sorted(unexpected)}, the job does not ask for {sorted(missing)}) did not "
                                           f"return: {quote(outcome.text)} [{what}]", tolerance=NOT_COMPARED),
                Check("loaded-canonical", "not-run", "the load did not return: nothing was loaded", tolerance=NOT_COMPARED)]
    if not loaded:
        raise ValueError(f"{what}: the load returned but no rank gave back a tensor to judge")
    kept = sorted(k for k in loaded if k in unexpected)
    loaded_check = state_check("loaded-canonical", expected or {}, loaded, "checkpoint / job's own", label,
                               f"{len(loaded) - len(kept)} tensors equal the checkpoint's, {len(kept)} the checkpoint lacks "
                               f"kept the job's own values ({', '.join(kept[:3]) or 'none'})", problems=list(problems))
    checks = [Check("outcome", "failed" if loaded_check.failed else "passed",
                    ("returned, but " if loaded_check.failed else "returned: ") + loaded_check.detail + f" [{what}]",
                    tolerance=NOT_COMPARED), loaded_check]
    returned = [(rank, e) for _, rank, e in each_event(events or {}, op="load") if e.get("returned_keys")]
    if returned:
        checks.append(_keys_check(returned, missing, unexpected))
    return checks


def _keys_check(returned: list[tuple[str, dict]], missing: set[str], unexpected: set[str]) -> Check:
    """What the load returned against the files' truth: every rank the same missing keys (they are
    global), and the union of the ranks' unexpected keys (each rank's own asks) the job's."""
    problems = [f"rank {rank} missing {e['missing_keys']}, the files give {sorted(missing)}"
                for rank, e in returned if set(e["missing_keys"]) != missing]
    union = set().union(*(e["unexpected_keys"] for _, e in returned))
    if union != unexpected:
        problems.append(f"unexpected (all ranks) {sorted(union)}, the files give {sorted(unexpected)}")
    if problems:
        return Check("mismatch-keys", "failed", "; ".join(problems[:6]), tolerance=EXACT)
    return Check("mismatch-keys", "passed", f"{len(returned)} rank(s) returned missing {sorted(missing)} and unexpected "
                                            f"{sorted(unexpected)}, as the two checkpoints' key sets give", tolerance=EXACT)
