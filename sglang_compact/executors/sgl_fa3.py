"""Dense passes on SGLang's FA3 kernel: every use of sgl_kernel's FlashAttention-3, in one place.

Stock `--attention-backend fa3`, SGLang's default on Hopper, runs Tri Dao's
FA3 from `sgl_kernel.flash_attn`. A dense pass of the compact backend (nothing
sparse in it) makes stock's call, so turning the backend on costs a Hopper
user nothing there and gives stock's answers: `flash_attn_with_kvcache` over
each request's pages after the chunk's K/V is stored, for every pass, the
first chunk of a prompt included. It reads the head-major pool
`[pages, H_kv, P, D]` in place through its `[pages, P, H_kv, D]` view (FA3
takes the cache's strides; the last dimension stays contiguous).

FA3's varlen kernel on a first chunk's own K/V is ~4% faster (0.262 against
0.274 ms per layer for 8K tokens of Qwen2.5-0.5B on an H100), but it tiles the
keys differently from the paged kernel, so its outputs differ from stock's in
the last bits, and greedy answers flip where two tokens nearly tie (1 of 10
prompts of the dense check, at the first token): equal answers win here.

FA3 takes device lengths with no host-side schedule, so a pass is planned by
copying its lengths once (`FA3DensePass`); every layer then launches one kernel.

FA3 is a separate library in sgl_kernel (`flash_ops`), which some builds leave
out; `unavailable_reason` says why it cannot run, and the executor then runs
dense passes on FlashInfer.
"""

from __future__ import annotations

import torch

from sglang_compact.batch import host_cumsum
from sglang_compact.executors.base import rows_from_tokens, tokens_from_rows
from sglang_compact.kernels import row_page_table, row_page_table_naive, use_triton

#: head dims FA3's forward kernels are built for
HEAD_DIMS = (64, 96, 128, 192, 256)


def unavailable_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why sgl_kernel's FA3 cannot run dense passes here, or None when it can (after one small call)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"FA3 runs on CUDA GPUs, the KV cache is on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"FA3 dense passes are used on Hopper (sm90), this GPU is sm{major}{minor}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"FA3 needs a bf16 or fp16 KV cache, this one is {dtype}"
    if head_dim not in HEAD_DIMS:
        return f"FA3 is built for head dims {HEAD_DIMS}, the model's is {head_dim}"
    try:
        from sgl_kernel.flash_attn import flash_attn_varlen_func
        x = torch.zeros(16, 1, head_dim, dtype=dtype, device=device)
        cu = torch.tensor([0, 16], dtype=torch.int32, device=device)
        flash_attn_varlen_func(x, x, x, cu, cu, 16, 16, causal=True)
    except Exception as e:   # ImportError when the build lacks flash_ops; a kernel error otherwise
        return f"sgl_kernel's FA3 does not run here ({type(e).__name__}: {e})"
    return None


