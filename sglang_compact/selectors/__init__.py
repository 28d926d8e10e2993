"""Pattern-search selectors (a registry; see `base.py` for the interface)."""

from sglang_compact.selectors import budget, dense, flashprefill, oracle, seer, xattention  # noqa: F401  (register)
from sglang_compact.selectors.base import Selection, Selector, make_selector, register_selector, registered_selectors

__all__ = ["Selection", "Selector", "make_selector", "register_selector", "registered_selectors"]
