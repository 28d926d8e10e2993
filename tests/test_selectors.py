"""Selectors: shapes, candidates, and each one's defining rule checked against a direct computation.
(flashprefill's rule and budget's counts: tests/test_pipeline.py.)"""

import pytest
import torch

from harness.synthetic import batch_summaries, random_batch
from sglang_compact.config import CompactConfig
from sglang_compact.indices import top_pages_indices
from sglang_compact.selectors import make_selector, selector_names
from sglang_compact.selectors.oracle import page_attention_mass
from sglang_compact.selectors.xattention import antidiagonal_page_mass
from sglang_compact.summaries import LayerSummaries

P = 16
BUILT_IN = {"flashprefill", "xattention", "oracle", "dense", "budget", "seer", "mass_budget"}


def batch(seed=0, structured=True, prefix=(100, 37, 260), chunk=(40, 17, 33), hq=6, hkv=2, d=16):
    return random_batch(list(prefix), list(chunk), num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=P,
                        seed=seed, structured=structured, window_pages=2)


def cfg(selector, **params):
    return CompactConfig(block_size=P, selector=selector, selector_params=params, sink_blocks=0, recent_blocks=0)


def select(b, name, layer=0, **params):
    return make_selector(cfg(name, **params)).select(b, layer, batch_summaries(b))


def rows(sel, b, config):
    """The rows' table of a selection that fixes them (`table`, or `ranked` rows kept to their counts)."""
    if sel.table is not None:
        return sel.table
    return top_pages_indices(sel.ranked, sel.counts, b, config.sink_blocks, config.recent_blocks, sel.per_qblock)[0]


def test_registry_has_every_built_in_selector():
    assert BUILT_IN <= set(selector_names())


@pytest.mark.parametrize("name", ["flashprefill", "xattention", "oracle", "dense", "budget", "mass_budget"])
def test_selections_are_shaped_and_stay_in_their_candidates(name):
    b = batch(1)
    qb = b.qblocks
    sel = select(b, name)
    if sel.mask is not None:   # per query head (or kv head) and q-block
        assert sel.mask.shape[0] in (6, 2) and sel.mask.shape[1:] == (qb.count, qb.max_pages)
        assert sel.mask.dtype == torch.bool
        assert not (sel.mask & ~b.candidates()[None]).any()
        # a q-block with candidates keeps at least one
        assert (sel.mask.any(-1) | ~b.candidates().any(-1)[None]).all()
    else:
        table = rows(sel, b, cfg(name))
        assert table.shape == (2, qb.windows, qb.max_pages)
        assert not (table & ~b.full_table()).any()
        assert torch.equal(sel.counts, table.sum(-1, dtype=torch.int32).reshape(-1))


def test_dense_selects_every_page():
    b = batch(2)
    assert torch.equal(select(b, "dense").table, b.full_table())


def test_summaries_kept_by_the_kv_store_equal_summaries_of_the_pool():
    b = batch(3)
    from_pool = LayerSummaries.from_pool(b.k_pool, b.page_table, b.context_lens_cpu())
    s = make_selector(cfg("flashprefill"))
    assert torch.equal(s.select(b, 0, from_pool).mask, s.select(b, 0, batch_summaries(b)).mask)
    s = make_selector(cfg("budget"))
    assert torch.equal(s.select(b, 0, from_pool).ranked, s.select(b, 0, batch_summaries(b)).ranked)


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_oracle_is_the_smallest_set_reaching_top_p(top_p):
    b = batch(6)
    sel = select(b, "oracle", top_p=top_p)
    mass, mask = sel.scores, sel.mask
    rows = b.candidates().any(-1)[None].expand(mass.shape[:2])
    total, kept = mass.sum(-1), (mass * mask).sum(-1)
    assert (kept[rows] >= top_p * total[rows] - 1e-6).all()
    # dropping the least-massive kept page falls below top_p (minimality)
    smallest = mass.masked_fill(~mask, float("inf")).amin(-1)
    assert ((kept - smallest)[rows] < top_p * total[rows] + 1e-6).all()
    # each q-block's mass sums to 1 over its candidates
    torch.testing.assert_close(total[rows], torch.ones_like(total[rows]), rtol=1e-4, atol=1e-4)


