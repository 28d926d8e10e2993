"""HTTP client of a running SGLang server (`--url`, or one we started): greedy `/generate`, `/flush_cache`, and
the compact backend's density counters from `/metrics`."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Sequence


class Client:
    def __init__(self, url: str, timeout: float = 1800.0):
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _req(self, path: str, payload: dict | None = None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.timeout) as r:
            body = r.read()
        try:
            return json.loads(body)
        except json.JSONDecodeError:
            return body.decode(errors="replace")

    def generate(self, input_ids: Sequence[int], max_new_tokens: int) -> dict:
        return self._req("/generate", {"input_ids": [int(t) for t in input_ids],
                                       "sampling_params": {"temperature": 0.0, "max_new_tokens": int(max_new_tokens)}})

    def flush_cache(self) -> None:
        try:
            self._req("/flush_cache", {})
        except urllib.error.URLError:
            pass

    def metrics_text(self) -> str:
        """The server's `/metrics` page (empty when it serves none)."""
        text = self._req("/metrics")
        return text if isinstance(text, str) else ""

    def density_counters(self) -> tuple[float, float] | None:
        """(sum, count) of the server's per-forward-pass density histogram (`sglang:compact_density_forward` on
        `/metrics`, served with `--enable-metrics`: pages the sparse windows read over their context pages (those
        that turned dense by their observed density reading every page), one observation per sparse forward
        pass); None when the server does not expose it."""
        return self.compact_counters()["density"]

    def compact_counters(self) -> dict[str, tuple[float, float] | None]:
        """From one `/metrics` read: `density` (as `density_counters`), `recall`, (sum, count) of
        `sglang:compact_recall_forward` (one observation per pass that measured its selection's mass recall,
        `--compact-recall-every`), and `prompt_pages`, (pages read, context pages) of every window of every
        extend pass (`sglang:compact_prompt_pages_read_total` / `..._pages_total`); None where the server exposes
        none."""
        try:
            text = self.metrics_text()
        except (urllib.error.URLError, OSError):
            text = ""
        return {"density": parse_density_counters(text) if text else None,
                "recall": parse_histogram_counters(text, "sglang:compact_recall_forward") if text else None,
                "prompt_pages": parse_prompt_pages(text) if text else None}


def parse_density_counters(text: str) -> tuple[float, float] | None:
    """(sum, count) of `sglang:compact_density_forward` over its series. Servers from before the per-window
    design labelled it by `stage`: only their `stage="after_group"` series (post-union density) is read."""
    return parse_histogram_counters(text, "sglang:compact_density_forward")


def parse_prompt_pages(text: str) -> tuple[float, float] | None:
    """(pages read, context pages) summed over the series of `sglang:compact_prompt_pages_read_total` and
    `sglang:compact_prompt_pages_total`; None when the page has neither (a server without them)."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ("sglang:compact_prompt_pages_read_total", "sglang:compact_prompt_pages_total"):
            sums[name] = sums.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    if "sglang:compact_prompt_pages_total" not in sums:
        return None
    return sums.get("sglang:compact_prompt_pages_read_total", 0.0), sums["sglang:compact_prompt_pages_total"]


def parse_histogram_counters(text: str, name: str) -> tuple[float, float] | None:
    """(sum, count) of the Prometheus histogram `name` over its series (a `stage` label other than
    `after_group` excluded); None when the page has none."""
    total = count = None
    for line in text.splitlines():
        if not line.startswith(name + "_"):
            continue
        if "stage=" in line and 'stage="after_group"' not in line:
            continue
        sample, value = line.split("{", 1)[0].split(" ", 1)[0], float(line.rsplit(" ", 1)[1])
        if sample == name + "_sum":
            total = (total or 0.0) + value
        elif sample == name + "_count":
            count = (count or 0.0) + value
    return None if total is None or count is None else (total, count)


def mean_between(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """Mean density (or recall) of the forward passes observed between two (sum, count) snapshots; with
    `prompt_pages` snapshots (read, total), the page-weighted density of the passes in between."""
    if after is None:
        return None
    b = before or (0.0, 0.0)
    n = after[1] - b[1]
    return (after[0] - b[0]) / n if n > 0 else None
