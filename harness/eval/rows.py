"""accuracy.json rows (`results.ROW_KEYS` and more) from scored records, with their density."""

from __future__ import annotations

import datetime as _dt
from typing import Any, Sequence

SERVER_DENSITY_SOURCE = "server /metrics (compact_density_forward, every prompt)"
HF_DENSITY_SOURCE = "hf run (measured on every prompt)"


def cell_densities(recs: list[dict[str, Any]], key: str = "server_density") -> dict[tuple, float]:
    """(task, length) -> mean of the records' `key` (server_density, or density for HF runs) where present."""
    by_key: dict[tuple, list[float]] = {}
    for r in recs:
        if r.get(key) is not None:
            by_key.setdefault((r["task"], r["length"]), []).append(r[key])
    return {k: sum(v) / len(v) for k, v in by_key.items()}


def accuracy_rows(recs: list[dict[str, Any]], *, model: str, method: str, params: dict[str, Any], device: str,
                  tasks: Sequence[str], lengths: Sequence[int], densities: dict[tuple, float] | None = None,
                  density_source: str | None = None, offline_densities: dict[tuple, float] | None = None,
                  dense_selector: bool = False, date: str | None = None) -> list[dict[str, Any]]:
    """accuracy.json rows (one per task and length with records, in length-then-task order) from scored records.

    `dense_selector`: the compact pipeline with selector dense (density 1.0 by construction)."""
    densities = densities or {}
    offline_densities = offline_densities or {}
    date = date or _dt.date.today().isoformat()
    rows = []
    for L in lengths:
        for t in tasks:
            rs = [r for r in recs if r["task"] == t and r["length"] == L]
            if not rs:
                continue
            dens = None
            if dense_selector:
                dens = 1.0
            elif (t, L) in densities:
                dens = round(densities[(t, L)], 4)
            rows.append({
                "model": model, "task": t, "length": L, "method": method, "params": params, "n": len(rs),
                "accuracy": round(100.0 * sum(r["score"] for r in rs) / len(rs), 2),
                "density": dens, "date": date, "device": device,
                "accuracy_all": round(100.0 * sum(r["all_found"] for r in rs) / len(rs), 2),
                "density_source": density_source if dens is not None else None,
                "seconds_per_sample": round(sum(r["seconds"] for r in rs) / len(rs), 2),
                "mean_prompt_tokens": round(sum(r["num_tokens"] for r in rs) / len(rs), 1),
            })
            seeds = {int(r.get("seed", 0)) for r in rs}
            if seeds != {0}:   # prompts of another seed: compared with dense rows of the same seed only
                if len(seeds) > 1:
                    raise ValueError(f"{t} at {L}: records of several seeds {sorted(seeds)} in one row")
                rows[-1]["seed"] = seeds.pop()
            prompt = [r["server_prompt_density"] for r in rs if r.get("server_prompt_density") is not None]
            if prompt:    # page-weighted over every chunk of the prompts (`run_samples`)
                rows[-1]["prompt_density"] = round(sum(prompt) / len(prompt), 4)
            recalls = [r["server_recall"] for r in rs if r.get("server_recall") is not None]
            if recalls:   # servers run with --compact-recall-every: the mass their selections read
                rows[-1]["recall"] = round(sum(recalls) / len(recalls), 4)
            if (t, L) in offline_densities:
                rows[-1]["density_offline"] = round(offline_densities[(t, L)], 4)
    return rows
