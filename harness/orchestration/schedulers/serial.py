"""The serial scheduler: one case after another in this process (the default)."""

from __future__ import annotations

from harness.orchestration.schedulers import Scheduler, Settings
from harness.orchestration.schedulers._common import serially


class Serial(Scheduler):
    name = "serial"

    def run(self, specs, options, run_one, on_result=None):
        return serially(specs, options, run_one, on_result)


def make(settings: Settings) -> Serial:
    return Serial()
