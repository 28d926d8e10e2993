"""`ChunkBatch`: one prefill chunk per request, each attending to its context in a paged pool.

This is the algorithm's whole view of a batch; it knows nothing of SGLang.

A request b has `L_b` cached prefix tokens and a chunk of `C_b` new tokens.
Its context is the `E_b = L_b + C_b` tokens in pages `page_table[b, :n_ctx_b]`;
the chunk's own keys and values are already in the pool (written before
attention), so every read goes through the page table.

Two units cut the chunk, both at absolute positions:

* q-blocks: the chunk's tokens in one page (P tokens); a selector scores pages
  per q-block (and query head);
* windows: the chunk's tokens in one union window of `window_pages` pages
  (W = window_pages * P tokens, e.g. 1024). A window is a row of the paged
  execution: its q-blocks' selections (and the query heads of a kv group) are
  unioned, so every query of the window reads the same pages, and the paged
  kernel reads each selected page once for the W queries of the window
  (per kv head) instead of once per q-block: the block union that keeps the
  sparse kernel as efficient per page as dense attention. A window reads its
  own pages densely (causally), its selection among the pages before it.

Because both units sit at absolute positions, how a prompt is cut into chunks
does not change what a window reads, as long as a chunk does not split a
window: SGLang's scheduler is made to start and end chunks on window
boundaries (`srt/alignment.py`); a window that is split anyway is still
computed exactly, from the queries the pass has.

Rows: one per (kv head g, window w), r = g * NW + w, each a one-kv-head
"request" with G query heads over the head-major pool viewed as
`[num_pages * H_kv, 1, P, D]`.

Shapes (B requests, T = sum of chunk lengths, P = page size):
    q            [T, H_q, D]                   chunk queries, ragged by `cu_chunk`
    k_pool       [num_pages, H_kv, P, D]       head-major paged pool ("HND")
    v_pool       [num_pages, H_kv, P, D]
    page_table   int32 [B, >= max_b n_ctx_b]   page ids of each context, in order
    k_chunk      [T, H_kv, D] or None          the chunk's keys (for the attention benchmark's ragged baselines)
    v_chunk      [T, H_kv, D] or None

Tensors derived from the lengths alone are computed once per batch and shared
by every layer: a layer's batch is `dataclasses.replace(template, q=...,
k_pool=...)`, which keeps the template's `derived` store (see `ChunkBatch.memo`).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def host_cumsum(values: Sequence[int]) -> list[int]:
    """[0, v0, v0 + v1, ...]: the host prefix sums every indptr is built from."""
    return [0, *itertools.accumulate(int(v) for v in values)]


ALL_WINDOWS = (0, 1 << 62)  # a sparse range that admits every window
DEFAULT_WINDOW_TOKENS = 1024


def forced_pages(first_page: torch.Tensor, last_page: torch.Tensor, sparse: torch.Tensor, n_pages: int,
                 sink_blocks: int, recent_blocks: int) -> torch.Tensor:
    """bool [NW, n_pages]: the pages every row of a window reads whatever the selection: the first
    `sink_blocks`, the `recent_blocks` before the window and the window's own pages up to its last
    query's; all of 0..last for a dense window (`sparse` 0)."""
    first, last = first_page.long()[:, None], last_page.long()[:, None]
    j = torch.arange(n_pages, device=first_page.device)[None, :]
    return (j <= last) & ((j < sink_blocks) | (j >= first - recent_blocks) | (sparse[:, None] == 0))


