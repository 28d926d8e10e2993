"""`xattention`: strided antidiagonal scoring (XAttention), cumulative-mass threshold.

For stride S, each q-block's queries are regrouped in reversed order and the keys in order into
S-token super-rows, so one dot product of super-rows sums an antidiagonal of the S x S tile of
Q.K^T. A softmax over the candidate super-columns (those in pages before the q-block's window),
summed per page and averaged over the q-block's super-rows, estimates each page's attention
mass; each head keeps pages by descending mass until `threshold` of it is covered. Reads the
context's keys (O(context tokens / S) per super-row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_compact.kernels import antidiagonal as antidiagonal_kernel
from sglang_compact.kernels import antidiagonal_naive, use_triton
from sglang_compact.selectors.base import Selection, Selector, qblock_queries, top_p_rows
from sglang_compact.selectors.registry import SelectorParams, param, register_selector


def antidiagonal_rows(batch, stride: int, row_stride: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The q-blocks' queries as the antidiagonal reads them: ([H_kv, NQB, GP, RQ, S * D] in the queries' dtype,
    row u = queries u*S+S-1 .. u*S of the q-block's page (flipped), query heads of each kv head's group padded
    to GP = next power of two with zeros; float32 [NQB, RQ] each row's weight in its q-block's mean, 1 / the
    q-block's scored rows that hold a query of this chunk, 0 for a row that holds none). `row_stride` r scores
    RQ = P / S / r rows (r times less search work): the q-block's last row holding a query and every r-th row
    before it, so a q-block cut short by the chunk's end still scores its queries."""
    q_pad, q_valid = qblock_queries(batch, dtype=batch.q.dtype)               # [NQB, P, H_q, D]
    NQB, P, H_q, D = q_pad.shape
    S, H_kv, G = stride, batch.num_kv_heads, batch.group_size
    R, GP = P // S, 1 << max(G - 1, 0).bit_length()
    if R % row_stride:
        raise ValueError(f"antidiagonal row stride {row_stride} must divide the {R} rows of a page "
                         f"(page {P}, stride {S})")
    rows = q_pad.reshape(NQB, R, S, H_kv, G, D)
    rows_ok = q_valid.reshape(NQB, R, S).any(-1)                                # [NQB, R]
    RQ = R // row_stride
    if row_stride > 1:   # rows last, last - r, ... (on the device: no host sync)
        u = torch.arange(R, device=rows_ok.device)
        last = torch.where(rows_ok, u, 0).amax(-1)
        pick = last[:, None] - row_stride * torch.arange(RQ - 1, -1, -1, device=u.device)[None, :]   # [NQB, RQ]
        rows_ok = rows_ok.gather(1, pick.clamp(min=0)) & (pick >= 0)
        rows = rows.gather(1, pick.clamp(min=0)[:, :, None, None, None, None].expand(-1, -1, *rows.shape[2:]))
    rows = rows.flip(2).permute(3, 0, 4, 1, 2, 5)                                # [H_kv, NQB, G, RQ, S, D]
    if GP > G:
        rows = torch.nn.functional.pad(rows, (0, 0, 0, 0, 0, 0, 0, GP - G))
    weight = rows_ok / rows_ok.sum(-1, keepdim=True).clamp(min=1)
    return rows.reshape(H_kv, NQB, GP, RQ, S * D), weight.to(torch.float32)


def antidiagonal_page_mass(batch, stride: int, row_stride: int = 1) -> torch.Tensor:
    """float32 [H_q, NQB, NKV] estimated attention mass of each candidate page (0 elsewhere): the Triton
    kernel on CUDA (`kernels/antidiagonal.py`), its torch twin elsewhere. `row_stride`: `antidiagonal_rows`."""
    if batch.page_size % stride:
        raise ValueError(f"antidiagonal stride {stride} must divide the page size {batch.page_size}")
    q_rows, weight = antidiagonal_rows(batch, stride, row_stride)
    d = batch.device_qblocks()
    args = (q_rows, batch.k_pool, batch.page_table, d["req"], d["cand"], weight, batch.group_size,
            batch.qblocks.max_pages, batch.sm_scale / stride)
    if use_triton(batch.q) and antidiagonal_kernel.supports(batch.head_dim, batch.page_size, stride):
        per_tile = antidiagonal_kernel.qblocks_per_tile(batch.group_size, q_rows.shape[3])
        tiles = batch.memo(("antidiagonal_tiles", per_tile), lambda: torch.tensor(
            antidiagonal_kernel.make_tiles(batch.qblocks.req, per_tile), dtype=torch.int32).to(
            batch.q.device, non_blocking=True))
        return antidiagonal_kernel.page_mass(*args, tiles=tiles)
    return antidiagonal_naive.page_mass(*args)


@dataclass(frozen=True)
class XAttentionParams(SelectorParams):
    threshold: float = param(0.9, lo=0.0, hi=1.0, help="cumulative estimated mass each head keeps")
    stride: int = param(8, lo=1, hi=16, power_of_two=True, help="antidiagonal stride S")


@register_selector("xattention", params=XAttentionParams, expected_density=0.4, priced_search=False)
class XAttentionSelector(Selector):
    """Strided antidiagonal page scores, cumulative-mass threshold (XAttention)."""

    def select(self, batch, layer, summaries):
        mass = antidiagonal_page_mass(batch, self.params.stride)
        return Selection(mask=top_p_rows(mass, batch.candidates()[None].expand_as(mass), self.params.threshold),
                         scores=mass)
