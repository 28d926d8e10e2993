"""The compact pipeline on the CPU: selection -> union -> paged indices -> execution, against the
plain-torch ground truth, and the selection's independence from how a prompt is chunked."""


import dataclasses

import pytest
import torch

from sglang_compact.batch import ChunkBatch, QBlocks, cdiv
from sglang_compact.compact import CompactAttention, mass_recall
from sglang_compact.config import CompactConfig
from sglang_compact.executors import ForwardShape, TorchExecutor, reference_attention
from sglang_compact.selectors.base import forced_count, row_budget
from sglang_compact.summaries import PageSummaries, store_kv

P = 16
WP = 4          # pages per union window: windows of 64 tokens


class Context:
    """Fixed K/V/Q for every position of a few requests, written into a shared pool page by page."""

    def __init__(self, lengths, hq=6, hkv=2, d=32, seed=0, structured=True):
        g = torch.Generator().manual_seed(seed)
        self.lengths, self.hq, self.hkv, self.d = list(lengths), hq, hkv, d
        n = [cdiv(E, P) for E in self.lengths]
        perm = torch.randperm(sum(n) + 4, generator=g).to(torch.int32)
        self.page_table = torch.zeros(len(n), max(n), dtype=torch.int32)
        used = 0
        for b, k in enumerate(n):
            self.page_table[b, :k] = perm[used:used + k]
            used += k
        self.num_pages = sum(n) + 4
        self.k = [torch.randn(E, hkv, d, generator=g) for E in self.lengths]
        self.v = [torch.randn(E, hkv, d, generator=g) for E in self.lengths]
        self.q = [torch.randn(E, hq, d, generator=g) for E in self.lengths]
        if structured:  # a few heavy pages per request whose keys align with the queries, plus sinks
            direction = torch.randn(hkv, d, generator=g)
            direction = direction / direction.norm(dim=-1, keepdim=True) * d ** 0.5 * 1.5
            for b, E in enumerate(self.lengths):
                self.q[b] += direction.repeat_interleave(hq // hkv, 0)[None] * 0.7
                heavy = torch.randperm(cdiv(E, P), generator=g)[:3]
                for j in heavy.tolist():
                    self.k[b][j * P:(j + 1) * P] += direction[None] * 0.8
                self.k[b][:4] += direction[None] * 1.2
        self.k_pool = torch.zeros(self.num_pages, hkv, P, d)
        self.v_pool = torch.zeros(self.num_pages, hkv, P, d)
        self.summaries = PageSummaries(1, self.num_pages, hkv, d, "cpu")

    def slots(self, b, start, end):
        pos = torch.arange(start, end)
        return self.page_table[b, pos // P].long() * P + pos % P

    def write(self, b, start, end):
        store_kv(self.k_pool, self.v_pool, self.slots(b, start, end), self.k[b][start:end], self.v[b][start:end],
                 self.summaries.layer(0))

    def batch(self, reqs, sparse_ranges=None, window_pages=WP) -> ChunkBatch:
        """reqs: [(request, prefix, chunk)]; writes the chunks' K/V (the prefixes must be written already)."""
        for b, L, C in reqs:
            self.write(b, L, L + C)
        q = torch.cat([self.q[b][L:L + C] for b, L, C in reqs])
        k = torch.cat([self.k[b][L:L + C] for b, L, C in reqs])
        v = torch.cat([self.v[b][L:L + C] for b, L, C in reqs])
        pt = self.page_table[[b for b, _, _ in reqs]]
        return ChunkBatch.build(q, self.k_pool, self.v_pool, pt, [L for _, L, _ in reqs], [C for _, _, C in reqs],
                                sparse_ranges=sparse_ranges, k_chunk=k, v_chunk=v, window_pages=window_pages)


def make_batch(seed, prefix=(100, 0, 333, 48), chunk=(140, 20, 117, 64), sparse_ranges=None, window_pages=WP, **kw):
    ctx = Context([L + C for L, C in zip(prefix, chunk)], seed=seed, **kw)
    for b, L in enumerate(prefix):
        ctx.write(b, 0, L)
    return ctx.batch([(b, L, C) for b, (L, C) in enumerate(zip(prefix, chunk))], sparse_ranges, window_pages)


def dense_float64(b: ChunkBatch) -> torch.Tensor:
    """Every query against its whole context, causally, in float64 (independent of every helper)."""
    out = torch.empty(b.q.shape, dtype=torch.float64)
    G, start = b.group_size, 0
    for r, (L, C) in enumerate(zip(b.prefix_lens_cpu, b.chunk_lens_cpu)):
        E = L + C
        pages = b.page_table[r, :cdiv(E, P)].long()
        k = b.k_pool[pages].permute(1, 0, 2, 3).reshape(b.num_kv_heads, -1, b.head_dim)[:, :E].double()
        v = b.v_pool[pages].permute(1, 0, 2, 3).reshape(b.num_kv_heads, -1, b.head_dim)[:, :E].double()
        q = b.q[start:start + C].transpose(0, 1).double()
        s = q @ k.repeat_interleave(G, 0).transpose(1, 2) * b.sm_scale
        causal = torch.arange(E)[None, :] <= (L + torch.arange(C))[:, None]
        s = s.masked_fill(~causal, float("-inf"))
        out[start:start + C] = (torch.softmax(s, -1) @ v.repeat_interleave(G, 0)).transpose(0, 1)
        start += C
    return out


def run(b, cfg):
    ca = CompactAttention(cfg)
    sel = ca.select_pages(b, with_stats=True)
    ex = TorchExecutor()
    ex.plan_forward(ForwardShape.of(b, ca.row_pages(b)), b.page_table)
    return ca, sel, ex.run(b, sel.indices)


def test_the_executor_writes_a_sparse_layer_into_a_given_buffer():
    # the backend hands SGLang's output buffer to the sparse path as to the dense one, so SGLang copies nothing
    b = make_batch(3, chunk=(140, 230, 117, 64), sparse_ranges=[(0, 100), (3, 100), (3, 7), (0, 1)])
    ca, sel, want = run(b, cfg("quest_budget", params={"density": 0.3}))
    assert b.qblocks.any_sparse
    ex = TorchExecutor()
    ex.plan_forward(ForwardShape.of(b, ca.row_pages(b)), b.page_table)
    given = torch.full_like(want, float("nan"))
    assert ex.run(b, sel.indices, out=given) is given and torch.equal(given, want)


def cfg(selector, **kw):
    params = kw.pop("params", {})
    return CompactConfig(block_size=P, selector=selector, selector_params=params, sink_blocks=1, recent_blocks=2, **kw)


@pytest.mark.parametrize("seed", range(4))
def test_dense_execution_and_the_full_table_equal_float64_dense(seed):
    b = make_batch(seed, sparse_ranges=[(0, 0)] * 4)
    want = dense_float64(b)
    torch.testing.assert_close(reference_attention(b, b.full_table()).double(), want, rtol=1e-4, atol=1e-5)
    ex = TorchExecutor()
    ex.plan_forward(ForwardShape.of(b), b.page_table)
    torch.testing.assert_close(ex.run(b, None).double(), want, rtol=1e-4, atol=1e-5)
    # what a layer of the serving path calls: the layer's tensors only, into a given output buffer
    buf = torch.full_like(b.q, float("nan"))
    got = ex.run_dense(b.q, b.k_pool, b.v_pool, out=buf)
    assert got.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    sb = make_batch(seed)
    ex.plan_forward(ForwardShape.of(sb), sb.page_table)
    with pytest.raises(ValueError, match="paged indices"):
        ex.run(sb, None)
    with pytest.raises(RuntimeError, match="sparse forward pass"):
        ex.run_dense(sb.q, sb.k_pool, sb.v_pool)


@pytest.mark.parametrize("selector", ["flashprefill", "budget", "dense", "oracle", "xattention"])
@pytest.mark.parametrize("seed", range(3))
def test_rows_execution_equals_the_reference_of_its_table(selector, seed):
    ranges = [(0, 100), (2, 100), (3, 7), (0, 1)]   # in windows of 64 tokens
    b = make_batch(seed, sparse_ranges=ranges)
    ca, sel, out = run(b, cfg(selector))
    torch.testing.assert_close(out, reference_attention(b, sel.table), rtol=1e-5, atol=1e-5)
    qb = b.qblocks
    assert qb.windows < qb.count and any(qb.w_sparse) and not all(qb.w_sparse)
    for w, (first, last, s) in enumerate(zip(qb.w_first, qb.w_last, qb.w_sparse)):
        row = sel.table[:, w]
        assert not row[:, last + 1:].any() and row[:, first:last + 1].all() and row[:, 0].all()
        assert row[:, max(first - 2, 0):first].all()
        if not s:
            assert row[:, :last + 1].all()
    assert torch.equal(sel.counts, sel.table.sum(-1, dtype=torch.int32).reshape(-1))
    rows = ca.row_pages(b)
    if selector in ("budget", "dense"):
        assert rows == sel.counts.tolist()
    else:
        assert rows is None
    assert 0 < float(sel.density) <= 1


def test_full_density_rows_equal_dense():
    b = make_batch(5)
    _, sel, out = run(b, cfg("budget", params={"density": 1.0}))
    assert torch.equal(sel.table, b.full_table())
    torch.testing.assert_close(out.double(), dense_float64(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_a_layer_that_reads_all_runs_the_rows_of_the_full_table(seed):
    """`CompactAttention.read_all` (a layer of `dense_layers` in a sparse pass): every row reads its whole context
    through the rows' kernel, windows computed apart included; the output is dense attention, the density 1.0,
    and its indices fit the pass's rows bound (the plan every layer of the pass shares)."""
    ranges = [(0, 100), (3, 100), (3, 7), (0, 1)]   # sparse and dense windows in one pass
    b = make_batch(seed, chunk=(140, 230, 117, 64), sparse_ranges=ranges)
    ca = CompactAttention(cfg("flashprefill", dense_layers=(3,)))
    sel = ca.read_all(b, with_stats=True)
    assert torch.equal(sel.table, b.full_table()) and float(sel.density) == 1.0
    assert sel.counts.tolist() == b.qblocks.full_counts() * b.num_kv_heads
    assert ca.read_all(b).table is sel.table                      # made once per batch
    ex = TorchExecutor()
    ex.plan_forward(ForwardShape.of(b), b.page_table)
    torch.testing.assert_close(ex.run(b, sel.indices).double(), dense_float64(b), rtol=1e-4, atol=1e-5)
    bound = ForwardShape.of(b).rows_upper_bound()
    counts = (sel.indices.kv_indptr[1:] - sel.indices.kv_indptr[:-1]).tolist()
    assert counts == [hi - lo for lo, hi in zip(bound, bound[1:])]


@pytest.mark.parametrize("selector", ["flashprefill", "budget"])
def test_dense_windows_of_a_sparse_pass_are_computed_apart(selector):
    """In a pass with sparse windows, a dense window's row names only its own pages (the rows' kernel does
    little for it) and the executor computes it over every page apart: its output is dense attention."""
    ranges = [(0, 100), (3, 100), (3, 7), (0, 1)]   # request 1: windows 0-2 dense (one segment), ...
    b = make_batch(4, chunk=(140, 230, 117, 64), sparse_ranges=ranges)
    qb = b.qblocks
    apart = qb.dense_apart
    assert any(apart) and any(qb.w_sparse) and apart == tuple(not s for s in qb.w_sparse)
    ca, sel, out = run(b, cfg(selector))
    rows = TorchExecutor().table_from_indices(b, sel.indices)
    for w, (first, last) in enumerate(zip(qb.w_first, qb.w_last)):
        if apart[w]:
            assert torch.equal(sel.table[:, w], b.full_table()[:, w])       # what the window reads: everything
            assert rows[:, w, first:last + 1].all() and not rows[:, w, :first].any() and not rows[:, w, last + 1:].any()
        else:
            assert torch.equal(rows[:, w], sel.table[:, w])
    bound = ForwardShape.of(b).rows_upper_bound()
    counts = (sel.indices.kv_indptr[1:] - sel.indices.kv_indptr[:-1]).tolist()
    assert all(c <= hi - lo for c, lo, hi in zip(counts, bound, bound[1:]))
    if selector == "budget":
        assert ForwardShape.of(b, ca.row_pages(b)).rows_indptr() == sel.indices.kv_indptr.tolist()
    torch.testing.assert_close(out, reference_attention(b, sel.table), rtol=1e-5, atol=1e-5)
    want = dense_float64(b)
    for w in range(qb.windows):
        if apart[w]:
            st, n = qb.w_start[w], qb.w_length[w]
            torch.testing.assert_close(out[st:st + n].double(), want[st:st + n], rtol=1e-4, atol=1e-5)
    # consecutive dense windows of a request are one segment of the apart pass
    segs = qb.apart_segments()
    assert sum(n for _, _, n, _ in segs) == sum(n for n, a in zip(qb.w_length, apart) if a)
    assert len(segs) < sum(apart) and all(segs[i][:2] != segs[i + 1][:2] for i in range(len(segs) - 1))
    assert not make_batch(4, sparse_ranges=[(0, 0)] * 4).qblocks.dense_apart[0]


def test_budget_rows_read_their_budget_and_the_density_cap_bounds_rows():
    b = make_batch(1, prefix=(700, 300), chunk=(164, 50))
    _, sel, _ = run(b, cfg("budget", params={"density": 0.25}))
    qb = b.qblocks
    for w, (first, last) in enumerate(zip(qb.w_first, qb.w_last)):
        assert sel.table[:, w].sum(-1).tolist() == [row_budget(last + 1, 0.25, forced_count(first, last, 1, 2))] * 2
    c = cfg("flashprefill", params={"alpha": 0.0}, density_cap=0.3)
    ca, sel, out = run(b, c)
    for w, (first, last) in enumerate(zip(qb.w_first, qb.w_last)):
        assert (sel.table[:, w].sum(-1) <= row_budget(last + 1, 0.3, forced_count(first, last, 1, 2))).all()
    assert sel.coverage is not None and float(sel.coverage) < 1
    torch.testing.assert_close(out, reference_attention(b, sel.table), rtol=1e-5, atol=1e-5)


def test_flashprefill_fill_keeps_the_counts_and_at_the_thresholds_counts_is_the_threshold():
    """`fix_rows`: a later layer fills each row to the first layer's count, best ratio first. At the same layer and
    the threshold's own counts, the fill is the threshold's table (ties aside); on another layer's data it keeps
    exactly the counts and the rows execute as their table says."""
    from sglang_compact.selectors.base import forced_count

    c = cfg("flashprefill", params={"alpha": 0.3, "fix_rows": True})
    ca = CompactAttention(c)
    assert c.spec.fixes_rows_at_observing_layer(c.params) and not cfg("flashprefill").spec.fixes_rows_at_observing_layer(
        cfg("flashprefill").params)
    ranges = [(0, 100), (2, 100), (3, 7), (0, 1)]
    b0 = make_batch(6, sparse_ranges=ranges)
    first = ca.select_pages(b0, with_stats=True)
    counts = first.counts.clone()
    again = ca.select_pages(b0, fill=counts)
    assert torch.equal(again.counts, counts)
    differ = (again.table != first.table).sum().item()
    assert differ <= 2, differ                       # a tie at the cut may swap a page
    # another layer (other data, same lengths and page table): exactly the counts, forced pages kept
    b1 = dataclasses.replace(b0, q=torch.randn_like(b0.q), k_pool=torch.randn_like(b0.k_pool),
                             v_pool=torch.randn_like(b0.v_pool))
    later = ca.select_pages(b1, fill=counts, with_stats=True)
    assert torch.equal(later.table.sum(-1, dtype=torch.int32).reshape(-1), counts)
    qb = b1.qblocks
    forced = b1.forced(1, 2)
    assert (later.table | ~forced[None]).all()
    for w, (f, last, sp) in enumerate(zip(qb.w_first, qb.w_last, qb.w_sparse)):
        if sp:
            assert (later.table[:, w].sum(-1) >= forced_count(f, last, 1, 2)).all()
        else:
            assert later.table[:, w, :last + 1].all()
    ex = TorchExecutor()
    ex.plan_forward(ForwardShape.of(b1, counts.tolist()), b1.page_table)
    torch.testing.assert_close(ex.run(b1, later.indices), reference_attention(b1, later.table), rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="does not fill"):
        CompactAttention(cfg("oracle")).select_pages(b0, fill=counts)


@pytest.mark.parametrize("selector,params", [("quest_budget", {"density": 0.3}), ("budget", {"density": 0.3}),
                                             ("dense", {}), ("flashprefill", {"alpha": 0.3})])
def test_the_density_of_counts_made_once_per_pass_is_computed_once(selector, params):
    """A fixed-length selector's counts are the same tensor in every layer of a pass: its density is derived once
    (the layers share it); counts a layer makes itself (flashprefill's threshold) get their own, each the density
    of its own counts. A fill with the pass's rows is derived once too."""
    from sglang_compact.union import row_density

    ca = CompactAttention(cfg(selector, params=params))
    b0 = make_batch(5, sparse_ranges=[(0, 100), (2, 100), (3, 7), (0, 1)])
    b1 = dataclasses.replace(b0, q=torch.randn_like(b0.q), k_pool=torch.randn_like(b0.k_pool))   # the next layer
    one, two = ca.select_pages(b0, with_stats=True), ca.select_pages(b1, with_stats=True)
    for sel, b in ((one, b0), (two, b1)):
        assert torch.equal(sel.density, row_density(sel.counts, b))
    assert (one.density is two.density) == (selector != "flashprefill")
    if selector == "flashprefill":
        assert not torch.equal(one.counts, two.counts)   # the layers' thresholds differ: a shared density would lie
        fill = one.counts.clone()
        got = [ca.select_pages(x, fill=fill, with_stats=True).density for x in (b0, b1)]
        assert got[0] is got[1] and torch.equal(got[0], row_density(fill, b0))


def test_pass_density_follows_counts_written_in_place_unless_they_are_the_pass_s():
    from sglang_compact.union import pass_density, row_density

    b = make_batch(5, sparse_ranges=[(0, 100), (2, 100), (3, 7), (0, 1)])
    counts = torch.tensor(b.qblocks.full_counts() * b.num_kv_heads, dtype=torch.int32)
    first = pass_density(counts, b, counts_per_pass=False)
    counts -= 1                                      # a buffer a layer reuses
    assert torch.equal(pass_density(counts, b, counts_per_pass=False), row_density(counts, b))
    assert not torch.equal(row_density(counts, b), first)
    once = pass_density(counts, b, counts_per_pass=True)
    assert pass_density(counts.clone(), b, counts_per_pass=True) is not once   # another tensor: its own
    assert pass_density(counts, b, counts_per_pass=True) is once


def test_flashprefill_keeps_the_pages_a_head_scores_above_alpha_of_its_best():
    """Against a direct loop: per q-block and head, softmax over mean keys of the pages before its window,
    max over the q-block's queries, threshold; OR over the window's q-blocks and the group's heads."""
    b = make_batch(2, prefix=(300, 77), chunk=(140, 133))
    alpha = 0.3
    _, sel, _ = run(b, cfg("flashprefill", params={"alpha": alpha}))
    G, qb = b.group_size, b.qblocks
    for w, (r, first) in enumerate(zip(qb.w_req, qb.w_first)):
        if first == 0:
            continue
        pages = b.page_table[r, :first].long()
        kbar = torch.stack([b.k_pool[p, :, :P].mean(1) for p in pages.tolist()], 1)   # [H_kv, first, D] (full pages)
        for g in range(b.num_kv_heads):
            keep = torch.zeros(first, dtype=torch.bool)
            for i in range(qb.w_qlo[w], qb.w_qhi[w]):
                st, n = qb.start[i], qb.length[i]
                for h in range(g * G, (g + 1) * G):
                    s = torch.softmax(b.q[st:st + n, h] @ kbar[g].T * b.sm_scale, -1).amax(0)
                    keep |= s >= alpha * s.max()
            forced = torch.tensor([j < 1 or j >= first - 2 for j in range(first)])
            assert torch.equal(sel.table[g, w, :first], keep | forced), (w, g)


CHUNKINGS = {   # window-aligned, as the scheduler cuts them (srt/alignment.py); windows of 64 tokens
    "one pass": [(0, 420)],
    "chunks of 128": [(0, 128), (128, 128), (256, 128), (384, 36)],
    "chunks of 64": [(s, min(64, 420 - s)) for s in range(0, 420, 64)],
    "cache hit at 192, then 128 + rest": [(192, 128), (320, 100)],   # the first 192 were written by another request
}


@pytest.mark.parametrize("selector,params", [("flashprefill", {"alpha": 0.3}), ("budget", {"density": 0.3}),
                                             ("flashprefill", {"alpha": 0.1, "query_stride": 2})])
@pytest.mark.parametrize("use_kernel", [False, True])
def test_a_q_blocks_pages_and_outputs_do_not_depend_on_the_chunking(selector, params, use_kernel, monkeypatch):
    """The same prompt prefilled in different page-aligned chunkings (SGLang cuts chunks at pages; a cache
    hit is whole pages), and next to another request in a batch, selects
    the same pages for every q-block (bit for bit), and its queries the same outputs (to float32 rounding:
    the kernels' shapes follow the pass)."""
    if use_kernel:  # the Triton kernels (interpreted) instead of the torch twins
        monkeypatch.setattr("sglang_compact.kernels.use_triton", lambda x, override=None: True)
        for mod in ("selectors.base", "selectors.flashprefill", "union", "indices", "summaries"):
            monkeypatch.setattr(f"sglang_compact.{mod}.use_triton", lambda x, override=None: True)
    E = 420
    results = {}
    for name, passes in CHUNKINGS.items():
        ctx = Context([E, 90], seed=7)
        ctx.write(0, 0, passes[0][0])                     # a cache hit: written before
        tables, outs = {}, {}
        for k, (start, n) in enumerate(passes):
            reqs = [(0, start, n)] + ([(1, 0, 90)] if k == 1 else [])   # mixed into a batch once
            ranges = [(1, 1 << 40), (0, 0)][:len(reqs)]
            b = ctx.batch(reqs, ranges)
            ca = CompactAttention(cfg(selector, params=params))
            sel = ca.select_pages(b, summaries=ctx.summaries.layer(0))
            ex = TorchExecutor()
            ex.plan_forward(ForwardShape.of(b, ca.row_pages(b)), b.page_table)
            out = ex.run(b, sel.indices)
            qb = b.qblocks
            for w, (r, first, last, st, ln) in enumerate(zip(qb.w_req, qb.w_first, qb.w_last, qb.w_start,
                                                              qb.w_length)):
                if r == 0:
                    tables[first] = sel.table[:, w, :last + 1].clone()
                    outs[first] = out[st:st + ln].clone()
        results[name] = (tables, outs)
    base_tables, base_outs = results["one pass"]
    for name, (tables, outs) in results.items():
        for a in tables:
            assert torch.equal(tables[a], base_tables[a]), (name, a)
            torch.testing.assert_close(outs[a], base_outs[a], rtol=1e-5, atol=1e-6)
    read = sum(int(t.sum()) for t in base_tables.values())
    assert read < sum(t.numel() for t in base_tables.values())  # something was actually skipped




@pytest.mark.parametrize("seed", range(3))
def test_mass_recall_is_the_attention_share_of_the_selected_pages(seed):
    """For each sparse window, the softmax mass of its last query (group's first head) that the row's pages hold,
    against a float64 computation from every token's own score; 1.0 for the full table; an empty row reads 0."""
    b = make_batch(seed)
    qb = b.qblocks
    sel = CompactAttention(cfg("flashprefill", params={"alpha": 0.6})).select_pages(b)
    G = b.group_size
    for g in range(b.num_kv_heads):
        got = mass_recall(b, sel.table, g)
        want = []
        for w in [w for w, sp in enumerate(qb.w_sparse) if sp]:
            r, pos = qb.w_req[w], qb.w_pos[w] + qb.w_length[w] - 1
            q = b.q[qb.w_start[w] + qb.w_length[w] - 1, g * G].double()
            k = b.context_keys(r)[g, :pos + 1].double()
            p = torch.softmax(k @ q * b.sm_scale, 0)
            chosen = sel.table[g, w][torch.arange(pos + 1) // P]
            want.append(p[chosen].sum())
        assert got is not None and len(want) == got.numel() > 0
        torch.testing.assert_close(got.double(), torch.stack(want), rtol=1e-5, atol=1e-6)
        if seed == 0:  # the check is not vacuous: at alpha 0.6 some window's selection misses mass
            assert (got < 1 - 1e-4).any()
        torch.testing.assert_close(mass_recall(b, b.full_table(), g), torch.ones_like(got))
        assert torch.equal(mass_recall(b, torch.zeros_like(sel.table), g), torch.zeros_like(got))
    dense = make_batch(seed, sparse_ranges=[(0, 0)] * 4)
    assert mass_recall(dense, dense.full_table(), 0) is None


def qblocks_naive(prefix_lens, chunk_lens, P, WP, sparse_ranges):
    """`QBlocks.build`'s q-block fields, one page at a time (its plain twin)."""
    W = WP * P
    out = {k: [] for k in ("req", "page", "pos", "start", "length", "window")}
    cu, windows = 0, 0
    for b, (L, C) in enumerate(zip(prefix_lens, chunk_lens)):
        E = L + C
        for k in range(L // W, -(-E // W)) if C > 0 else ():
            ws, we = max(L, k * W), min(E, (k + 1) * W)
            for a in range(ws // P, -(-we // P)):
                s = max(ws, a * P)
                for key, v in (("req", b), ("page", a), ("pos", s), ("start", cu + s - L),
                               ("length", min(we, (a + 1) * P) - s), ("window", windows)):
                    out[key].append(v)
            windows += 1
        cu += C
    return {k: tuple(v) for k, v in out.items()}


@pytest.mark.parametrize("seed", range(40))
def test_qblocks_build_equals_the_page_by_page_twin(seed):
    """Prefixes and chunks starting and ending anywhere in a page or a window, empty chunks, one-page windows."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda hi: int(torch.randint(hi, (1,), generator=g))  # noqa: E731
    P = [1, 4, 16, 32][rnd(4)]
    WP = 1 + rnd(5)
    B = 1 + rnd(4)
    prefix = [rnd(6 * WP * P) if rnd(3) else 0 for _ in range(B)]
    chunk = [rnd(4 * WP * P + 3) for _ in range(B)]
    ranges = [(rnd(4), rnd(8)) for _ in range(B)]
    qb = QBlocks.build(prefix, chunk, P, WP, ranges)
    want = qblocks_naive(prefix, chunk, P, WP, ranges)
    assert {k: getattr(qb, k) for k in want} == want
    assert all(qb.w_qlo[w] < qb.w_qhi[w] and qb.window[qb.w_qlo[w]] == w for w in range(qb.windows))
    assert sum(qb.length) == sum(chunk)
