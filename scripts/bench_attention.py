#!/usr/bin/env python3
"""One layer's attention for one prefill chunk against its cached prefix: CompactAttention vs baselines.

For every configuration (context = prefix length L, chunk C, batch B, heads H_q/H_kv, head_dim D) all
methods run side by side in one process on the same inputs, then memory is freed before the next one:

  dense_fa2 / dense_fa3   FlashInfer BatchPrefillWithPagedKVCacheWrapper over the HND pool with page ids
                          (all heads), non-causal prefix with return_lse + ragged causal chunk + merge_state;
                          both wrappers planned once outside the timed region (plan is per forward pass).
  compact_<sel>           CompactAttention.plan + FlashInferExecutor.run (fa2: planned once per forward
                          pass, plan kernel writes the executor's buffers). <sel> = flashprefill (alpha),
                          xattention (threshold), budget_<d> (fixed density d; budget_1.0 = everything,
                          which separates kernel choice from sparsity).
  compact_fa3_<sel>       the same with FlashInferExecutor(backend="fa3"): for budget_<d> (row lengths fixed
                          on the host, CompactAttention.row_blocks) planned once per forward pass like fa2
                          (its host plan is begin_forward_ms); for threshold selectors a plan() per layer
                          with a device->host sync (counted in its attention time). The chunk's own causal
                          part then also runs on fa3 (chunk_ms shows the shared fa2 figure).
  bsparse_<sel>           FlashInfer's VariableBlockSparseAttentionWrapper on the selector's per-query-block
                          masks (before the union): per-kv-head masks, one launch for the whole batch
                          (requests block-diagonal). It needs contiguous K/V [H_kv, sum L, D]: the gather
                          from the paged pool is timed ("gather_ms") and counted in ms. Its plan() (host,
                          expands blocks to token indices, syncs) is reported as plan_ms but NOT counted
                          in ms, since a native block-sparse kernel takes the mask directly.
  quoka                   QUOKA-style: quoka_token_mask (query ratio 0.25, KV budget 0.25), gather of the
                          selected tokens per kv head into contiguous K/V [N, H_kv, D], FlashInfer ragged
                          non-causal over them + ragged causal chunk + merge.

Split times (each timed on its own with the same inputs): search_ms (pooled-key gather from PageSummaries
+ selector.select; xattention reads the prefix keys), union_ms (union_table), plan_ms (build_plan into
FlashInferExecutor.buffers), prefix_ms (paged prefix attention), chunk_ms (ragged causal chunk; shared per
config), merge_ms (merge_state; shared per config), gather_ms (bsparse / quoka). attn_ms = prefix_ms +
chunk_ms. "ms" is the method's end-to-end time, timed as one closure. begin_forward_ms is host time of the
per-forward-pass planning (not per layer, not in ms).

Timing: CUDA events around each call, L2 flushed (256 MB write) before each call, warm-up calls first,
median of N calls where N = clamp(--budget-ms / estimate, --min-reps, --reps).

Inputs are structured (attention sinks, a local window, a few heavy blocks, per-query-block topic
mixtures correlated across query blocks and heads), built directly on the device; see `structured_batch`.

Outputs (under --out-dir, default docs/results): rows appended to speed.json, speed_attention.md and
speed_attention.png rendered from the rows of this --run-tag, speed_attention_meta.json (per run: command,
GPU, versions, generator parameters).

GPU host (from the repository root, after ../shared/gpu-host/stage.sh and carrying .gpu):
  source scripts/gpu/setup.sh
  python3 scripts/bench_attention.py --smoke --check --out-dir $OUT/smoke      # ~1 min: checks outputs
  mkdir -p $OUT/results && cp docs/results/* $OUT/results/ 2>/dev/null
  python3 scripts/bench_attention.py --out-dir $OUT/results --deadline-s 540 ...
On a CPU machine `--smoke` runs the torch paths (FlashInfer-only methods are recorded as skipped).
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import gc
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[1]

if not torch.cuda.is_available():  # Triton kernels (not used on the CPU paths) would need the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sglang_compact.batch import ChunkBatch, cdiv  # noqa: E402
from sglang_compact.compact import CompactAttention  # noqa: E402
from sglang_compact.config import CompactConfig  # noqa: E402
from sglang_compact.execute import (TorchPagedExecutor, causal_chunk_attention, merge_states,  # noqa: E402
                                    reference_attention)
from sglang_compact.plan import build_plan  # noqa: E402
from sglang_compact.quoka import quoka_token_mask  # noqa: E402
from sglang_compact.summaries import PageSummaries  # noqa: E402
from sglang_compact.union import forced_blocks, union_stats, union_table  # noqa: E402

try:
    import flashinfer  # noqa: F401
    HAVE_FI = True
    FI_VERSION = getattr(flashinfer, "__version__", "?")
except Exception as e:  # noqa: BLE001
    HAVE_FI = False
    FI_VERSION = f"unavailable ({type(e).__name__})"

FULL = dict(contexts="32768,65536,131072,262144", chunks="1024,8192", batches="1,8", heads="32/8,16/4")
# smoke sizes are not page aligned on purpose (partial last pages and query blocks); GPU: head_dim 128 (JIT cache)
SMOKE = dict(contexts="4000,8192", chunks="200", batches="1,2", heads="8/2")
SMOKE_CPU = dict(contexts="500,1024", chunks="100", batches="1,2", heads="8/2", head_dim=32, page_size=16)
DEFAULT_METHODS = ("dense_*,compact_flashprefill,compact_xattention,compact_budget_*,compact_fa3_flashprefill,"
                   "compact_fa3_budget_*,"
                   "bsparse_flashprefill,bsparse_xattention,quoka")


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------

@dataclass
class GenParams:
    """Structure of the synthetic inputs (all strengths in nats of the attention logit).

    Every kv head g has a shared direction u0 (the one every query leans towards) and `topics`
    orthogonal topic directions. A prefix block j carries topic weights w_j ~ N(0, 1) scaled so that a
    query block's logit for block j varies by `spread` nats (std) across blocks; `heavy_blocks` random
    blocks per (request, kv head) get +`heavy_nats` along u0; the first `sink_tokens` tokens get
    +`sink_nats`; the last `window_tokens` prefix tokens a ramp up to +`window_nats` (recency).
    Each query block of each query head mixes a per-(request, kv head) shared topic vector (weight
    `rho`) with an independent one, so query blocks and the heads of a group want overlapping but
    different blocks: the unions inflate density as they do on real models. Token-level noise keeps
    per-token logits at std ~1.
    """

    topics: int = 32
    spread: float = 2.0
    rho: float = 0.8
    heavy_blocks: int = 8
    heavy_nats: float = 3.0
    sink_tokens: int = 4
    sink_nats: float = 8.0
    window_tokens: int = 256
    window_nats: float = 2.0

    def describe(self) -> str:
        return "structured(" + ",".join(f"{k}={v}" for k, v in self.__dict__.items()) + ")"


def structured_batch(prefix_lens: list[int], chunk_lens: list[int], H_q: int, H_kv: int, D: int, P: int, *,
                     device: torch.device, dtype: torch.dtype, seed: int, gp: GenParams,
                     extra_pages: int = 3) -> ChunkBatch:
    """A ChunkBatch whose prefixes lie in shuffled pages of an HND pool, generated on `device`."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)

    def randn(*shape, dt=torch.float32):
        return torch.randn(*shape, generator=g, device=dev, dtype=dt)

    B, G = len(prefix_lens), H_q // H_kv
    n_pages = [cdiv(L, P) for L in prefix_lens]
    total = sum(n_pages) + extra_pages
    perm = torch.randperm(total, generator=g, device=dev).to(torch.int32)
    page_table = torch.zeros(B, max(n_pages + [1]), dtype=torch.int32, device=dev)
    used = 0
    for b, n in enumerate(n_pages):
        page_table[b, :n] = perm[used:used + n]
        used += n
    m = max(1, min(gp.topics, D - 1))
    # orthonormal directions per kv head, norm sqrt(D): q.k * D^-0.5 = sqrt(D) per unit coefficient
    U = torch.linalg.qr(randn(H_kv, D, m + 1))[0].transpose(1, 2).contiguous() * D ** 0.5  # [H_kv, m+1, D]
    unit = D ** 0.5
    k_pool = randn(total, H_kv, P, D, dt=dtype)
    v_pool = randn(total, H_kv, P, D, dt=dtype)
    for b, (L, n) in enumerate(zip(prefix_lens, n_pages)):
        if n == 0:
            continue
        W = randn(n, H_kv, m) * (gp.spread / unit)
        w0 = torch.zeros(n, H_kv, device=dev)
        if gp.heavy_blocks > 0:
            heavy = torch.rand(n, H_kv, generator=g, device=dev).argsort(dim=0)[:min(gp.heavy_blocks, n)]
            w0.scatter_(0, heavy, gp.heavy_nats / unit)
        block_sig = torch.einsum("nhm,hmd->nhd", W, U[:, 1:]) + w0[..., None] * U[None, :, 0]  # [n, H_kv, D]
        tok_boost = torch.zeros(n * P, device=dev)
        tok_boost[:min(gp.sink_tokens, L)] += gp.sink_nats
        if gp.window_tokens > 0 and L > 0:
            ws = max(L - gp.window_tokens, 0)
            tok_boost[ws:L] += gp.window_nats * torch.arange(1, L - ws + 1, device=dev, dtype=torch.float32) / gp.window_tokens
        pages = page_table[b, :n].long()
        for s in range(0, n, 4096):  # bounded temporaries
            e = min(n, s + 4096)
            sig = block_sig[s:e, :, None, :] + (tok_boost.view(n, P)[s:e, None, :, None] / unit) * U[None, :, 0, None, :]
            k_pool[pages[s:e]] += sig.to(dtype)
    T = sum(chunk_lens)
    q = randn(T, H_q, D)
    start = 0
    for b, C in enumerate(chunk_lens):
        nq = cdiv(C, P)
        shared = randn(H_kv, 1, m)
        ind = randn(H_kv, G * nq, m)
        A = gp.rho * shared / shared.norm(dim=-1, keepdim=True) + math.sqrt(max(0.0, 1 - gp.rho ** 2)) * ind / ind.norm(dim=-1, keepdim=True)
        A = (A / A.norm(dim=-1, keepdim=True)).view(H_kv, G, nq, m)
        qs = torch.einsum("hgim,hmd->ihgd", A, U[:, 1:]) + U[:, 0][None, :, None, :]  # [nq, H_kv, G, D]
        q[start:start + C] += qs.reshape(nq, H_q, D).repeat_interleave(P, dim=0)[:C]
        start += C
    k_chunk = randn(T, H_kv, D, dt=dtype)
    v_chunk = randn(T, H_kv, D, dt=dtype)
    return ChunkBatch.build(q.to(dtype), k_chunk, v_chunk, k_pool, v_pool, page_table, prefix_lens, chunk_lens)


