"""A toy selector defined outside the package, registered from this one file (the structure test and
the CPU-server test load it with `--compact-selector-module toy_selector`): every other candidate page."""

from dataclasses import dataclass

import torch

from sglang_compact.selectors import Selection, Selector, SelectorParams, param, register_selector


@dataclass(frozen=True)
class ToyParams(SelectorParams):
    offset: int = param(0, lo=0, hi=1, help="keep candidate pages j with j % 2 == offset")


@register_selector("toy_every_other", params=ToyParams, expected_density=0.5)
class ToyEveryOther(Selector):
    """Every other candidate page."""

    def select(self, batch, layer, summaries):
        j = torch.arange(batch.qblocks.max_pages, device=batch.q.device)
        keep = (j % 2 == self.params.offset)[None, :] & batch.candidates()
        return Selection(mask=keep[None].expand(batch.num_q_heads, -1, -1).contiguous())
