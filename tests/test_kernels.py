"""Every Triton kernel against its plain-torch twin (`kernels/*_naive.py`) on fresh random inputs,
run on the CPU under TRITON_INTERPRET=1 (set in conftest)."""

import pytest
import torch

from sglang_compact.kernels import antidiagonal, antidiagonal_naive, flashprefill, flashprefill_naive, indices, \
    indices_naive, kv_cache, kv_cache_naive, row_page_table, row_page_table_naive, union, union_naive
from _cases import random_geometry

SEEDS = range(6)


def queries_and_summaries(case, Hq, Hkv, D, dtype=torch.float32):
    g = case["generator"]
    T = sum(case["chunk"])
    q = torch.randn(T, Hq, D, generator=g).to(dtype)
    key_sum = torch.randn(case["num_pages"], Hkv, D, generator=g) * 4
    count = torch.randint(1, 17, (case["num_pages"],), generator=g, dtype=torch.int32)
    return q, key_sum, count


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("Hq,Hkv,D", [(6, 2, 32), (4, 4, 16), (9, 3, 64)])
@pytest.mark.parametrize("query_stride", [1, 2])
def test_search_scores_equal_reference(seed, Hq, Hkv, D, query_stride):
    P = 32
    case = random_geometry(seed, P=P)
    q, key_sum, count = queries_and_summaries(case, Hq, Hkv, D)
    qb = case["qb"].on("cpu")
    NKV = case["qb"].max_pages
    for group_max in (False, True):
        args = (q, qb, case["page_table"], key_sum, count, 0.125, Hkv, NKV)
        got = flashprefill.block_scores(*args, group_max=group_max, query_stride=query_stride, page_size=P)
        want = flashprefill_naive.block_scores(*args, group_max=group_max, query_stride=query_stride)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("alpha", [0.05, 0.4, 0.9])
