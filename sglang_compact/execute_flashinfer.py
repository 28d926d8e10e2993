"""FlashInfer executor: zero-copy paged prefill over the selected blocks (GPU).

The pool `[num_pages, H_kv, P, D]` is viewed as `[num_pages * H_kv, 1, P, D]`
(HND, one kv head), so every (request, kv head) row is a one-head "request"
with G query heads whose pages are `page * H_kv + g`. Queries are reshaped
`[T, H_q, D] -> [H_kv * T, G, D]` (a chunk-sized copy; no KV is copied).

Per forward pass, `begin_forward` plans:
  * the paged wrapper (fa2) once, from host-known upper-bound row lengths (the
    whole prefix), with split-KV off. Its device metadata buffers then become
    `self.buffers`: each layer's plan kernel overwrites kv_indptr / kv_indices /
    kv_last_page_len there, on the device. No per-layer `plan()`, no sync.
  * the ragged wrapper, causal over each chunk's own tokens.
Per layer, `run` executes both and merges with `merge_state`.

Why split-KV off and no CUDA-graph mode (seen on the H200, 2026-11-29, FlashInfer
0.6.15.post1): with split-KV the kernel derives KV partitions from the planned
lengths, and rows shorter at run time gave relative errors ~0.9 (9/3, 6/2,
12/4 heads, batch 2); with split-KV off in CUDA-graph mode the paged kernel
failed with "operation not supported on global/shared address space" (9/3
heads, head_dim 64). Without split-KV each CTA reads its row's real length.

backend="fa3" bakes the row lengths into its host-side schedule, so one plan
serves every layer only when every layer's rows have the same lengths. That
holds when the selector fixes them on the host (`CompactAttention.row_blocks`,
e.g. `budget`, and the dense plan): `begin_forward(..., row_blocks=...)` then
plans fa3 once with the exact lengths and each layer's plan kernel rewrites
kv_indices in place (kv_indptr and kv_last_page_len come out identical). For
threshold selectors fa3 plans per layer from host copies of the lengths (one
device->host sync per layer; benchmarks only). Forward passes in which a
request has no prefix run on fa2 (fa3 is not given zero-length rows).
"""

from __future__ import annotations

from typing import Sequence

import torch

from sglang_compact.batch import ChunkBatch, cdiv
from sglang_compact.plan import PagedPlan, PlanBuffers

DEFAULT_WORKSPACE_BYTES = 256 * 1024 * 1024


