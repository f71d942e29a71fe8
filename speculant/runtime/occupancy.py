"""Cores that other processes keep busy, read while decoding, and the thread count that follows from it.

A decoding step splits every product over the threads and waits for the slowest at each barrier (OpenMP).  When
another process keeps one of the cores busy, the thread that shares that core is descheduled for whole time slices
and every barrier waits for it: on 2 cores, 2 threads then decode several times slower than 1 (BENCHMARKS.md AE).
The tuner measures the thread count on a quiet machine; :class:`ThreadGovernor` follows the machine's load as it
changes, at no cost to a step: between rounds, once per window, it reads how many cores were busy
(``/proc/stat``) besides this process's own CPU time (``os.times``) and takes ``tuned - busy elsewhere`` threads
(at least 1), the tuned count again once the other work stops.  Results never depend on it: every kernel computes
the same bits with any thread count (batch and thread invariance are tested).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

PROC_STAT = Path("/proc/stat")
WINDOW_SECONDS = 0.1
"""Shortest time between two readings [s] (``/proc/stat`` counts in 10 ms ticks per core: 0.1 s reads a core's
share to ~0.1)."""
LONG_WINDOWS = 5
"""A reading over at least this many windows (e.g. from a model's load to its first prompt) decides alone; shorter
ones need a second that agrees."""
BUSY_CORE = 0.5
"""Cores' worth of other processes' work [cores] that counts as one core taken (rounded at this fraction)."""


def cpu_seconds() -> tuple[float, float] | None:
    """``(busy, all)``: seconds of all CPUs since boot that were busy (user, nice, system, irq, softirq, steal: the
    hypervisor running something else counts as busy) and in total, from ``/proc/stat``; ``None`` where it cannot
    be read (not Linux)."""
    try:
        with PROC_STAT.open() as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 8:
        return None
    ticks = [int(v) for v in fields[1:9]]          # user nice system idle iowait irq softirq steal (guest is in user)
    idle = ticks[3] + ticks[4]
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return (sum(ticks) - idle) / hz, sum(ticks) / hz


def own_cpu_seconds() -> float:
    """CPU seconds this process has used, all its threads, user and system, and its children that have ended (a
    kernel build's compilers, a conversion's interpreter) [s]: work this process asked for is not another's."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def reading() -> tuple[float, float, float] | None:
    """``(wall clock [s], busy CPU seconds of the machine, this process's CPU seconds)`` now (:func:`cpu_seconds`,
    :func:`own_cpu_seconds`), for :func:`other_cores`; ``None`` where ``/proc/stat`` cannot be read."""
    seconds = cpu_seconds()
    return None if seconds is None else (time.perf_counter(), seconds[0], own_cpu_seconds())


def other_cores(since: tuple[float, float, float] | None, now: tuple[float, float, float] | None = None) -> float | None:
    """Cores' worth of work other processes did between :func:`reading` ``since`` and ``now`` (default: now)
    [cores]: the machine's busy CPU time less this process's, over the wall time; ``None`` without readings."""
    now = reading() if now is None else now
    if since is None or now is None or now[0] <= since[0]:
        return None
    return max(0.0, (now[1] - since[1]) - (now[2] - since[2])) / (now[0] - since[0])


class ThreadGovernor:
    """The torch (and OpenMP) thread count of decoding, ``threads`` at most, fewer while other processes keep cores
    busy.

    Args:
        threads: the tuned count (the most it sets).
        cores: cores of the machine (default ``os.cpu_count()``).
        window: seconds between readings (:data:`WINDOW_SECONDS`).
    Call :meth:`tick` before a prompt and between rounds; it changes the count when two windows in a row agree (no
    flapping on one noisy reading), or at once after a reading over :data:`LONG_WINDOWS` windows.
    """

    def __init__(self, threads: int, cores: int | None = None, window: float = WINDOW_SECONDS):
        self.threads = threads
        self.cores = cores or os.cpu_count() or 1
        self.window = window
        self.current = threads
        self.others = 0.0                   # cores busy elsewhere in the last window
        self._pending = None                # a count one window asked for
        self._last = reading()              # (wall, busy, own) of the last reading: the first window runs from here

    def wanted(self, others: float) -> int:
        """The count for ``others`` cores busy elsewhere: ``min(threads, cores - round(others))``, at least 1."""
        taken = int(others + (1 - BUSY_CORE))
        return max(1, min(self.threads, self.cores - taken))

    def tick(self) -> int:
        """Read the machine if a window has passed and set the count it calls for; returns the count in force."""
        if self._last is not None and time.perf_counter() - self._last[0] < self.window:
            return self.current
        now = reading()
        if now is None:
            return self.current
        if self._last is not None:
            wall = now[0] - self._last[0]
            self.others = other_cores(self._last, now) or 0.0
            want = self.wanted(self.others)
            if want != self.current and (want == self._pending or wall >= LONG_WINDOWS * self.window):
                self.current = want
                torch.set_num_threads(want)
            self._pending = want if want != self.current else None
        self._last = now
        return self.current
