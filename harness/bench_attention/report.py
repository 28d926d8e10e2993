"""Results: speedups and overhead fractions of a configuration's rows, speed.json I/O, the Markdown table and the
PNG of a run, and the closing tables on stdout."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


def finish_rows(rows: list[dict]):
    """speedup_vs_dense against the faster dense backend of the same configuration; overhead fractions."""
    dense = [r["ms"] for r in rows if r["method"].startswith("dense_") and r.get("ms")]
    best = min(dense) if dense else None
    for r in rows:
        r["dense_best_ms"] = best
        r["speedup_vs_dense"] = (best / r["ms"]) if (best and r.get("ms")) else None
        if r["method"].startswith("dense_") or not r.get("ms") or r.get("search_ms") is None:
            r["overhead_frac"] = None
        else:  # bsparse's host plan_ms is not inside its ms
            over = sum(r.get(k) or 0.0 for k in ("search_ms", "union_ms", "index_ms", "gather_ms"))
            r["overhead_frac"] = over / r["ms"]
        if r.get("attn_ms") is None and r.get("prefix_ms") is not None and r.get("chunk_ms") is not None:
            r["attn_ms"] = r["prefix_ms"] + r["chunk_ms"]
        if r.get("union_ms") is not None or r.get("index_ms") is not None:
            r["union_index_ms"] = (r.get("union_ms") or 0.0) + (r.get("index_ms") or 0.0)


def load_rows(path: Path) -> list:
    if path.exists():
        data = json.loads(path.read_text() or "[]")
        if not isinstance(data, list):
            raise SystemExit(f"{path} is not a JSON list")
        return data
    return []


def save_json(path: Path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def ctx_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _f(x, fmt="{:.3f}"):
    return "" if x is None else fmt.format(x)


def render_markdown(rows: list[dict], meta: dict) -> str:
    out = [f"# Attention benchmark: one layer, one chunk against its context ({meta.get('run_tag')})", "",
           f"GPU: {meta.get('gpu')}; date {meta.get('date')}; torch {meta.get('torch')}, "
           f"flashinfer {meta.get('flashinfer')}; page size {meta.get('page_size')}, head_dim {meta.get('head_dim')}, "
           f"{meta.get('dtype')}.", "",
           f"Command: `{meta.get('cmd')}`", "",
           f"Inputs: {meta.get('inputs')}.", "",
           "Context: the prefix length; the chunk's own K/V are in the pool too. The chunk's queries are cut into "
           "q-blocks (one page, what selectors score) and union windows (`union_window` tokens of each row: the "
           "compact path's rows, reading the union of their q-blocks' and heads' selections and their own pages "
           "causally). "
           "ms: median end-to-end time of one layer (dense: one paged prefill over the whole context; compact: "
           "search + union + index + one causal paged pass over the rows (kv head, window); bsparse: search + "
           "group OR + K/V gather + block-sparse pass (rows = q-blocks, no window union) over the pages before "
           "each q-block's window + the window's own pages causally + merge, whose "
           "FlashInfer host plan is listed as plan but not counted; quoka: selection + index + gather + attention "
           "to the kept prefix tokens + the chunk causally + merge). speedup: faster dense backend of the same "
           "configuration / ms. overhead: (search + union + index [+ gather]) / ms. attn: the attention kernels "
           "(compact: the executor's paged pass; bsparse/quoka: prefix + chunk attn). chunk attn: quoka's chunk "
           "against itself (shared per configuration, like merge), bsparse's windows' own pages, causally. density: "
           "fixed budget, else the density the kernel reads: pages the rows read over their context pages (compact: "
           "after the group and window unions and the forced pages; bsparse: per kv head and q-block). sel / "
           "after_group: the density per query head and q-block before the unions (selectors with a per-head "
           "choice), and the density read (compact: after the unions). begin_fwd: host time of the per-forward-pass "
           "planning (executor.plan_forward / the wrappers' plan), not in ms. Split times are each timed on their "
           "own; they need not add up to ms.", ""]
    cols = ["context", "chunk", "batch", "heads", "method", "density", "ms", "speedup", "overhead", "search",
            "union+index", "gather", "attn", "prefix", "chunk attn", "merge", "sel / after_group", "begin_fwd",
            "status"]
    out.append("| " + " | ".join(cols) + " |")
    out.append("|" + "---|" * len(cols))
    key = lambda r: (r["q_heads"], r["kv_heads"], r["batch"], r["chunk"], r["context"])  # noqa: E731
    for r in sorted(rows, key=lambda r: (key(r), r.get("order", 0))):
        after = r.get("density_after_group", r.get("density_executed"))
        dens = f"{_f(r.get('density_selected'), '{:.3f}') or '-'} / {after:.3f}" if after is not None else ""
        status = r.get("status", "ok") + (f": {r['note']}" if r.get("status") != "ok" and r.get("note") else "")
        out.append("| " + " | ".join([
            ctx_label(r["context"]), str(r["chunk"]), str(r["batch"]), f"{r['q_heads']}/{r['kv_heads']}", r["method"],
            _f(r.get("density"), "{:.3f}"), _f(r.get("ms"), "{:.3f}"), _f(r.get("speedup_vs_dense"), "{:.2f}"),
            _f(r.get("overhead_frac"), "{:.1%}"), _f(r.get("search_ms")),
            " ".join(x for x in (_f(r.get("union_index_ms")), _f(r.get("plan_ms"), "plan {:.3f} (host, not in ms)"))
                     if x),
            _f(r.get("gather_ms")), _f(r.get("attn_ms")), _f(r.get("prefix_ms")), _f(r.get("chunk_ms")),
            _f(r.get("merge_ms")), dens,
            _f(r.get("begin_forward_ms")), status.replace("|", "/")]) + " |")
    notes = sorted({(r["method"], r["note"]) for r in rows if r.get("note") and r.get("status") == "ok"})
    if notes:
        out += ["", "Notes per method:", ""] + [f"- `{m}`: {n}" for m, n in notes]
    return "\n".join(out) + "\n"


def render_png(rows: list[dict], path: Path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        return f"no PNG: matplotlib unavailable ({type(e).__name__})"
    groups = sorted({(r["q_heads"], r["kv_heads"], r["batch"], r["chunk"]) for r in rows})
    if not groups:
        return "no PNG: no rows"
    ncol = min(4, len(groups))
    nrow = math.ceil(len(groups) / ncol)
    width = max(9.0, 4.6 * ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(width, 3.6 * nrow + 1.0), squeeze=False, layout="constrained")
    methods = sorted({r["method"] for r in rows}, key=lambda m: min(r.get("order", 0) for r in rows if r["method"] == m))
    cmap = plt.get_cmap("tab20")
    for gi, (hq, hk, bsz, ch) in enumerate(groups):
        ax = axes[gi // ncol][gi % ncol]
        ctxs = set()
        for mi, m in enumerate(methods):
            pts = sorted((r["context"], r["speedup_vs_dense"]) for r in rows
                         if (r["q_heads"], r["kv_heads"], r["batch"], r["chunk"], r["method"]) == (hq, hk, bsz, ch, m)
                         and r.get("speedup_vs_dense"))
            if pts:
                ctxs.update(p[0] for p in pts)
                style = "--" if m.startswith(("dense", "bsparse", "quoka")) else "-"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", ms=3, color=cmap(mi % 20), label=m)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        if ctxs:
            ax.set_xticks(sorted(ctxs), [ctx_label(c) for c in sorted(ctxs)])
            ax.minorticks_off()
        ax.set_title(f"heads {hq}/{hk}, batch {bsz}, chunk {ch}", fontsize=9)
        ax.set_xlabel("context (prefix tokens)")
        ax.set_ylabel("speedup vs faster dense")
        ax.grid(alpha=0.3)
    for gi in range(len(groups), nrow * ncol):
        axes[gi // ncol][gi % ncol].axis("off")
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    ncol_leg = max(1, min(len(labels), int(width / 2.3)))
    try:
        fig.legend(handles, labels, loc="outside lower center", ncol=ncol_leg, fontsize=7)
    except ValueError:  # matplotlib < 3.7
        fig.legend(handles, labels, loc="lower center", ncol=ncol_leg, fontsize=7)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


ABBREV = (("compact_fa3_", "c3."), ("compact_", "c."), ("bsparse_", "bs."), ("dense_", "d."), ("flashprefill", "fp"),
          ("xattention", "xa"), ("mass_budget_", "mb"), ("quest_budget_", "qb"), ("budget_", "b"))


def abbrev(name: str) -> str:
    for a, b in ABBREV:
        name = name.replace(a, b)
    return name


def print_pivots(rows: list[dict]):
    """Compact closing tables (one line per configuration): speedups, then densities and overheads."""
    methods = sorted({r["method"] for r in rows}, key=lambda m: min(r.get("order", 0) for r in rows if r["method"] == m))
    configs = sorted({(r["q_heads"], r["kv_heads"], r["batch"], r["chunk"], r["context"]) for r in rows})
    by = {(r["q_heads"], r["kv_heads"], r["batch"], r["chunk"], r["context"], r["method"]): r for r in rows}
    label = lambda c: f"{c[0]}/{c[1]} B{c[2]} C{c[3]} {ctx_label(c[4])}"  # noqa: E731
    w = max(len(abbrev(m)) for m in methods) + 1
    print("\nspeedup vs the faster dense backend (x = not run; see status)")
    print(f"{'heads B chunk ctx':<22}{'dense ms':>9} " + "".join(f"{abbrev(m):>{max(w, 6)}}" for m in methods))
    for c in configs:
        best = next((by[c + (m,)].get("dense_best_ms") for m in methods if c + (m,) in by), None)
        cells = []
        for m in methods:
            r = by.get(c + (m,))
            sp = r.get("speedup_vs_dense") if r else None
            cells.append(f"{sp:.2f}" if sp is not None else "x")
        print(f"{label(c):<22}{_f(best, '{:.3f}'):>9} " + "".join(f"{x:>{max(w, 6)}}" for x in cells))
    sel = [m for m in methods if not m.startswith("dense_") and "budget" not in m]
    if sel:
        print("\ndensity read by the kernel / overhead fraction (search + union + index [+ gather]) / ms")
        print(f"{'heads B chunk ctx':<22}" + "".join(f"{abbrev(m):>14}" for m in sel))
        for c in configs:
            cells = []
            for m in sel:
                r = by.get(c + (m,)) or {}
                cells.append(f"{_f(r.get('density'), '{:.2f}') or '-'}/{_f(r.get('overhead_frac'), '{:.0%}') or '-'}")
            print(f"{label(c):<22}" + "".join(f"{x:>14}" for x in cells))


def print_summary(rows: list[dict]):
    hdr = f"{'ctx':>5} {'chunk':>5} {'B':>2} {'heads':>5} {'method':<26} {'dens':>6} {'ms':>9} {'speedup':>7} {'ovh':>6}  status"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{ctx_label(r['context']):>5} {r['chunk']:>5} {r['batch']:>2} {r['q_heads']:>2}/{r['kv_heads']:<2} "
              f"{r['method']:<26} {_f(r.get('density'), '{:.3f}'):>6} {_f(r.get('ms'), '{:.3f}'):>9} "
              f"{_f(r.get('speedup_vs_dense'), '{:.2f}'):>7} {_f(r.get('overhead_frac'), '{:.0%}'):>6}  "
              f"{r.get('status')}{(' ' + r['note'][:60]) if r.get('status') != 'ok' and r.get('note') else ''}")
