"""Cut a matrix's worlds to the machine (`ckpt-harness run --max-world N`, `--ckpt-max-world N`).

The rule, applied to each topology above N ranks: reduce dp first, then cp, then pp, then tp,
each to the largest divisor of its value that makes the world fit (or 1, then the next dim).
Data parallelism goes first because it changes the least of what a checkpoint must reshard
(replicas, not shards); tensor parallelism last because it splits every tensor. Other fields of
the topology are kept where they still fit: an expert-tensor-parallel size that followed tp
(megatron-core's default, etp == tp) follows it down; ep (then etp) shrinks to the largest
divisor of itself with which the experts still split the cut world (world % (etp*ep*pp) == 0);
vpp goes to 1 when pp does (interleaving needs a pipeline). Every value only shrinks to a divisor
of itself, so a cut topology still divides every model dimension the original divided.
"""

from __future__ import annotations

from dataclasses import replace

from harness.core.topology import Topology

ORDER = ("dp", "cp", "pp", "tp")


def cut(topo: Topology, max_world: int) -> Topology:
    """`topo` reduced by the rule above until its world size is at most `max_world` (unchanged if it fits)."""
    if max_world < 1:
        raise ValueError(f"--max-world must be >= 1, got {max_world}")
    for dim in ORDER:
        value = getattr(topo, dim)
        if topo.world_size <= max_world:
            break
        rest = topo.world_size // value
        fits = [d for d in range(value, 0, -1) if value % d == 0 and rest * d <= max_world]
        changes = {dim: fits[0] if fits else 1}
        if dim == "tp" and topo.etp == topo.tp:  # etp defaulted to tp: it follows
            changes["etp"] = changes["tp"]
        topo = _fitted(topo, changes)
    return topo


def _divisors(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def _fitted(topo: Topology, changes: dict[str, int]) -> Topology:
    """`topo` with `changes`, and ep/etp/vpp shrunk (largest divisors first) to what the new world holds."""
    v = {f: getattr(topo, f) for f in ("tp", "pp", "dp", "cp", "vpp", "ep", "etp")} | changes
    world = v["tp"] * v["pp"] * v["dp"] * v["cp"]
    if v["pp"] == 1:
        v["vpp"] = 1
    v["ep"], v["etp"] = next((e, t) for t in _divisors(v["etp"]) for e in _divisors(v["ep"]) if world % (t * e * v["pp"]) == 0)
    return replace(topo, **v)
