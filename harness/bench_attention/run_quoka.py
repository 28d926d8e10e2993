"""`quoka`: the QUOKA-style baseline (`harness.quoka.quoka_token_mask` over each request's prefix tokens), the
selected tokens gathered per kv head into contiguous K/V, FlashInfer ragged non-causal over them (torch without
FlashInfer) + the chunk against itself, causally (ragged over k_chunk / v_chunk, shared) + merge."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from harness.bench_attention.common import cumsum, torch_masked_attention
from harness.bench_attention.methods import Method
from harness.quoka import quoka_allowed, quoka_token_mask
from sglang_compact.executors.torch_executor import masked_context_attention

if TYPE_CHECKING:
    from harness.bench_attention.config_run import ConfigRun


def run_quoka(run: ConfigRun, m: Method, row: dict):
    b, t, args = run.b, run.timer, run.args
    qr, kb = args.quoka_query_ratio, args.quoka_kv_budget
    n_keep = [max(1, math.ceil(kb * L - 1e-9)) if L else 0 for L in b.prefix_lens_cpu]
    row["density"] = kb
    row["quoka_query_ratio"], row["quoka_kv_budget"] = qr, kb
    select = lambda: quoka_token_mask(b, qr, kb)  # noqa: E731
    hg = torch.arange(run.H_kv, device=run.dev)[None, :]

    def index(mask):
        """Selected tokens per (request, kv head) -> flat pool rows [sum n_keep, H_kv] (ascending tokens)."""
        parts = []
        for i, (L, n) in enumerate(zip(b.prefix_lens_cpu, n_keep)):
            if n == 0:
                continue
            tok = torch.sort(mask[i, :, :L].to(torch.uint8), dim=-1, descending=True, stable=True).indices[:, :n]
            tok = tok.t()  # [n, H_kv]
            page = b.page_table[i].long()[tok // run.P]
            parts.append((page * run.H_kv + hg) * run.P + tok % run.P)
        return torch.cat(parts, dim=0)

    k2, v2 = b.k_pool.view(-1, run.D), b.v_pool.view(-1, run.D)
    N = sum(n_keep)

    def gather(idx):
        f = idx.reshape(-1)
        return k2.index_select(0, f).view(N, run.H_kv, run.D), v2.index_select(0, f).view(N, run.H_kv, run.D)

    if run.fi:
        from flashinfer import BatchPrefillWithRaggedKVCacheWrapper
        qo = torch.tensor([0] + list(cumsum(b.chunk_lens_cpu)), dtype=torch.int32)
        kvp = torch.tensor([0] + list(cumsum(n_keep)), dtype=torch.int32)
        w = BatchPrefillWithRaggedKVCacheWrapper(run.workspace(), "NHD", backend=args.quoka_backend)
        row["begin_forward_ms"] = t.host_ms(lambda: w.plan(qo, kvp, run.H_q, run.H_kv, run.D, causal=False,
                                                           sm_scale=b.sm_scale, q_data_type=b.q.dtype,
                                                           kv_data_type=b.q.dtype), reps=3)
        prefix = lambda kc, vc: w.run(b.q, kc, vc, return_lse=True)  # noqa: E731
        row["note"] = (f"quoka_token_mask + gather into contiguous K/V [N, H_kv, D] + FlashInfer ragged "
                       f"({args.quoka_backend}) non-causal; index_ms = selected-token index build")
    else:
        row["note"] = "torch attention over gathered K/V (FlashInfer unavailable); index_ms = index build"
        kstart = [0] + list(cumsum(n_keep))

        def prefix(kc, vc):
            T = b.q.shape[0]
            o = torch.empty(T, run.H_q, run.D, dtype=torch.float32, device=run.dev)
            lse = torch.empty(T, run.H_q, dtype=torch.float32, device=run.dev)
            c0 = 0
            for i, C in enumerate(b.chunk_lens_cpu):
                kk = kc[kstart[i]:kstart[i + 1]].transpose(0, 1).repeat_interleave(run.G, dim=0)
                vv = vc[kstart[i]:kstart[i + 1]].transpose(0, 1).repeat_interleave(run.G, dim=0)
                allowed = torch.ones(1, 1, 1, dtype=torch.bool, device=run.dev)
                o[c0:c0 + C], lse[c0:c0 + C] = torch_masked_attention(b.q[c0:c0 + C].transpose(0, 1), kk, vv, allowed,
                                                                      b.sm_scale)
                c0 += C
            return o, lse

    def e2e():
        kc, vc = gather(index(select()))
        o_p, l_p = prefix(kc, vc)
        o_c, l_c = run.chunk_fn()
        return run.merge_fn(o_p, l_p, o_c, l_c)

    out = e2e()
    row["ms"] = t.device_ms(e2e)
    mask = select()
    idx = index(mask)
    kc, vc = gather(idx)
    if not args.no_split:
        row["search_ms"] = t.device_ms(select)
        row["index_ms"] = t.device_ms(lambda: index(mask))
        row["gather_ms"] = t.device_ms(lambda: gather(idx))
        row["prefix_ms"] = t.device_ms(lambda: prefix(kc, vc))
        row["chunk_ms"], row["merge_ms"] = run.chunk_ms, run.merge_ms
    run.check(row, out, ref=lambda: masked_context_attention(b, quoka_allowed(b, mask)))