def fill_summaries(batch: ChunkBatch) -> PageSummaries:
    """Page summaries of the pool as serving would hold them (sum and count of each page's written keys)."""
    num_pages, H_kv, P, D = batch.k_pool.shape
    s = PageSummaries(1, num_pages, H_kv, D, P, batch.q.device)
    for b, L in enumerate(batch.prefix_lens_cpu):
        n = cdiv(L, P)
        if n == 0:
            continue
        pages = batch.page_table[b, :n].long()
        valid = (torch.arange(n * P, device=pages.device) < L).view(n, P)
        for i in range(0, n, 4096):
            pg, vd = pages[i:i + 4096], valid[i:i + 4096]
            k = batch.k_pool[pg].to(torch.float32) * vd[:, None, :, None]
            s.key_sum[0, pg] = k.sum(dim=2)
            s.count[0, pg] = vd.sum(dim=1, dtype=torch.int32)
    return s


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# methods
# ---------------------------------------------------------------------------------------------

@dataclass
class Method:
    name: str
    kind: str                    # dense | compact | bsparse | quoka
    backend: str | None = None   # fa2 / fa3 / torch
    selector: str | None = None
    params: dict = field(default_factory=dict)
    fixed_density: float | None = None


def known_methods(budgets: list[float]) -> list[Method]:
    ms = [Method("dense_fa2", "dense", "fa2"), Method("dense_fa3", "dense", "fa3"), Method("dense_torch", "dense", "torch")]
    sels = [("flashprefill", "flashprefill", None), ("xattention", "xattention", None)]
    sels += [(f"budget_{d}", "budget", d) for d in budgets]
    for prefix, bk in (("compact", "fa2"), ("compact_fa3", "fa3")):
        for tag, sel, d in sels:
            ms.append(Method(f"{prefix}_{tag}", "compact", bk, sel, fixed_density=d))
    for tag, sel, d in sels:
        ms.append(Method(f"bsparse_{tag}", "bsparse", None, sel, fixed_density=d))
    ms.append(Method("quoka", "quoka"))
    return ms


def select_methods(spec: str, budgets: list[float], fi_usable: bool) -> list[Method]:
    pats = [p.strip() for p in spec.split(",") if p.strip()]
    out = [m for m in known_methods(budgets) if any(fnmatch.fnmatchcase(m.name, p) for p in pats)]
    unknown = [p for p in pats if not any(fnmatch.fnmatchcase(m.name, p) for m in known_methods(budgets))]
    if unknown:
        raise SystemExit(f"--methods: no method matches {unknown}; known: {[m.name for m in known_methods(budgets)]}")
    if not fi_usable and not any(m.name == "dense_torch" for m in out):
        out.insert(0, Method("dense_torch", "dense", "torch"))  # the baseline without FlashInfer
    if fi_usable:
        out = [m for m in out if m.name != "dense_torch" or "dense_torch" in pats]
    return out