def test_threshold_mask_equals_reference_up_to_ties(seed, alpha):
    P, Hq, Hkv, D = 16, 6, 2, 32
    case = random_geometry(seed, P=P)
    q, key_sum, count = queries_and_summaries(case, Hq, Hkv, D)
    qb = case["qb"].on("cpu")
    NKV = case["qb"].max_pages
    args = (q, qb, case["page_table"], key_sum, count, 0.2, Hkv, NKV, alpha)
    m_k = flashprefill.threshold_mask(*args, page_size=P)
    m_n = flashprefill_naive.threshold_mask(*args)
    # a cell may differ only where some head of the group scores within rounding of its threshold
    s = flashprefill_naive.block_scores(q, qb, case["page_table"], key_sum, count, 0.2, Hkv, NKV)
    near = ((s - alpha * s.amax(-1, keepdim=True)).abs() < 1e-5).reshape(Hkv, Hq // Hkv, *s.shape[1:]).any(1)
    assert not ((m_k != m_n) & ~near).any()
    # only candidates: the pages before each q-block's window (none in a dense window)
    cand = torch.arange(NKV)[None, :] < qb["cand"].long()[:, None]
    assert not (m_k & ~cand[None]).any()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("Hq,Hkv,D", [(6, 2, 32), (9, 3, 64)])
@pytest.mark.parametrize("query_stride", [1, 2])
def test_ratio_scores_equal_reference_and_the_threshold_is_a_cut_of_them(seed, Hq, Hkv, D, query_stride):
    """The kernel's ratio scores (a page's score over its head's best, maxed over the group) equal the torch
    twin's; and the threshold mask at alpha keeps exactly the candidates whose ratio is >= alpha (up to
    rounding at the cut)."""
    P = 32
    case = random_geometry(seed, P=P)
    q, key_sum, count = queries_and_summaries(case, Hq, Hkv, D)
    qb = case["qb"].on("cpu")
    NKV = case["qb"].max_pages
    args = (q, qb, case["page_table"], key_sum, count, 0.125, Hkv, NKV)
    got = flashprefill.ratio_scores(*args, query_stride=query_stride, page_size=P)
    want = flashprefill_naive.ratio_scores(*args, query_stride=query_stride)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    cand = torch.arange(NKV)[None, :] < qb["cand"].long()[:, None]
    assert not (want[:, ~cand] != 0).any() and (want <= 1 + 1e-6).all()
    for alpha in (0.1, 0.5):
        mask = flashprefill_naive.threshold_mask(*args, alpha, query_stride=query_stride)
        near = (want - alpha).abs() < 1e-5
        assert not ((mask != ((want >= alpha) & cand[None])) & ~near).any()


@pytest.mark.parametrize("seed", SEEDS[:4])
@pytest.mark.parametrize("split", [2, 3])
def test_search_split_over_pages_equals_one_program(seed, split):
    """SPLIT programs per q-block (each over a share of its pages, softmax statistics combined): every output
    the unsplit kernel gives, and the reference's."""
    P, Hq, Hkv, D = 16, 6, 2, 32
    case = random_geometry(seed, P=P, max_pages=40)
    q, key_sum, count = queries_and_summaries(case, Hq, Hkv, D)
    qb = case["qb"].on("cpu")
    NKV = case["qb"].max_pages
    args = (q, qb, case["page_table"], key_sum, count, 0.125, Hkv, NKV)
    one = dict(BN=16, num_warps=4, num_stages=2, SPLIT=1)
    cut = dict(one, SPLIT=split)
    for group_max in (False, True):
        got = flashprefill.block_scores(*args, group_max=group_max, page_size=P, config=cut)
        torch.testing.assert_close(got, flashprefill.block_scores(*args, group_max=group_max, page_size=P, config=one),
                                   atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got, flashprefill_naive.block_scores(*args, group_max=group_max), atol=1e-5,
                                   rtol=1e-4)
    torch.testing.assert_close(flashprefill.ratio_scores(*args, page_size=P, config=cut),
                               flashprefill_naive.ratio_scores(*args), atol=1e-5, rtol=1e-4)
    assert torch.equal(flashprefill.threshold_mask(*args, 0.3, page_size=P, config=cut),
                       flashprefill.threshold_mask(*args, 0.3, page_size=P, config=one))


@pytest.mark.parametrize("seed", [0, 3, 4, 5])   # geometries with candidate pages (seed 1 has none)
@pytest.mark.parametrize("Hq,Hkv,D", [(6, 2, 32), (14, 2, 64)])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("P,query_stride", [(16, 1), (32, 2)])
def test_bound_scores_equal_reference(seed, Hq, Hkv, D, split, P, query_stride):
    """Quest's bound (`key_bounds`: q+ . kmax + q- . kmin per page) in place of the mean key: the kernel's
    scores equal the torch twin's, one program or SPLIT programs per q-block, per head and group max, every
    query or every second one of each q-block (`quest_budget`'s `query_stride`); and they are not the mean-key
    scores (the bounds are read), nor with a stride those of every query."""
    case = random_geometry(seed, P=P, max_pages=40)
    q, key_sum, count = queries_and_summaries(case, Hq, Hkv, D)
    g = case["generator"]
    centre = torch.randn(case["num_pages"], Hkv, D, generator=g)
    radius = torch.rand(case["num_pages"], Hkv, D, generator=g) * 2
    bounds = (centre + radius, centre - radius)
    qb = case["qb"].on("cpu")
    NKV = case["qb"].max_pages
    args = (q, qb, case["page_table"], key_sum, count, 0.125, Hkv, NKV)
    config = dict(BN=16, num_warps=4, num_stages=2, SPLIT=split)
    for group_max in (False, True):
        got = flashprefill.block_scores(*args, group_max=group_max, page_size=P, config=config, key_bounds=bounds,
                                        query_stride=query_stride)
        want = flashprefill_naive.block_scores(*args, group_max=group_max, key_bounds=bounds,
                                               query_stride=query_stride)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        assert (want > 0).sum() > 20
        assert not torch.allclose(want, flashprefill_naive.block_scores(*args, group_max=group_max,
                                                                        query_stride=query_stride), atol=1e-3)
        if query_stride > 1:
            assert not torch.allclose(want, flashprefill_naive.block_scores(*args, group_max=group_max,
                                                                            key_bounds=bounds), atol=1e-4)


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize("chunks", [2, 8])
@pytest.mark.parametrize("split", [1, 3])
def test_search_in_head_chunks_equals_one_chunk(seed, chunks, split):
    """A program taking its group's heads in chunks (`HC`, one after another; the group outputs fold each chunk
    into what the earlier ones stored) gives every output one chunk gives, and the reference's: per head and
    group max, mean keys and bounds, ratios and the threshold mask, one program or SPLIT per q-block."""
    P, Hq, Hkv, D = 16, 14, 2, 32     # 7 heads a group, padded to 8
    case = random_geometry(seed, P=P, max_pages=40)
    q, key_sum, count = queries_and_summaries(case, Hq, Hkv, D)
    g = case["generator"]
    centre = torch.randn(case["num_pages"], Hkv, D, generator=g)
    radius = torch.rand(case["num_pages"], Hkv, D, generator=g) * 2
    qb = case["qb"].on("cpu")
    NKV = case["qb"].max_pages
    args = (q, qb, case["page_table"], key_sum, count, 0.125, Hkv, NKV)
    one = dict(BN=16, num_warps=4, num_stages=2, SPLIT=split, HC=1)
    cut = dict(one, HC=chunks)
    for bounds in (None, (centre + radius, centre - radius)):
        for group_max in (False, True):
            got = flashprefill.block_scores(*args, group_max=group_max, page_size=P, config=cut, key_bounds=bounds)
            torch.testing.assert_close(got, flashprefill.block_scores(*args, group_max=group_max, page_size=P,
                                                                      config=one, key_bounds=bounds),
                                       atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(got, flashprefill_naive.block_scores(*args, group_max=group_max,
                                                                            key_bounds=bounds), atol=1e-5, rtol=1e-4)
            assert (got > 0).sum() > 20
    torch.testing.assert_close(flashprefill.ratio_scores(*args, page_size=P, config=cut),
                               flashprefill_naive.ratio_scores(*args), atol=1e-5, rtol=1e-4)
    for alpha in (0.05, 0.3):
        mask = flashprefill.threshold_mask(*args, alpha, page_size=P, config=cut)
        assert torch.equal(mask, flashprefill.threshold_mask(*args, alpha, page_size=P, config=one))
        assert mask.any()
    with pytest.raises(ValueError, match="head chunks"):
        flashprefill.block_scores(*args, page_size=P, config=dict(one, HC=3))


def test_head_chunks_keep_the_query_tiles_within_shared_memory():
    chunks = flashprefill.head_chunks
    assert chunks(8, 64, 128, 2, bounds=True) == 2     # Llama-70B / Qwen2.5-7B groups, page 64: two 128 KiB tiles
    assert chunks(8, 64, 128, 2, bounds=False) == 1    # one tile: as measured on the H200
    assert chunks(4, 64, 128, 2, bounds=True) == 1     # Llama-3.1-8B
    assert chunks(8, 32, 64, 2, bounds=True) == 1      # Qwen2.5-Coder-0.5B, page 32
    assert chunks(1, 128, 256, 4, bounds=True) == 1    # one head: nothing to chunk


def test_search_splits_only_an_idle_gpu_over_long_rows():
    cfg = flashprefill.launch_config
    assert cfg(256, 2048, True, programs=128, sms=132)["SPLIT"] == 5        # one chunk after a 128K prefix
    assert cfg(256, 2048, True, programs=1024, sms=132)["SPLIT"] == 1       # a batch of 8: the GPU is full
    assert cfg(256, 200, True, programs=128, sms=132)["SPLIT"] == 1         # short rows: not worth a second launch
    assert cfg(256, 512, True, programs=128, sms=132)["SPLIT"] == 1         # 32K: the split was slower on the H200
    assert cfg(256, 1232, False, programs=128, sms=132)["SPLIT"] == 4       # 78K, per-head scores
    assert cfg(256, 2048, True, programs=128, sms=132, splittable=False)["SPLIT"] == 1   # the threshold mask
    assert cfg(256, 2048, True)["SPLIT"] == 1                               # no GPU


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("G", [1, 3])
def test_union_equals_reference(seed, G):
    case = random_geometry(seed)
    qb = case["qb"]
    d = qb.on("cpu")
    mask = torch.rand(2 * G, qb.count, qb.max_pages, generator=case["generator"]) < 0.3
    for sink, recent in ((0, 0), (2, 3)):
        got = union.union_table(mask, 2, d, sink, recent)
        want = union_naive.union_table(mask, 2, d, sink, recent)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # the rule, directly: a window row holds what a head of its group chose for one of its q-blocks, the
    # forced pages, nothing past its last page
    table, _ = union_naive.union_table(mask, 2, d, 1, 1)
    for w, (first, last, sparse, lo, hi) in enumerate(zip(qb.w_first, qb.w_last, qb.w_sparse, qb.w_qlo, qb.w_qhi)):
        for g in range(2):
            chosen = mask[g * G:(g + 1) * G, lo:hi].any(0).any(0)
            j = torch.arange(qb.max_pages)
            forced = (j <= last) & ((j < 1) | (j >= first - 1) | (not sparse))
            assert torch.equal(table[g, w], (chosen & (j <= last)) | forced)


@pytest.mark.parametrize("seed", SEEDS)
def test_indices_equal_reference(seed):
    case = random_geometry(seed)
    qb = case["qb"]
    d = qb.on("cpu")
    table = torch.rand(3, qb.windows, qb.max_pages, generator=case["generator"]) < 0.4
    table &= torch.arange(qb.max_pages)[None, None, :] <= d["w_last"][None, :, None]
    counts = table.sum(-1, dtype=torch.int32).reshape(-1)
    kp, ki = indices.build_indices(table, counts, case["page_table"], d["w_req"])
    np_, ni = indices_naive.build_indices(table, counts, case["page_table"], d["w_req"])
    n = int(np_[-1])
    assert torch.equal(kp, np_) and torch.equal(ki[:n], ni)
    # row r = g * NW + w lists page_table[b, j] * H_kv + g for its pages j, ascending
    r = 3 * qb.windows // 2
    g, w = divmod(r, qb.windows)
    pages = table[g, w].nonzero().flatten()
    want = case["page_table"][qb.w_req[w], pages] * 3 + g
    assert torch.equal(ni[np_[r]:np_[r + 1]], want.to(torch.int32))


@pytest.mark.parametrize("seed", SEEDS)
def test_row_page_table_equals_reference_and_leaves_the_padding(seed):
    """CSR rows of the index kernels -> FA3's padded page table and KV lengths; rows longer than one tile."""
    g = torch.Generator().manual_seed(seed)
    R, P = int(torch.randint(1, 9, (1,), generator=g)), 16
    counts = torch.randint(1, 40 if seed % 2 else 2000, (R,), generator=g)
    kv_indptr = torch.zeros(R + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(counts, 0)
    kv_indices = torch.randint(0, 10**6, (int(kv_indptr[-1]) + 5,), generator=g, dtype=torch.int32)
    last = torch.randint(1, P + 1, (R,), generator=g, dtype=torch.int32)
    W = int(counts.max()) + 3
    got = [torch.full((R + 2, W), -7, dtype=torch.int32), torch.full((R + 2,), -7, dtype=torch.int32)]
    want = [t.clone() for t in got]
    row_page_table.row_page_table(kv_indptr, kv_indices, last, P, *got)
    row_page_table_naive.row_page_table(kv_indptr, kv_indices, last, P, *want)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for r in range(R):
        n = int(counts[r])
        assert torch.equal(want[0][r, :n], kv_indices[int(kv_indptr[r]):int(kv_indptr[r + 1])])
        assert (want[0][r, n:] == -7).all()
        assert int(want[1][r]) == (n - 1) * P + int(last[r])
    assert (want[0][R:] == -7).all() and (want[1][R:] == -7).all()


def write_stream(seed, P=16, H=2, D=32, pages=10):
    """A request's tokens 0..E written in writes of random sizes (chunks, then decode steps)."""
    g = torch.Generator().manual_seed(seed)
    E = int(torch.randint(P, pages * P, (1,), generator=g))
    page_ids = torch.randperm(pages, generator=g)
    loc = torch.tensor([int(page_ids[t // P]) * P + t % P for t in range(E)])
    k = torch.randn(E, H, D, generator=g)
    v = torch.randn(E, H, D, generator=g)
    cuts, t = [0], 0
    while t < E:
        t = min(E, t + int(torch.randint(1, 3 * P, (1,), generator=g)))
        cuts.append(t)
    return loc, k, v, cuts, (pages, H, P, D)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("impl", [kv_cache, kv_cache_naive])
def test_store_kv_and_summaries_do_not_depend_on_how_writes_are_split(seed, impl):
    loc, k, v, cuts, shape = write_stream(seed)
    pages, H, P, D = shape
    outs = []
    for split in (cuts, [0, len(loc)]):
        kp, vp = torch.zeros(shape), torch.zeros(shape)
        ks, cnt = torch.zeros(pages, H, D), torch.zeros(pages, dtype=torch.int32)
        for a, b in zip(split, split[1:]):
            impl.store_kv(kp, vp, loc[a:b], k[a:b], v[a:b], ks, cnt)
        outs.append((kp, vp, ks, cnt))
    (kp1, vp1, ks1, c1), (kp2, vp2, ks2, c2) = outs
    assert torch.equal(kp1, kp2) and torch.equal(vp1, vp2) and torch.equal(c1, c2)
    assert torch.equal(ks1, ks2)  # bit for bit: a page's sum is always taken in offset order
    # and the summaries are the pages' key sums
    page = loc // P
    for p in page.unique():
        n = int((page == p).sum())
        assert int(c1[p]) == n
        torch.testing.assert_close(ks1[p], kp1[p, :, :n].sum(1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", SEEDS)
def test_store_kv_kernel_equals_reference(seed):
    loc, k, v, cuts, shape = write_stream(seed)
    pages, H, P, D = shape
    state = [(torch.zeros(shape), torch.zeros(shape), torch.zeros(pages, H, D), torch.zeros(pages, dtype=torch.int32))
             for _ in range(2)]
    for impl, (kp, vp, ks, cnt) in zip((kv_cache, kv_cache_naive), state):
        for a, b in zip(cuts, cuts[1:]):
            impl.store_kv(kp, vp, loc[a:b], k[a:b], v[a:b], ks, cnt)
        impl.store_kv(kp, vp, loc[:0], k[:0], v[:0], ks, cnt)  # an empty write is a no-op
    for x, y in zip(*state):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("seed", SEEDS)
def test_store_kv_of_a_batch_whose_blocks_end_several_pages_equals_reference(seed):
    """One write of a batch as SGLang lays it out (each request's new tokens after its cached ones, requests one
    after another): long enough for blocks of tokens (`kv_cache.block_tokens`), short requests so that one block
    ends several pages, and requests whose first new token continues a page they filled before."""
    P, H, D, pages = 16, 2, 32, 40
    g = torch.Generator().manual_seed(500 + seed)
    page_ids = torch.randperm(pages, generator=g).tolist()
    loc, cached = [], []
    for r in range(8):
        own = page_ids[5 * r:5 * r + 5]
        start = int(torch.randint(0, 2 * P, (1,), generator=g))
        n = int(torch.randint(1, 2 * P, (1,), generator=g))
        cached.append([own[t // P] * P + t % P for t in range(start)])
        loc += [own[t // P] * P + t % P for t in range(start, start + n)]
    loc = torch.tensor(loc)
    assert kv_cache.block_tokens(len(loc), P) > 1
    k, v = torch.randn(len(loc), H, D, generator=g), torch.randn(len(loc), H, D, generator=g)
    before = torch.tensor([t for c in cached for t in c], dtype=torch.long)
    k0 = torch.randn(len(before), H, D, generator=g)
    state = []
    # the kernel in blocks (runs=1 claims one long run), one token per program (a run per token), and the twin
    assert kv_cache.block_tokens(len(loc), P, runs=len(loc)) == 1
    for impl, runs in ((kv_cache, 1), (kv_cache, len(loc)), (kv_cache_naive, 1)):
        kp, vp = torch.zeros(pages, H, P, D), torch.zeros(pages, H, P, D)
        ks, cnt = torch.zeros(pages, H, D), torch.zeros(pages, dtype=torch.int32)
        kmax, kmin = torch.zeros(pages, H, D), torch.zeros(pages, H, D)
        kv_cache_naive.store_kv(kp, vp, before, k0, k0, ks, cnt, kmax, kmin)   # the requests' cached tokens
        impl.store_kv(kp, vp, loc, k, v, ks, cnt, kmax, kmin, runs=runs)
        state.append((kp, vp, ks, cnt, kmax, kmin))
    for other in state[1:]:
        for x, y in zip(state[0], other):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-5)


def test_block_tokens_blocks_long_runs_only():
    """Blocks of 16 tokens (at most a page) where a write spans several pages in long runs; one token per program
    for a short write and for a decode step (a run per token: every token ends a page)."""
    assert kv_cache.block_tokens(1024, 64) == 16                       # one chunk of one request
    assert kv_cache.block_tokens(8192, 32, runs=4) == 16               # four long requests
    assert kv_cache.block_tokens(1024, 8) == 8                         # at most a page
    assert kv_cache.block_tokens(255, 64) == 1                         # under four pages
    assert kv_cache.block_tokens(256, 64, runs=256) == 1               # a decode step of 256 requests
    assert kv_cache.block_tokens(512, 16, runs=512) == 1
    assert kv_cache.block_tokens(256, 16, runs=64) == 1                # requests of 4 tokens on average
    assert kv_cache.block_tokens(256, 16, runs=16) == 16               # of 16


def store_with_bounds(impl, loc, k, v, split, shape, dtype, seed):
    """A stream written with `impl` in the given split into a pool of `dtype` that starts full of stale
    keys (large, either sign: a bound that reads an offset past a page's last token shows them)."""
    pages, H, P, D = shape
    g = torch.Generator().manual_seed(1000 + seed)
    kp = (torch.randn(shape, generator=g) * 100).to(dtype)
    vp = torch.zeros(shape, dtype=dtype)
    ks, cnt = torch.zeros(pages, H, D), torch.zeros(pages, dtype=torch.int32)
    kmax = torch.full((pages, H, D), 7.0, dtype=dtype)    # pages never written keep it
    kmin = torch.full((pages, H, D), -7.0, dtype=dtype)
    for a, b in zip(split, split[1:]):
        impl.store_kv(kp, vp, loc[a:b], k[a:b], v[a:b], ks, cnt, kmax, kmin)
    return kp, vp, ks, cnt, kmax, kmin


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_key_bounds_equal_reference_and_do_not_depend_on_how_writes_are_split(seed, dtype):
    loc, k, v, cuts, shape = write_stream(seed)
    # float32 inputs the pool's dtype holds exactly: the interpreter casts float32 to bfloat16 by truncation,
    # torch (and Triton on the GPU) by rounding to nearest, so only exact casts make the pools comparable
    k, v = k.to(dtype).float(), v.to(dtype).float()
    pages, H, P, D = shape
    runs = {(impl.__name__, name): store_with_bounds(impl, loc, k, v, split, shape, dtype, seed)
            for impl in (kv_cache, kv_cache_naive) for name, split in (("split", cuts), ("one", [0, len(loc)]))}
    kp, vp, ks, cnt, kmax, kmin = runs[(kv_cache.__name__, "split")]
    assert kmax.dtype == kmin.dtype == dtype
    for key, (kp2, vp2, ks2, cnt2, kmax2, kmin2) in runs.items():
        # the bounds are exact: bit for bit across kernels and splits
        assert torch.equal(kmax, kmax2) and torch.equal(kmin, kmin2), key
        assert torch.equal(kp, kp2) and torch.equal(vp, vp2) and torch.equal(cnt, cnt2), key
        torch.testing.assert_close(ks, ks2, rtol=1e-6, atol=1e-5)
    # the bounds are the max / min of the page's keys as the pool holds them, offsets 0..off only
    page = loc // P
    written = page.unique()
    for p in written:
        n = int((page == p).sum())
        assert torch.equal(kmax[p], kp[p, :, :n].amax(1)) and torch.equal(kmin[p], kp[p, :, :n].amin(1))
        if n < P:  # the stale keys past the page's end would have moved them
            assert not torch.equal(kmax[p], kp[p].amax(1)) or not torch.equal(kmin[p], kp[p].amin(1))
    untouched = torch.ones(pages, dtype=torch.bool)
    untouched[written] = False
    assert (kmax[untouched] == 7).all() and (kmin[untouched] == -7).all()
    # keeping the bounds leaves the sum as it is without them
    kp0 = (torch.randn(shape, generator=torch.Generator().manual_seed(1000 + seed)) * 100).to(dtype)
    ks0, cnt0 = torch.zeros(pages, H, D), torch.zeros(pages, dtype=torch.int32)
    for a, b in zip(cuts, cuts[1:]):
        kv_cache.store_kv(kp0, torch.zeros(shape, dtype=dtype), loc[a:b], k[a:b], v[a:b], ks0, cnt0)
    assert torch.equal(ks0, ks) and torch.equal(cnt0, cnt)


@pytest.mark.parametrize("impl", [kv_cache, kv_cache_naive])
def test_store_kv_key_bounds_need_key_sum_and_each_other(impl):
    loc, k, v, _, shape = write_stream(0)
    pages, H, P, D = shape
    kp, vp = torch.zeros(shape), torch.zeros(shape)
    ks, cnt = torch.zeros(pages, H, D), torch.zeros(pages, dtype=torch.int32)
    kmax, kmin = torch.zeros(pages, H, D), torch.zeros(pages, H, D)
    with pytest.raises(ValueError):
        impl.store_kv(kp, vp, loc, k, v, None, None, kmax, kmin)
    with pytest.raises(ValueError):
        impl.store_kv(kp, vp, loc, k, v, key_max=kmax, key_min=kmin)
    with pytest.raises(ValueError):
        impl.store_kv(kp, vp, loc, k, v, ks, cnt, kmax, None)
    with pytest.raises(ValueError):
        impl.store_kv(kp, vp, loc, k, v, ks, cnt, None, kmin)
    assert not kp.any() and not ks.any()   # refused before anything was written
    impl.store_kv(kp, vp, loc, k, v, ks, cnt, kmax, kmin)
    assert kmax.any() and kmin.any()


def test_store_kv_page_summaries_keep_key_bounds():
    from sglang_compact.summaries import LayerSummaries, PageSummaries, store_kv

    loc, k, v, cuts, (pages, H, P, D) = write_stream(3)
    s = PageSummaries(2, pages, H, D, "cpu", key_bounds=True, bounds_dtype=torch.bfloat16)
    assert s.key_max.shape == s.key_min.shape == (2, pages, H, D) and s.key_max.dtype == torch.bfloat16
    assert PageSummaries.bytes_needed(2, pages, H, D, key_bounds=True, bounds_itemsize=2) == sum(
        t.numel() * t.element_size() for t in (s.key_sum, s.count, s.key_max, s.key_min))
    assert PageSummaries.bytes_needed(2, pages, H, D, key_bounds=True) == \
        PageSummaries.bytes_needed(2, pages, H, D) + 2 * pages * 2 * H * D * 4
    plain = PageSummaries(2, pages, H, D, "cpu")
    assert plain.key_max is None and plain.layer(1).key_max is None and plain.layer(1).key_min is None
    assert PageSummaries.bytes_needed(2, pages, H, D) == sum(
        t.numel() * t.element_size() for t in (plain.key_sum, plain.count))
    kp, vp = torch.zeros(pages, H, P, D, dtype=torch.bfloat16), torch.zeros(pages, H, P, D, dtype=torch.bfloat16)
    layer = s.layer(1)
    for a, b in zip(cuts, cuts[1:]):
        store_kv(kp, vp, loc[a:b], k[a:b], v[a:b], layer)
    assert not s.key_max[0].any() and s.key_max[1].any()        # layer 1's views were written, not layer 0
    for name in ("key_sum", "count", "key_max", "key_min"):   # the layers' views are of these tables: no rebinding
        with pytest.raises(AttributeError):
            setattr(s, name, torch.zeros(1))
    # from_pool computes the same summaries from the pool (the request's pages, in order)
    E = len(loc)
    order = loc[::P] // P
    table = torch.zeros(1, pages, dtype=torch.int32)
    table[0, :len(order)] = order.to(torch.int32)
    ref = LayerSummaries.from_pool(kp, table, [E], key_bounds=True)
    assert ref.key_max.dtype == torch.bfloat16
    assert torch.equal(ref.key_max[order], s.key_max[1][order])
    assert torch.equal(ref.key_min[order], s.key_min[1][order])
    assert LayerSummaries.from_pool(kp, table, [E]).key_max is None


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("Hq,Hkv,D,S,row_stride", [(6, 2, 32, 4, 1), (4, 4, 16, 8, 1), (14, 2, 16, 16, 1),
                                                    (3, 1, 32, 2, 1), (6, 2, 32, 4, 2), (4, 2, 16, 2, 8)])
def test_antidiagonal_page_mass_equals_reference(seed, Hq, Hkv, D, S, row_stride):
    P = 16
    case = random_geometry(seed, P=P)
    g = case["generator"]
    qb = case["qb"]
    NQB, NKV, G, R = qb.count, qb.max_pages, Hq // Hkv, P // S // row_stride   # R: the scored rows
    GP = 1 << (G - 1).bit_length()
    q_rows = torch.randn(Hkv, NQB, GP, R, S * D, generator=g)
    q_rows[:, :, G:] = float("nan")                       # padded heads: never read into a result
    k_pool = torch.randn(case["num_pages"], Hkv, P, D, generator=g) * 0.5
    weight = torch.rand(NQB, R, generator=g) * (torch.rand(NQB, R, generator=g) > 0.2)
    d = qb.on("cpu")
    args = (q_rows, k_pool, case["page_table"], d["req"], d["cand"], weight, G, NKV, 0.3 / S)
    want = antidiagonal_naive.page_mass(*args)
    # other column / dot blocks and tiles of fewer q-blocks give the same result
    for config in (None, {"BN": 16, "BK": 16}, {"rows": 16, "BN": 32, "BK": 16}):
        got = antidiagonal.page_mass(*args, config=config)
        assert got.shape == (Hq, NQB, NKV)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    # each q-block's mass over its candidates sums to its rows' total weight; nothing outside them
    cand = torch.arange(NKV)[None, :] < d["cand"].long()[:, None]
    assert not (got * ~cand[None]).any()
    has = d["cand"] > 0
    torch.testing.assert_close(got.sum(-1)[:, has], weight.sum(-1)[has][None].expand(Hq, -1), atol=1e-5, rtol=1e-4)


def test_antidiagonal_tiles_stay_within_a_request():
    req = [0, 0, 0, 1, 2, 2, 2, 2, 2]
    tiles = antidiagonal.make_tiles(req, 2)
    assert tiles == [(0, 2), (2, 1), (3, 1), (4, 2), (6, 2), (8, 1)]
    assert antidiagonal.qblocks_per_tile(7, 4, target_rows=128) == 4
    assert antidiagonal.qblocks_per_tile(1, 1, target_rows=128) == 128
    assert antidiagonal.qblocks_per_tile(7, 4) == antidiagonal.DEFAULT_CONFIG["rows"] // 32
    assert antidiagonal.qblocks_per_tile(1, 2, target_rows=4) == 8        # tl.dot needs 16 rows


def fixed_row_counts(qb, H_kv, sink, recent, generator):
    """int32 [H_kv * NW]: a random length per sparse row between its forced pages and its context, last + 1
    for a dense one."""
    from sglang_compact.selectors.base import forced_count
    out = []
    for _ in range(H_kv):
        for f, la, s in zip(qb.w_first, qb.w_last, qb.w_sparse):
            lo = forced_count(f, la, sink, recent) if s else la + 1
            out.append(int(torch.randint(lo, la + 2, (1,), generator=generator)))
    return torch.tensor(out, dtype=torch.int32)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("GS,per_qblock,apart", [(1, True, True), (3, True, True), (1, False, True), (2, False, False)])
def test_top_pages_equal_reference(seed, GS, per_qblock, apart):
    from sglang_compact.kernels import top_pages, top_pages_naive
    case = random_geometry(seed)
    qb = case["qb"]
    d = qb.on("cpu")
    H_kv, g = 2, case["generator"]
    counts = fixed_row_counts(qb, H_kv, 1, 2, g)
    S2 = qb.count if per_qblock else qb.windows
    # few distinct values: ties are common, and both keep the lowest tied pages
    scores = torch.randint(0, 4, (H_kv * GS, S2, qb.max_pages), generator=g).float()
    args = (scores, d, counts, case["page_table"], H_kv, 1, 2, per_qblock, apart)
    table, kp, ki = top_pages.top_pages(*args)
    t_ref, kp_ref, ki_ref = top_pages_naive.top_pages(*args)
    n = int(kp_ref[-1])
    assert torch.equal(table, t_ref) and torch.equal(kp, kp_ref) and torch.equal(ki[:n], ki_ref)
    for r, c in enumerate(counts.tolist()):          # a sparse row reads exactly its count
        w = r % qb.windows
        if qb.w_sparse[w]:
            assert int(table.view(-1, qb.max_pages)[r].sum()) == c
            assert int(kp[r + 1] - kp[r]) == c
        else:
            assert int(kp[r + 1] - kp[r]) == qb.w_last[w] + 1 - (qb.w_first[w] if apart else 0)


def test_top_pages_keeps_the_best_scores():
    """The reference itself: one window, the forced pages, then the best candidates, ties lowest first."""
    from sglang_compact.batch import QBlocks
    from sglang_compact.kernels import top_pages_naive
    qb = QBlocks.build([8 * 16], [16], 16, window_pages=1)           # 8 candidate pages, window page 8
    d = qb.on("cpu")
    scores = torch.tensor([[[0., 5., 1., 7., 3., 3., 2., 0., 0.]]])  # [1, NQB=1, 9]
    # sink 1 (page 0), recent 1 (page 7), window page 8: 3 forced; 3 more: 7 (page 3), 5 (page 1), 3 (page 4)
    table, kp, ki = top_pages_naive.top_pages(scores, d, torch.tensor([6]), torch.arange(9)[None].int(), 1, 1, 1)
    assert table[0, 0].nonzero().flatten().tolist() == [0, 1, 3, 4, 7, 8]
    assert kp.tolist() == [0, 6] and ki.tolist() == [0, 1, 3, 4, 7, 8]


LAUNCH_ARGS = [0, 1, 2, 15, 16, 17, 48, (1 << 31) - 1, 1 << 31, -(1 << 31), -(1 << 31) - 1, 1 << 63, (1 << 64) - 1,
               True, False, 0.5, 1.0, None]


def test_launcher_key_is_at_least_as_fine_as_tritons():
    """Two arguments the cached launch cannot tell apart are ones Triton's own specializer does not tell apart
    either, so a cached compiled kernel is the one Triton would pick (kernels/launch.py)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from sglang_compact.kernels.launch import _arg_key
    base = torch.zeros(64, dtype=torch.float32)
    tensors = [base[i:] for i in range(5)] + [base.view(torch.int32)[i:] for i in range(5)] + \
        [base.view(torch.bfloat16)[i:] for i in range(9)] + [torch.zeros(8, dtype=torch.int64)[i:] for i in range(3)]
    values = LAUNCH_ARGS + tensors
    triton_key = lambda x: native_specialize_impl(BaseBackend, x, False, True, True)  # noqa: E731
    distinct = 0
    for a in values:
        for b in values:
            if _arg_key(a, False) == _arg_key(b, False):
                assert triton_key(a) == triton_key(b), (a, b)
            else:
                distinct += 1
    assert distinct > len(values) ** 2 // 2   # the key does tell most of them apart (it is not one constant)
    assert _arg_key(4, True) != _arg_key(8, True) and _arg_key(4, True) == _arg_key(4, True)   # constexprs by value


def test_launcher_keys_a_call_by_every_parameter_and_option():
    from sglang_compact.kernels.launch import Launcher
    from triton.runtime.jit import JITFunction
    launch = kv_cache._store_kv_launch
    if launch._names is None:   # Triton's interpreter (no parameter list): the compiled kernel's launcher
        launch = Launcher(JITFunction(kv_cache._store_kv_kernel.fn))
    pool = torch.zeros(4, 2, 8, 16)
    loc, k = torch.arange(8), torch.zeros(8, 2, 16)
    args = (pool, pool, loc, k, k, pool, loc, pool, pool, 8, 2, 32, 16, 32, 16)
    kw = dict(P=8, D=16, BN=1, SUMMARIZE=False, BOUNDS=False)
    key = launch.key(args, kw)
    assert key == launch.key(args, dict(kw)) and hash(key) is not None
    assert launch.key(args, dict(kw, BOUNDS=True)) != key                       # a constexpr
    assert launch.key(args, dict(kw, num_warps=8)) != key                       # a launch option
    assert launch.key(args[:-1] + (17,), kw) != key                             # an int's divisibility
    assert launch.key((pool[1:],) + args[1:], kw) is not None
    assert launch.key(args, {k2: v2 for k2, v2 in kw.items() if k2 != "BOUNDS"}) is None   # a parameter left out


def test_launcher_sees_launch_hooks_only_when_one_is_set(monkeypatch):
    """Triton 3.6 always holds a `HookChain` in its launch-hook knobs: an empty chain is no hook (the cached path
    runs), one with a call is (a profiler's hook sees every launch through Triton's path)."""
    from sglang_compact.kernels.launch import _hooked
    knobs = pytest.importorskip("triton.knobs")
    hook = lambda *a, **k: None  # noqa: E731
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if hasattr(enter, "calls"):
        monkeypatch.setattr(enter, "calls", [])
        monkeypatch.setattr(leave, "calls", [])
        assert not _hooked()
        leave.add(hook)
        assert _hooked()
    else:   # a Triton whose knob holds the hook itself
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
        monkeypatch.setattr(knobs.runtime, "launch_exit_hook", None)
        assert not _hooked()
        knobs.runtime.launch_exit_hook = hook
        assert _hooked()


@pytest.mark.parametrize("enabled", [False, True])
def test_store_kv_through_the_launcher_equals_reference(enabled, monkeypatch):
    """With the cached launch on, the interpreter still takes Triton's path (nothing to cache) and the store
    equals its torch twin (on a GPU the cached path itself is checked in tests/test_gpu_core.py)."""
    from sglang_compact.kernels.launch import Launcher
    monkeypatch.setattr(Launcher, "enabled", enabled)
    loc, k, v, cuts, shape = write_stream(0)
    pages, H, P, D = shape
    state = [(torch.zeros(shape), torch.zeros(shape), torch.zeros(pages, H, D), torch.zeros(pages, dtype=torch.int32))
             for _ in range(2)]
    for impl, (kp, vp, ks, cnt) in zip((kv_cache, kv_cache_naive), state):
        for _ in range(2):   # the second call of a signature is the one a GPU launches from the cache
            for a, b in zip(cuts, cuts[1:]):
                impl.store_kv(kp, vp, loc[a:b], k[a:b], v[a:b], ks, cnt)
    for x, y in zip(*state):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-5)
