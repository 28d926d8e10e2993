"""`bsparse_<sel>`: the selector's choice per q-block (the chunk's tokens in one page), before the window union, per
kv head (the OR over its query heads: FlashInfer's block-sparse wrapper shares one mask per kv head; `budget`
chooses per window, so its q-blocks take their window's row), plus the forced pages, executed block-sparse: each
context's K/V gathered from the paged pool into contiguous tensors, FlashInfer's VariableBlockSparseAttentionWrapper
over the selected pages before each q-block's window (non-causal; rows = q-blocks, columns = context pages,
requests block-diagonal, one launch), the window's own pages causally (a paged prefill, one row per window), and
merge_state. Torch masked attention without FlashInfer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from harness.bench_attention.common import cumsum, torch_masked_attention, torch_merge
from harness.bench_attention.methods import Method, Skip, selector_config
from harness.bench_attention.run_compact import head_density
from harness.eval.fidelity import sparse_qblock_cells, table_allowed
from sglang_compact.compact import CompactAttention
from sglang_compact.executors.torch_executor import masked_context_attention

if TYPE_CHECKING:
    from harness.bench_attention.config_run import ConfigRun


def contiguous_kv_index(run: ConfigRun):
    """Flat rows of k_pool.view(-1, D) for contiguous K [H_kv, sum_b E_b, D] (contexts concatenated)."""
    b = run.b
    idx = []
    for i, E in enumerate(b.context_lens_cpu()):
        tok = torch.arange(E, device=run.dev)
        page = b.page_table[i].long()[tok // run.P]
        g = torch.arange(run.H_kv, device=run.dev)[:, None]
        idx.append((page[None, :] * run.H_kv + g) * run.P + (tok % run.P)[None, :])
    return torch.cat(idx, dim=1).reshape(-1)  # [H_kv * sum E]


def qblock_kv_mask(run: ConfigRun, ca: CompactAttention, sel) -> torch.Tensor:
    """bool [H_kv, NQB, NKV]: per kv head and q-block, the pages it reads: the selector's choice (OR over the group's
    query heads; a window's row for selectors that return the rows' table) plus its window's forced pages, up to
    its own page."""
    b, cfg = run.b, ca.config
    d = b.device_qblocks()
    window = d["window"].long()
    if sel.mask is not None:
        m = sel.mask
        if m.shape[0] != run.H_kv:
            m = m.reshape(run.H_kv, m.shape[0] // run.H_kv, *m.shape[1:]).any(dim=1)
    else:
        m = sel.table[:, window]
    forced = b.forced(cfg.sink_blocks, cfg.recent_blocks)[window]                   # [NQB, NKV]
    upto = torch.arange(run.NKV, device=run.dev)[None, :] <= d["page"].long()[:, None]
    return (m | forced[None]) & upto[None]


def run_bsparse(run: ConfigRun, m: Method, row: dict):
    b, t, args = run.b, run.timer, run.args
    qb = b.qblocks
    ca = CompactAttention(selector_config(args, m, run.window))
    sel, search_ms = run.search(m, ca)
    kvmask = qblock_kv_mask(run, ca, sel)                                  # [H_kv, NQB, NKV]
    w_first = torch.tensor(qb.w_first, device=run.dev)
    before = kvmask & (torch.arange(run.NKV, device=run.dev)[None, :] < w_first[b.device_qblocks()["window"].long()]
                       [:, None])[None]                                     # the cells before each q-block's window
    row["density_selected"] = head_density(run, ca)
    sparse, cells = sparse_qblock_cells(b)
    row["density_executed"] = float(kvmask[:, sparse].sum()) / max(1, cells * run.H_kv)
    row["density"] = m.fixed_density if m.fixed_density is not None else row["density_executed"]
    ctx = b.context_lens_cpu()
    n_ctx = list(qb.n_ctx)
    flat = contiguous_kv_index(run)
    k2, v2 = b.k_pool.view(-1, run.D), b.v_pool.view(-1, run.D)
    Etot = sum(ctx)

    def gather():
        return (k2.index_select(0, flat).view(run.H_kv, Etot, run.D),
                v2.index_select(0, flat).view(run.H_kv, Etot, run.D))

    def select():  # the search and the per-kv-head OR (its result: the masks planned here)
        s = ca.selector.select(b, 0, run.summaries)
        if s.mask is not None and s.mask.shape[0] != run.H_kv:
            s.mask.reshape(run.H_kv, -1, *s.mask.shape[1:]).any(dim=1)

    kc, vc = gather()
    if run.fi:
        from flashinfer import BatchPrefillWithPagedKVCacheWrapper
        from flashinfer.sparse import VariableBlockSparseAttentionWrapper
        n_sel = int(before.sum())
        est = n_sel * run.P
        if est > args.bsparse_max_indices:
            raise Skip(f"VariableBlockSparseAttentionWrapper expands blocks to {est:.3g} token indices "
                       f"(page size 1); over --bsparse-max-indices {args.bsparse_max_indices:.3g}")
        NB = sum(n_ctx)
        col0 = [0] + list(cumsum(n_ctx))
        w = None

        def plan_bsr():
            bm = torch.zeros(run.H_kv, qb.count, NB, dtype=torch.bool, device=run.dev)
            for i, r in enumerate(qb.req):
                bm[:, i, col0[r]:col0[r] + n_ctx[r]] = before[:, i, :n_ctx[r]]
            rows = torch.tensor(qb.length, dtype=torch.int32, device=run.dev)
            cols = torch.tensor([min(run.P, E - j * run.P) for E, n in zip(ctx, n_ctx) for j in range(n)],
                                dtype=torch.int32, device=run.dev)
            w.plan(bm, rows[None].expand(run.H_kv, -1).contiguous(), cols[None].expand(run.H_kv, -1).contiguous(),
                   run.H_q, run.H_kv, run.D, causal=False, sm_scale=b.sm_scale, q_data_type=b.q.dtype,
                   kv_data_type=b.q.dtype)

        def prefix(kc, vc):
            o, lse = w.run(b.q.transpose(0, 1), kc, vc, return_lse=True)  # HND in and out
            return o.transpose(0, 1).contiguous(), lse.transpose(0, 1).contiguous()

        failed = []
        for bk in dict.fromkeys([args.bsparse_backend, "fa2"]):  # "auto" may pick a backend that cannot run it
            try:
                w = VariableBlockSparseAttentionWrapper(run.workspace(), backend=bk)
                plan_bsr()
                prefix(kc, vc)
                torch.cuda.synchronize(run.dev)
                break
            except Exception as e:  # noqa: BLE001
                if isinstance(e, torch.OutOfMemoryError):
                    raise
                failed.append(f"backend {bk}: {type(e).__name__}: {str(e)[:150]}")
                w = None
        if w is None:
            raise RuntimeError("VariableBlockSparseAttentionWrapper failed: " + "; ".join(failed))
        row["plan_ms"] = t.host_ms(plan_bsr, reps=2)
        # each window's own pages, causally: one row per window (FlashInfer's bottom-right causal mask)
        own_w = BatchPrefillWithPagedKVCacheWrapper(run.workspace(), "HND", backend="fa2")
        n_own = [last - first + 1 for first, last in zip(qb.w_first, qb.w_last)]
        own_pages = torch.cat([b.page_table[r, first:last + 1] for r, first, last in
                               zip(qb.w_req, qb.w_first, qb.w_last)]).to(torch.int32)
        own_w.plan(torch.tensor(list(qb.w_start) + [b.num_tokens], dtype=torch.int32),
                   torch.tensor([0] + list(cumsum(n_own)), dtype=torch.int32), own_pages,
                   torch.tensor(qb.last_page_len(), dtype=torch.int32), run.H_q, run.H_kv, run.D, run.P, causal=True,
                   sm_scale=b.sm_scale, q_data_type=b.q.dtype, kv_data_type=b.q.dtype)
        own_fn = lambda kc, vc: own_w.run(b.q, (b.k_pool, b.v_pool), return_lse=True)  # noqa: E731  (the pool)
        merge = run.merge_fn
        row["note"] = (f"FlashInfer VariableBlockSparseAttentionWrapper (backend {w._backend}), one launch, rows = "
                       "q-blocks, requests block-diagonal, over the pages before each q-block's window; the window's "
                       "own pages causally (paged, chunk_ms); per-kv-head masks = OR over the group's query heads "
                       "per q-block (no window union) + forced pages; K/V gathered from the paged pool (gather_ms, "
                       "in ms); host plan_ms not in ms" + (f"; fell back after {failed}" if failed else ""))
    else:
        row["note"] = ("torch masked attention over gathered K/V (FlashInfer unavailable): the pages before each "
                       "q-block's window, then the window's own pages causally (chunk_ms), merged; per-kv-head masks "
                       "= OR over the group's query heads per q-block (no window union) + forced pages")
        starts = [0] + list(cumsum(ctx))
        cu = b.cu_chunk_cpu()
        W = run.window
        first_q = {r: qb.req.index(r) for r in set(qb.req)}
        first_w = {r: qb.w_req.index(r) for r in set(qb.w_req)}

        def per_request(kc, vc, mask_fn):
            T = b.q.shape[0]
            o = torch.zeros(T, run.H_q, run.D, dtype=torch.float32, device=run.dev)
            lse = torch.full((T, run.H_q), float("-inf"), dtype=torch.float32, device=run.dev)
            for i, (L, C) in enumerate(zip(b.prefix_lens_cpu, b.chunk_lens_cpu)):
                if C == 0:
                    continue
                E = L + C
                pos = L + torch.arange(C, device=run.dev)
                allowed = mask_fn(i, L, pos, E)                                 # [H_kv or 1, C, E]
                if allowed.shape[0] != 1:
                    allowed = allowed.repeat_interleave(run.G, dim=0)
                kk = kc[:, starts[i]:starts[i] + E].repeat_interleave(run.G, dim=0)
                vv = vc[:, starts[i]:starts[i] + E].repeat_interleave(run.G, dim=0)
                o[cu[i]:cu[i + 1]], lse[cu[i]:cu[i + 1]] = torch_masked_attention(
                    b.q[cu[i]:cu[i + 1]].transpose(0, 1), kk, vv, allowed, b.sm_scale)
            return o, lse

        def before_mask(i, L, pos, E):  # the selected pages before each q-block's window, non-causal
            qblock = first_q[i] + pos // run.P - L // run.P
            return before[:, qblock][:, :, torch.arange(E, device=run.dev) // run.P]

        def own_mask(i, L, pos, E):  # the window's own pages, causally
            window = first_w[i] + pos // W - L // W
            tok = torch.arange(E, device=run.dev)
            first_tok = w_first[window] * run.P
            return ((tok[None, :] >= first_tok[:, None]) & (tok[None, :] <= pos[:, None]))[None]

        prefix = lambda kc, vc: per_request(kc, vc, before_mask)  # noqa: E731
        own_fn = lambda kc, vc: per_request(kc, vc, own_mask)  # noqa: E731
        merge = lambda oa, la, ob, lb: torch_merge(oa, la, ob, lb).to(b.q.dtype)  # noqa: E731

    def e2e():
        select()
        kc, vc = gather()
        o_p, l_p = prefix(kc, vc)
        o_c, l_c = own_fn(kc, vc)
        return merge(o_p, l_p, o_c, l_c)

    out = e2e()
    row["ms"] = t.device_ms(e2e)
    if not args.no_split:
        row["search_ms"] = search_ms
        if sel.mask is not None and sel.mask.shape[0] != run.H_kv:
            row["union_ms"] = t.device_ms(lambda: sel.mask.reshape(run.H_kv, -1, *sel.mask.shape[1:]).any(dim=1))
        row["gather_ms"] = t.device_ms(gather)
        row["prefix_ms"] = t.device_ms(lambda: prefix(kc, vc))
        row["chunk_ms"] = t.device_ms(lambda: own_fn(kc, vc))
        row["merge_ms"] = run.merge_ms
    run.check(row, out, ref=lambda: masked_context_attention(
        b, lambda i, L, C: table_allowed(b, kvmask, i, per="qblock")))
