"""The cost gate: which q-blocks read a selection, and where the break-even comes from."""

import json

import pytest

from sglang_compact.config import CompactConfig
from sglang_compact.gate import FALLBACK_MIN_CONTEXT, NEVER, CostModel, Gate, GateDecision, ModelShape, \
    cost_model_json, load_cost_models

SHAPE_8B = ModelShape(32, 8, 128, 64)
SHAPE_05B = ModelShape(14, 2, 64, 32)


def model(**kw):
    base = dict(gpu="test", dense_flops={"fa2": 350e12, "fa3": 500e12}, rows_flops={"fa2": 330e12, "fa3": 480e12},
                search_flops=100e12, sparse_gpu_s=20e-6, sparse_host_s=250e-6, dense_host_s=80e-6, margin=0.1)
    base.update(kw)
    return CostModel(**base)


def test_break_even_grows_as_heads_shrink_and_never_below_it():
    m = model()
    big = m.break_even(SHAPE_8B, 1024, 0.3, "fa3", 131072)
    small = m.break_even(SHAPE_05B, 1024, 0.3, "fa3", 131072)
    assert big is not None and small is not None and small > big
    for L in (big, big * 2, 131072 - 64):
        dense, sparse = m.layer_times(SHAPE_8B, L, 1024, 0.3, "fa3")
        assert sparse <= 0.9 * dense
    dense, sparse = m.layer_times(SHAPE_8B, big - 64, 1024, 0.3, "fa3")
    assert sparse > 0.9 * dense


def test_break_even_none_when_the_overhead_never_pays():
    assert model(sparse_host_s=1.0).break_even(SHAPE_8B, 1024, 0.3, "fa3", 131072) is None
    assert model().break_even(SHAPE_8B, 1024, 1.0, "fa3", 131072) is None  # nothing saved at density 1


def test_the_gate_prices_the_rows_on_their_own_kernel():
    """`flashprefill`'s rows run on fa2 while the dense pass runs fa3: the gate opens later (or never) than
    if the rows ran on fa3, and its log line names both kernels."""
    m = model(rows_flops={"fa2": 200e12, "fa3": 480e12})
    assert m.break_even(SHAPE_8B, 8192, 0.35, "fa3", 131072) is not None
    assert m.break_even(SHAPE_8B, 8192, 0.35, "fa3", 131072, rows_kernel="fa2") is None
    assert m.break_even(SHAPE_8B, 8192, 0.3, "fa3", 131072, rows_kernel="fa2") is not None
    L = 65536
    assert m.layer_times(SHAPE_8B, L, 1024, 0.3, "fa3", rows_kernel="fa2")[1] > m.layer_times(SHAPE_8B, L, 1024, 0.3,
                                                                                            "fa3")[1]
    assert m.layer_times(SHAPE_8B, L, 1024, 0.3, "fa3", rows_kernel="fa2")[0] == m.layer_times(SHAPE_8B, L, 1024, 0.3,
                                                                                             "fa3")[0]
    # rows at density 0.5 on a kernel at 200 TF/s against dense at 500: never 10% faster
    assert m.break_even(SHAPE_8B, 1024, 0.5, "fa3", 131072, rows_kernel="fa2") is None
    from unittest import mock

    cfg = CompactConfig(block_size=64, selector="flashprefill")
    with mock.patch("sglang_compact.gate.cost_model_for", return_value=m):
        fa2_rows = Gate.for_server(cfg, SHAPE_8B, 1024, "test", "fa3", 131072, rows_kernel="fa2").decision
        fa3_rows = Gate.for_server(cfg, SHAPE_8B, 1024, "test", "fa3", 131072, rows_kernel="fa3").decision
    assert fa2_rows.never and "fa3 dense vs fa2 rows" in fa2_rows.detail   # flashprefill expects density 0.5
    assert not fa3_rows.never and "fa3 dense vs fa3 rows" in fa3_rows.detail


def test_gate_sources():
    shape, cfg = SHAPE_8B, CompactConfig(block_size=64)
    assert Gate.for_server(cfg.replace(min_context=5000), shape, 1024, "any", "fa3", 131072).decision == \
        GateDecision(5000, "flag", "--compact-min-context 5000")
    assert Gate.for_server(cfg.replace(selector="dense"), shape, 1024, "any", "fa3", 131072).decision.never
    fb = Gate.for_server(cfg, shape, 1024, "no such gpu", "fa3", 131072).decision
    assert fb.source == "fallback" and fb.min_context == FALLBACK_MIN_CONTEXT


