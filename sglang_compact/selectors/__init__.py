"""Pattern-search selectors. `registry.py` is the one source of their names and parameters;
`base.py` the interface; one module per selector."""

from sglang_compact.selectors.base import Selection, Selector
from sglang_compact.selectors.registry import (SelectorParams, SelectorSpec, param, register_selector,
                                               selector_names, selector_spec)
from sglang_compact.selectors import (budget, dense, flashprefill, mass_budget, oracle, quest_budget,  # noqa: F401,E402
                                     seer, xattention)  # (register)


def make_selector(config) -> Selector:
    return selector_spec(config.selector).make(config)


__all__ = ["Selection", "Selector", "SelectorParams", "SelectorSpec", "make_selector", "param", "register_selector",
           "selector_names", "selector_spec"]
