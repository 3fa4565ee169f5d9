"""The shard scheduler (`--shard I/N`): a matrix split across CI runners (issue 20 item 3). Every
runner computes the same deterministic, balanced split (schedulers._balance) from the same matrix,
so the N parts hold every case exactly once; `ckpt-harness merge` (harness.report.merge) makes one
report from their results.

Sharding is a selection more than a way of running: it picks the part, then runs it through an
inner scheduler (serial, pool or packing, as the other flags say). It has the protocol all the
same, so `--shard` is one more name in the lookup: `select` is the part (`list --shard` prints it),
`run` runs that part of what it is given through the inner one."""

from __future__ import annotations

from harness.core.result import CaseResult
from harness.orchestration.schedulers import Scheduler, Settings, inner_of
from harness.orchestration.schedulers._balance import parse_shard, select


class Shard(Scheduler):
    name = "shard"

    def __init__(self, index: int, total: int, inner: Scheduler, durations: dict[str, float] | None = None):
        self.index, self.total, self.inner, self.durations = index, total, inner, durations

    def select(self, specs) -> list:
        return select(list(specs), self.index, self.total, self.durations)

    def check(self, specs, options) -> None:
        self.inner.check(self.select(specs), options)

    def run(self, specs, options, run_one, on_result=None) -> list[CaseResult]:
        return self.inner.run(self.select(specs), options, run_one, on_result)


def make(settings: Settings) -> Shard:
    if not settings.shard:
        raise ValueError("the shard scheduler needs --shard I/N")
    index, total = parse_shard(settings.shard)
    return Shard(index, total, inner_of(settings, "shard"), settings.durations)
