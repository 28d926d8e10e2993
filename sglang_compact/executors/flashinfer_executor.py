"""FlashInfer executors (GPU): dense passes as stock SGLang runs them, sparse passes as rows.

Dense pass (no q-block reads a selection), planned once per forward pass: one
causal paged pass over each request's whole context (prefix + chunk, the
chunk's K/V already written into the pool), all heads, page ids of the
head-major pool; on fa3 where the GPU has it. A pass in which no request has a
cached prefix (a first chunk, every short prompt) instead runs one causal
ragged pass over the chunks' own K/V, the kernel stock SGLang's FlashInfer
backend runs for it. Per layer: one `run`, into the output buffer SGLang hands
the backend when it does, nothing else. (Stock SGLang's FlashInfer backend
runs ragged + paged + `merge_state` for a pass with a prefix; stock fa3 runs
one paged pass, as here.) With `dense_fa3` (Hopper, where sgl_kernel's FA3
runs: `sgl_fa3.py`), dense passes run on the kernel stock fa3 runs instead.

Sparse pass: the pool `[num_pages, H_kv, P, D]` is viewed as
`[num_pages * H_kv, 1, P, D]`, so every row (kv head g, window w) is a
one-kv-head "request" with G query heads over pages `page * H_kv + g`, read in
place. Queries are reshaped `[T, H_q, D] -> [H_kv * T, G, D]` (a chunk-sized
copy; no KV is copied). One causal paged pass per layer: a row's last pages are
its window's own, its queries the window's last tokens, so FlashInfer's
bottom-right causal mask is each query's causal mask.

Two kernels, one class each:
* `FlashInferFA2Executor`: the rows' wrapper is planned once per forward pass
  with each row's whole context as its length and split-KV off; each layer's
  index kernel then writes the real kv_indptr / kv_indices into the wrapper's
  device buffers (`index_buffers`). With split-KV off every CTA reads its row's
  real length, so the once-made plan serves every layer (checked bit-identical
  to a fresh plan on the H200).
* `FlashInferFA3Executor` (Hopper): fa3 bakes row lengths into its host-side
  schedule, so one plan serves every layer only when the lengths are known on
  the host (`ForwardShape.row_pages`: dense passes, selectors that fix them).
  Otherwise it plans every layer from host copies of the lengths (one
  device->host sync per layer; for benchmarks). A dense pass in which some
  request has no prefix runs its paged part on fa2 (fa3 is not given empty rows).
"""

from __future__ import annotations

import torch

from sglang_compact.batch import ChunkBatch, host_cumsum
from sglang_compact.executors import flashinfer_adapter as fi
from sglang_compact.executors.base import ForwardShape, rows_from_tokens, tokens_from_rows
from sglang_compact.executors.sgl_fa3 import FA3DensePass, FA3Rows
from sglang_compact.indices import IndexBuffers, PagedIndices

DEFAULT_WORKSPACE_BYTES = 256 * 1024 * 1024


def _i32(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32)


