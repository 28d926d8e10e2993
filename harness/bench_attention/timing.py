"""Timing: median device time with CUDA events and an L2 flush before each call (wall time on the CPU), and host
time of planning steps."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch


class Timer:
    def __init__(self, device: torch.device, reps: int, min_reps: int, warmup: int, budget_ms: float):
        self.cuda = device.type == "cuda"
        self.device = device
        self.reps, self.min_reps, self.warmup, self.budget_ms = reps, min_reps, warmup, budget_ms
        self.flush = torch.empty(256 << 20, dtype=torch.int8, device=device) if self.cuda else None

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def device_ms(self, fn: Callable[[], Any]) -> float:
        """Median device time of fn (ms): CUDA events, L2 flushed before each call."""
        for _ in range(self.warmup):
            fn()
        self.sync()
        if not self.cuda:
            est = self._host_once(fn)
            n = max(self.min_reps, min(self.reps, int(self.budget_ms / max(est, 1e-3))))
            return statistics.median(self._host_once(fn) for _ in range(n))
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.flush.zero_()
        s.record()
        fn()
        e.record()
        e.synchronize()
        est = s.elapsed_time(e)
        n = max(self.min_reps, min(self.reps, int(self.budget_ms / max(est, 1e-3))))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for i in range(n):
            self.flush.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        self.sync()
        return statistics.median(a.elapsed_time(b) for a, b in zip(starts, ends))

    def _host_once(self, fn) -> float:
        self.sync()
        t = time.perf_counter()
        fn()
        self.sync()
        return (time.perf_counter() - t) * 1e3

    def host_ms(self, fn: Callable[[], Any], reps: int = 5) -> float:
        """Median wall time of fn (ms), synchronised before and after (host-side planning)."""
        fn()
        return statistics.median(self._host_once(fn) for _ in range(max(1, reps)))
