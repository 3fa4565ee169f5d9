"""Parallel topologies: the thing a checkpoint must survive a change of.

A topology is a value (tp, pp, dp, cp, vpp, ep, etp) with a compact id; the world size is
derived, never given, so a matrix cannot state an inconsistent one. vpp, ep and etp appear in the
id only when they differ from their default (vpp 1, ep 1, etp = tp, megatron-core's default), so
every dense topology keeps its id.

The expert groups are derived as megatron-core derives them (parallel_state.initialize_model_parallel):
the expert layers of a world of tp*pp*cp*dp ranks are split etp x ep x pp, and what is left is
the expert-data-parallel size, `world / (etp * ep * pp)`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

_DIMS = ("tp", "pp", "dp", "cp", "vpp", "ep", "etp")
_ID_RE = re.compile(r"^(?:(etp|vpp|tp|pp|dp|cp|ep)(\d+))+$")
_PART_RE = re.compile(r"(etp|vpp|tp|pp|dp|cp|ep)(\d+)")


class TopologyError(ValueError):
    """A topology that cannot exist, or cannot hold a given model."""


class ModelShape(Protocol):
    """What a topology needs to know about a model to validate against it."""

    name: str
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int
    # optional (ModelSpec has it): when not None the vocab is padded to a multiple of TP
    # make_vocab_size_divisible_by: int | None
    # optional, MoE models: num_moe_experts: int | None, moe_ffn_hidden_size: int, moe_shared_expert_size: int | None


@dataclass(frozen=True, order=True)
class Topology:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    vpp: int = 1  # virtual pipeline chunks per PP rank (interleaved schedule); needs pp > 1
    ep: int = 1  # expert parallel
    etp: int = 0  # expert tensor parallel; 0 (unset) means tp, megatron-core's default

    def __post_init__(self) -> None:
        if self.etp == 0:
            object.__setattr__(self, "etp", self.tp)  # one canonical value: tp2 == tp2etp2
        for dim in _DIMS:
            value = getattr(self, dim)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TopologyError(f"topology {dim} must be a positive integer, got {value!r}")
        if self.vpp > 1 and self.pp == 1:
            raise TopologyError(f"{self.id}: vpp={self.vpp} needs pp > 1 (megatron-core: the interleaved schedule "
                                "needs a pipeline)")
        if self.world_size % (self.etp * self.ep * self.pp):
            raise TopologyError(
                f"{self.id}: world size {self.world_size} (tp*pp*dp*cp) is not divisible by etp*ep*pp = "
                f"{self.etp}*{self.ep}*{self.pp}: the expert layers cannot be split so"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def expert_dp(self) -> int:
        """Expert-data-parallel size: the ranks that hold the same expert shard."""
        return self.world_size // (self.etp * self.ep * self.pp)

    @property
    def id(self) -> str:
        """Compact id, e.g. tp2pp1dp2cp1; vpp/ep/etp appear only when not their default."""
        base = f"tp{self.tp}pp{self.pp}dp{self.dp}cp{self.cp}"
        extra = "".join(f"{d}{getattr(self, d)}" for d in ("vpp", "ep") if getattr(self, d) != 1)
        return base + extra + (f"etp{self.etp}" if self.etp != self.tp else "")

    def __str__(self) -> str:
        return self.id

    @classmethod
    def parse(cls, text: str | dict) -> "Topology":
        """Parse `tp2pp1dp2cp1` (missing dims are 1) or a mapping {tp: 2, dp: 2}."""
        if isinstance(text, Topology):
            return text
        if isinstance(text, dict):
            unknown = set(text) - set(_DIMS)
            if unknown:
                raise TopologyError(f"unknown topology dimension(s) {sorted(unknown)} in {text!r}")
            return cls(**{k: int(v) for k, v in text.items()})
        if not isinstance(text, str):
            raise TopologyError(f"a topology is a string like 'tp2pp1' or a mapping, got {text!r}")
        compact = text.strip().lower().replace("_", "").replace(" ", "")
        if not _ID_RE.match(compact):
            raise TopologyError(
                f"cannot parse topology {text!r}: expected e.g. 'tp2pp1dp2cp1' (dims tp, pp, dp, cp, vpp, ep, etp)"
            )
        values: dict[str, int] = {}
        for dim, num in _PART_RE.findall(compact):
            if dim in values:
                raise TopologyError(f"topology {text!r} names {dim} twice")
            values[dim] = int(num)
        return cls(**values)

    def validate(self, model: ModelShape, available_ranks: int | None = None) -> None:
        """Raise TopologyError naming the model and the rule when the model cannot be split so."""
        problems = []
        if model.num_layers % (self.pp * self.vpp):
            what = f"pp*vpp={self.pp}*{self.vpp}" if self.vpp > 1 else f"pp={self.pp}"
            problems.append(f"num_layers={model.num_layers} is not divisible by {what}")
        experts = getattr(model, "num_moe_experts", None)
        if experts:
            if experts % self.ep:
                problems.append(f"num_moe_experts={experts} is not divisible by ep={self.ep}")
            moe_ffn = getattr(model, "moe_ffn_hidden_size", None) or model.ffn_hidden_size
            if moe_ffn % self.etp:
                problems.append(f"moe_ffn_hidden_size={moe_ffn} is not divisible by etp={self.etp}")
            shared = getattr(model, "moe_shared_expert_size", None)
            if shared and shared % self.tp:
                problems.append(f"moe_shared_expert_size={shared} is not divisible by tp={self.tp}")
        elif self.ep > 1 or self.etp != self.tp:
            problems.append(f"ep={self.ep}/etp={self.etp} need an MoE model (this one has no experts)")
        if model.num_attention_heads % self.tp:
            problems.append(
                f"num_attention_heads={model.num_attention_heads} is not divisible by tp={self.tp}"
            )
        if model.num_query_groups % self.tp:
            problems.append(
                f"num_query_groups={model.num_query_groups} is not divisible by tp={self.tp}"
            )
        if model.ffn_hidden_size % self.tp:
            problems.append(f"ffn_hidden_size={model.ffn_hidden_size} is not divisible by tp={self.tp}")
        # A padded vocab (make_vocab_size_divisible_by) is a multiple of tp by construction.
        if getattr(model, "make_vocab_size_divisible_by", None) is None and model.vocab_size % self.tp:
            problems.append(f"vocab_size={model.vocab_size} is not divisible by tp={self.tp}")
        if model.seq_length % (2 * self.cp):
            problems.append(
                f"seq_length={model.seq_length} is not divisible by 2*cp={2 * self.cp} "
                "(context parallel splits each sequence into 2*cp chunks)"
            )
        if available_ranks is not None and self.world_size > available_ranks:
            problems.append(f"world size {self.world_size} exceeds the {available_ranks} ranks available")
        if problems:
            raise TopologyError(f"topology {self.id} cannot hold model {model.name!r}: " + "; ".join(problems))
