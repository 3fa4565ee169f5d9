"""Host memory per rank and per phase: what a save or load costs on top of what the rank holds.

A background thread samples RSS (every `interval_s`) and USS with psutil. USS walks the whole
address space (/proc/PID/smaps_rollup: ~17 ms for a 1 GiB rank with torch and Megatron imported,
1000x an RSS read), so it is read at the start and then only once `USS_SPACING` times its last
cost has passed: the sampler takes ~2% of a core, not a quarter of one. The kernel's own
high-water mark (VmHWM, reset at phase start through
/proc/self/clear_refs where Linux allows it) catches spikes between samples; the reported peak is
the larger of the two, and both are kept so a report can show how well the sampler saw the phase.
A phase starts from a trimmed heap (glibc malloc_trim): heap a rank freed before the phase but
still holds would otherwise absorb the phase's allocations and hide them from the delta.
Each sample also reads the host-wide memory in use (psutil: total - available, every process on
the machine): what the kernel's OOM killer runs out of, which no single rank's RSS shows when
several ranks (or other jobs) peak at once.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import psutil

MiB = 1024 * 1024
#: a USS read waits this many times the previous read's cost (an RSS read does not wait)
USS_SPACING = 50
TIMELINE_POINTS = 48  # per phase and rank in results.json: enough to draw, small for 100 cases x 4 ranks


def _kernel_hwm() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _trim_heap() -> None:
    """Give the heap's freed pages back to the kernel (glibc only; a no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_kernel_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


@dataclass
class PhaseMemory:
    phase: str
    baseline_rss: int = 0
    peak_rss: int = 0  # max(sampled, kernel HWM when it was reset at phase start)
    sampled_peak_rss: int = 0
    kernel_hwm: int | None = None  # None when VmHWM could not be reset for this phase
    baseline_uss: int | None = None
    peak_uss: int | None = None
    samples: int = 0
    seconds: float = 0.0
    #: (seconds since the phase began, RSS bytes), decimated to at most TIMELINE_POINTS (the peak kept)
    timeline: list[tuple[float, int]] = field(default_factory=list)
    #: host-wide memory in use (total - available) at phase start and its sampled peak, and the host's total
    host_used_baseline: int | None = None
    host_used_peak: int | None = None
    host_total: int | None = None

    @property
    def peak_delta(self) -> int:
        """What the phase added on top of what the rank held when it started."""
        return self.peak_rss - self.baseline_rss

    def to_dict(self) -> dict:
        d = asdict(self)
        d["peak_delta"] = self.peak_delta
        return d


_recording: dict[str, PhaseMemory] | None = None
_depth = 0  # how many `track` blocks of this process are open (a nested one leaves VmHWM alone)


def start_recording() -> None:
    """From now on every `track` of this process is kept for `stop_recording` (the rank envelope,
    harness.run.envelope, collects a rank's phases this way, so rank functions only say `with track(...)`)."""
    global _recording
    _recording = {}


def stop_recording() -> dict[str, PhaseMemory]:
    global _recording
    out, _recording = _recording or {}, None
    return out


@contextmanager
def track(phase: str, interval_s: float = 0.005) -> Iterator[PhaseMemory]:
    """Measure this process during the `with` block.

    A phase name met again in the same recording is kept as `NAME#2`, `NAME#3`, ... (a job that
    saves twice). A phase inside another (a backend's `exchange` inside the case's `load`) is
    measured by the sampler only: resetting the kernel's high-water mark for it would blind the
    enclosing phase's, so its `kernel_hwm` is None."""
    global _depth
    proc = psutil.Process()
    if _recording is not None:
        name, n = phase, 1
        while name in _recording:
            n += 1
            name = f"{phase}#{n}"
        phase = name
    m = PhaseMemory(phase)
    if _recording is not None:
        _recording[phase] = m
    if _depth == 0:
        _trim_heap()
    hwm_reset = _depth == 0 and _reset_kernel_hwm()
    m.baseline_rss = proc.memory_info().rss
    uss_next = 0.0  # when the next USS read is due

    def read_uss() -> int:
        nonlocal uss_next
        began = time.perf_counter()
        uss = proc.memory_full_info().uss
        done = time.perf_counter()
        uss_next = done + USS_SPACING * (done - began)
        return uss

    try:
        m.baseline_uss = read_uss()
    except (psutil.AccessDenied, AttributeError):
        m.baseline_uss = None
    m.sampled_peak_rss, m.peak_uss = m.baseline_rss, m.baseline_uss
    m.host_total, m.host_used_baseline = host_used()
    m.host_used_peak = m.host_used_baseline
    stop = threading.Event()

    points: list[tuple[float, int]] = [(0.0, m.baseline_rss)]

    def sample() -> None:
        n = 0
        while not stop.is_set():
            rss = proc.memory_info().rss
            points.append((time.perf_counter() - start, rss))
            m.sampled_peak_rss = max(m.sampled_peak_rss, rss)
            m.host_used_peak = max(m.host_used_peak or 0, host_used()[1])
            if m.peak_uss is not None and time.perf_counter() >= uss_next:
                m.peak_uss = max(m.peak_uss, read_uss())
            n += 1
            m.samples = n
            stop.wait(interval_s)

    thread = threading.Thread(target=sample, name=f"mem-{phase}", daemon=True)
    start = time.perf_counter()
    thread.start()
    _depth += 1
    try:
        yield m
    finally:
        _depth -= 1
        stop.set()
        thread.join()
        m.seconds = round(time.perf_counter() - start, 3)
        last = proc.memory_info().rss  # one reading for the last point and the peak: two could differ by a page
        m.sampled_peak_rss = max(m.sampled_peak_rss, last)
        m.kernel_hwm = _kernel_hwm() if hwm_reset else None
        m.peak_rss = max(m.sampled_peak_rss, m.kernel_hwm or 0)
        points.append((time.perf_counter() - start, last))
        m.timeline = decimate(points, TIMELINE_POINTS)


