"""`eval_longctx.py fidelity`: offline attention-level fidelity of the methods on one prompt's HF q/k/v; the table is
printed, and (unless `--no-write`) appended to `fidelity.json` beside `--results` with `fidelity.md` re-rendered."""

from __future__ import annotations

import datetime as _dt
import json
import os
import sys
import time
from pathlib import Path

from harness.eval.progress import progress
from harness.eval.tasks import load_tokenizer, make_sample


def cmd_fidelity(args) -> int:
    from harness.eval import fidelity as F
    if not args.no_write and args.results is None:
        sys.exit("fidelity: give --results (fidelity.json is written beside it) or --no-write")
    tok = load_tokenizer(args.model)
    s = make_sample(args.task, args.length, args.index, tok, seed=args.seed)
    model = F.load_model(args.model)
    t0 = time.monotonic()
    layers = F.capture_qkv(model, s.input_ids)
    t_cap = time.monotonic() - t0
    bar = progress(len(layers), "fidelity layers")
    res = F.simulate(layers, args.methods or F.DEFAULT_METHODS, chunk=args.chunk, page_size=args.page_size,
                     min_context=args.min_prefix_len, sink_blocks=args.sink_blocks,
                     recent_blocks=args.recent_blocks, progress=lambda _m: bar.update(1))
    bar.close()
    print(F.fidelity_markdown(res.as_dict(), f"{Path(args.model).name}: {args.task} #{args.index} at {args.length}"))
    if not args.no_write:
        out = Path(args.results).parent / "fidelity.json"
        data = json.loads(out.read_text()) if out.exists() else []
        data.append({"model": Path(args.model).name, "task": args.task, "index": args.index, "length": args.length,
                     "date": _dt.date.today().isoformat(), "device": f"cpu ({os.cpu_count()} cores)",
                     "capture_seconds": round(t_cap, 1), **res.as_dict()})
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1) + "\n")
        out.with_suffix(".md").write_text(F.render_fidelity_md(data))
        print(f"wrote {out}, {out.with_suffix('.md')}", file=sys.stderr)
    return 0
