"""The product package's shape: no import cycles; SGLang's internals reached from one module;
a selector added from one file outside the package works through the registry."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"sglang_compact": ROOT / "sglang_compact", "sglang_compact.kernels": ROOT / "kernels"}
#: the only product modules that may import sglang.srt
SGLANG_TOUCHPOINTS = {"sglang_compact.srt.compat", "sglang_compact.srt.backend"}


def product_modules() -> dict[str, Path]:
    mods = {}
    for pkg, d in PACKAGE_DIRS.items():
        for f in d.rglob("*.py"):
            rel = f.relative_to(d).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts])
            if pkg == "sglang_compact" and parts[:1] == ["kernels"]:
                continue
            mods[name] = f
    return mods


def imports(path: Path, module_level_only: bool):
    """(imported module names) of a file; module level only, or anywhere."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
            out += [f"{node.module}.{a.name}" for a in node.names]
    return out


def test_no_import_cycles_among_product_modules():
    mods = product_modules()
    graph = {}
    for name, path in mods.items():
        deps = set()
        for imp in imports(path, module_level_only=True):
            parts = imp.split(".")
            # importing a.b.c imports the packages a.b and a too
            deps.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in mods)
        deps.discard(name)
        graph[name] = deps
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == "open" and not (n.startswith(m + ".") and m in graph):
                cycle = stack[stack.index(m):] + [m]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n)


def test_sglang_internals_are_imported_only_by_compat_and_the_backend():
    offenders = []
    for name, path in product_modules().items():
        if name in SGLANG_TOUCHPOINTS:
            continue
        for imp in imports(path, module_level_only=False):
            if imp == "sglang" or imp.startswith("sglang."):
                offenders.append(f"{name}: {imp}")
    assert not offenders, offenders


def test_the_backend_module_imports_only_the_interface_from_sglang():
    path = product_modules()["sglang_compact.srt.backend"]
    sg = [i for i in imports(path, module_level_only=False) if i.startswith("sglang.")]
    assert sg == ["sglang.srt.layers.attention.base_attn_backend",
                  "sglang.srt.layers.attention.base_attn_backend.AttentionBackend"]


def test_flashinfer_wrappers_are_planned_only_through_the_adapter():
    """FlashInfer's plan() must not be called again before the GPU copied the previous plan (H200, 2026-12-02:
    wrong outputs on fa2, an illegal memory access on fa3); `flashinfer_adapter.plan` waits for that copy, so
    every `.plan(...)` call in the package goes through it (or is one of the backend's planners)."""
    allowed = {"fi", "self.extend", "self.decode"}
    offenders = []
    for name, path in product_modules().items():
        if name == "sglang_compact.executors.flashinfer_adapter":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "plan":
                receiver = ast.unparse(node.func.value)
                if receiver not in allowed:
                    offenders.append(f"{name}:{node.lineno}: {receiver}.plan(...)")
    assert not offenders, offenders


def test_a_toy_selector_from_one_outside_module_runs_the_pipeline():
    import torch

    from sglang_compact.compact import CompactAttention
    from sglang_compact.config import CompactConfig
    from sglang_compact.executors import ForwardShape, TorchExecutor, reference_attention
    from sglang_compact.selectors.registry import selector_names
    from test_pipeline import make_batch

    cfg = CompactConfig(block_size=16, selector="toy_every_other", selector_modules=("toy_selector",),
                        selector_params={"offset": 1}, sink_blocks=0, recent_blocks=0)
    assert "toy_every_other" in selector_names()
    b = make_batch(0)
    ca = CompactAttention(cfg)
    sel = ca.select_pages(b)
    ex = TorchExecutor()
    ex.plan_forward(ForwardShape.of(b, ca.row_pages(b)), b.page_table)
    torch.testing.assert_close(ex.run(b, sel.indices), reference_attention(b, sel.table))
    # its rule: odd pages (offset 1) of the candidates (those before the window), plus the window's own pages
    qb = b.qblocks
    for w, (first, last, s) in enumerate(zip(qb.w_first, qb.w_last, qb.w_sparse)):
        if s:
            want = [j for j in range(first) if j % 2 == 1] + list(range(first, last + 1))
            assert sel.table[0, w].nonzero().flatten().tolist() == want