def selector_config(args, m: Method) -> CompactConfig:
    if m.selector == "flashprefill":
        params = {"alpha": args.alpha, "query_stride": args.query_stride}
    elif m.selector == "xattention":
        params = {"threshold": args.xattn_threshold, "stride": args.xattn_stride}
    else:
        params = {"density": m.fixed_density, "query_stride": args.query_stride}
    return CompactConfig(block_size=args.page_size, selector=m.selector, selector_params=params,
                         sink_blocks=args.sink_blocks, recent_blocks=args.recent_blocks, min_prefix_len=0)


class Skip(Exception):
    """A method that cannot run here (recorded as status 'skipped')."""


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def torch_masked_attention(q, k, v, allowed, scale):
    """q [H, M, D], k/v [H, N, D], allowed bool broadcastable to [H, M, N] -> (o [M, H, D], lse [M, H]) fp32."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    return torch.matmul(p, v.float()).transpose(0, 1), lse.transpose(0, 1)


class ConfigRun:
    """Everything for one configuration: inputs, shared chunk/merge kernels, and the method runners."""

    def __init__(self, args, batch: ChunkBatch, timer: Timer):
        self.args, self.b, self.timer = args, batch, timer
        self.dev = batch.q.device
        self.fi = HAVE_FI and self.dev.type == "cuda"
        self.P, self.H_kv, self.H_q, self.D = batch.page_size, batch.num_kv_heads, batch.num_q_heads, batch.head_dim
        self.G = self.H_q // self.H_kv
        self.NKV = batch.max_kv_blocks
        self.kv_blocks = batch.kv_blocks()
        self.pages = batch.page_table[:, :self.NKV].contiguous()
        self.index_bound = self.H_kv * sum(batch.kv_blocks_cpu())
        self.summaries = fill_summaries(batch)
        self.searches: dict[str, tuple] = {}
        self.executors: dict[str, Any] = {}
        self.check_ok = args.check and self.H_q * max(batch.chunk_lens_cpu) * max(batch.prefix_lens_cpu) <= args.check_max_elems
        self._setup_shared_chunk()

    # --- shared pieces ---------------------------------------------------------------------
    def workspace(self):
        return torch.empty(256 << 20, dtype=torch.uint8, device=self.dev)

    def _setup_shared_chunk(self):
        b = self.b
        if self.fi:
            import flashinfer
            self.chunk_wrapper = self._ragged_causal("fa2")
            self.chunk_fn = lambda: self.chunk_wrapper.run(b.q, b.k_chunk, b.v_chunk, return_lse=True)
            self.merge_fn = lambda oa, la, ob, lb: flashinfer.merge_state(oa, la, ob, lb)[0]
        else:
            self.chunk_fn = lambda: causal_chunk_attention(b.q, b.k_chunk, b.v_chunk, b.chunk_lens_cpu, b.sm_scale)
            self.merge_fn = lambda oa, la, ob, lb: merge_states(oa, la, ob, lb)[0].to(b.q.dtype)
        o_c, lse_c = self.chunk_fn()
        self.o_c, self.lse_c = o_c, lse_c
        self.chunk_ms = self.timer.device_ms(self.chunk_fn)
        o_p = torch.randn_like(o_c)
        lse_p = torch.randn_like(lse_c)
        self.merge_ms = self.timer.device_ms(lambda: self.merge_fn(o_p, lse_p, o_c, lse_c))

    def _ragged_causal(self, backend):
        from flashinfer import BatchPrefillWithRaggedKVCacheWrapper
        b = self.b
        cu = torch.tensor([0] + list(_cumsum(b.chunk_lens_cpu)), dtype=torch.int32)
        w = BatchPrefillWithRaggedKVCacheWrapper(self.workspace(), "NHD", backend=backend)
        w.plan(cu, cu, self.H_q, self.H_kv, self.D, causal=True, sm_scale=b.sm_scale, q_data_type=b.q.dtype,
               kv_data_type=b.q.dtype)
        return w

    def check(self, row: dict, out: torch.Tensor, **mask):
        if not self.check_ok:
            return
        ref = reference_attention(self.b, q_block=self.P, **mask)
        row["rel_err"] = rel_err(out, ref)
        if not (row["rel_err"] <= self.args.check_tol):
            row["status"] = "error"
            row["note"] = (row.get("note", "") + f" CHECK FAILED: rel_err {row['rel_err']:.3e} > {self.args.check_tol}").strip()

    def full_table(self):
        return (torch.arange(self.NKV, device=self.dev)[None, :] < self.kv_blocks[:, None])[:, None, :].expand(
            self.b.batch_size, self.H_kv, self.NKV).contiguous()

    # --- dense -------------------------------------------------------------------------------
    def run_dense(self, m: Method, row: dict):
        b, t = self.b, self.timer
        if m.backend == "torch":
            ex = TorchPagedExecutor()
            plan = CompactAttention(CompactConfig(block_size=self.P, selector="dense", min_prefix_len=0)).plan(b).plan
            prefix = lambda: ex.prefix_attention(b, plan)  # noqa: E731
            chunk, merge, chunk_ms = self.chunk_fn, self.merge_fn, self.chunk_ms
            row["note"] = "torch paged executor over every page (FlashInfer unavailable)"
        else:
            if not self.fi:
                raise Skip("needs FlashInfer on CUDA")
            import flashinfer
            from flashinfer import BatchPrefillWithPagedKVCacheWrapper
            n = b.kv_blocks_cpu()
            kv_indptr = torch.tensor([0] + list(_cumsum(n)), dtype=torch.int32)
            kv_indices = torch.cat([b.page_table[i, :n[i]] for i in range(b.batch_size)]).to(torch.int32)
            last = torch.tensor([L - (k - 1) * self.P if k else 0 for L, k in zip(b.prefix_lens_cpu, n)], dtype=torch.int32)
            qo = torch.tensor([0] + list(_cumsum(b.chunk_lens_cpu)), dtype=torch.int32)
            w = BatchPrefillWithPagedKVCacheWrapper(self.workspace(), "HND", backend=m.backend)
            r = self._ragged_causal(m.backend)

            def plan_all():  # both wrappers: what a forward pass plans once (not per layer)
                w.plan(qo, kv_indptr, kv_indices, last, self.H_q, self.H_kv, self.D, self.P, causal=False,
                       sm_scale=b.sm_scale, q_data_type=b.q.dtype, kv_data_type=b.q.dtype)
                r.plan(qo, qo, self.H_q, self.H_kv, self.D, causal=True, sm_scale=b.sm_scale, q_data_type=b.q.dtype,
                       kv_data_type=b.q.dtype)

            row["begin_forward_ms"] = t.host_ms(plan_all, reps=3)
            prefix = lambda: w.run(b.q, (b.k_pool, b.v_pool), return_lse=True)  # noqa: E731
            chunk = lambda: r.run(b.q, b.k_chunk, b.v_chunk, return_lse=True)  # noqa: E731
            merge = lambda oa, la, ob, lb: flashinfer.merge_state(oa, la, ob, lb)[0]  # noqa: E731
            chunk_ms = t.device_ms(chunk) if m.backend != "fa2" else self.chunk_ms

        def e2e():
            o_p, l_p = prefix()
            o_c, l_c = chunk()
            return merge(o_p, l_p, o_c, l_c)

        out = e2e()
        row["ms"] = t.device_ms(e2e)
        if not self.args.no_split:
            row["prefix_ms"] = t.device_ms(prefix)
            row["chunk_ms"] = chunk_ms
            row["merge_ms"] = self.merge_ms
        row["density"] = 1.0
        self.check(row, out, table=self.full_table())

    # --- compact -----------------------------------------------------------------------------
    def executor(self, backend: str, row_blocks: list[int] | None = None):
        """(executor, begin_forward host ms) planned for this configuration; fa3 with `row_blocks`
        (selectors that fix the row lengths) is planned once with those lengths."""
        key = (backend, None if row_blocks is None else tuple(row_blocks))
        if key in self.executors:
            return self.executors[key]
        b = self.b
        if not self.fi:
            if backend == "fa3":
                raise Skip("needs FlashInfer on CUDA")
            ex, bf_ms = TorchPagedExecutor(), None
        else:
            from sglang_compact.execute_flashinfer import FlashInferExecutor
            ex = FlashInferExecutor(self.dev, max_rows=b.batch_size * self.H_kv, max_indices=self.index_bound, backend=backend)
            bf_ms = self.timer.host_ms(lambda: ex.begin_forward_for(b, row_blocks), reps=3)
        self.executors[key] = (ex, bf_ms)
        return ex, bf_ms

    def search(self, m: Method, ca: CompactAttention, retime: bool = False):
        """(mask, search_ms) for the method's selector; cached per selector configuration. `retime`
        measures search_ms again (every compact row times its own search: a figure timed once and
        shared between rows was seen off by 0.5 ms on the H200)."""
        key = f"{m.selector}:{sorted(ca.config.selector_params.items())}"
        if key not in self.searches or retime:
            uses = ca.selector.uses_summaries
            fn = lambda: ca.select(self.b, 0, self.summaries.pooled(0, self.pages) if uses else None)  # noqa: E731
            sel = fn()
            self.searches[key] = (sel, self.timer.device_ms(fn))
        return self.searches[key]

    def run_compact(self, m: Method, row: dict):
        b, t, args = self.b, self.timer, self.args
        ca = CompactAttention(selector_config(args, m))
        rows = ca.row_blocks(b.prefix_lens_cpu, [True] * b.batch_size) if m.backend == "fa3" else None
        ex, bf_ms = self.executor(m.backend, rows)
        ca.executor = ex
        mode = getattr(ex, "mode", None)
        buffers = getattr(ex, "buffers", None) if mode != "fa3-per-layer" else None
        uses = ca.selector.uses_summaries
        if not self.fi:
            row["note"] = "torch paged executor (FlashInfer unavailable)"
        elif mode == "fa3-per-layer":
            row["note"] = "fa3 executor: plan() per layer with a device->host sync, inside prefix_ms and ms"
        elif mode == "fa3":
            row["note"] = "fa3 executor planned once per forward pass from the host-known row lengths"

        def e2e():
            pk = self.summaries.pooled(0, self.pages) if uses else None
            cp = ca.plan(b, 0, pk, buffers=buffers, with_stats=False)  # as the server runs it (metrics off)
            return ex.run(b, cp.plan)

        out = e2e()
        row["ms"] = t.device_ms(e2e)
        row["begin_forward_ms"] = bf_ms
        sel, search_ms = self.search(m, ca, retime=True)
        cfg = ca.config
        union_in = sel.rows[:, :, None, :] if sel.rows is not None else sel.mask  # as CompactAttention.plan
        table, counts = union_table(union_in, self.H_kv, self.kv_blocks, cfg.sink_blocks, cfg.recent_blocks)
        plan = build_plan(table, counts, b.page_table, b.prefix_lens, b.cu_chunk, self.P, buffers=buffers,
                          index_bound=self.index_bound)
        st = union_stats(sel.mask, table, self.kv_blocks, b.q_blocks(self.P)).as_floats()
        row.update(density_selected=st["selected"], density_after_q=st["after_q"], density_after_group=st["after_group"])
        row["density"] = m.fixed_density if m.fixed_density is not None else st["after_group"]
        if not args.no_split:
            row["search_ms"] = search_ms
            row["union_ms"] = t.device_ms(lambda: union_table(union_in, self.H_kv, self.kv_blocks, cfg.sink_blocks,
                                                              cfg.recent_blocks))
            row["plan_ms"] = t.device_ms(lambda: build_plan(table, counts, b.page_table, b.prefix_lens, b.cu_chunk,
                                                            self.P, buffers=buffers, index_bound=self.index_bound))
            row["prefix_ms"] = t.device_ms(lambda: ex.prefix_attention(b, plan))
            row["chunk_ms"], row["merge_ms"] = self.chunk_ms, self.merge_ms
        self.check(row, out, table=table)

    # --- block-sparse wrapper ----------------------------------------------------------------
    def _kv_mask(self, sel_mask):
        """Per-query-block, per-kv-head mask the block-sparse kernel executes: OR over the group's query
        heads (FlashInfer's wrapper shares one mask per kv head), plus the forced sink/recent blocks."""
        b = self.b
        B, _, NQ, NKV = sel_mask.shape
        mk = sel_mask.reshape(B, self.H_kv, self.G, NQ, NKV).any(dim=2)
        forced = forced_blocks(self.kv_blocks, NKV, self.args.sink_blocks, self.args.recent_blocks)
        qv = b.q_block_valid(self.P)
        kvv = b.kv_block_valid()
        mk = (mk | forced[:, None, None, :]) & qv[:, None, :, None] & kvv[:, None, None, :]
        return mk  # [B, H_kv, NQ, NKV]

    def _contiguous_kv_index(self):
        """Flat rows of k_pool.view(-1, D) for contiguous K [H_kv, sum_b L_b, D] (requests concatenated)."""
        b = self.b
        idx = []
        for i, L in enumerate(b.prefix_lens_cpu):
            tok = torch.arange(L, device=self.dev)
            page = b.page_table[i].long()[tok // self.P]
            g = torch.arange(self.H_kv, device=self.dev)[:, None]
            idx.append((page[None, :] * self.H_kv + g) * self.P + (tok % self.P)[None, :])
        return torch.cat(idx, dim=1).reshape(-1)  # [H_kv * sum L]

    def run_bsparse(self, m: Method, row: dict):
        b, t, args = self.b, self.timer, self.args
        ca = CompactAttention(selector_config(args, m))
        sel, search_ms = self.search(m, ca)
        mk = self._kv_mask(sel.mask)
        nq, nkv = b.q_blocks_cpu(self.P), b.kv_blocks_cpu()
        cells = sum(q * k for q, k in zip(nq, nkv)) * self.H_kv
        n_sel = int(mk.sum())
        row["density_selected"] = float(sel.mask.sum()) / max(1, cells * self.G)
        row["density_executed"] = n_sel / max(1, cells)
        row["density"] = m.fixed_density if m.fixed_density is not None else row["density_executed"]
        flat = self._contiguous_kv_index()
        k2, v2 = b.k_pool.view(-1, self.D), b.v_pool.view(-1, self.D)
        Ltot = sum(b.prefix_lens_cpu)

        def gather():
            return (k2.index_select(0, flat).view(self.H_kv, Ltot, self.D),
                    v2.index_select(0, flat).view(self.H_kv, Ltot, self.D))

        kc, vc = gather()
        if self.fi:
            from flashinfer.sparse import VariableBlockSparseAttentionWrapper
            est = n_sel * self.P
            if est > args.bsparse_max_indices:
                raise Skip(f"VariableBlockSparseAttentionWrapper expands blocks to {est:.3g} token indices "
                           f"(page size 1); over --bsparse-max-indices {args.bsparse_max_indices:.3g}")
            MB, NB = sum(nq), sum(nkv)
            ws = self.workspace()
            w = None

            def plan_bsr():
                bm = torch.zeros(self.H_kv, MB, NB, dtype=torch.bool, device=self.dev)
                rq = cq = 0
                for i in range(b.batch_size):
                    bm[:, rq:rq + nq[i], cq:cq + nkv[i]] = mk[i, :, :nq[i], :nkv[i]]
                    rq += nq[i]
                    cq += nkv[i]
                rows = torch.tensor([min(self.P, C - j * self.P) for C, n in zip(b.chunk_lens_cpu, nq) for j in range(n)],
                                    dtype=torch.int32, device=self.dev)
                cols = torch.tensor([min(self.P, L - j * self.P) for L, n in zip(b.prefix_lens_cpu, nkv) for j in range(n)],
                                    dtype=torch.int32, device=self.dev)
                w.plan(bm, rows[None].expand(self.H_kv, -1).contiguous(), cols[None].expand(self.H_kv, -1).contiguous(),
                       self.H_q, self.H_kv, self.D, causal=False, sm_scale=b.sm_scale, q_data_type=b.q.dtype,
                       kv_data_type=b.q.dtype)

            def prefix(kc, vc):
                o, lse = w.run(b.q.transpose(0, 1), kc, vc, return_lse=True)  # HND in and out
                return o.transpose(0, 1).contiguous(), lse.transpose(0, 1).contiguous()

            failed = []
            for bk in dict.fromkeys([args.bsparse_backend, "fa2"]):  # "auto" may pick a backend that cannot run it
                try:
                    w = VariableBlockSparseAttentionWrapper(ws, backend=bk)
                    plan_bsr()
                    prefix(kc, vc)
                    torch.cuda.synchronize(self.dev)
                    break
                except Exception as e:  # noqa: BLE001
                    if isinstance(e, torch.OutOfMemoryError):
                        raise
                    failed.append(f"backend {bk}: {type(e).__name__}: {str(e)[:150]}")
                    w = None
            if w is None:
                raise RuntimeError("VariableBlockSparseAttentionWrapper failed: " + "; ".join(failed))
            row["plan_ms"] = t.host_ms(plan_bsr, reps=2)
            row["note"] = (f"FlashInfer VariableBlockSparseAttentionWrapper (backend {w._backend}), one launch, requests "
                           "block-diagonal; per-kv-head masks = OR over the group's query heads + sink/recent blocks; "
                           "K/V gathered from the paged pool (gather_ms, in ms); host plan_ms not in ms"
                           + (f"; fell back after {failed}" if failed else ""))
        else:
            row["note"] = ("torch masked attention over gathered K/V (FlashInfer unavailable); per-kv-head masks = OR "
                           "over the group's query heads + sink/recent blocks")
            starts = [0] + list(_cumsum(b.prefix_lens_cpu))

            def prefix(kc, vc):
                T = b.q.shape[0]
                o = torch.empty(T, self.H_q, self.D, dtype=torch.float32, device=self.dev)
                lse = torch.empty(T, self.H_q, dtype=torch.float32, device=self.dev)
                c0 = 0
                for i, (L, C) in enumerate(zip(b.prefix_lens_cpu, b.chunk_lens_cpu)):
                    allowed = mk[i][:, torch.arange(C, device=self.dev) // self.P][:, :, torch.arange(L, device=self.dev) // self.P]
                    allowed = allowed.repeat_interleave(self.G, dim=0)
                    kk = kc[:, starts[i]:starts[i] + L].repeat_interleave(self.G, dim=0)
                    vv = vc[:, starts[i]:starts[i] + L].repeat_interleave(self.G, dim=0)
                    o[c0:c0 + C], lse[c0:c0 + C] = torch_masked_attention(b.q[c0:c0 + C].transpose(0, 1), kk, vv, allowed,
                                                                          b.sm_scale)
                    c0 += C
                return o, lse

        def e2e():
            ca.select(b, 0, self.summaries.pooled(0, self.pages) if ca.selector.uses_summaries else None)
            kc, vc = gather()
            o_p, l_p = prefix(kc, vc)
            o_c, l_c = self.chunk_fn()
            return self.merge_fn(o_p, l_p, o_c, l_c)

        out = e2e()
        row["ms"] = t.device_ms(e2e)
        if not args.no_split:
            row["search_ms"] = search_ms
            row["gather_ms"] = t.device_ms(gather)
            row["prefix_ms"] = t.device_ms(lambda: prefix(kc, vc))
            row["chunk_ms"], row["merge_ms"] = self.chunk_ms, self.merge_ms
        self.check(row, out, block_mask=mk.repeat_interleave(self.G, dim=1))

    # --- QUOKA-style -------------------------------------------------------------------------
    def run_quoka(self, m: Method, row: dict):
        b, t, args = self.b, self.timer, self.args
        qr, kb = args.quoka_query_ratio, args.quoka_kv_budget
        n_keep = [max(1, math.ceil(kb * L - 1e-9)) if L else 0 for L in b.prefix_lens_cpu]
        row["density"] = kb
        row["quoka_query_ratio"], row["quoka_kv_budget"] = qr, kb
        select = lambda: quoka_token_mask(b, qr, kb)  # noqa: E731
        hg = torch.arange(self.H_kv, device=self.dev)[None, :]

        def index(mask):
            """Selected tokens per (request, kv head) -> flat pool rows [sum n_keep, H_kv] (ascending tokens)."""
            parts = []
            for i, (L, n) in enumerate(zip(b.prefix_lens_cpu, n_keep)):
                if n == 0:
                    continue
                tok = torch.sort(mask[i, :, :L].to(torch.uint8), dim=-1, descending=True, stable=True).indices[:, :n]
                tok = tok.t()  # [n, H_kv]
                page = b.page_table[i].long()[tok // self.P]
                parts.append((page * self.H_kv + hg) * self.P + tok % self.P)
            return torch.cat(parts, dim=0)

        k2, v2 = b.k_pool.view(-1, self.D), b.v_pool.view(-1, self.D)
        N = sum(n_keep)

        def gather(idx):
            f = idx.reshape(-1)
            return k2.index_select(0, f).view(N, self.H_kv, self.D), v2.index_select(0, f).view(N, self.H_kv, self.D)

        if self.fi:
            from flashinfer import BatchPrefillWithRaggedKVCacheWrapper
            qo = torch.tensor([0] + list(_cumsum(b.chunk_lens_cpu)), dtype=torch.int32)
            kvp = torch.tensor([0] + list(_cumsum(n_keep)), dtype=torch.int32)
            w = BatchPrefillWithRaggedKVCacheWrapper(self.workspace(), "NHD", backend=args.quoka_backend)
            row["begin_forward_ms"] = t.host_ms(lambda: w.plan(qo, kvp, self.H_q, self.H_kv, self.D, causal=False,
                                                               sm_scale=b.sm_scale, q_data_type=b.q.dtype,
                                                               kv_data_type=b.q.dtype), reps=3)
            prefix = lambda kc, vc: w.run(b.q, kc, vc, return_lse=True)  # noqa: E731
            row["note"] = (f"quoka_token_mask + gather into contiguous K/V [N, H_kv, D] + FlashInfer ragged "
                           f"({args.quoka_backend}) non-causal; plan_ms = selected-token index build")
        else:
            row["note"] = "torch attention over gathered K/V (FlashInfer unavailable); plan_ms = index build"
            kstart = [0] + list(_cumsum(n_keep))

            def prefix(kc, vc):
                T = b.q.shape[0]
                o = torch.empty(T, self.H_q, self.D, dtype=torch.float32, device=self.dev)
                lse = torch.empty(T, self.H_q, dtype=torch.float32, device=self.dev)
                c0 = 0
                for i, C in enumerate(b.chunk_lens_cpu):
                    kk = kc[kstart[i]:kstart[i + 1]].transpose(0, 1).repeat_interleave(self.G, dim=0)
                    vv = vc[kstart[i]:kstart[i + 1]].transpose(0, 1).repeat_interleave(self.G, dim=0)
                    allowed = torch.ones(1, 1, 1, dtype=torch.bool, device=self.dev)
                    o[c0:c0 + C], lse[c0:c0 + C] = torch_masked_attention(b.q[c0:c0 + C].transpose(0, 1), kk, vv, allowed,
                                                                          b.sm_scale)
                    c0 += C
                return o, lse

        def e2e():
            kc, vc = gather(index(select()))
            o_p, l_p = prefix(kc, vc)
            o_c, l_c = self.chunk_fn()
            return self.merge_fn(o_p, l_p, o_c, l_c)

        out = e2e()
        row["ms"] = t.device_ms(e2e)
        mask = select()
        idx = index(mask)
        kc, vc = gather(idx)
        if not args.no_split:
            row["search_ms"] = t.device_ms(select)
            row["plan_ms"] = t.device_ms(lambda: index(mask))
            row["gather_ms"] = t.device_ms(lambda: gather(idx))
            row["prefix_ms"] = t.device_ms(lambda: prefix(kc, vc))
            row["chunk_ms"], row["merge_ms"] = self.chunk_ms, self.merge_ms
        self.check(row, out, token_mask=mask)

    def run(self, m: Method, row: dict):
        {"dense": self.run_dense, "compact": self.run_compact, "bsparse": self.run_bsparse,
         "quoka": self.run_quoka}[m.kind](m, row)


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


# ---------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------

def finish_rows(rows: list[dict]):
    """speedup_vs_dense against the faster dense backend of the same configuration; overhead fractions."""
    dense = [r["ms"] for r in rows if r["method"].startswith("dense_") and r.get("ms")]
    best = min(dense) if dense else None
    for r in rows:
        r["dense_best_ms"] = best
        r["speedup_vs_dense"] = (best / r["ms"]) if (best and r.get("ms")) else None
        if r["method"].startswith("dense_") or not r.get("ms") or r.get("search_ms") is None:
            r["overhead_frac"] = None
        else:
            over = sum(r.get(k) or 0.0 for k in ("search_ms", "union_ms", "gather_ms"))
            if not r["method"].startswith("bsparse_"):  # bsparse's host plan is not inside its ms
                over += r.get("plan_ms") or 0.0
            r["overhead_frac"] = over / r["ms"]
        if r.get("prefix_ms") is not None and r.get("chunk_ms") is not None:
            r["attn_ms"] = r["prefix_ms"] + r["chunk_ms"]
        if r.get("union_ms") is not None or (r.get("plan_ms") is not None and not r["method"].startswith("bsparse_")):
            r["union_plan_ms"] = (r.get("union_ms") or 0.0) + (r.get("plan_ms") or 0.0)


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
    out = [f"# Attention benchmark: one layer, one chunk against its prefix ({meta.get('run_tag')})", "",
           f"GPU: {meta.get('gpu')}; date {meta.get('date')}; torch {meta.get('torch')}, "
           f"flashinfer {meta.get('flashinfer')}; page size {meta.get('page_size')}, head_dim {meta.get('head_dim')}, "
           f"{meta.get('dtype')}.", "",
           f"Command: `{meta.get('cmd')}`", "",
           f"Inputs: {meta.get('inputs')}.", "",
           "ms: median end-to-end time of the method (search + union + plan + attention + merge for compact; "
           "search + K/V gather + attention + merge for bsparse, whose FlashInfer host plan is listed as plan but "
           "not counted; selection + index + gather + attention + merge for quoka). speedup: faster dense backend "
           "of the same configuration / ms. overhead: (search + union + plan [+ gather]) / ms. density: fixed "
           "budget, else the density the kernel reads (compact: after both unions; bsparse: per query block after "
           "the group OR). sel / after_q / after_group: density per query block and head, after the Q-block "
           "union, after the group union + forced blocks. chunk and merge times are measured once per "
           "configuration and shared. Split times are each timed on their own; they need not add up to ms.", ""]
    cols = ["context", "chunk", "batch", "heads", "method", "density", "ms", "speedup", "overhead", "search",
            "union+plan", "gather", "prefix", "chunk attn", "merge", "sel / after_q / after_group", "begin_fwd",
            "status"]
    out.append("| " + " | ".join(cols) + " |")
    out.append("|" + "---|" * len(cols))
    key = lambda r: (r["q_heads"], r["kv_heads"], r["batch"], r["chunk"], r["context"])  # noqa: E731
    for r in sorted(rows, key=lambda r: (key(r), r.get("order", 0))):
        dens = " / ".join(_f(r.get(k), "{:.3f}") for k in ("density_selected", "density_after_q", "density_after_group")
                          ) if r.get("density_selected") is not None else ""
        status = r.get("status", "ok") + (f": {r['note']}" if r.get("status") != "ok" and r.get("note") else "")
        out.append("| " + " | ".join([
            ctx_label(r["context"]), str(r["chunk"]), str(r["batch"]), f"{r['q_heads']}/{r['kv_heads']}", r["method"],
            _f(r.get("density"), "{:.3f}"), _f(r.get("ms"), "{:.3f}"), _f(r.get("speedup_vs_dense"), "{:.2f}"),
            _f(r.get("overhead_frac"), "{:.1%}"), _f(r.get("search_ms")),
            _f(r.get("union_plan_ms")) or _f(r.get("plan_ms"), "{:.3f} (host, not in ms)"),
            _f(r.get("gather_ms")), _f(r.get("prefix_ms")), _f(r.get("chunk_ms")), _f(r.get("merge_ms")), dens,
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
          ("xattention", "xa"), ("budget_", "b"))


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
        print("\ndensity read by the kernel / overhead fraction (search + union + plan [+ gather]) / ms")
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


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Methods (fnmatch patterns for --methods): dense_fa2 dense_fa3 dense_torch "
                                       "compact[_fa3]_{flashprefill,xattention,budget_<d>} "
                                       "bsparse_{flashprefill,xattention,budget_<d>} quoka")
    p.add_argument("--contexts", help=f"prefix lengths (default {FULL['contexts']})")
    p.add_argument("--chunks", help=f"chunk lengths (default {FULL['chunks']})")
    p.add_argument("--batches", help=f"batch sizes (default {FULL['batches']})")
    p.add_argument("--heads", help=f"H_q/H_kv pairs (default {FULL['heads']}: TP1, TP2 per rank)")
    p.add_argument("--head-dim", type=int, default=None, help="default 128 (32 for --smoke on the CPU)")
    p.add_argument("--page-size", type=int, default=None,
                   help="KV page size = block size (default 64; 16 for --smoke on the CPU)")
    p.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma list of patterns (default {DEFAULT_METHODS})")
    p.add_argument("--budgets", default="0.1,0.2,0.3,0.4,0.5,1.0", help="fixed densities for budget_<d> methods")
    p.add_argument("--alpha", type=float, default=0.06, help="flashprefill alpha")
    p.add_argument("--query-stride", type=int, default=1,
                   help="flashprefill / budget search: score every s-th query of each block (s times cheaper)")
    p.add_argument("--xattn-threshold", type=float, default=0.9)
    p.add_argument("--xattn-stride", type=int, default=8)
    p.add_argument("--sink-blocks", type=int, default=2)
    p.add_argument("--recent-blocks", type=int, default=4)
    p.add_argument("--quoka-query-ratio", type=float, default=0.25)
    p.add_argument("--quoka-kv-budget", type=float, default=0.25)
    p.add_argument("--quoka-backend", default="fa2", help="FlashInfer ragged backend for quoka (fa2/fa3)")
    p.add_argument("--bsparse-backend", default="auto", help="VariableBlockSparseAttentionWrapper backend")
    p.add_argument("--bsparse-max-indices", type=float, default=1e9,
                   help="skip bsparse when its token-level kv_indices would exceed this (int32, memory)")
    p.add_argument("--reps", type=int, default=50, help="max timed calls per measurement")
    p.add_argument("--min-reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="untimed calls before each measurement")
    p.add_argument("--budget-ms", type=float, default=300.0, help="target measured time per measurement")
    p.add_argument("--no-split", action="store_true", help="time only the end-to-end ms")
    p.add_argument("--check", action="store_true", help="compare every method's output with reference_attention "
                                                        "(where H_q * C * L <= --check-max-elems)")
    p.add_argument("--check-max-elems", type=float, default=2 ** 29)
    p.add_argument("--check-tol", type=float, default=2e-2)
    p.add_argument("--smoke", action="store_true", help=f"tiny sizes (GPU {SMOKE}; CPU {SMOKE_CPU}), few reps")
    p.add_argument("--device", default=None, help="cuda / cuda:N / cpu (default cuda if available)")
    p.add_argument("--dtype", default=None, help="bfloat16 (default on CUDA) / float16 / float32 (default on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=str(REPO / "docs" / "results"))
    p.add_argument("--run-tag", default=None, help="rows of this tag are rendered into the md/png (default: this run)")
    p.add_argument("--deadline-s", type=float, default=None, help="start no new configuration after this many seconds")
    p.add_argument("--render-only", action="store_true", help="only re-render md/png from speed.json for --run-tag")
    for k, v in GenParams().__dict__.items():
        p.add_argument("--gen-" + k.replace("_", "-"), type=type(v), default=v, dest="gen_" + k)
    return p.parse_args(argv)


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv=None) -> int:
    t_start = time.time()
    args = parse_args(argv)
    cmd = "python3 " + " ".join(shlex.quote(a) for a in ([sys.argv[0]] + (list(argv) if argv is not None else sys.argv[1:])))
    out_dir = Path(args.out_dir)
    json_path, md_path, png_path = out_dir / "speed.json", out_dir / "speed_attention.md", out_dir / "speed_attention.png"
    meta_path = out_dir / "speed_attention_meta.json"
    if args.render_only:
        if not args.run_tag:
            raise SystemExit("--render-only needs --run-tag")
        rows = [r for r in load_rows(json_path) if r.get("bench") == "attention" and r.get("run_tag") == args.run_tag]
        metas = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        meta = next((v for v in metas.values() if v.get("run_tag") == args.run_tag), {"run_tag": args.run_tag})
        md_path.write_text(render_markdown(rows, meta))
        print(render_png(rows, png_path) or f"wrote {md_path}, {png_path}")
        return 0

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sizes = dict(FULL, head_dim=128, page_size=64)
    if args.smoke:
        sizes = dict(sizes, **(SMOKE if device.type == "cuda" else SMOKE_CPU))
    args.head_dim = args.head_dim or sizes["head_dim"]
    args.page_size = args.page_size or sizes["page_size"]
    if args.smoke:  # a functional run: on the CPU one timed call per measurement
        cuda = device.type == "cuda"
        args.reps, args.min_reps = min(args.reps, 5 if cuda else 1), min(args.min_reps, 2 if cuda else 1)
        args.warmup, args.budget_ms = (1, 50.0) if cuda else (0, 0.0)
    contexts = ints(args.contexts or sizes["contexts"])
    chunks = ints(args.chunks or sizes["chunks"])
    batches = ints(args.batches or sizes["batches"])
    heads = [tuple(int(x) for x in h.split("/")) for h in (args.heads or sizes["heads"]).split(",")]
    budgets = [float(x) for x in args.budgets.split(",") if x.strip()]
    methods = select_methods(args.methods, budgets, HAVE_FI and device.type == "cuda")
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    gp = GenParams(**{k: getattr(args, "gen_" + k) for k in GenParams().__dict__})

    now = datetime.datetime.now(datetime.timezone.utc)
    run_id = now.strftime("%Y%m%dT%H%M%SZ") + f"-{os.getpid()}"
    run_tag = args.run_tag or run_id
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()}, {os.cpu_count()} cores)"
    meta = dict(run_id=run_id, run_tag=run_tag, cmd=cmd, gpu=gpu, date=now.isoformat(timespec="seconds"),
                torch=torch.__version__, flashinfer=FI_VERSION, cuda=torch.version.cuda, python=platform.python_version(),
                page_size=args.page_size, head_dim=args.head_dim, dtype=str(dtype).replace("torch.", ""),
                inputs=gp.describe(), gen_params=gp.__dict__, methods=[m.name for m in methods],
                timing=dict(reps=args.reps, min_reps=args.min_reps, warmup=args.warmup, budget_ms=args.budget_ms,
                            l2_flush_mb=256 if device.type == "cuda" else 0),
                selector_params=dict(alpha=args.alpha, query_stride=args.query_stride, xattn_threshold=args.xattn_threshold, xattn_stride=args.xattn_stride,
                                     sink_blocks=args.sink_blocks, recent_blocks=args.recent_blocks,
                                     quoka_query_ratio=args.quoka_query_ratio, quoka_kv_budget=args.quoka_kv_budget))
    metas = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    metas[run_id] = meta
    save_json(meta_path, metas)
    print(f"[bench_attention] {gpu}; torch {torch.__version__}; flashinfer {FI_VERSION}; run {run_id}", flush=True)

    configs = [(hq, hk, bsz, ch, ctx) for (hq, hk) in heads for bsz in batches for ch in chunks for ctx in contexts]
    timer = Timer(device, args.reps, args.min_reps, args.warmup, args.budget_ms)
    try:
        from tqdm import tqdm
        bar = tqdm(total=len(configs) * len(methods), desc="attention", dynamic_ncols=True)
    except ImportError:
        bar = None
    all_rows: list[dict] = []
    for ci, (hq, hk, bsz, ch, ctx) in enumerate(configs):
        base = dict(bench="attention", gpu=gpu, date=meta["date"], context=ctx, chunk=ch, batch=bsz, q_heads=hq,
                    kv_heads=hk, head_dim=args.head_dim, page_size=args.page_size, dtype=meta["dtype"], run_id=run_id,
                    run_tag=run_tag, cmd=cmd, inputs=meta["inputs"], query_stride=args.query_stride)
        rows: list[dict] = []
        run, why, why_status = None, "", "skipped"
        if args.deadline_s is not None and time.time() - t_start > args.deadline_s:
            why = f"not run: --deadline-s {args.deadline_s:g} passed"
        else:
            try:
                if bar is not None:
                    bar.set_postfix_str(f"ctx {ctx} chunk {ch} B {bsz} heads {hq}/{hk}: inputs")
                batch = structured_batch([ctx] * bsz, [ch] * bsz, hq, hk, args.head_dim, args.page_size, device=device,
                                         dtype=dtype, seed=args.seed + ci, gp=gp)
                run = ConfigRun(args, batch, timer)
            except torch.OutOfMemoryError as e:
                why, why_status = f"out of memory building inputs: {str(e).splitlines()[0][:200]}", "oom"
            except Exception as e:  # noqa: BLE001
                why, why_status = f"inputs/shared kernels failed: {type(e).__name__}: {str(e)[:300]}", "error"
                traceback.print_exc(file=sys.stderr)
        for mi, m in enumerate(methods):
            row = dict(base, method=m.name, density=m.fixed_density, ms=None, speedup_vs_dense=None, overhead_frac=None,
                       status="ok", order=mi)
            if run is None:
                row.update(status=why_status, note=why)
            else:
                if bar is not None:
                    bar.set_postfix_str(f"ctx {ctx} chunk {ch} B {bsz} heads {hq}/{hk}: {m.name}")
                try:
                    run.run(m, row)
                    timer.sync()
                except Skip as e:
                    row.update(status="skipped", note=str(e))
                except torch.OutOfMemoryError as e:
                    row.update(status="oom", ms=None, note=f"out of memory: {str(e).splitlines()[0][:200]}")
                except Exception as e:  # noqa: BLE001  (recorded; the run goes on)
                    row.update(status="error", ms=None, note=f"{type(e).__name__}: {str(e)[:300]}")
                    traceback.print_exc(file=sys.stderr)
                if row["status"] != "ok":
                    row["ms"] = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            if bar is not None:
                bar.update(1)
        finish_rows(rows)
        all_rows += rows
        stored = load_rows(json_path)
        save_json(json_path, stored + rows)
        del run
        batch = None  # noqa: F841
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if bar is not None:
        bar.close()
    tagged = [r for r in load_rows(json_path) if r.get("bench") == "attention" and r.get("run_tag") == run_tag]
    md_path.write_text(render_markdown(tagged, meta))
    try:
        png_note = render_png(tagged, png_path)
    except Exception as e:  # noqa: BLE001  (the rows and the table are already written)
        png_note = f"no PNG: {type(e).__name__}: {e}"
    print()
    print_summary(all_rows)
    print_pivots(all_rows)
    bad = [r for r in all_rows if r["status"] in ("error", "oom")]
    failed_checks = [r for r in all_rows if "CHECK FAILED" in (r.get("note") or "")]
    print(f"\nrows -> {json_path} ({len(all_rows)} new, {len(bad)} error/oom, {len(failed_checks)} failed checks); "
          f"table -> {md_path}; {png_note or 'plot -> ' + str(png_path)}; {time.time() - t_start:.0f} s")
    for r in bad:
        print(f"  {r['status']}: {r['method']} ctx {r['context']} chunk {r['chunk']} B {r['batch']} "
              f"{r['q_heads']}/{r['kv_heads']}: {(r.get('note') or '')[:160]}")
    return 2 if failed_checks else 0


if __name__ == "__main__":
    sys.exit(main())