class FlashInferExecutor:
    """Shared by the fa2 and fa3 executors. Args:
        device: CUDA device.
        max_rows: bound on R = H_kv * NW per forward pass.
        max_indices: bound on the (row, page) pairs of a pass in which every row reads its whole context.
        dense_fa3: dense passes on sgl_kernel's FA3 (`sgl_fa3.unavailable_reason` must be None), not FlashInfer.
    """

    kernel = "fa2"

    def __init__(self, device, max_rows: int, max_indices: int, workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
                 dense_fa3: bool = False):
        fi.flashinfer()  # fail early and clearly without it
        self.device = torch.device(device)
        self.dense_fa3 = dense_fa3
        self._fa3_dense: FA3DensePass | None = None
        self.max_rows = max_rows
        self.max_indices = max_indices
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._indices = torch.zeros(0, dtype=torch.int32, device=self.device)  # grown to the largest pass seen
        self._paged: dict[str, object] = {}
        self._dense = None          # paged wrapper of a dense pass
        self._dense_ragged = None   # ragged wrapper of a dense pass with no cached prefix
        self._page_table: torch.Tensor | None = None
        self._apart: tuple | None = None   # (wrapper, token indices) of the windows computed apart
        self.shape: ForwardShape | None = None
        self.index_buffers: IndexBuffers | None = None
        #: how the current forward pass runs: "dense", "rows" (planned once) or "rows-per-layer"
        self.mode: str | None = None

    def _paged_wrapper(self, kernel: str, role: str):
        key = f"{role}-{kernel}"
        if key not in self._paged:
            self._paged[key] = fi.paged_wrapper(self.workspace, kernel)
        return self._paged[key]

    # --- once per forward pass ------------------------------------------------------------------
    def plan_forward(self, shape: ForwardShape, page_table: torch.Tensor) -> None:
        self.shape = shape
        self.index_buffers = None
        self._apart = None
        self._fa3_dense = None
        if shape.sparse:
            self._plan_rows(shape)
            self._plan_apart(shape, page_table)
        else:
            self._plan_dense(shape, page_table)

    def _context_indices(self, page_table: torch.Tensor, reqs, pages) -> torch.Tensor:
        """The page ids of request reqs[i]'s first pages[i] pages, concatenated (kv_indices of a dense plan)."""
        width = page_table.shape[1]
        flat = torch.cat([torch.arange(b * width, b * width + k, dtype=torch.int64) for b, k in zip(reqs, pages)])
        return page_table.reshape(-1)[flat.to(self.device, non_blocking=True)]

    def _plan_dense(self, shape: ForwardShape, page_table: torch.Tensor) -> None:
        s = shape
        self.mode = "dense"
        self._dense = self._dense_ragged = None
        self._page_table = page_table
        if self.dense_fa3 and all(s.chunk_lens):
            self._fa3_dense = FA3DensePass(s, page_table, self.device)
            return
        if any(s.prefix_lens):
            self._plan_dense_paged(s, page_table)
            return
        if "ragged" not in self._paged:
            self._paged["ragged"] = fi.ragged_wrapper(self.workspace, self.kernel)
        w = self._paged["ragged"]
        indptr = _i32(host_cumsum(s.chunk_lens))
        fi.plan(w, indptr, indptr, s.num_q_heads, s.num_kv_heads, s.head_dim, causal=True, sm_scale=s.sm_scale,
                q_data_type=s.dtype, kv_data_type=s.dtype)
        self._dense_ragged = w

    def _plan_dense_paged(self, shape: ForwardShape, page_table: torch.Tensor) -> None:
        s = shape
        n = s.context_pages()
        # fa3 is not given empty rows (a request with nothing to attend to)
        kernel = self.kernel if all(n) else "fa2"
        indices = self._context_indices(page_table, range(len(n)), n)
        last = [E - (k - 1) * s.page_size if k else 0 for E, k in zip(s.context_lens(), n)]
        w = self._paged_wrapper(kernel, "dense")
        fi.plan(w, _i32(host_cumsum(s.chunk_lens)), _i32(host_cumsum(n)), indices, _i32(last), s.num_q_heads,
                s.num_kv_heads, s.head_dim, s.page_size, causal=True, sm_scale=s.sm_scale, q_data_type=s.dtype,
                kv_data_type=s.dtype)
        self._dense = w

    def _plan_apart(self, shape: ForwardShape, page_table: torch.Tensor) -> None:
        """The windows computed apart (dense windows of a sparse pass): one causal paged pass, all heads, each
        run of consecutive such windows of a request one "request" over its context up to the run's end."""
        segments = shape.qblocks.apart_segments()
        if not segments:
            return
        s, P = shape, shape.page_size
        ends = [pos + n for _, _, n, pos in segments]
        pages = [-(-e // P) for e in ends]
        indices = self._context_indices(page_table, [b for b, *_ in segments], pages)
        tokens = torch.cat([torch.arange(st, st + n, dtype=torch.int64) for _, st, n, _ in segments])
        w = self._paged_wrapper(self.kernel, "apart")
        fi.plan(w, _i32(host_cumsum([n for _, _, n, _ in segments])), _i32(host_cumsum(pages)), indices,
                _i32(e - (k - 1) * P for e, k in zip(ends, pages)), s.num_q_heads, s.num_kv_heads, s.head_dim, P,
                causal=True, sm_scale=s.sm_scale, q_data_type=s.dtype, kv_data_type=s.dtype)
        self._apart = (w, tokens.to(self.device, non_blocking=True))

    def _rows_plan(self, shape: ForwardShape):
        """(kernel, kv_indptr to plan with, extra plan arguments) of a sparse pass."""
        return "fa2", shape.rows_upper_bound(), dict(disable_split_kv=True)

    def _check_rows(self, shape: ForwardShape) -> list[int]:
        """The rows' upper-bound kv_indptr (`rows_upper_bound`), after checking that the pass fits."""
        ub = shape.rows_upper_bound()
        if shape.num_rows > self.max_rows or ub[-1] > self.max_indices:
            raise ValueError(f"forward pass needs {shape.num_rows} rows / {ub[-1]} page indices; the executor "
                             f"holds {self.max_rows} / {self.max_indices}")
        return ub

    def _plan_rows(self, shape: ForwardShape) -> None:
        s = shape
        ub = self._check_rows(s)
        self._qo = _i32(s.qblocks.rows_qo_indptr(s.num_kv_heads, s.total_tokens))
        self._last = _i32(s.qblocks.last_page_len() * s.num_kv_heads)
        kernel, kv_indptr, extra = self._rows_plan(s)
        self._rows_kernel = kernel
        if kv_indptr is None:
            self.mode = "rows-per-layer"
            return
        self.mode = "rows"
        w = self._paged_wrapper(kernel, "rows")
        # kv_indices sized to the bound, on the device (the wrapper keeps this tensor and runs from it):
        # each layer's index kernel writes into it
        if self._indices.numel() < max(ub[-1], 1):
            self._indices = torch.zeros(max(ub[-1], 1), dtype=torch.int32, device=self.device)
        fi.plan(w, self._qo, _i32(kv_indptr), self._indices[:max(ub[-1], 1)], self._last,
                s.num_q_heads // s.num_kv_heads, 1, s.head_dim, s.page_size, causal=True, sm_scale=s.sm_scale,
                q_data_type=s.dtype, kv_data_type=s.dtype, **extra)
        self.index_buffers = fi.index_buffers(w)

    # --- per layer ----------------------------------------------------------------------------------
    def run(self, batch: ChunkBatch, indices: PagedIndices | None, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.shape is None:
            raise RuntimeError(f"{type(self).__name__}.run before plan_forward")
        if self.mode == "dense":
            chunk_kv = (batch.k_chunk, batch.v_chunk) if batch.k_chunk is not None else None
            return self.run_dense(batch.q, batch.k_pool, batch.v_pool, out=out, chunk_kv=chunk_kv)
        if indices is None:
            raise ValueError("a sparse forward pass needs the layer's paged indices")
        return self._run_rows(batch, indices, out)

    def run_dense(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  out: torch.Tensor | None = None, chunk_kv: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> torch.Tensor:
        """A dense pass's layer: q [T, H_q, D] against the contexts in the pool (the chunk's K/V stored).
        `chunk_kv`: the chunk's own K/V [T, H_kv, D], which a pass with no cached prefix on FlashInfer attends to
        directly (stock `flashinfer`'s ragged kernel); FA3 reads the pool in every pass, as stock `fa3` does."""
        if self.mode != "dense":
            raise RuntimeError(f"{type(self).__name__}.run_dense in a {self.mode} forward pass")
        if self._fa3_dense is not None:
            return self._fa3_dense.run(q, k_pool, v_pool, out=out)
        if self._dense_ragged is not None:
            if chunk_kv is not None and chunk_kv[0].dtype == q.dtype == self.shape.dtype:
                return self._dense_ragged.run(q, chunk_kv[0], chunk_kv[1], out=out)
            # the chunk's K/V not handed over (or stored in another dtype): read them from the pool
            self._plan_dense_paged(self.shape, self._page_table)
            self._dense_ragged = None
        return self._dense.run(q, (k_pool, v_pool), out=out)

    def _run_rows(self, batch: ChunkBatch, indices: PagedIndices, out: torch.Tensor | None) -> torch.Tensor:
        o = self._rows(batch, indices, out)
        if self._apart is not None:
            apart, tokens = self._apart
            o.index_copy_(0, tokens, apart.run(batch.q.index_select(0, tokens), (batch.k_pool, batch.v_pool)))
        return o

    def _rows(self, batch: ChunkBatch, indices: PagedIndices, out: torch.Tensor | None) -> torch.Tensor:
        """The rows' attention, o [T, H_q, D] (`out` when given; a window computed apart: garbage, overwritten by
        `_run_rows`)."""
        s = self.shape
        H_kv, P, D = s.num_kv_heads, s.page_size, s.head_dim
        w = self._paged_wrapper(self._rows_kernel, "rows")
        if self.mode == "rows-per-layer":
            n = int(indices.kv_indptr[-1])  # fa3 needs real lengths on the host: one sync per layer
            fi.plan(w, self._qo, indices.kv_indptr.cpu(), indices.kv_indices[:n], self._last, s.num_q_heads // H_kv,
                    1, D, P, causal=True, sm_scale=s.sm_scale, q_data_type=s.dtype, kv_data_type=s.dtype)
        else:
            self._load(indices)
        kv = (batch.k_pool.view(-1, 1, P, D), batch.v_pool.view(-1, 1, P, D))
        return tokens_from_rows(w.run(rows_from_tokens(batch.q, H_kv), kv), H_kv, out)

    def _load(self, indices: PagedIndices) -> None:
        """Make the wrapper read `indices` (a no-op when the index kernel wrote into its buffers)."""
        b = self.index_buffers
        if indices.kv_indptr.data_ptr() != b.kv_indptr.data_ptr():
            b.kv_indptr[:indices.kv_indptr.numel()].copy_(indices.kv_indptr)
        if indices.kv_indices.data_ptr() != b.kv_indices.data_ptr():
            n = min(indices.kv_indices.numel(), b.kv_indices.numel())
            b.kv_indices[:n].copy_(indices.kv_indices[:n])


class FlashInferFA2Executor(FlashInferExecutor):
    """fa2 everywhere: the rows planned once per forward pass with upper-bound lengths."""

    kernel = "fa2"


class FlashInferFA3Executor(FlashInferExecutor):
    """fa3 (Hopper) for dense passes and for rows whose lengths are known on the host; rows whose lengths
    depend on the scores run on fa2 planned once (`per_layer_rows=False`, what `auto` picks) or on fa3
    planned every layer from host copies of the lengths (`per_layer_rows=True`: one sync per layer)."""

    kernel = "fa3"

    def __init__(self, *args, per_layer_rows: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.per_layer_rows = per_layer_rows

    def _rows_plan(self, shape: ForwardShape):
        if shape.row_pages is None:
            return ("fa3", None, {}) if self.per_layer_rows else super()._rows_plan(shape)
        return "fa3", shape.rows_indptr(), {}


class SglFA3RowsExecutor(FlashInferFA3Executor):
    """Rows on sgl_kernel's FA3 (`sgl_fa3.FA3Rows`, the kernel stock SGLang's fa3 backend runs): FA3 reads each
    row's length on the device, so one plan serves every layer for every selector, with no host sync and no
    bound on the rows' lengths; FlashInfer's fa3 for the windows computed apart (and dense passes unless
    `dense_fa3`). The index kernels write into the executor's own buffers, grown to the largest pass seen."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._fa3_rows: FA3Rows | None = None
        self._row_buffers: tuple[IndexBuffers, torch.Tensor, torch.Tensor] | None = None

    def _buffers(self, rows: int, indices: int, table: int) -> tuple[IndexBuffers, torch.Tensor, torch.Tensor]:
        have = self._row_buffers
        if have is None or have[0].max_rows < rows or have[0].max_indices < indices or have[1].numel() < table:
            rows, indices, table = (max(rows, have[0].max_rows if have else 0),
                                    max(indices, have[0].max_indices if have else 0),
                                    max(table, have[1].numel() if have else 0))
            self._row_buffers = (IndexBuffers(rows, indices, self.device),
                                 torch.zeros(max(table, 1), dtype=torch.int32, device=self.device),
                                 torch.zeros(max(rows, 1), dtype=torch.int32, device=self.device))
        return self._row_buffers

    def _plan_rows(self, shape: ForwardShape) -> None:
        s = shape
        ub = self._check_rows(s)
        R = s.num_rows
        buffers, table, seqlens = self._buffers(R, ub[-1], R * max(s.qblocks.rows_bound()))
        self._fa3_rows = FA3Rows(s, s.qblocks.rows_qo_indptr(s.num_kv_heads, s.total_tokens),
                                 s.qblocks.last_page_len() * s.num_kv_heads, table, seqlens, self.device)
        self.mode = "rows"
        self.index_buffers = buffers

    def _rows(self, batch: ChunkBatch, indices: PagedIndices, out: torch.Tensor | None) -> torch.Tensor:
        return self._fa3_rows.run(batch.q, batch.k_pool, batch.v_pool, indices, out)


def make_flashinfer_executor(kernel: str, device, max_rows: int, max_indices: int,
                             dense_fa3: bool = False) -> FlashInferExecutor:
    """kernel: "fa2"; "fa3" (rows always on fa3); "fa3-auto" (fa3 where one plan serves every layer); "sgl-fa3"
    (rows on sgl_kernel's FA3, planned once for every selector).
    dense_fa3: dense passes on sgl_kernel's FA3 (what stock SGLang's fa3 backend runs)."""
    if kernel == "sgl-fa3":
        return SglFA3RowsExecutor(device, max_rows, max_indices, dense_fa3=dense_fa3)
    if kernel == "fa2":
        return FlashInferFA2Executor(device, max_rows, max_indices, dense_fa3=dense_fa3)
    if kernel in ("fa3", "fa3-auto"):
        return FlashInferFA3Executor(device, max_rows, max_indices, per_layer_rows=kernel == "fa3",
                                     dense_fa3=dense_fa3)
    raise ValueError(f"rows kernel must be 'fa2', 'fa3', 'fa3-auto' or 'sgl-fa3', got {kernel!r}")
