"""Helpers shared by the method runners: the accuracy check's error, torch masked attention (the CPU paths), the
torch twins of the ragged causal chunk and `merge_state`, a running sum."""

from __future__ import annotations

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def torch_masked_attention(q, k, v, allowed, scale):
    """q [H, M, D], k/v [H, N, D], allowed bool broadcastable to [H, M, N] -> (o [M, H, D], lse [M, H]) fp32."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    return torch.matmul(p, v.float()).transpose(0, 1), lse.transpose(0, 1)


def torch_chunk_attention(batch):
    """Each chunk against itself only, causally (from `k_chunk` / `v_chunk`): (o [T, H_q, D], lse [T, H_q]) fp32."""
    T, H_q, D = batch.q.shape
    G = batch.group_size
    o = torch.zeros(T, H_q, D, dtype=torch.float32, device=batch.q.device)
    lse = torch.full((T, H_q), float("-inf"), dtype=torch.float32, device=batch.q.device)
    cu = batch.cu_chunk_cpu()
    for b, C in enumerate(batch.chunk_lens_cpu):
        if C == 0:
            continue
        sl = slice(cu[b], cu[b + 1])
        k = batch.k_chunk[sl].transpose(0, 1).repeat_interleave(G, dim=0)
        v = batch.v_chunk[sl].transpose(0, 1).repeat_interleave(G, dim=0)
        causal = torch.arange(C, device=o.device)[None, :] <= torch.arange(C, device=o.device)[:, None]
        o[sl], lse[sl] = torch_masked_attention(batch.q[sl].transpose(0, 1), k, v, causal[None], batch.sm_scale)
    return o, lse


def torch_merge(o_a, lse_a, o_b, lse_b):
    """Merge two attention states over disjoint key sets (o [T, H, D], lse [T, H], natural log) -> o fp32."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    wa = torch.exp(lse_a - safe)[..., None]
    wb = torch.exp(lse_b - safe)[..., None]
    return o_a.float() * wa + o_b.float() * wb


def cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s