def rows_from_tokens(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[T, H_q, ...] -> [H_kv * T, G, ...] (rows kv-head-major)."""
    T, H_q = x.shape[:2]
    G = H_q // num_kv_heads
    return x.reshape(T, num_kv_heads, G, *x.shape[2:]).transpose(0, 1).reshape(num_kv_heads * T, G, *x.shape[2:])


def tokens_from_rows(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Inverse of `rows_from_tokens`."""
    R_T, G = x.shape[:2]
    T = R_T // num_kv_heads
    return x.reshape(num_kv_heads, T, G, *x.shape[2:]).transpose(0, 1).reshape(T, num_kv_heads * G, *x.shape[2:])


def upper_bound_rows(prefix_lens: Sequence[int], chunk_lens: Sequence[int], num_kv_heads: int, page_size: int,
                     row_blocks: Sequence[int] | None = None):
    """Host metadata of the plan with `row_blocks[b]` pages per row (default every prefix page,
    the densest plan), rows r = g * B + b. A row's last page is always its prefix's last page
    (the most recent block is always kept), so kv_last_page_len does not depend on row_blocks.

    Returns int32 CPU tensors (qo_indptr [R+1], kv_indptr [R+1], kv_last_page_len [R]).
    """
    T = sum(chunk_lens)
    qo, kv, last = [0], [0], []
    for g in range(num_kv_heads):
        start = 0
        for b, (L, C) in enumerate(zip(prefix_lens, chunk_lens)):
            start += C
            qo.append(g * T + start)
            n = cdiv(L, page_size)
            kv.append(kv[-1] + (n if row_blocks is None else row_blocks[b]))
            last.append(L - (n - 1) * page_size if n else 0)
    as_t = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return as_t(qo), as_t(kv), as_t(last)


class FlashInferExecutor:
    """Args:
        device: CUDA device.
        max_rows: bound on R = B * H_kv per forward pass.
        max_indices: bound on selected (row, page) pairs per forward pass.
        backend: "fa2" (plan once per forward pass) or "fa3" (once per forward pass when
            `begin_forward` gets the row lengths, else per layer with a host sync).
    """

    def __init__(self, device, max_rows: int, max_indices: int, backend: str = "fa2",
                 workspace_bytes: int = DEFAULT_WORKSPACE_BYTES):
        import flashinfer  # noqa: F401  (fail early and clearly without it)
        if backend not in ("fa2", "fa3"):
            raise ValueError(f"FlashInferExecutor backend must be 'fa2' or 'fa3', got {backend!r}")
        self.device = torch.device(device)
        self.backend = backend
        self.max_rows = max_rows
        self.max_indices = max_indices
        self.buffers: PlanBuffers | None = None
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._paged: dict[str, object] = {}
        self._ragged: dict[str, object] = {}
        self._planned_for: tuple | None = None
        #: how the current forward pass runs its paged part: "fa2", "fa3" (planned once) or "fa3-per-layer"
        self.mode: str | None = None

    # --- planning, once per forward pass ---------------------------------------------------
    def _paged_wrapper(self, backend: str):
        from flashinfer import BatchPrefillWithPagedKVCacheWrapper
        if backend not in self._paged:
            self._paged[backend] = BatchPrefillWithPagedKVCacheWrapper(self.workspace, "HND", backend=backend)
        return self._paged[backend]

    def _ragged_wrapper(self, backend: str):
        from flashinfer import BatchPrefillWithRaggedKVCacheWrapper
        if backend not in self._ragged:
            self._ragged[backend] = BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD", backend=backend)
        return self._ragged[backend]

    def begin_forward(self, prefix_lens: Sequence[int], chunk_lens: Sequence[int], num_q_heads: int,
                      num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype, sm_scale: float,
                      row_blocks: Sequence[int] | None = None):
        """Plan both wrappers for a forward pass (host data only; once, not per layer).

        Args:
            row_blocks: pages every (request, kv head) row reads, per request, when every layer's
                plan will have exactly these (`CompactAttention.row_blocks`); lets fa3 plan once.
        """
        B = len(prefix_lens)
        R = B * num_kv_heads
        G = num_q_heads // num_kv_heads
        qo, kv_ub, last_ub = upper_bound_rows(prefix_lens, chunk_lens, num_kv_heads, page_size)
        n_ub = int(kv_ub[-1])
        if R > self.max_rows or n_ub > self.max_indices:
            raise ValueError(f"forward pass needs {R} rows / {n_ub} page indices; executor holds "
                             f"{self.max_rows} / {self.max_indices}")
        if row_blocks is not None:
            if len(row_blocks) != B or any(not 0 <= k <= cdiv(L, page_size) for k, L in zip(row_blocks, prefix_lens)):
                raise ValueError(f"row_blocks {list(row_blocks)} do not fit prefixes {list(prefix_lens)} "
                                 f"(page size {page_size})")
        all_prefixed = all(L > 0 for L in prefix_lens)
        if self.backend == "fa3" and all_prefixed:
            self.mode = "fa3" if row_blocks is not None else "fa3-per-layer"
        else:
            self.mode = "fa2"
        self._meta = dict(G=G, D=head_dim, P=page_size, dtype=dtype, sm_scale=sm_scale, R=R)
        self.buffers = None
        if n_ub > 0 and self.mode != "fa3-per-layer":
            if self.mode == "fa3":
                _, kv_exact, _ = upper_bound_rows(prefix_lens, chunk_lens, num_kv_heads, page_size, row_blocks)
                kv_plan, extra = kv_exact, {}
            else:
                kv_plan, extra = kv_ub, dict(disable_split_kv=True)
            w = self._paged_wrapper(self.mode)
            # kv_indices sized to the bound: the plan kernel's index_bound check is against this buffer
            w.plan(qo, kv_plan, torch.zeros(max(n_ub, 1), dtype=torch.int32), last_ub, G, 1, head_dim,
                   page_size, causal=False, sm_scale=sm_scale, q_data_type=dtype, kv_data_type=dtype, **extra)
            # the wrapper runs from these device tensors: the plan kernel writes into them
            self.buffers = PlanBuffers.wrap(w._qo_indptr_buf, w._paged_kv_indptr_buf, w._paged_kv_indices_buf,
                                            w._paged_kv_last_page_len_buf)
        cu = [0]
        for c in chunk_lens:
            cu.append(cu[-1] + c)
        cu_t = torch.tensor(cu, dtype=torch.int32)
        self._ragged_kernel = "fa3" if self.backend == "fa3" else "fa2"
        self._ragged_wrapper(self._ragged_kernel).plan(cu_t, cu_t, num_q_heads, num_kv_heads, head_dim, causal=True,
                                                       sm_scale=sm_scale, q_data_type=dtype, kv_data_type=dtype)
        self._planned_for = (tuple(prefix_lens), tuple(chunk_lens), num_q_heads, num_kv_heads, head_dim,
                             page_size, dtype)

    def begin_forward_for(self, batch: ChunkBatch, row_blocks: Sequence[int] | None = None) -> None:
        self.begin_forward(batch.prefix_lens_cpu, batch.chunk_lens_cpu, batch.num_q_heads, batch.num_kv_heads,
                           batch.head_dim, batch.page_size, batch.q.dtype, batch.sm_scale, row_blocks)

    # --- per layer ---------------------------------------------------------------------------
    def _load_plan(self, plan: PagedPlan) -> None:
        """Make the wrapper see `plan` (a no-op when the plan kernel wrote into self.buffers)."""
        b = self.buffers
        for dst, src in ((b.qo_indptr, plan.qo_indptr), (b.kv_indptr, plan.kv_indptr),
                         (b.kv_last_page_len, plan.kv_last_page_len)):
            if src.data_ptr() != dst.data_ptr():
                dst[:src.numel()].copy_(src)
        if plan.kv_indices.data_ptr() != b.kv_indices.data_ptr():
            # a plan's valid indices never exceed H_kv * sum_b n_b, the buffer's size
            n = min(plan.kv_indices.numel(), b.kv_indices.numel())
            b.kv_indices[:n].copy_(plan.kv_indices[:n])

    def prefix_attention(self, batch: ChunkBatch, plan: PagedPlan):
        """Rows' queries against their planned pages. Returns (o [T, H_q, D], lse [T, H_q])."""
        m = self._meta
        H_kv = batch.num_kv_heads
        P, D = batch.page_size, batch.head_dim
        q_rows = rows_from_tokens(batch.q, H_kv)
        kv = (batch.k_pool.view(-1, 1, P, D), batch.v_pool.view(-1, 1, P, D))
        if self.mode is None:
            raise RuntimeError("FlashInferExecutor.prefix_attention before begin_forward")
        w = self._paged_wrapper(self.mode if self.mode != "fa3-per-layer" else "fa3")
        if self.mode != "fa3-per-layer":
            self._load_plan(plan)
        else:
            n = int(plan.kv_indptr[-1])  # fa3 needs real lengths on the host: one sync per layer
            w.plan(plan.qo_indptr, plan.kv_indptr, plan.kv_indices[:n], plan.kv_last_page_len,
                   m["G"], 1, D, P, causal=False, sm_scale=m["sm_scale"], q_data_type=m["dtype"],
                   kv_data_type=m["dtype"])
        o_rows, lse_rows = w.run(q_rows, kv, return_lse=True)
        return tokens_from_rows(o_rows, H_kv), tokens_from_rows(lse_rows, H_kv)

    def chunk_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of each chunk to itself only (batches without any prefix)."""
        if self._planned_for is None:
            raise RuntimeError("FlashInferExecutor.chunk_attention before begin_forward")
        return self._ragged_wrapper(self._ragged_kernel).run(q, k, v)

    def run(self, batch: ChunkBatch, plan: PagedPlan, return_lse: bool = False):
        from flashinfer import merge_state
        if self._planned_for is None:
            raise RuntimeError("FlashInferExecutor.run before begin_forward")
        o_p, lse_p = self.prefix_attention(batch, plan)
        o_c, lse_c = self._ragged_wrapper(self._ragged_kernel).run(batch.q, batch.k_chunk, batch.v_chunk,
                                                                   return_lse=True)
        o, lse = merge_state(o_p.contiguous(), lse_p.contiguous(), o_c, lse_c)
        return (o, lse) if return_lse else o