def test_sparse_ranges_and_uses_compact_path():
    """Windows of 1024 tokens (the default): window k is sparse when k * 1024 >= min_context and it holds
    none of the last dense_tail prompt tokens."""
    gate = Gate(CompactConfig(block_size=64, dense_tail=1000), GateDecision(4096, "flag", ""))
    assert gate.window == 1024
    assert gate.sparse_range(None) == (4, NEVER)
    assert gate.sparse_range(20000) == (4, (20000 - 1000) // 1024)      # (4, 18)
    assert gate.sparse_range(5000) == (4, 4)                           # all of it in the tail or below the gate
    assert not gate.uses_compact_path(0, 4096)                         # context below the gate
    assert gate.uses_compact_path(4000, 200, 20000)                    # reaches window 4
    assert not gate.uses_compact_path(18432, 1024, 20000)              # window 18 holds tail tokens
    assert gate.uses_compact_path(4096, 1, None)
    never = Gate(CompactConfig(block_size=64), GateDecision(NEVER, "selector dense", ""))
    assert never.sparse_range(10 ** 6) == (0, 0) and not never.uses_compact_path(10 ** 5, 1024)


def test_the_decision_depends_on_positions_only():
    """Window k is sparse iff lo <= k < hi: the same for any chunking of the prompt."""
    gate = Gate(CompactConfig(block_size=16, dense_tail=100), GateDecision(300, "flag", ""), window_tokens=64)
    lo, hi = gate.sparse_range(1000)
    assert (lo, hi) == (5, 14)   # 5 * 64 >= 300; 14 * 64 <= 900 < 15 * 64
    per_window = [lo <= k < hi for k in range(1000 // 64 + 1)]
    assert per_window[lo] and not per_window[lo - 1] and not per_window[hi] and per_window[hi - 1]
    # chunks cut anywhere see the same windows as sparse
    for start, n in ((0, 1000), (256, 128), (320, 64), (640, 360)):
        first, last = start // 64, (start + n - 1) // 64
        assert gate.uses_compact_path(start, n, 1000) == any(per_window[first:last + 1])


def test_shipped_cost_models_load_and_round_trip():
    models = load_cost_models()
    text = cost_model_json(models)
    assert json.loads(text)["gpus"].keys() == models.keys()
    for m in models.values():
        assert m.dense_flops and m.rows_flops and m.search_flops > 0


@pytest.mark.parametrize("name", sorted(load_cost_models()))
def test_shipped_model_gates_the_small_model_off_at_short_contexts(name):
    m = load_cost_models()[name]
    be = m.break_even(SHAPE_05B, 1024, 0.5, "fa3", 32768)
    assert be is None or be >= 8192


def test_the_dense_tail_starts_after_the_last_sparse_window():
    """Where a prompt's dense tail starts (sglang_compact/srt/alignment.py): before it its KV is what any prompt
    sparse over the same windows computes cold; from it on every page was read (the dense tail, the output)."""
    from sglang_compact.srt.alignment import dense_tail_start

    gate = Gate(CompactConfig(block_size=64, dense_tail=1000), GateDecision(4096, "flag", ""))
    assert dense_tail_start(gate, 20000) == 18 * 1024      # windows 4..17 sparse
    assert dense_tail_start(gate, 5000) == 4 * 1024        # none sparse: at the gate (dense below it too)
    assert dense_tail_start(gate, 1000) == 4 * 1024        # shorter than that: past its end
    assert dense_tail_start(None, 20000) is None           # no compact backend in this process
    never = Gate(CompactConfig(block_size=64), GateDecision(NEVER, "selector dense", ""))
    assert dense_tail_start(never, 20000) is None          # never sparse: every page read, everything serves


def test_cached_kv_serves_a_prompt_that_computes_it_the_same_way():
    """`first_inexact`: along the tree nodes a hit matched, the first position a prompt would compute otherwise
    cold. Windows of 1024 tokens, sparse from window 4, dense tail 1000 tokens: a 20000-token prompt's dense tail
    starts at 18 * 1024 (its windows 4..17 sparse)."""
    from sglang_compact.srt.alignment import first_inexact

    gate = Gate(CompactConfig(block_size=64, dense_tail=1000), GateDecision(4096, "flag", ""))
    W = 1024
    # cached by the same prompt (dense from 18 W): all of it serves a repeat, both the sparse and the dense part
    assert first_inexact(gate, [(0, 19900, 18 * W)], 20000) == 19900
    # ... and a prompt whose dense tail starts at the same window (a short continuation: 20400 tokens)
    assert first_inexact(gate, [(0, 19900, 18 * W)], 20400) == 19900
    # a longer prompt (its tail from 20 W) computes windows 18, 19 sparse: the cached dense copies stop at 18 W
    assert first_inexact(gate, [(0, 19900, 18 * W)], 22000) == 18 * W
    # a shorter prompt (its tail from 17 W) reads every page of window 17, which was cached sparse
    assert first_inexact(gate, [(0, 19900, 18 * W)], 19000) == 17 * W
    # below the gate every window reads every page: a cached dense tail there serves every prompt
    assert first_inexact(gate, [(0, 3000, 2 * W), (3000, 4096, 2 * W)], 20000) == 4096
    # nodes from two prompts: sparse to 10 W by one, then dense from 12 W by another
    spans = [(0, 10 * W, 18 * W), (10 * W, 13 * W, 12 * W)]
    assert first_inexact(gate, spans, 20000) == 12 * W        # sparse here: the dense copy of window 12 does not serve
    assert first_inexact(gate, spans, 13 * W + 500) == 13 * W    # its tail from 12 W: all of it
    # a node without a record was computed sparse as far as it goes (what a cache of only exact prefixes holds)
    assert first_inexact(gate, [(0, 19900, None)], 20000) == 18 * W
    # never sparse, or `reuse`: everything serves
    never = Gate(CompactConfig(block_size=64), GateDecision(NEVER, "selector dense", ""))
    assert first_inexact(never, [(0, 19900, 4 * W)], 30000) == 19900
    reuse = Gate(CompactConfig(block_size=64, prefix_cache="reuse"), GateDecision(4096, "flag", ""))
    assert first_inexact(reuse, [(0, 19900, 4 * W)], 30000) == 19900


def test_a_hit_is_cut_to_a_window_start_an_insert_only_inside_a_sparse_window():
    """A cache hit ending inside a window before the dense tail is cut back to the window start, even below the
    gate (chunks are whole windows from where it ends); an insert is cut only inside a sparse window, so a request
    on top of a cached prefix that ends mid-window below the gate still enters the cache. Windows of 1024 tokens,
    sparse from window 4, dense tail 1000 tokens: a 20000-token prompt reads every page from 18 * 1024."""
    from sglang_compact.srt.alignment import insert_limit, window_start_before_tail

    gate = Gate(CompactConfig(block_size=64, dense_tail=1000), GateDecision(4096, "flag", ""))
    W = 1024
    assert window_start_before_tail(gate, 3000, 20000) == 2 * W         # below the gate: a hit still is cut
    assert window_start_before_tail(gate, 6000, 20000) == 5 * W         # inside a sparse window
    assert window_start_before_tail(gate, 19000, 20000) == 19000        # in the dense tail: served as is
    assert window_start_before_tail(gate, 3000, 4000) == 3000           # no sparse window: served as is
    assert insert_limit(gate, [], 20000) is None                        # nothing cached: all of it enters
    assert insert_limit(gate, [(0, 3000, 20000)], 20000) is None        # cached to mid-window below the gate
    assert insert_limit(gate, [(0, 6144, 20000)], 20000) is None        # whole sparse windows, computed alike
    assert insert_limit(gate, [(0, 6000, 20000)], 20000) == 5 * W       # part of a sparse window: left out
    # another prompt's dense tail from 5 W where this one is sparse: only up to there
    assert insert_limit(gate, [(0, 6000, 5 * W)], 20000) == 5 * W


def test_break_even_density_where_the_rows_stop_paying():
    """Per window, rows reading density d of the pages (plus the search) against the dense kernel on all of them:
    both scale with the context, so one density; slower rows kernels and finer searches lower it."""
    m = model()
    d = m.break_even_density(SHAPE_8B, "fa3", "fa2")
    # rows at d cost (1 - margin) x dense: d * rows_cost + search = 0.9 * dense_cost, per unit of context
    assert d == pytest.approx(0.9 * 330 / 500 - 330 / (64 * 100))
    assert m.break_even_density(SHAPE_8B, "fa3", "fa3") > d                       # faster rows pay longer
    assert m.break_even_density(SHAPE_8B, "fa2", "fa2") > d                       # against a slower dense kernel
    assert m.break_even_density(SHAPE_8B, "fa3", "fa2", query_stride=4) > d       # a cheaper search
    assert m.break_even_density(SHAPE_05B, "fa3", "fa2") < d                      # smaller pages: dearer search
    assert model(search_flops=1e9).break_even_density(SHAPE_8B, "fa3", "fa2") == 0.0   # never pays
    for name, shipped in load_cost_models().items():
        assert 0.0 < shipped.break_even_density(SHAPE_8B, "fa3", "fa2") < 1.0, name


def test_dense_above_sources_and_the_windows_it_turns_dense():
    cfg = CompactConfig(block_size=64, selector="flashprefill")
    shipped = sorted(load_cost_models())[0]
    auto = Gate.for_server(cfg, SHAPE_8B, 1024, shipped, "fa3", 131072, rows_kernel="fa2")
    want = load_cost_models()[shipped].break_even_density(SHAPE_8B, "fa3", "fa2")
    assert auto.dense_above == pytest.approx(want) and auto.observes_density and "fa2 rows" in auto.describe()
    # the flag wins, whatever gates the context; no cost model and no flag: never
    flag = Gate.for_server(cfg.replace(dense_above=0.6, min_context=5000), SHAPE_8B, 1024, shipped, "fa3", 131072)
    assert flag.dense_above == 0.6 and flag.dense_above_source == "flag"
    none = Gate.for_server(cfg, SHAPE_8B, 1024, "no such gpu", "fa3", 131072)
    assert none.dense_above == 1.0 and not none.observes_density
    assert not Gate.for_server(cfg.replace(dense_above=1.0), SHAPE_8B, 1024, shipped, "fa3", 131072).observes_density
    with pytest.raises(ValueError, match="dense_above"):
        cfg.replace(dense_above=1.5)
    # only sparse windows turn dense, those reading more than dense_above (mean over the kv heads)
    from sglang_compact.batch import QBlocks

    qb = QBlocks.build([4096, 0], [2048, 1024], 64, 16, [(2, 100), (0, 0)])   # windows: 4, 5 sparse; 0 dense
    assert qb.w_sparse == (True, True, False)
    counts = [40, 90, 16, 30, 97, 16]            # rows g * 3 + w, 2 kv heads; windows read 0..79 / 0..95 / 0..15
    dens = qb.window_density(counts, 2)
    assert dens == pytest.approx([35 / 80, 93.5 / 96, 1.0])
    assert flag.dense_windows(qb, dens) == [1]
    assert qb.with_dense([1]).w_sparse == (True, False, False) and qb.with_dense([]) is qb


def test_a_sparse_pass_is_priced_whole():
    """Layers that read every page save nothing: a first layer on the dense kernel (passes that observe their
    density) opens the gate later, and read-all layers (`dense_layers`) lower the density that still pays."""
    from sglang_compact.gate import SparsePassLayers

    m = model()
    one = m.break_even(SHAPE_8B, 1024, 0.3, "fa3", 131072)
    assert m.break_even(SHAPE_8B, 1024, 0.3, "fa3", 131072, layers=SparsePassLayers(32)) == one
    observing = m.break_even(SHAPE_8B, 1024, 0.3, "fa3", 131072, layers=SparsePassLayers(4, dense_first=1))
    assert observing > one    # 4 layers: the first's share is large enough to move the break-even by pages
    dense, sparse = m.pass_times(SHAPE_8B, observing, 1024, 0.3, "fa3", SparsePassLayers(4, 1))
    d1, s1 = m.layer_times(SHAPE_8B, observing, 1024, 0.3, "fa3")
    assert dense == pytest.approx(4 * d1) and sparse == pytest.approx(d1 + 3 * s1) and sparse <= 0.9 * dense
    dense, sparse = m.pass_times(SHAPE_8B, observing - 64, 1024, 0.3, "fa3", SparsePassLayers(4, 1))
    assert sparse > 0.9 * dense
    # a read-all layer is the rows over every page, without the search
    _, s2 = m.pass_times(SHAPE_8B, 65536, 1024, 0.3, "fa3", SparsePassLayers(4, 0, 1), rows_kernel="fa2")
    rows_all = 4.0 * 1024 * (65536 + 512) * 32 * 128 / 330e12 + 20e-6
    assert s2 == pytest.approx(3 * m.layer_times(SHAPE_8B, 65536, 1024, 0.3, "fa3", rows_kernel="fa2")[1] + rows_all)
    assert m.break_even(SHAPE_8B, 1024, 0.3, "fa3", 131072, layers=SparsePassLayers(2, 1, 1)) is None  # none select

    # the density decided at the observing layer prices the layers after it: per unit of work, with r the rows'
    # and D the dense kernel's throughput, s the search, 3 read-all of 31 layers left:
    # 28 (d + s) + 3 < 0.9 * 31 * r / D
    d = m.break_even_density(SHAPE_8B, "fa3", "fa2", layers=SparsePassLayers(32, 1, 3))
    s = 330 / (64 * 100)
    assert d == pytest.approx((0.9 * 31 * 330 / 500 - 3) / 28 - s)
    assert d < m.break_even_density(SHAPE_8B, "fa3", "fa2")
    assert m.break_even_density(SHAPE_8B, "fa3", "fa2", layers=SparsePassLayers(32, 1)) == \
        pytest.approx(m.break_even_density(SHAPE_8B, "fa3", "fa2"))     # the first layer is spent at the decision
    with pytest.raises(ValueError, match="do not fit"):
        SparsePassLayers(4, 1, 4)


def test_the_server_gate_prices_its_own_passes():
    """`Gate.for_server(num_layers=...)`: a selector that observes at the second layer pays its first layer
    dense; one whose rows are fixed from the lengths (`budget`) selects in every layer; dense layers count."""
    from unittest import mock

    from sglang_compact.gate import SparsePassLayers

    m = model()
    fix = CompactConfig(block_size=64, selector="flashprefill", selector_params={"fix_rows": True})
    budget = CompactConfig(block_size=64, selector="budget")
    assert SparsePassLayers.of(fix, 32, observes=True) == SparsePassLayers(32, 1, 0)
    assert SparsePassLayers.of(fix.replace(dense_layers=(5, 6, 40)), 32, observes=True) == SparsePassLayers(32, 1, 2)
    with mock.patch("sglang_compact.gate.cost_model_for", return_value=m):
        per_layer = Gate.for_server(fix, SHAPE_8B, 1024, "test", "fa3", 131072, "fa3").decision
        whole = Gate.for_server(fix, SHAPE_8B, 1024, "test", "fa3", 131072, "fa3", num_layers=4).decision
        b1 = Gate.for_server(budget, SHAPE_8B, 1024, "test", "fa3", 131072, "fa3").decision
        b32 = Gate.for_server(budget, SHAPE_8B, 1024, "test", "fa3", 131072, "fa3", num_layers=32).decision
        plain = Gate.for_server(fix.replace(selector_params={}), SHAPE_8B, 1024, "test", "fa3", 131072, "fa2",
                                num_layers=32)
        dl = Gate.for_server(fix.replace(selector_params={}, dense_layers=(20, 21, 22)), SHAPE_8B, 1024, "test",
                             "fa3", 131072, "fa2", num_layers=32)
    assert whole.min_context > per_layer.min_context
    assert "passes of 4 layers (1 dense first, 0 read-all)" in whole.detail
    assert b32.min_context == b1.min_context and "(0 dense first, 0 read-all)" in b32.detail
    assert dl.dense_above < plain.dense_above


def test_the_gate_prices_per_layer_budgets_at_their_mean():
    """`layer_density` reads more (or fewer) pages in the layers it names: the gate's expected density is the
    mean over the model's layers, so more pages in some layers move the break-even context up."""
    from unittest import mock

    cfg = CompactConfig(block_size=64, selector="budget", selector_params={"density": 0.3})
    more = cfg.replace(selector_params={"density": 0.3, "layer_density": "0-15:0.9"})
    with mock.patch("sglang_compact.gate.cost_model_for", return_value=model()):
        flat = Gate.for_server(cfg, SHAPE_8B, 1024, "test", "fa3", 131072, "fa2", num_layers=32).decision
        half = Gate.for_server(more, SHAPE_8B, 1024, "test", "fa3", 131072, "fa2", num_layers=32).decision
    assert "expected density 0.30" in flat.detail and "expected density 0.60" in half.detail
    assert half.never or half.min_context > flat.min_context


def test_the_gate_prices_a_page_floor():
    """A fixed budget's `min_pages` makes a row read at least that many pages: the rows cost what they read, so the
    floor moves the break-even context up (a floor at least the whole context saves nothing), as the server
    gate states."""
    from unittest import mock

    m = model()
    L = 8192
    flat = m.layer_times(SHAPE_8B, L, 1024, 0.25, "fa3")[1]
    assert m.layer_times(SHAPE_8B, L, 1024, 0.25, "fa3", min_pages=4)[1] == flat          # below the fraction
    assert m.layer_times(SHAPE_8B, L, 1024, 0.25, "fa3", min_pages=128)[1] > flat
    assert m.layer_times(SHAPE_8B, L, 1024, 0.25, "fa3", min_pages=10 ** 6, search=False)[1] == \
        m.layer_times(SHAPE_8B, L, 1024, 1.0, "fa3", search=False)[1]                      # capped at the context
    no_floor = m.break_even(SHAPE_8B, 1024, 0.25, "fa3", 131072)
    floor = m.break_even(SHAPE_8B, 1024, 0.25, "fa3", 131072, min_pages=256)
    assert no_floor is not None and floor is not None and floor > no_floor
    cfg = CompactConfig(block_size=64, selector="budget", selector_params={"density": 0.25})
    with mock.patch("sglang_compact.gate.cost_model_for", return_value=m):
        a = Gate.for_server(cfg, SHAPE_8B, 1024, "test", "fa3", 131072, "fa3", num_layers=32).decision
        b = Gate.for_server(cfg.replace(selector_params={"density": 0.25, "min_pages": 256}), SHAPE_8B, 1024,
                            "test", "fa3", 131072, "fa3", num_layers=32).decision
    assert b.min_context > a.min_context and "at least 256 pages" in b.detail and "at least" not in a.detail


@pytest.mark.parametrize("selector", ["mass_budget", "xattention", "oracle"])
def test_a_search_the_cost_model_does_not_price_gets_the_fallback_context(selector):
    """The shipped model prices the FlashPrefill search (mean keys, key bounds) only: a selector that reads the keys
    themselves is not predicted to pay anywhere; it opens at the fixed fallback context (or the flag) and has
    no observed-density fallback."""
    shipped = sorted(load_cost_models())[0]
    cfg = CompactConfig(block_size=64, selector=selector)
    g = Gate.for_server(cfg, SHAPE_8B, 1024, shipped, "fa3", 131072)
    assert g.decision.min_context == FALLBACK_MIN_CONTEXT and g.decision.source == "fallback"
    assert "does not price" in g.decision.detail and selector in g.decision.detail
    assert g.dense_above == 1.0 and not g.observes_density
    flagged = Gate.for_server(cfg.replace(min_context=20000), SHAPE_8B, 1024, shipped, "fa3", 131072)
    assert flagged.decision.min_context == 20000 and flagged.decision.source == "flag"
    # the priced selectors keep the cost model
    assert Gate.for_server(cfg.replace(selector="budget"), SHAPE_8B, 1024, shipped, "fa3", 131072) \
        .decision.source == "cost model"


def test_the_key_bound_search_is_priced_at_its_own_throughput():
    """`quest_budget` reads each page's key max / min (two dot products per page tile): the gate prices its
    search with `bounds_search_flops`, so it opens later than `budget` at the same density and fallback-reads
    at a lower density; a model without that throughput gives it the fallback context, and says why."""
    from unittest import mock

    m = model(search_flops=40e12, bounds_search_flops=18e12)
    assert m.search_model(False) is m and m.search_model(True).search_flops == 18e12
    assert model().search_model(True) is None
    L = 65536
    assert m.search_model(True).layer_times(SHAPE_8B, L, 1024, 0.3, "fa3")[1] > m.layer_times(SHAPE_8B, L, 1024,
                                                                                              0.3, "fa3")[1]
    budget = CompactConfig(block_size=64, selector="budget", selector_params={"density": 0.3})
    quest = budget.replace(selector="quest_budget", selector_params={"query_stride": 1})   # budget's stride
    with mock.patch("sglang_compact.gate.cost_model_for", return_value=m):
        b = Gate.for_server(budget, SHAPE_8B, 1024, "test", "fa3", 131072, "fa3", num_layers=32)
        q = Gate.for_server(quest, SHAPE_8B, 1024, "test", "fa3", 131072, "fa3", num_layers=32)
    assert b.decision.source == q.decision.source == "cost model"
    assert not q.decision.never and q.decision.min_context > b.decision.min_context
    assert q.dense_above < b.dense_above
    with mock.patch("sglang_compact.gate.cost_model_for", return_value=m):   # the default stride: 16 of 64 queries
        strided = Gate.for_server(quest.replace(selector_params={}), SHAPE_8B, 1024, "test", "fa3", 131072, "fa3",
                                  num_layers=32)
    assert strided.decision.min_context < q.decision.min_context
    with mock.patch("sglang_compact.gate.cost_model_for", return_value=model()):
        unpriced = Gate.for_server(quest, SHAPE_8B, 1024, "test", "fa3", 131072, "fa3", num_layers=32)
    assert unpriced.decision.min_context == FALLBACK_MIN_CONTEXT and unpriced.decision.source == "fallback"
    assert "key-bound search" in unpriced.decision.detail and not unpriced.observes_density
    shipped = load_cost_models()["NVIDIA H200"]
    assert 0 < shipped.bounds_search_flops < shipped.search_flops


@pytest.mark.parametrize("shape", [SHAPE_8B, SHAPE_05B])
def test_the_cost_gate_starts_at_a_whole_chunk(shape):
    """The model prices a pass by its cached prefix; the gate starts the sparse windows at the first whole chunk
    from the break-even, so a prompt's first chunk (no cached prefix) is one dense pass and every sparse window
    belongs to a pass the model priced. At chunk 1024 (one window per chunk) nothing moves."""
    cfg = CompactConfig(block_size=shape.page_size)            # the default selector, its page floor
    m = load_cost_models()["NVIDIA H200"]                      # the shipped model the H200 servers use
    be = m.search_model(True).break_even(shape, 8192, cfg.spec.expected_density(cfg.params, 24), "fa3", 131072, 1,
                                         cfg.sink_blocks + cfg.recent_blocks + 1024 // shape.page_size, "fa3",
                                         None, cfg.params.floor_pages(shape.page_size))
    big = Gate.for_server(cfg, shape, 8192, "NVIDIA H200", "fa3", 131072, "fa3", num_layers=24)
    small = Gate.for_server(cfg, shape, 1024, "NVIDIA H200", "fa3", 131072, "fa3", num_layers=24)
    assert be is not None and 0 < be < 8192          # the model's break-even lies inside the first chunk ...
    assert big.decision.min_context == 8192 and "sparse from 8192 (whole chunks)" in big.decision.detail
    assert not big.uses_compact_path(0, 8192, 32768)                 # ... which stays one dense pass
    assert big.uses_compact_path(8192, 8192, 32768)
    assert big.sparse_range(32768)[0] * big.window == 8192
    assert "whole chunks" not in small.decision.detail                  # one window per chunk: as the model says


def test_a_gpu_without_its_own_cost_model_borrows_one_of_the_same_architecture():
    """An H100 SXM (compute capability 9.0, 132 SMs, the GH100 die of the H200) has no calibration of its own: it
    gets the H200's model, named as borrowed in the gate's reason, instead of the fixed 4096-token fallback that
    made small models slower than stock there."""
    from sglang_compact.gate import cost_model_for

    h200 = cost_model_for("NVIDIA H200")
    assert h200 is not None and (h200.capability, h200.multiprocessors) == ("9.0", 132)
    h100 = cost_model_for("NVIDIA H100 80GB HBM3", "9.0", 132)
    assert h100.dense_flops == h200.dense_flops and h100.sparse_host_s == h200.sparse_host_s
    assert h100.gpu == "NVIDIA H200, applied to NVIDIA H100 80GB HBM3" and "not calibrated on" in h100.source
    assert "the same compute capability 9.0 and 132 SMs" in h100.source
    assert cost_model_for("NVIDIA H100 80GB HBM3") is None                 # nothing known of the device
    assert cost_model_for(None, "9.0", 132) is None                        # the CPU path
    cfg = CompactConfig(block_size=32)

    def gate(name, **device):
        return Gate.for_server(cfg, SHAPE_05B, 1024, name, "fa3", 131072, "fa3", num_layers=24, **device)
    borrowed = gate("NVIDIA H100 80GB HBM3", capability="9.0", multiprocessors=132)
    assert borrowed.decision.source == "cost model" and "applied to NVIDIA H100 80GB HBM3" in borrowed.decision.detail
    assert borrowed.decision.min_context == gate("NVIDIA H200").decision.min_context > FALLBACK_MIN_CONTEXT
    assert borrowed.dense_above == gate("NVIDIA H200").dense_above
    assert gate("NVIDIA H100 80GB HBM3").decision.source == "fallback"


def test_an_older_or_smaller_gpu_borrows_the_nearest_model_and_opens_no_earlier(caplog):
    """A GPU of another architecture or SM count gets the nearest calibrated model, not the fixed 4096-token
    gate (which sent a 0.5B model's 4K-62K prompts down the sparse path, 2.7x slower than stock on the H200).
    On an older or smaller GPU attention is slower than on the H200, so the sparse path pays from a shorter
    context there than the H200's model predicts: the borrowed gate can only open late (less speed-up), never
    early (a loss), and the server says nothing. A newer GPU gets the model too, with a warning that it may
    open early."""
    import logging

    from sglang_compact.gate import UNPRICED_FASTER_GPU, cost_model_for

    h200 = cost_model_for("NVIDIA H200")
    for name, cc, sms in (("NVIDIA A100-SXM4-80GB", "8.0", 108), ("NVIDIA L40S", "8.9", 142),
                          ("NVIDIA H100 PCIe", "9.0", 114), ("NVIDIA H20", "9.0", 78)):
        m = cost_model_for(name, cc, sms)
        assert m is not None and m.dense_flops == h200.dense_flops, name
        assert m.gpu == f"NVIDIA H200, applied to {name}" and "attention is slower here" in m.source, name
    newer = cost_model_for("NVIDIA B200", "10.0", 148)
    assert newer.gpu == "NVIDIA H200, applied to NVIDIA B200" and newer.source.endswith(UNPRICED_FASTER_GPU)
    assert cost_model_for("NVIDIA X", "nine", 132) is None and cost_model_for("NVIDIA X", "9.0", 0) is None

    cfg = CompactConfig(block_size=32)

    def gate(name, cc, sms, kernel="fa2", chunk=1024):
        return Gate.for_server(cfg, SHAPE_05B, chunk, name, kernel, 131072, kernel, num_layers=24,
                               capability=cc, multiprocessors=sms)
    with caplog.at_level(logging.WARNING, logger="sglang_compact.gate"):
        a100 = gate("NVIDIA A100-SXM4-80GB", "8.0", 108)
        assert not caplog.records
        # the H200's model priced on the kernels an A100 runs (fa2 dense and rows): a 0.5B model's chunk-1024
        # passes stay dense far past the old fixed gate, and the observed-density fallback is on
        assert a100.decision.source == "cost model" and a100.decision.min_context > 4 * FALLBACK_MIN_CONTEXT
        assert a100.decision.min_context == gate("NVIDIA H200", "9.0", 132).decision.min_context
        assert a100.observes_density and "fa2 dense vs fa2 rows" in a100.decision.detail
        gate("NVIDIA B200", "10.0", 148)
        assert [r.getMessage() for r in caplog.records] == [
            f"sglang_compact: the cost gate prices NVIDIA B200 with {newer.source}"]
        caplog.clear()
        Gate.for_server(cfg.replace(min_context=5000), SHAPE_05B, 1024, "NVIDIA B200", "fa2", 131072, "fa2",
                        capability="10.0", multiprocessors=148)
        assert not caplog.records                                         # the flag decides: nothing to warn of