class FA3DensePass:
    """A dense pass on FA3: its lengths on the device, copied once per forward pass; `run` per layer.

    shape: the pass's `ForwardShape`; page_table: int32 [B, >= pages of the longest context] on the device.
    """

    def __init__(self, shape, page_table: torch.Tensor, device: torch.device):
        from sgl_kernel.flash_attn import flash_attn_with_kvcache
        self._paged = flash_attn_with_kvcache
        chunk = list(shape.chunk_lens)
        lens = torch.tensor(host_cumsum(chunk) + shape.context_lens(), dtype=torch.int32)
        lens = lens.to(device, non_blocking=True)
        B = len(chunk)
        self.cu_seqlens_q, self.cache_seqlens = lens[:B + 1], lens[B + 1:]
        self.max_seqlen_q = max(chunk)
        self.page_table = page_table if page_table.dtype == torch.int32 else page_table.to(torch.int32)
        self.sm_scale = shape.sm_scale

    def run(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H_q, D] against each request's context in the pool (the chunk's K/V already stored)."""
        return self._paged(q=q, k_cache=k_pool.transpose(1, 2), v_cache=v_pool.transpose(1, 2),
                           page_table=self.page_table, cache_seqlens=self.cache_seqlens,
                           cu_seqlens_q=self.cu_seqlens_q, max_seqlen_q=self.max_seqlen_q,
                           softmax_scale=self.sm_scale, causal=True, out=out)


class FA3Rows:
    """A sparse pass's rows (kv head, window) on FA3, planned once per forward pass; `run` per layer.

    The rows are those of the FlashInfer executors (`indices.py`): the pool viewed as one-kv-head pages
    `page * H_kv + g`, queries `[H_kv * T, G, D]`, a row's last pages its window's own, so FA3's bottom-right
    causal mask is each query's. FA3 takes the rows' page tables and lengths on the device, so the plan holds
    only what the pass's shape fixes (the rows' query offsets, last-page lengths, the table's width) and
    serves every layer whatever its rows' lengths: per layer one table kernel turns the index kernel's
    CSR into the padded table FA3 reads (`kernels/row_page_table.py`), then one FA3 call.

    A pass of one window (one request whose chunk lies in one window: a long prompt's chunks at chunk size <= the
    window) has one row per kv head, each over all T queries, so FA3's batch call takes the queries and writes the
    output in the tokens' own layout: row g's queries are q[:, g*G:(g+1)*G], a `[H_kv, T, G, D]` view whose batch
    stride FA3 reads, so the two copies between the token and row layouts (~25 us a layer for 1024 tokens of
    Llama-3.1-8B heads on an H100) are not made. Other passes hand FA3 the rows kv-head-major (varlen).

    shape: the pass's `ForwardShape`; table, seqlens: int32 device buffers of at least R * W and R elements;
    paged: FA3's paged call (sgl_kernel's `flash_attn_with_kvcache` unless given: a test's twin of its contract).
    """

    def __init__(self, shape, qo_indptr: list[int], last_page_len: list[int], table: torch.Tensor,
                 seqlens: torch.Tensor, device: torch.device, paged=None):
        if paged is None:
            from sgl_kernel.flash_attn import flash_attn_with_kvcache as paged
        self._paged = paged
        R = shape.num_rows
        width = max(shape.qblocks.rows_bound())
        self.table = table[:R * width].view(R, width)
        self.seqlens = seqlens[:R]
        host = torch.tensor(list(qo_indptr) + list(last_page_len), dtype=torch.int32)
        host = host.to(device, non_blocking=True)
        self.cu_seqlens_q, self.last_page_len = host[:R + 1], host[R + 1:]
        self.max_seqlen_q = max(b - a for a, b in zip(qo_indptr[:-1], qo_indptr[1:]))
        self.num_kv_heads, self.page_size, self.sm_scale = shape.num_kv_heads, shape.page_size, shape.sm_scale
        self.one_window = R == shape.num_kv_heads

    def run(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, indices,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H_q, D] against the pages of `indices` (a `PagedIndices` of this pass's rows) -> o [T, H_q, D]
        (`out` when given, contiguous)."""
        impl = row_page_table if use_triton(indices.kv_indices) else row_page_table_naive
        impl.row_page_table(indices.kv_indptr, indices.kv_indices, self.last_page_len, self.page_size, self.table,
                            self.seqlens)
        H_kv, P, D = self.num_kv_heads, self.page_size, q.shape[-1]
        k_cache, v_cache = k_pool.view(-1, 1, P, D).transpose(1, 2), v_pool.view(-1, 1, P, D).transpose(1, 2)
        if self.one_window:
            groups = (H_kv, q.shape[1] // H_kv)
            out = torch.empty_like(q) if out is None else out
            self._paged(q=q.unflatten(1, groups).transpose(0, 1), k_cache=k_cache, v_cache=v_cache,
                        page_table=self.table, cache_seqlens=self.seqlens, softmax_scale=self.sm_scale, causal=True,
                        out=out.unflatten(1, groups).transpose(0, 1))
            return out
        o = self._paged(q=rows_from_tokens(q, H_kv), k_cache=k_cache, v_cache=v_cache, page_table=self.table,
                        cache_seqlens=self.seqlens, cu_seqlens_q=self.cu_seqlens_q, max_seqlen_q=self.max_seqlen_q,
                        softmax_scale=self.sm_scale, causal=True)
        return tokens_from_rows(o, H_kv, out)
