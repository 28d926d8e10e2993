"""`compact_<sel>` / `compact_fa3_<sel>`: `CompactAttention.select_pages` + the executor's one causal paged pass over
the rows (kv head, window), end to end as the server runs a layer (the executor planned once per forward pass,
outside), then its search, union, index and attention timed on their own. A selector that fixes its rows at the
pass's observing layer (`compact_fa3_flashprefill_fixed`) is timed as a later layer: the observing layer's row counts plan
the executor, and the layer fills each row to them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.bench_attention.methods import Method, selector_config
from sglang_compact.compact import CompactAttention
from sglang_compact.indices import build_indices, top_pages_indices
from sglang_compact.selectors.base import Selection
from sglang_compact.union import union_table

if TYPE_CHECKING:
    from harness.bench_attention.config_run import ConfigRun


def rows_table(run: ConfigRun, ca: CompactAttention, sel: Selection):
    """(table, counts) of a selection, as `select_pages` makes them (group and window unions, forced pages; no cap
    here)."""
    if sel.table is not None:
        return sel.table, sel.counts
    cfg = ca.config
    if sel.ranked is not None:
        return top_pages_indices(sel.ranked, sel.counts, run.b, cfg.sink_blocks, cfg.recent_blocks,
                                 sel.per_qblock)[0], sel.counts
    return union_table(sel.mask, run.b, cfg.sink_blocks, cfg.recent_blocks)


def head_density(run: ConfigRun, ca: CompactAttention) -> float | None:
    """Per query head and q-block, before the group and window unions: (q-block, page) cells read (the selector's
    choice + the forced pages, up to the q-block's own page) over the sparse windows' q-blocks' context cells;
    None for selectors without a per-head choice (budget)."""
    from harness.eval.fidelity import sparse_qblock_cells, head_masks
    try:
        masks = head_masks(run.b, 0, ca.config, ca, run.summaries)            # [H_q, NQB, NKV]
    except ValueError:
        return None
    sparse, cells = sparse_qblock_cells(run.b)
    return float(masks[:, sparse].sum()) / max(1, cells * run.H_q)


def run_compact(run: ConfigRun, m: Method, row: dict):
    b, t, args = run.b, run.timer, run.args
    ca = CompactAttention(selector_config(args, m, run.window))
    fill, rows = None, ca.row_pages(b)
    if ca.config.spec.fixes_rows_at_observing_layer(ca.config.params):
        first = ca.select_pages(b, 0, run.summaries)     # the observing layer: its threshold fixes the rows
        fill, rows = first.counts, first.counts.tolist()
    ex, bf_ms = run.executor(m.backend, rows if m.backend == "fa3" else None)
    buffers = ex.index_buffers
    mode = getattr(ex, "mode", None)
    if not run.fi:
        row["note"] = "torch executor (FlashInfer unavailable)"
    elif mode == "rows-per-layer":
        row["note"] = "fa3 executor: plan() per layer with a device->host sync, inside attn_ms and ms"
    elif m.backend == "fa3":
        row["note"] = "fa3 executor planned once per forward pass from the host-known row lengths"
    if fill is not None:
        row["note"] = (row.get("note", "") + "; " if row.get("note") else "") + \
            "rows fixed by an earlier layer's counts; the layer timed fills each row to them"

    def e2e():
        ps = ca.select_pages(b, 0, run.summaries, buffers=buffers, fill=fill)  # as the server runs it (metrics off)
        return ex.run(b, ps.indices)

    out = e2e()
    row["ms"] = t.device_ms(e2e)
    row["begin_forward_ms"] = bf_ms
    ps = ca.select_pages(b, 0, run.summaries, buffers=buffers, with_stats=True, fill=fill)
    row["density_after_group"] = float(ps.density)
    row["density_selected"] = head_density(run, ca)
    row["density"] = m.fixed_density if m.fixed_density is not None else row["density_after_group"]
    run.check(row, out, table=ps.table)
    if args.no_split:
        return
    cfg = ca.config
    if fill is not None:
        sel = ca.selector.fill(b, 0, run.summaries, fill)
        search_ms = t.device_ms(lambda: ca.selector.fill(b, 0, run.summaries, fill))
    else:
        sel, search_ms = run.search(m, ca, retime=True)
    row["search_ms"] = search_ms
    if sel.mask is not None:
        row["union_ms"] = t.device_ms(lambda: union_table(sel.mask, b, cfg.sink_blocks, cfg.recent_blocks))
    if sel.ranked is not None:   # the rows' ranking, table and indices: one kernel
        def index():
            return top_pages_indices(sel.ranked, sel.counts, b, cfg.sink_blocks, cfg.recent_blocks, sel.per_qblock,
                                     buffers)[1]
    else:
        table, counts = rows_table(run, ca, sel)

        def index():
            return build_indices(table, counts, b, buffers)
    row["index_ms"] = t.device_ms(index)
    indices = index()
    row["attn_ms"] = t.device_ms(lambda: ex.run(b, indices))
