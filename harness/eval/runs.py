"""Scored greedy generation of samples: through a server (`run_samples`), in-process with HF transformers and
chunked sparse prefill (`run_samples_hf`), and the offline density replay of a compact method."""

from __future__ import annotations

import json
import time
from typing import Any

from harness.eval.client import Client, mean_between
from harness.eval.progress import progress as _progress
from harness.eval.tasks import Sample, load_tokenizer


def run_samples(client: Client, samples: list[Sample], desc: str, flush: bool = True,
                log_file=None, progress: bool = True, stop=None) -> list[dict[str, Any]]:
    """Greedy generation for every sample; each record has `server_density` (None when not exposed: the mean
    over the prompt's sparse forward passes), from compact servers with metrics `server_prompt_density` (pages
    read over context pages of all its extend passes, dense ones included: what its attention cost) and, from
    servers measuring it (`--compact-recall-every`), `server_recall`: the mean mass recall of its measured passes.

    `stop`: a callable checked before each sample; when it returns True the records so far are returned
    (fewer than `samples`)."""
    out = []
    bar = _progress(len(samples), desc, progress)
    try:
        for s in samples:
            if stop is not None and stop():
                break
            if flush:
                client.flush_cache()  # independent samples: chunks start at 0 as in the offline replay
            before = client.compact_counters()
            t0 = time.monotonic()
            r = client.generate(s.input_ids, s.max_new_tokens)
            dt = time.monotonic() - t0
            after = client.compact_counters()
            server_density = mean_between(before["density"], after["density"])
            pred = r.get("text", "")
            rec = {**s.as_dict(), "pred": pred, "score": s.score(pred), "all_found": s.all_found(pred),
                   "seconds": round(dt, 3), "prompt_tokens": r.get("meta_info", {}).get("prompt_tokens"),
                   "completion_tokens": r.get("meta_info", {}).get("completion_tokens"),
                   "server_density": server_density}
            recall = mean_between(before["recall"], after["recall"])
            if recall is not None:
                rec["server_recall"] = recall
            prompt_density = mean_between(before.get("prompt_pages"), after.get("prompt_pages"))
            if prompt_density is not None:
                rec["server_prompt_density"] = prompt_density
            _keep(out, rec, log_file, bar, s, dt)
    finally:
        bar.close()
    return out


def _keep(out: list, rec: dict, log_file, bar, s: Sample, seconds: float) -> None:
    """Keep one scored sample: in `out`, in the JSONL log if any, and on the progress bar."""
    out.append(rec)
    if log_file is not None:
        log_file.write(json.dumps(rec) + "\n")
        log_file.flush()
    bar.update(1)
    bar.set_postfix_str(f"{s.task}@{s.length} {seconds:.1f}s score {rec['score']:.2f}")


def load_hf_model(args):
    """The HF model of `--start hf` (`--hf-dtype`, on `--hf-device`)."""
    import torch
    from harness.eval import hf_runner as H
    dtype = getattr(torch, getattr(args, "hf_dtype", "float32"))
    return H.load_model(args.model, dtype=dtype, device=getattr(args, "hf_device", None))


def run_samples_hf(args, samples: list[Sample], desc: str, log_file=None, model=None, tok=None,
                   progress: bool = True, stop=None) -> tuple[list[dict[str, Any]], dict]:
    """Greedy generation in-process with HF transformers and chunked sparse prefill (`hf_runner`).

    `model`/`tok`: already loaded (default: load them from `args.model`); `stop` as in `run_samples`."""
    from harness.eval import hf_runner as H
    tok = tok if tok is not None else load_tokenizer(args.model)
    model = model if model is not None else load_hf_model(args)
    eos = [model.generation_config.eos_token_id] if isinstance(model.generation_config.eos_token_id, int) \
        else list(model.generation_config.eos_token_id or [])
    out, dens = [], {}
    bar = _progress(len(samples), desc, progress)
    try:
        for s in samples:
            if stop is not None and stop():
                break
            g = H.generate(model, s.input_ids, args.hf_method, max_new_tokens=s.max_new_tokens, chunk=args.chunk,
                           page_size=args.page_size, min_context=args.min_prefix_len,
                           sink_blocks=args.sink_blocks, recent_blocks=args.recent_blocks, eos_token_ids=eos)
            pred = tok.decode(g.output_ids, skip_special_tokens=True)
            rec = {**s.as_dict(), "pred": pred, "score": s.score(pred), "all_found": s.all_found(pred),
                   "seconds": round(g.seconds, 3), "density": g.density}
            if g.density is not None:
                dens.setdefault((s.task, s.length), []).append(g.density)
            _keep(out, rec, log_file, bar, s, g.seconds)
    finally:
        bar.close()
    return out, {k: sum(v) / len(v) for k, v in dens.items()}


def offline_densities(args, samples: list[Sample], method: str, params: dict[str, Any]) -> dict[tuple, float]:
    """(task, length) -> mean offline density (the sparse windows' pages over their context pages) over the first
    `--density-samples` prompts."""
    from harness.eval import fidelity as F
    sel = method.removeprefix("compact-")
    sp = {k: v for k, v in params.items() if k not in ("chunk", "page_size", "min_context", "sink_blocks",
                                                          "recent_blocks")}
    m = F.Method("compact", sel, tuple(sorted(sp.items())))
    model = F.load_model(args.model)
    by_key: dict[tuple, list[float]] = {}
    todo = [s for s in samples if s.index < args.density_samples]
    bar = _progress(len(todo), "offline density")
    for s in todo:
        d = F.offline_density(model, s.input_ids, m, chunk=params["chunk"], page_size=params["page_size"],
                              min_context=params["min_context"], sink_blocks=params["sink_blocks"],
                              recent_blocks=params["recent_blocks"])
        if d is not None:
            by_key.setdefault((s.task, s.length), []).append(d)
        bar.update(1)
    bar.close()
    return {k: sum(v) / len(v) for k, v in by_key.items()}
