"""`seer`: SeerAttention's AttnGate (learned page gate), top-p on the gate's scores.

Architecture (per layer), after SeerAttention (Gao et al., 2024):
    q_gate = mean-pool of each q-block's queries   [H_q, NQB, D]     -> per-head linear D -> d_g
    k_gate = [max, min, mean]-pool of each page    [H_kv, NKV, 3D]   -> per-head linear 3D -> d_g
    gate   = softmax_j(q_gate . k_gate_j / sqrt(d_g)) over the candidate pages (before the q-block's window)
Each head keeps the fewest pages whose gate mass reaches `threshold`.
(The published gates also re-apply RoPE to the pooled vectors; this one does not.)

Weights come from a safetensors file with, for every layer l,
    layers.{l}.q_gate.weight  [H_q, D, d_g]
    layers.{l}.k_gate.weight  [H_kv, 3 * D, d_g]
No trained gates exist for the models here: the plumbing is tested with random
weights only, so this selector's accuracy is unmeasured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_compact.selectors.base import NEG_INF, Selection, Selector, qblock_queries, request_qblocks, top_p_rows
from sglang_compact.selectors.registry import SelectorParams, param, register_selector


def load_gate_weights(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    try:
        return load_file(path)
    except FileNotFoundError:
        raise ValueError(f"seer selector: gate weight file not found: {path}") from None


@dataclass(frozen=True)
class SeerParams(SelectorParams):
    threshold: float = param(0.9, lo=0.0, hi=1.0, help="gate mass each head keeps")
    gate_path: str = param(None, help="safetensors file of AttnGate weights (required)")


@register_selector("seer", params=SeerParams, expected_density=0.4, priced_search=False)
class SeerSelector(Selector):
    """SeerAttention's learned AttnGate over pooled queries and pages, top-p."""

    def __init__(self, config):
        super().__init__(config)
        self.weights = load_gate_weights(self.params.gate_path)
        self._on_device: dict[tuple[str, torch.device], torch.Tensor] = {}

    def _weight(self, name: str, device: torch.device) -> torch.Tensor:
        key = (name, device)
        if key not in self._on_device:
            if name not in self.weights:
                raise ValueError(f"seer selector: {name} missing from {self.params.gate_path}")
            self._on_device[key] = self.weights[name].to(device=device, dtype=torch.float32)
        return self._on_device[key]

    def gate_scores(self, batch, layer: int) -> torch.Tensor:
        """float32 [H_q, NQB, NKV] gate probabilities over each q-block's candidate pages."""
        dev = batch.q.device
        wq = self._weight(f"layers.{layer}.q_gate.weight", dev)
        wk = self._weight(f"layers.{layer}.k_gate.weight", dev)
        H_q, H_kv, D, P = batch.num_q_heads, batch.num_kv_heads, batch.head_dim, batch.page_size
        d_g = wq.shape[-1]
        if wq.shape != (H_q, D, d_g) or wk.shape != (H_kv, 3 * D, d_g):
            raise ValueError(f"seer selector: gate weights of layer {layer} have shapes {tuple(wq.shape)}, "
                             f"{tuple(wk.shape)}; the model needs [{H_q}, {D}, d_g], [{H_kv}, {3 * D}, d_g]")
        q_pad, q_valid = qblock_queries(batch)
        q_pool = q_pad.sum(1) / q_valid.sum(1).clamp(min=1)[:, None, None].to(torch.float32)   # [NQB, H_q, D]
        qg = torch.einsum("qhd,hde->hqe", q_pool, wq)                                         # [H_q, NQB, d_g]
        NKV = batch.qblocks.max_pages
        out = torch.zeros(H_q, batch.qblocks.count, NKV, dtype=torch.float32, device=dev)
        for idx, a, k, n in request_qblocks(batch):
            E = k.shape[1]
            kb = torch.nn.functional.pad(k, (0, 0, 0, n * P - E)).reshape(H_kv, n, P, D)
            ok = (torch.arange(n * P, device=dev) < E).reshape(1, n, P, 1)
            kmax = kb.masked_fill(~ok, NEG_INF).amax(2)
            kmin = kb.masked_fill(~ok, float("inf")).amin(2)
            kmean = kb.sum(2) / ok.sum(2).clamp(min=1)
            kp = torch.cat([kmax, kmin, kmean], dim=-1).nan_to_num_(0.0, posinf=0.0, neginf=0.0)
            kg = torch.einsum("hnd,hde->hne", kp, wk).repeat_interleave(batch.group_size, dim=0)  # [H_q, n, d_g]
            s = torch.einsum("hqe,hne->hqn", qg[:, idx], kg) / d_g ** 0.5
            s = s.masked_fill(~(torch.arange(n, device=dev)[None, :] < a[:, None])[None], NEG_INF)
            out[:, idx, :n] = torch.softmax(s, dim=-1).nan_to_num_(0.0)
        return out

    def select(self, batch, layer, summaries):
        scores = self.gate_scores(batch, layer)
        return Selection(mask=top_p_rows(scores, batch.candidates()[None].expand_as(scores), self.params.threshold),
                         scores=scores)