def host_used() -> tuple[int, int]:
    """(host total, host-wide bytes in use = total - available) right now."""
    vm = psutil.virtual_memory()
    return vm.total, vm.total - vm.available


def decimate(points: list[tuple[float, int]], limit: int) -> list[tuple[float, int]]:
    """At most `limit` evenly spread points (limit >= 3), always keeping the first, the last and the peak."""
    n = len(points)
    if n <= limit:
        keep = set(range(n))
    else:
        keep = {round(i * (n - 1) / (limit - 2)) for i in range(limit - 1)}  # limit-1 points, first and last included
        keep.add(max(range(n), key=lambda i: points[i][1]))
    return [(round(points[i][0], 4), points[i][1]) for i in sorted(keep)]


@dataclass(frozen=True)
class Budget:
    """A limit on one phase of one rank: absolute MiB over baseline, or a multiple of shard bytes."""

    phase: str
    rank: int = 0
    max_peak_delta_mib: float | None = None
    max_peak_delta_x_shard: float | None = None

    @classmethod
    def parse(cls, raw: dict, where: str) -> "Budget":
        allowed = {"phase", "rank", "max_peak_delta_mib", "max_peak_delta_x_shard"}
        if not isinstance(raw, dict) or set(raw) - allowed or "phase" not in raw:
            raise ValueError(f"{where}: a memory budget is {{phase, rank?, max_peak_delta_mib? | max_peak_delta_x_shard?}}, got {raw!r}")
        b = cls(**raw)
        if not isinstance(b.phase, str) or isinstance(b.rank, bool) or not isinstance(b.rank, int) or b.rank < 0:
            raise ValueError(f"{where}: phase must be a name and rank a rank number, got {raw!r}")
        for limit in (b.max_peak_delta_mib, b.max_peak_delta_x_shard):
            if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))):
                raise ValueError(f"{where}: a limit must be a number, got {limit!r}")
        if b.max_peak_delta_mib is None and b.max_peak_delta_x_shard is None:
            raise ValueError(f"{where}: budget for phase {b.phase!r} sets no limit")
        return b

    def violation(self, m: PhaseMemory, shard_bytes: int) -> str | None:
        delta_mib = m.peak_delta / MiB
        if self.max_peak_delta_mib is not None and delta_mib > self.max_peak_delta_mib:
            return (
                f"rank {self.rank} {self.phase}: peak RSS delta {delta_mib:.1f} MiB > budget "
                f"{self.max_peak_delta_mib:.1f} MiB (baseline {m.baseline_rss / MiB:.1f} MiB, peak {m.peak_rss / MiB:.1f} MiB)"
            )
        if self.max_peak_delta_x_shard is not None and shard_bytes > 0:
            ratio = m.peak_delta / shard_bytes
            if ratio > self.max_peak_delta_x_shard:
                return (
                    f"rank {self.rank} {self.phase}: peak RSS delta {delta_mib:.1f} MiB = {ratio:.2f} x its "
                    f"shard ({shard_bytes / MiB:.1f} MiB) > budget {self.max_peak_delta_x_shard:g} x"
                )
        return None
