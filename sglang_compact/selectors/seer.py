"""`seer`: SeerAttention's AttnGate (learned block gate), top-p on the gate's scores.

Architecture (per layer), after SeerAttention (Gao et al., 2024):
    q_gate = mean-pool of each query block          [B, H_q, NQ, D]   -> per-head linear D -> d_g
    k_gate = [max, min, mean]-pool of each kv block [B, H_kv, NKV, 3D] -> per-head linear 3D -> d_g
    gate   = softmax_j(q_gate . k_gate_j / sqrt(d_g)) over the valid prefix blocks
Each row keeps the fewest blocks whose gate mass reaches `threshold`.
(The published gates also re-apply RoPE to the pooled vectors; this one does not.)

Weights come from a safetensors file with, for every layer l,
    layers.{l}.q_gate.weight  [H_q, D, d_g]
    layers.{l}.k_gate.weight  [H_kv, 3 * D, d_g]
No trained gates exist for the models here: the plumbing is tested with random
weights only, so this selector's accuracy is unmeasured.
"""

from __future__ import annotations

import torch

from sglang_compact.selectors.base import NEG_INF, Selection, Selector, register_selector, top_p_rows, valid_cells


def load_gate_weights(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    try:
        return load_file(path)
    except FileNotFoundError:
        raise ValueError(f"seer selector: gate weight file not found: {path}") from None


@register_selector("seer")
class SeerSelector(Selector):
    def __init__(self, config):
        super().__init__(config)
        self.weights = load_gate_weights(config.param("gate_path"))
        self._on_device: dict[tuple[str, torch.device], torch.Tensor] = {}

    def _weight(self, name: str, device: torch.device) -> torch.Tensor:
        key = (name, device)
        if key not in self._on_device:
            if name not in self.weights:
                raise ValueError(f"seer selector: {name} missing from {self.config.param('gate_path')}")
            self._on_device[key] = self.weights[name].to(device=device, dtype=torch.float32)
        return self._on_device[key]

    def gate_scores(self, batch, layer: int) -> torch.Tensor:
        bs = self.config.block_size
        wq = self._weight(f"layers.{layer}.q_gate.weight", batch.q.device)
        wk = self._weight(f"layers.{layer}.k_gate.weight", batch.q.device)
        H_q, D, d_g = batch.num_q_heads, batch.head_dim, wq.shape[-1]
        if wq.shape != (H_q, D, d_g) or wk.shape != (batch.num_kv_heads, 3 * D, d_g):
            raise ValueError(f"seer selector: gate weights of layer {layer} have shapes {tuple(wq.shape)}, "
                             f"{tuple(wk.shape)}; the model needs [{H_q}, {D}, d_g], [{batch.num_kv_heads}, {3 * D}, d_g]")
        q_pad, q_valid = batch.padded_queries(bs)
        B, _, LQ, _ = q_pad.shape
        NQ = LQ // bs
        qn = q_valid.reshape(B, 1, NQ, bs, 1).sum(3).clamp(min=1)
        q_pool = q_pad.to(torch.float32).reshape(B, H_q, NQ, bs, D).sum(3) / qn  # [B, H_q, NQ, D]
        k, k_valid = batch.prefix_keys()  # [B, H_kv, NKV*P, D]
        P = batch.page_size
        NKV = k.shape[2] // P
        kb = k.to(torch.float32).reshape(B, -1, NKV, P, D)
        vmask = k_valid.reshape(B, 1, NKV, P, 1)
        kmax = kb.masked_fill(~vmask, NEG_INF).amax(3)
        kmin = kb.masked_fill(~vmask, float("inf")).amin(3)
        kmean = kb.sum(3) / vmask.sum(3).clamp(min=1)
        k_pool = torch.cat([kmax, kmin, kmean], dim=-1).nan_to_num_(0.0, posinf=0.0, neginf=0.0)
        qg = torch.einsum("bhqd,hde->bhqe", q_pool, wq)
        kg = torch.einsum("bhkd,hde->bhke", k_pool, wk).repeat_interleave(batch.group_size, dim=1)
        s = torch.matmul(qg, kg.transpose(-1, -2)) / d_g ** 0.5
        s = s.masked_fill(~batch.kv_block_valid()[:, None, None, :], NEG_INF)
        return torch.softmax(s, dim=-1).nan_to_num_(0.0)

    def select(self, batch, layer=0, pooled_keys=None):
        scores = self.gate_scores(batch, layer)
        valid = valid_cells(batch, self.config.block_size).expand_as(scores)
        return Selection(top_p_rows(scores, valid, self.config.param("threshold")), scores * valid)