def gather_chunk_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor,
                    prefix_lens: Sequence[int], chunk_lens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """([T, H_kv, D], [T, H_kv, D]): the chunk's own K/V read back from the pool at its positions, in the
    token order of q (what the server's forward pass holds beside the pool)."""
    P = k_pool.shape[2]
    ks, vs = [], []
    for b, (L, C) in enumerate(zip(prefix_lens, chunk_lens)):
        pos = torch.arange(int(L), int(L) + int(C), device=k_pool.device)
        pages = page_table[b, pos // P].long()
        ks.append(k_pool[pages, :, pos % P])
        vs.append(v_pool[pages, :, pos % P])
    return torch.cat(ks), torch.cat(vs)


@dataclass(frozen=True)
class QBlocks:
    """The q-blocks and windows of a batch, on the host (tuples) and, once asked for, on the device.

    Per q-block q (requests in order, pages ascending within a request):
        req[q]     request index b
        page[q]    absolute page index a (the q-block's own page)
        pos[q]     absolute position of its first query (a * P, or L_b for a chunk that starts mid-page)
        start[q]   index of its first query in q [T, ...]
        length[q]  its queries (<= P)
        window[q]  index of its window (in this batch's window list)
    Per window w (a row unit):
        w_req, w_first (its first page: k * window_pages), w_last (the page of its last query),
        w_pos / w_start / w_length (its queries, as for q-blocks), w_sparse (reads a selection, else
        every page 0..last), w_qlo / w_qhi (its q-blocks)
    """

    page_size: int
    window_pages: int
    req: tuple[int, ...]
    page: tuple[int, ...]
    pos: tuple[int, ...]
    start: tuple[int, ...]
    length: tuple[int, ...]
    window: tuple[int, ...]
    w_req: tuple[int, ...]
    w_first: tuple[int, ...]
    w_last: tuple[int, ...]
    w_pos: tuple[int, ...]
    w_start: tuple[int, ...]
    w_length: tuple[int, ...]
    w_sparse: tuple[bool, ...]
    w_qlo: tuple[int, ...]
    w_qhi: tuple[int, ...]
    n_ctx: tuple[int, ...]      # context pages per request, ceil(E_b / P)
    device_arrays: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, prefix_lens: Sequence[int], chunk_lens: Sequence[int], page_size: int,
              window_pages: int | None = None,
              sparse_ranges: Sequence[tuple[int, int]] | None = None) -> "QBlocks":
        """`sparse_ranges[b] = (lo, hi)`: request b's windows k (absolute, tokens [k * W, (k + 1) * W)) with
        lo <= k < hi read a selection (default: all of them); the others are dense rows.
        `window_pages`: pages per window (default DEFAULT_WINDOW_TOKENS / page_size, at least 1)."""
        P = page_size
        WP = window_pages or max(1, DEFAULT_WINDOW_TOKENS // P)
        W = WP * P
        qf = {k: [] for k in ("req", "page", "pos", "start", "length", "window")}
        wf = {k: [] for k in ("w_req", "w_first", "w_last", "w_pos", "w_start", "w_length", "w_sparse", "w_qlo",
                              "w_qhi")}
        n_ctx = []
        cu = host_cumsum(chunk_lens)
        for b, (L, C) in enumerate(zip(prefix_lens, chunk_lens)):
            L, C = int(L), int(C)
            E = L + C
            n_ctx.append(cdiv(E, P))
            lo, hi = ALL_WINDOWS if sparse_ranges is None else sparse_ranges[b]
            for k in range(L // W, cdiv(E, W)) if C > 0 else ():
                ws, we = max(L, k * W), min(E, (k + 1) * W)
                wf["w_req"].append(b)
                wf["w_first"].append(k * WP)
                wf["w_last"].append((we - 1) // P)
                wf["w_pos"].append(ws)
                wf["w_start"].append(cu[b] + ws - L)
                wf["w_length"].append(we - ws)
                wf["w_sparse"].append(lo <= k < hi)
                wf["w_qlo"].append(len(qf["req"]))
                # the window's q-blocks, one per page a0..a1-1 it touches: the first starts at ws, the last ends
                # at we, the others are whole pages (ranges and repeats, not a Python loop: this runs every pass)
                a0, a1 = ws // P, cdiv(we, P)
                n, off = a1 - a0, cu[b] - L
                qf["req"] += [b] * n
                qf["page"] += range(a0, a1)
                qf["pos"].append(ws)
                qf["pos"] += range((a0 + 1) * P, a1 * P, P)
                qf["start"].append(ws + off)
                qf["start"] += range((a0 + 1) * P + off, a1 * P + off, P)
                qf["length"] += [we - ws] if n == 1 else [(a0 + 1) * P - ws, *[P] * (n - 2), we - (a1 - 1) * P]
                qf["window"] += [len(wf["w_req"]) - 1] * n
                wf["w_qhi"].append(len(qf["req"]))
        return cls(P, WP, **{k: tuple(v) for k, v in qf.items()}, **{k: tuple(v) for k, v in wf.items()},
                   n_ctx=tuple(n_ctx))

    @property
    def count(self) -> int:
        """NQB: q-blocks."""
        return len(self.req)

    @property
    def windows(self) -> int:
        """NW: windows (the rows per kv head)."""
        return len(self.w_req)

    @property
    def max_pages(self) -> int:
        """NKV: the widest row (every table is [.., NKV])."""
        return max(self.n_ctx, default=0)

    @property
    def any_sparse(self) -> bool:
        return any(self.w_sparse)

    @property
    def cand(self) -> tuple[int, ...]:
        """Per q-block: its candidate pages 0..cand-1 (those before its window; none in a dense window)."""
        return tuple(self.w_first[w] if self.w_sparse[w] else 0 for w in self.window)

    def full_counts(self) -> list[int]:
        """Pages a dense row of each window reads: last + 1."""
        return [a + 1 for a in self.w_last]

    @property
    def dense_apart(self) -> tuple[bool, ...]:
        """Per window: computed apart from the rows, by one causal pass over its whole context: the dense
        windows of a pass in which some window is sparse (their rows name only their own pages, so a mixed
        pass pays the rows' kernel only for its sparse windows)."""
        if not self.any_sparse:
            return (False,) * self.windows
        return tuple(not s for s in self.w_sparse)

    def row_counts(self, counts: Sequence[int]) -> list[int]:
        """Pages the rows' paged indices name, from the pages each window's row reads (`counts`, rows
        r = g * NW + w): a window computed apart names its own pages only, first..last."""
        apart = self.dense_apart
        NW = self.windows
        return [c - self.w_first[r % NW] if apart[r % NW] else c for r, c in enumerate(counts)]

    def rows_bound(self) -> list[int]:
        """Per window, the most pages its row's indices name (`full_counts`, own pages only when apart)."""
        return self.row_counts(self.full_counts())

    def apart_segments(self) -> list[tuple[int, int, int, int]]:
        """The windows computed apart as (request, first token in q, tokens, absolute position of the first),
        consecutive windows of a request merged: each segment is one causal "request" of the dense kernel."""
        out: list[list[int]] = []
        for w, apart in enumerate(self.dense_apart):
            if not apart:
                continue
            b, st, n, pos = self.w_req[w], self.w_start[w], self.w_length[w], self.w_pos[w]
            if out and out[-1][0] == b and out[-1][1] + out[-1][2] == st:
                out[-1][2] += n
            else:
                out.append([b, st, n, pos])
        return [tuple(x) for x in out]

    def window_density(self, counts: Sequence[int], num_kv_heads: int) -> list[float]:
        """Per window: the share of its context pages (0..last) its rows read, mean over the kv heads, from the
        pages each row reads (`counts`, rows r = g * NW + w)."""
        NW = self.windows
        return [sum(counts[g * NW + w] for g in range(num_kv_heads)) / (num_kv_heads * (last + 1))
                for w, last in enumerate(self.w_last)]

    def with_dense(self, windows) -> "QBlocks":
        """These q-blocks with the given windows (indices) dense: they read every page."""
        drop = set(windows)
        if not drop:
            return self
        return dataclasses.replace(self, w_sparse=tuple(s and w not in drop for w, s in enumerate(self.w_sparse)),
                                   device_arrays={})

    def last_page_len(self) -> list[int]:
        """Tokens of each window's last page (its row's last page) that its last query sees."""
        P = self.page_size
        return [p + n - a * P for p, n, a in zip(self.w_pos, self.w_length, self.w_last)]

    def rows_qo_indptr(self, num_kv_heads: int, total_tokens: int) -> list[int]:
        """qo_indptr of the rows r = g * NW + w over the queries laid out [H_kv, T, G, D]."""
        out = []
        for g in range(num_kv_heads):
            out.extend(g * total_tokens + s for s in self.w_start)
        out.append(num_kv_heads * total_tokens)
        return out

    def on(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        """int32 device copies of the per-q-block (req, page, start, length, window, cand: the pages a selector
        scores, those before its window, none in a dense window) and per-window (w_req, w_first, w_last, w_sparse, w_qlo, w_qhi) arrays, made once per batch and
        device."""
        key = str(device)
        hit = self.device_arrays.get(key)
        if hit is None:
            qrows = [self.req, self.page, self.start, self.length, self.window, self.cand]
            wrows = [self.w_req, self.w_first, self.w_last, [int(x) for x in self.w_sparse], self.w_qlo, self.w_qhi]
            flat = [x for row in qrows + wrows for x in row]
            host = torch.tensor(flat, dtype=torch.int32)
            dev = host.to(device, non_blocking=True)
            n, m = self.count, self.windows
            parts = dev.split([n] * len(qrows) + [m] * len(wrows))
            names = ("req", "page", "start", "length", "window", "cand", "w_req", "w_first", "w_last", "w_sparse",
                     "w_qlo", "w_qhi")
            hit = dict(zip(names, parts))
            self.device_arrays[key] = hit
        return hit


@dataclass
class ChunkBatch:
    q: torch.Tensor
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    page_table: torch.Tensor
    prefix_lens_cpu: Sequence[int]
    chunk_lens_cpu: Sequence[int]
    qblocks: QBlocks
    sm_scale: float
    k_chunk: torch.Tensor | None = None
    v_chunk: torch.Tensor | None = None
    #: tensors derived from the lengths, shared by the layers' copies of one batch (see `memo`)
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor,
              prefix_lens_cpu: Sequence[int], chunk_lens_cpu: Sequence[int], sm_scale: float | None = None, *,
              sparse_ranges: Sequence[tuple[int, int]] | None = None, k_chunk: torch.Tensor | None = None,
              v_chunk: torch.Tensor | None = None, window_pages: int | None = None) -> "ChunkBatch":
        """Validate shapes; the chunk's K/V must already be in the pool at its context pages."""
        prefix_lens_cpu = [int(x) for x in prefix_lens_cpu]
        chunk_lens_cpu = [int(x) for x in chunk_lens_cpu]
        if len(prefix_lens_cpu) != len(chunk_lens_cpu):
            raise ValueError("prefix_lens and chunk_lens differ in length")
        if q.dim() != 3 or k_pool.dim() != 4:
            raise ValueError("expected q [T, H_q, D] and k_pool [pages, H_kv, P, D]")
        T, H_q, D = q.shape
        _, H_kv, P, Dk = k_pool.shape
        if sum(chunk_lens_cpu) != T:
            raise ValueError(f"q has {T} tokens, the chunk lengths sum to {sum(chunk_lens_cpu)}")
        if Dk != D or v_pool.shape != k_pool.shape:
            raise ValueError("pool shape does not match q")
        if H_q % H_kv:
            raise ValueError(f"query heads {H_q} not a multiple of kv heads {H_kv}")
        for name, t in (("k_chunk", k_chunk), ("v_chunk", v_chunk)):
            if t is not None and t.shape != (T, H_kv, D):
                raise ValueError(f"{name} must be [{T}, {H_kv}, {D}], got {tuple(t.shape)}")
        qb = QBlocks.build(prefix_lens_cpu, chunk_lens_cpu, P, window_pages, sparse_ranges)
        if page_table.dim() != 2 or page_table.shape[0] != len(prefix_lens_cpu) or page_table.shape[1] < qb.max_pages:
            raise ValueError(f"page_table must be [B, >= {qb.max_pages}], got {tuple(page_table.shape)}")
        return cls(q=q, k_pool=k_pool, v_pool=v_pool, page_table=page_table.to(torch.int32),
                   prefix_lens_cpu=prefix_lens_cpu, chunk_lens_cpu=chunk_lens_cpu, qblocks=qb,
                   sm_scale=float(sm_scale) if sm_scale is not None else D ** -0.5, k_chunk=k_chunk, v_chunk=v_chunk)

    # --- sizes (host values, no sync) -------------------------------------------------
    @property
    def batch_size(self) -> int:
        return len(self.prefix_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.q.shape[0]

    @property
    def num_q_heads(self) -> int:
        return self.q.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k_pool.shape[1]

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.q.shape[2]

    @property
    def page_size(self) -> int:
        return self.k_pool.shape[2]

    @property
    def num_rows(self) -> int:
        """R = H_kv * NW: one row per (kv head, window)."""
        return self.num_kv_heads * self.qblocks.windows

    def context_lens_cpu(self) -> list[int]:
        """E_b = L_b + C_b: tokens of each context after this chunk."""
        return [L + C for L, C in zip(self.prefix_lens_cpu, self.chunk_lens_cpu)]

    def cu_chunk_cpu(self) -> list[int]:
        return self.memo(("cu_chunk_cpu",), lambda: host_cumsum(self.chunk_lens_cpu))

    # --- tensors derived from the lengths (computed once per batch) -----------------------
    def memo(self, key: tuple, compute: Callable[[], object]):
        """`compute()` once per key for the batch's lengths: the layers of a forward pass share it
        (their batches are `dataclasses.replace` copies of one template, with the same store)."""
        full = (key, id(self.qblocks))
        hit = self.derived.get(full)
        if hit is None:
            hit = (self.qblocks, compute())   # the entry keeps the q-blocks alive: ids stay unique
            self.derived[full] = hit
        return hit[1]

    def device_qblocks(self) -> dict[str, torch.Tensor]:
        return self.qblocks.on(self.q.device)

    def cu_chunk(self) -> torch.Tensor:
        return self.memo(("cu_chunk",), lambda: torch.tensor(self.cu_chunk_cpu(), dtype=torch.int32).to(
            self.q.device, non_blocking=True))

    def full_table(self) -> torch.Tensor:
        """bool [H_kv, NW, NKV]: every page 0..last of every row (the dense table)."""
        def compute():
            last = self.device_qblocks()["w_last"].long()
            j = torch.arange(self.qblocks.max_pages, device=last.device)
            return (j[None, :] <= last[:, None])[None].expand(self.num_kv_heads, -1, -1)
        return self.memo(("full_table",), compute)

    def candidates(self) -> torch.Tensor:
        """bool [NQB, NKV]: pages a selector may score for each q-block: those before its window (none in a
        dense window)."""
        def compute():
            first = self.device_qblocks()["cand"].long()
            return torch.arange(self.qblocks.max_pages, device=first.device)[None, :] < first[:, None]
        return self.memo(("candidates",), compute)

    def forced(self, sink_blocks: int, recent_blocks: int) -> torch.Tensor:
        """bool [NW, NKV]: pages every row reads (`forced_pages`)."""
        d = self.device_qblocks()
        return self.memo(("forced", sink_blocks, recent_blocks), lambda: forced_pages(
            d["w_first"], d["w_last"], d["w_sparse"], self.qblocks.max_pages, sink_blocks, recent_blocks))

    # --- reads of the pool (O(context tokens); selectors that need keys, and references) --------
    def context_keys(self, b: int) -> torch.Tensor:
        """[H_kv, E_b, D]: request b's context keys in order, read from the pool."""
        return self._context(self.k_pool, b)

    def context_values(self, b: int) -> torch.Tensor:
        return self._context(self.v_pool, b)

    def _context(self, pool: torch.Tensor, b: int) -> torch.Tensor:
        E = self.prefix_lens_cpu[b] + self.chunk_lens_cpu[b]
        n = cdiv(E, self.page_size)
        pages = self.page_table[b, :n].long()
        H, D = pool.shape[1], pool.shape[3]
        return pool[pages].permute(1, 0, 2, 3).reshape(H, n * self.page_size, D)[:, :E]