def test_oracle_mass_equals_a_direct_loop():
    b = batch(4)
    mass = page_attention_mass(b)
    qb, G = b.qblocks, b.group_size
    i = qb.count - 1
    r, a, st, n = qb.req[i], qb.cand[i], qb.start[i], qb.length[i]   # candidates: the pages before its window
    assert a > 0
    k = b.context_keys(r)[:, :a * P].float()
    for h in range(b.num_q_heads):
        p = torch.softmax(b.q[st:st + n, h].float() @ k[h // G].T * b.sm_scale, -1)   # [n, a*P]
        want = p.reshape(n, a, P).sum(-1).mean(0)
        torch.testing.assert_close(mass[h, i, :a], want, rtol=1e-5, atol=1e-6)


def test_xattention_stride_one_is_the_exact_page_mass():
    b = batch(7)
    torch.testing.assert_close(antidiagonal_page_mass(b, 1), page_attention_mass(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stride", [2, 4, 8, 16])
def test_xattention_estimates_are_normalised(stride):
    b = batch(8)
    mass = antidiagonal_page_mass(b, stride)
    rows = b.candidates().any(-1)[None].expand(mass.shape[:2])
    torch.testing.assert_close(mass.sum(-1)[rows], torch.ones(int(rows.sum())), rtol=1e-4, atol=1e-4)
    m = select(b, "xattention", stride=stride, threshold=0.9).mask
    assert m.any(-1)[rows].all()


def test_threshold_selectors_find_the_planted_heavy_pages():
    """On structured inputs the sink page and a few heavy pages hold most of the mass. Mean keys dilute the
    4 sink tokens (that is what forced sink pages are for), so recall is measured after page 0."""
    b = batch(9, prefix=(1024, 700), chunk=(64, 64), hq=4, hkv=2, d=32)
    oracle = select(b, "oracle", top_p=0.9).mask[..., 1:]
    chosen = select(b, "flashprefill", alpha=0.06).mask[..., 1:]      # per kv head and q-block
    oracle_rows = oracle.reshape(2, 2, *oracle.shape[1:]).any(1)      # per kv head
    recall = (oracle_rows & chosen).sum() / oracle_rows.sum()
    assert oracle_rows.sum() > 0 and recall > 0.9, float(recall)
    cand = b.candidates()[None, :, 1:].expand_as(chosen)
    assert chosen.sum() < 0.7 * cand.sum()  # and it is actually sparse


def seer_weights(tmp_path, b, layers=2, d_g=8, seed=0):
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    w = {}
    for layer in range(layers):
        w[f"layers.{layer}.q_gate.weight"] = torch.randn(b.num_q_heads, b.head_dim, d_g, generator=g)
        w[f"layers.{layer}.k_gate.weight"] = torch.randn(b.num_kv_heads, 3 * b.head_dim, d_g, generator=g)
    path = tmp_path / "gates.safetensors"
    save_file(w, str(path))
    return str(path)


def test_seer_with_random_gate_weights(tmp_path):
    b = batch(10)
    sel = make_selector(cfg("seer", gate_path=seer_weights(tmp_path, b), threshold=0.8))
    s0, s1 = sel.select(b, 0, None), sel.select(b, 1, None)
    cand = b.candidates()[None].expand_as(s0.mask)
    rows = cand.any(-1)
    assert not (s0.mask & ~cand).any() and s0.mask.any(-1)[rows].all()
    torch.testing.assert_close(s0.scores.sum(-1)[rows], torch.ones(int(rows.sum())), rtol=1e-4, atol=1e-4)
    assert not torch.equal(s0.scores, s1.scores)  # per-layer weights are used
    with pytest.raises(ValueError, match="missing"):
        sel.select(b, 5, None)


def test_seer_rejects_bad_weights(tmp_path):
    b = batch(11)
    other = batch(11, hq=4, hkv=2)
    sel = make_selector(cfg("seer", gate_path=seer_weights(tmp_path, other)))
    with pytest.raises(ValueError, match="shapes"):
        sel.select(b, 0, None)
    with pytest.raises(ValueError, match="not found"):
        make_selector(cfg("seer", gate_path=str(tmp_path / "none.safetensors")))


@pytest.mark.parametrize("seed,density", [(7, 0.33), (8, 0.5), (9, 0.2)])
def test_mass_budget_is_xattention_ranked_by_mass_under_the_density_cap(seed, density):
    """`mass_budget` is the configuration measured on Qwen at 32K (xattention at threshold 1, capped by
    `density_cap`), as one selector whose rows are fixed on the host: the same pages, and as many as
    `row_pages` promised."""
    from sglang_compact.compact import CompactAttention
    b = batch(seed)
    common = dict(block_size=P, sink_blocks=1, recent_blocks=1)
    ours = CompactAttention(CompactConfig(selector="mass_budget", selector_params={"density": density}, **common))
    measured = CompactAttention(CompactConfig(selector="xattention", selector_params={"threshold": 1.0},
                                              density_cap=density, **common))
    a = ours.select_pages(b, 0, batch_summaries(b))
    x = measured.select_pages(b, 0, batch_summaries(b))
    assert torch.equal(a.table, x.table) and torch.equal(a.counts, x.counts)
    assert a.counts.tolist() == ours.row_pages(b)
    assert a.table.sum() < b.full_table().sum() * b.num_kv_heads   # it did drop pages


def test_mass_budget_finds_a_needle_page_that_mean_keys_dilute():
    """One key per page aligned with every query (a needle sentence in a haystack page) whose other keys score
    below the haystack's: the antidiagonal estimate sums keys over `stride` tokens only and keeps the needle
    pages; a page's mean key dilutes the single token over the page and ranks them below the haystack."""
    torch.manual_seed(0)
    b = batch(10, structured=False, prefix=(256,), chunk=(32,), hq=2, hkv=1, d=16)
    pages = b.page_table[0].long()
    needle_pages = [2, 5, 9]
    direction = torch.nn.functional.normalize(torch.randn(16), dim=0)
    b.q[:] = direction * 8.0                               # every query asks the same thing
    k = b.k_pool                                           # [num_pages, H_kv, P, D]
    k[pages[:16]] = 0.35 * direction.to(k.dtype)           # haystack: mildly relevant everywhere
    for j in needle_pages:   # one strongly relevant token, the rest of the page below the haystack's mean
        k[pages[j], :, 5] = 6.0 * direction.to(k.dtype)
        k[pages[j], :, 8:] = -0.8 * direction.to(k.dtype)
    config = dict(block_size=P, sink_blocks=0, recent_blocks=0, selector_params={"density": 0.4})
    summaries = LayerSummaries.from_pool(b.k_pool, b.page_table, b.context_lens_cpu(), key_bounds=True)
    tables = {}
    for name in ("mass_budget", "quest_budget", "budget"):
        c = CompactConfig(selector=name, **config)
        tables[name] = rows(make_selector(c).select(b, 0, summaries), b, c)
    assert tables["mass_budget"][0, 0, needle_pages].all()
    assert tables["quest_budget"][0, 0, needle_pages].all()    # the channel bound sees the one matching token
    assert not tables["budget"][0, 0, needle_pages].any()


@pytest.mark.parametrize("query_stride", [1, 2])
def test_quest_bound_scores_equal_a_per_query_loop(query_stride):
    """`quest_budget`'s scores against a loop over queries and pages: u = sum_d max(q_d kmax_d, q_d kmin_d) (an
    upper bound of every q . k of the page), softmax over the q-block's candidate pages, max over its queries
    (every `query_stride`-th of the q-block); the bounds from the summaries the KV store keeps (written in chunks
    of 13 tokens) and from the pool alike; the selector's own scores (group max) are those."""
    from sglang_compact.selectors.base import page_scores
    from sglang_compact.summaries import PageSummaries, store_kv
    torch.manual_seed(1)
    b = batch(7, prefix=(200, 64, 330), chunk=(45, 20, 9), hq=4, hkv=2, d=16)
    kept = PageSummaries(1, b.k_pool.shape[0], b.num_kv_heads, b.head_dim, "cpu", key_bounds=True,
                         bounds_dtype=b.k_pool.dtype).layer(0)
    k_copy, v_copy = torch.zeros_like(b.k_pool), torch.zeros_like(b.k_pool)
    for r, E in enumerate(b.context_lens_cpu()):
        ps = b.page_size
        slots = (b.page_table[r, :-(-E // ps)].long()[:, None] * ps + torch.arange(ps)).reshape(-1)[:E]
        keys = b.context_keys(r).transpose(0, 1)                           # [E, H_kv, D]
        for a in range(0, E, 13):
            store_kv(k_copy, v_copy, slots[a:a + 13], keys[a:a + 13], keys[a:a + 13], kept)
    got = page_scores(b, kept, key_bounds=True, query_stride=query_stride)
    from_pool = LayerSummaries.from_pool(b.k_pool, b.page_table, b.context_lens_cpu(), key_bounds=True)
    assert torch.equal(got, page_scores(b, from_pool, key_bounds=True, query_stride=query_stride))
    if query_stride > 1:                                                     # the stride is read
        assert not torch.allclose(got, page_scores(b, kept, key_bounds=True), atol=1e-4)
    selector = make_selector(cfg("quest_budget", query_stride=query_stride))
    assert torch.equal(selector.select(b, 0, kept).scores, got.reshape(b.num_kv_heads, b.group_size, *got.shape[1:])
                       .amax(1))
    qb, P, G = b.qblocks, b.page_size, b.group_size
    want = torch.zeros_like(got)
    for i in range(qb.count):
        r, a = qb.req[i], int(b.device_qblocks()["cand"][i])
        if a == 0:
            continue
        keys = b.context_keys(r).float()                                   # [H_kv, E, D]
        for h in range(b.num_q_heads):
            k = keys[h // G, :a * P].reshape(a, P, -1)
            best = torch.zeros(a)
            for t in range(qb.start[i], qb.start[i] + qb.length[i], query_stride):
                q = b.q[t, h].float()
                u = torch.maximum(q * k.amax(1), q * k.amin(1)).sum(-1) * b.sm_scale   # [a]
                assert (u + 1e-4 >= (k @ q).amax(-1) * b.sm_scale).all()              # an upper bound
                best = torch.maximum(best, torch.softmax(u, -1))
            want[h, i, :a] = best
    assert (want > 0).sum() > 100                                            # q-blocks with candidates were scored
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_quest_budget_scores_16_queries_of_each_page_by_default():
    """The default `query_stride` (0) is page_size // 16: at page 32 the selector scores as stride 2 does, and not
    as stride 1 (the stride is read)."""
    b = random_batch([300, 64, 500], [70, 20, 40], num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=32, seed=3,
                     structured=True, window_pages=2)
    summaries = batch_summaries(b)

    def scores(**params):
        c = CompactConfig(block_size=32, selector="quest_budget", selector_params=params, sink_blocks=0,
                          recent_blocks=0)
        return make_selector(c).select(b, 0, summaries).scores

    auto = scores()
    assert torch.equal(auto, scores(query_stride=2))
    assert not torch.allclose(auto, scores(query_stride=1), atol=1e-4)


def test_quest_budget_rows_are_fixed_on_the_host():
    from sglang_compact.compact import CompactAttention
    b = batch(12, prefix=(300, 37, 520), chunk=(40, 17, 33))
    ca = CompactAttention(CompactConfig(block_size=P, sink_blocks=1, recent_blocks=1, selector="quest_budget",
                                        selector_params={"density": 0.25}))
    sel = ca.select_pages(b, 0)
    assert sel.counts.tolist() == ca.row_pages(b)
    assert ca.config.spec.fixes_row_lengths and ca.config.spec.priced_search and ca.config.spec.uses_key_bounds


@pytest.mark.parametrize("name", ["budget", "mass_budget"])
def test_a_page_floor_keeps_at_least_min_pages_per_sparse_row(name):
    """`min_pages`: each sparse row keeps max(row_budget at the density, min_pages) pages, never more than its
    context; the rows stay fixed on the host (`row_pages` equals what `select` keeps), and the floor only adds
    pages: every page of the plain budget is still kept."""
    from sglang_compact.compact import CompactAttention
    from sglang_compact.selectors.base import row_budget
    b = batch(12, prefix=(300, 37, 520), chunk=(40, 17, 33))
    common = dict(block_size=P, sink_blocks=1, recent_blocks=1)
    plain = CompactAttention(CompactConfig(selector=name, selector_params={"density": 0.2}, **common))
    floor = CompactAttention(CompactConfig(selector=name, selector_params={"density": 0.2, "min_pages": 12}, **common))
    a = plain.select_pages(b, 0, batch_summaries(b))
    f = floor.select_pages(b, 0, batch_summaries(b))
    assert f.counts.tolist() == floor.row_pages(b)
    qb = b.qblocks
    want = [row_budget(l + 1, 0.2, int(c), 12) if s else l + 1
            for l, s, c in zip(qb.w_last, qb.w_sparse, a.counts[:qb.windows].tolist())]
    assert f.counts[:qb.windows].tolist() == want
    assert any(s and 12 < l + 1 and c < 12 for l, s, c in zip(qb.w_last, qb.w_sparse, a.counts.tolist()))
    assert (f.table | ~a.table).all()          # a superset of the plain selection


def test_mass_budget_row_stride_scores_fewer_rows_and_stays_normalised():
    """`row_stride` r: each q-block's estimate is the mean over its scored rows (its last row holding a query
    and every r-th before it), still a distribution over its candidates, also for q-blocks the chunk cuts
    short; r = 1 is the plain estimate; a stride that does not divide the rows of a page is refused."""
    b = batch(13, chunk=(40, 17, 31))                      # the last q-block: 3 queries, all in row 0
    plain = antidiagonal_page_mass(b, 4)
    assert torch.equal(antidiagonal_page_mass(b, 4, 1), plain)
    half = antidiagonal_page_mass(b, 4, 2)
    cand = b.candidates()
    has = cand.any(-1)
    torch.testing.assert_close(half.sum(-1)[:, has], torch.ones_like(half.sum(-1)[:, has]), rtol=1e-5, atol=1e-5)
    assert not (half * ~cand[None]).any()
    assert not torch.allclose(half, plain)
    sel = select(b, "mass_budget", row_stride=2, stride=4)
    assert sel.counts.tolist() == make_selector(cfg("mass_budget", row_stride=2, stride=4)).row_pages(b)
    with pytest.raises(ValueError, match="row stride"):
        antidiagonal_page_mass(b, 4, 8)            # page 16 / stride 4 = 4 rows


@pytest.mark.parametrize("name", ["budget", "mass_budget"])
def test_layer_density_gives_named_layers_their_own_budget(name):
    """`layer_density`: a named layer keeps `row_budget` at its own fraction, the others at `density`; the plan's
    rows (`row_pages`) are the others'; each layer's selection holds its best pages by the same scores."""
    from sglang_compact.compact import CompactAttention
    from sglang_compact.selectors.base import forced_count, row_budget
    b = batch(14, prefix=(300, 37, 520), chunk=(40, 17, 33))
    common = dict(block_size=P, sink_blocks=1, recent_blocks=1)
    ca = CompactAttention(CompactConfig(selector=name, selector_params={"density": 0.2, "layer_density": "3:0.6"},
                                        **common))
    qb = b.qblocks
    s = batch_summaries(b)
    other, own = ca.select_pages(b, 5, s), ca.select_pages(b, 3, s)
    for sel, frac in ((other, 0.2), (own, 0.6)):
        want = [row_budget(la + 1, frac, forced_count(f, la, 1, 1)) if sp else la + 1
                for f, la, sp in zip(qb.w_first, qb.w_last, qb.w_sparse)] * b.num_kv_heads
        assert sel.counts.tolist() == want
        assert torch.equal(sel.counts, sel.table.sum(-1, dtype=torch.int32).reshape(-1))
    assert ca.row_pages(b) == other.counts.tolist()
    assert any(a < c for a, c in zip(other.counts.tolist(), own.counts.tolist()))
    assert (own.table | ~other.table).all()        # more pages of the same ranking: a superset


def test_rows_longer_than_the_top_pages_tile_rank_on_the_twin_and_say_so_once(monkeypatch, caplog):
    """On CUDA a row of more pages than the top-pages kernel tiles (`MAX_PAGES`) ranks on its torch twin: the same
    rows, and one warning per process naming the page count (seen here on the CPU by telling the dispatch it is
    on CUDA with a tile too small for the rows)."""
    import sglang_compact.indices as indices
    from sglang_compact import logs

    b = batch(seed=3)
    config = cfg("quest_budget", density=0.3, min_tokens=0)
    sel = make_selector(config).select(b, 0, batch_summaries(b))
    want, want_idx = top_pages_indices(sel.ranked, sel.counts, b, 0, 0, sel.per_qblock)
    monkeypatch.setattr(indices, "use_triton", lambda x: True)
    monkeypatch.setattr(indices.top_pages_kernel, "supports", lambda n_pages: False)
    logs.reset()
    with caplog.at_level("WARNING", logger="sglang_compact.indices"):
        for _ in range(2):
            got, got_idx = top_pages_indices(sel.ranked, sel.counts, b, 0, 0, sel.per_qblock)
            assert torch.equal(got, want) and torch.equal(got_idx.kv_indices, want_idx.kv_indices)
    warned = [r.getMessage() for r in caplog.records if "top-pages kernel" in r.getMessage()]
    assert len(warned) == 1 and f"rows of {sel.ranked.shape[-1]} pages" in warned[0], warned
