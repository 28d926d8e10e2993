"""A model check of the exact prefix cache: SGLang's own radix cache, request and pools, driven through random
schedules with sglang_compact's hooks applied, and every KV slot labelled with how it was computed.

Run in a fresh process (the hooks patch SGLang's classes): `python tests/cache_model.py SEED [SEED ...]`, with
`SGLANG_COMPACT_CPU_SHIM=1`. Prints one JSON line per seed: the configuration, what the schedule did, and the
violations found (none expected).

A token's KV depends on how its queries read the context (`srt/alignment.py`): below the gate and in a prompt's
dense tail (and its output) every page, causally, so it depends on the tokens before it only (label "a"); in a
sparse window the union of the window's selections, so it also depends on every token of its window (label
("s", the window's tokens)). The prefix before a position is the same tokens wherever a radix path serves it, so a
slot serves a request exactly when its label is the label the request's cold run gives that position. The
checks, after every step of a schedule:

* what a request is served from the cache at admission, and what SGLang swaps into its row when it caches a
  chunk (`cache_unfinished_req` matches the tree again), carries the request's cold labels;
* no chunk starts or ends inside a sparse window (a sparse window is computed in one pass);
* a hit is page-aligned (the next token is written after it, in a page of its own);
* no slot is freed twice or leaked: after the schedule, with every request done and the tree evicted, the
  allocator holds every page again.

The schedules mix fresh prompts, repeats, parallel samples, prefixes with other suffixes and next turns (a prompt
plus an earlier answer plus new tokens), chunked prefills interleaved with other admissions, continuing chunks cut
to a short KV pool's room (`alignment.continuing_chunk_len`; with room for less than the rest of a sparse window,
the window is computed over two passes: labelled as the request's own, which no other request may read),
evictions, and retractions (a decoding request loses its KV and prefills its prompt and output again).
"""

from __future__ import annotations

import json
import random
import sys
from array import array

import torch

from sglang.srt.plugins import load_plugins

load_plugins()   # SGLang's loader: our entry point registers the hooks, then SGLang applies them

from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from sglang_compact.config import CompactConfig  # noqa: E402
from sglang_compact.gate import NEVER, Gate, GateDecision  # noqa: E402
from sglang_compact.srt import alignment  # noqa: E402

VOCAB = 7          # few token ids: prompts share prefixes, windows, and tails by chance too
MAX_CONTEXT = 2048


class Model:
    def __init__(self, seed: int):
        rng = self.rng = random.Random(seed)
        self.page = rng.choice([16, 32])
        self.window = self.page * rng.choice([2, 4])
        never = rng.random() < 0.1
        min_context = NEVER if never else rng.choice([0, self.window, 100, 3 * self.window + 5])
        self.dense_tail = rng.choice([0, 1, 50, self.window, 2 * self.window + 7])
        self.chunk = self.window * rng.choice([1, 2, 4])
        self.prefix_cache = "reuse" if rng.random() < 0.2 else "exact"
        config = CompactConfig(block_size=self.page, dense_tail=self.dense_tail, union_window=self.window,
                               prefix_cache=self.prefix_cache)
        self.gate = Gate(config, GateDecision(min_context, "flag", ""), window_tokens=self.window)
        alignment.activate(self.gate)
        pages = 400
        self.allocator = PagedTokenToKVPoolAllocator(pages * self.page, self.page, torch.int64, "cpu", None, False)
        self.req_pool = ReqToTokenPool(size=64, max_context_len=MAX_CONTEXT, device="cpu", enable_memory_saver=False)
        self.tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=self.req_pool,
                                               token_to_kv_pool_allocator=self.allocator, page_size=self.page))
        self.label: dict[int, object] = {}      # KV slot -> how its KV was computed
        self.violations: list[str] = []
        self.done: list[Req] = []
        self.counts = {"admitted": 0, "served": 0, "chunks": 0, "split": 0, "retracted": 0, "evicted": 0,
                       "finished": 0}
        self._rid = 0

    # --- what a request's cold run computes --------------------------------------------------------------

    def cold_label(self, req: Req, pos: int):
        lo, hi = self.gate.sparse_range(req.compact_model_fill)
        W = self.window
        if pos < lo * W or pos >= hi * W:
            return "a"
        w = pos // W
        if w in req.compact_model_split:     # computed over two passes: this request's own, as no cold run has it
            return ("split", req.rid, w)
        tokens = req.origin_input_ids + req.output_ids
        return ("s", tuple(tokens[w * W:(w + 1) * W]))

    def check_row(self, req: Req, upto: int, what: str) -> None:
        if self.prefix_cache == "reuse":
            return      # serves every cached token, however it was computed: only the other checks hold
        row = self.req_pool.req_to_token[req.req_pool_idx]
        for pos in range(upto):
            got = self.label.get(int(row[pos]))
            if got != self.cold_label(req, pos):
                self.violations.append(f"{what}: {req.rid} (prompt {len(req.origin_input_ids)}, fill "
                                       f"{req.compact_model_fill}) position {pos} holds {got!r:.60}, its cold run "
                                       f"computes {self.cold_label(req, pos)!r:.60}")
                return

    def inside_sparse_window(self, req: Req, pos: int) -> bool:
        lo, hi = self.gate.sparse_range(req.compact_model_fill)
        return lo * self.window < pos < hi * self.window and pos % self.window != 0

    # --- SGLang's request lifecycle, step by step ----------------------------------------------------------

    def new_request(self, tokens: list[int], outputs: int) -> Req:
        self._rid += 1
        req = Req(f"r{self._rid}", "", array("q", tokens), SamplingParams(max_new_tokens=outputs))
        req.compact_model_outputs = outputs
        return req

    def alloc_page(self) -> int:
        for _ in range(3):
            pages = self.allocator.alloc(self.page)
            if pages is not None:
                return int(pages[0])
            self.evict(self.page * 8)
        raise RuntimeError("KV pool exhausted")

    def write_slots(self, req: Req, start: int, end: int, label_of) -> None:
        row = self.req_pool.req_to_token[req.req_pool_idx]
        for pos in range(start, end):
            slot = self.alloc_page() if pos % self.page == 0 else int(row[pos - 1]) + 1
            row[pos] = slot
            self.label[slot] = label_of(pos)

    def match(self, req: Req) -> None:
        """The scheduler's match of a waiting request (`init_next_round_input`, with the hooks)."""
        req.init_next_round_input(self.tree)
        req.compact_model_fill = len(req.origin_input_ids) + len(req.output_ids)

    def needs_chunks(self, req: Req) -> bool:
        return req.compact_model_fill - len(req.prefix_indices) > self.chunk

    def admit(self, req: Req) -> None:
        """The request joins a prefill batch with what it was matched: locked, given a row, its hit written."""
        kept = len(req.prefix_indices)
        self.counts["admitted"] += 1
        self.counts["served"] += kept
        if kept % self.page:
            self.violations.append(f"admit: {req.rid} is served {kept} tokens, not whole pages of {self.page}")
        if self.inside_sparse_window(req, kept):
            self.violations.append(f"admit: {req.rid} is served {kept} tokens, inside a sparse window")
        req.compact_model_split = set()
        req.compact_model_first_chunk = True
        self.tree.inc_lock_ref(req.last_node)
        self.req_pool.alloc([req])
        if kept:
            self.req_pool.write((req.req_pool_idx, slice(0, kept)), req.prefix_indices.to(torch.int32))
        self.check_row(req, kept, "cache hit")
        req.compact_model_kv = kept

    def prefill_chunk(self, req: Req) -> bool:
        """One pass of the request's prefill; True when its prefill is done."""
        start, fill = req.compact_model_kv, req.compact_model_fill
        if req.compact_model_first_chunk:    # `add_one_req`: the budget, in whole windows (truncation_align_size)
            n = min(fill - start, self.chunk // self.window * self.window)
            req.compact_model_first_chunk = False
        else:                                # `add_chunked_req`: the budget, or the KV pool's room when less
            room = self.chunk if self.rng.random() < 0.7 else self.rng.randrange(1, self.chunk + 1)
            keep = alignment.continuing_chunk_len(self.gate, req, room)
            n = keep if keep else min(fill - start, room)
            if keep == 0:
                req.compact_model_split.add(start // self.window)
                self.counts["split"] += 1
        end = start + n
        if self.inside_sparse_window(req, start) and start // self.window not in req.compact_model_split or \
                (end < fill and self.inside_sparse_window(req, end) and end // self.window not in
                 req.compact_model_split):
            self.violations.append(f"chunk: {req.rid} computes [{start}, {end}), splitting a sparse window")
        self.write_slots(req, start, end, lambda pos: self.cold_label(req, pos))
        req.compact_model_kv = end
        req.set_extend_range(start, end)
        self.counts["chunks"] += 1
        if end < fill:
            self.tree.cache_unfinished_req(req, chunked=True)     # the scheduler's `stash_chunked_request`
            self.check_row(req, end, "chunk cached")
            req.init_next_round_input()                     # the scheduler's next round of a chunked request
            return False
        req.output_ids.append(self.rng.randrange(VOCAB))
        if len(req.output_ids) < req.compact_model_outputs:
            self.tree.cache_unfinished_req(req)
            self.check_row(req, end, "prefill cached")
        return True

    def decode(self, req: Req) -> bool:
        """One decode step (the KV of the last output token, a new token); True when the request finished."""
        if len(req.output_ids) >= req.compact_model_outputs:
            return True
        pos = req.compact_model_kv
        self.write_slots(req, pos, pos + 1, lambda _: "a")
        req.compact_model_kv = pos + 1
        req.output_ids.append(self.rng.randrange(VOCAB))
        return len(req.output_ids) >= req.compact_model_outputs

    def finish(self, req: Req) -> None:
        self.check_row(req, req.compact_model_kv, "finished")
        self.tree.cache_finished_req(req, kv_len_to_handle=req.compact_model_kv)
        self.req_pool.free(req)
        self.counts["finished"] += 1
        self.done.append(req)

    def retract(self, req: Req) -> None:
        """SGLang's retraction of a decoding request: its KV is freed, not cached; it prefills again later."""
        self.tree.cache_finished_req(req, is_insert=False, kv_len_to_handle=req.compact_model_kv)
        self.req_pool.free(req)
        req.reset_for_retract()
        self.counts["retracted"] += 1

    def evict(self, tokens: int) -> None:
        self.counts["evicted"] += self.tree.evict(EvictParams(num_tokens=tokens)).num_tokens_evicted

    # --- prompts --------------------------------------------------------------------------------------------

    def random_tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def next_prompt(self, docs: list[list[int]]) -> list[int]:
        rng = self.rng
        kind = rng.random()
        if self.done and kind < 0.2:                                   # a repeat
            return list(rng.choice(self.done).origin_input_ids)
        if self.done and kind < 0.45:                                  # a next turn
            prev = rng.choice(self.done)
            return list(prev.origin_input_ids) + list(prev.output_ids) + self.random_tokens(rng.randrange(1, 200))
        if self.done and kind < 0.6:                                   # a prefix of a cached prompt, another end
            prev = list(rng.choice(self.done).origin_input_ids)
            return prev[:rng.randrange(1, len(prev) + 1)] + self.random_tokens(rng.randrange(0, 120))
        doc = rng.choice(docs)                                         # a shared document, a question
        return doc[:rng.randrange(1, len(doc) + 1)] + self.random_tokens(rng.randrange(1, 80))

    # --- a schedule -----------------------------------------------------------------------------------------

    def run(self, steps: int) -> dict:
        rng = self.rng
        docs = [self.random_tokens(rng.randrange(100, 700)) for _ in range(3)]
        waiting: list[Req] = []
        chunked: Req | None = None
        decoding: list[Req] = []
        for _ in range(steps):
            if len(waiting) < 3 and rng.random() < 0.5:
                tokens = self.next_prompt(docs)[:MAX_CONTEXT - 64]
                outputs = rng.randrange(1, 40)
                waiting.append(self.new_request(tokens, outputs))
                if rng.random() < 0.15:                                # parallel samples of one prompt
                    waiting.append(self.new_request(list(tokens), outputs))
            # one scheduler pass: the chunked request's next chunk, then waiting requests matched and admitted
            # (one of them may start a chunked prefill when none runs), all matched before any is cached
            if chunked is not None and self.prefill_chunk(chunked):
                decoding.append(chunked)
                chunked = None
            batch = []
            while waiting and rng.random() < 0.7:
                req = waiting[0]
                self.match(req)
                if self.needs_chunks(req) and (chunked is not None or any(self.needs_chunks(r) for r in batch)):
                    break                               # SGLang prefills one chunked request at a time
                waiting.pop(0)
                self.admit(req)
                batch.append(req)
            for req in batch:
                if self.prefill_chunk(req):
                    decoding.append(req)
                else:
                    chunked = req
            for req in list(decoding):
                if rng.random() < 0.04 and len(req.output_ids) < req.compact_model_outputs:
                    decoding.remove(req)
                    self.retract(req)
                    waiting.append(req)
                elif self.decode(req):
                    decoding.remove(req)
                    self.finish(req)
            if rng.random() < 0.1:
                self.evict(rng.randrange(1, 6) * self.window)
        if chunked is not None:
            while not self.prefill_chunk(chunked):
                pass
            decoding.append(chunked)
        for req in waiting:
            self.match(req)
            self.admit(req)
            while not self.prefill_chunk(req):
                pass
            decoding.append(req)
        for req in decoding:
            while not self.decode(req):
                pass
            self.finish(req)
        self.evict(1 << 30)
        free = self.allocator.available_size()
        if free != self.allocator.size:
            self.violations.append(f"pool: {self.allocator.size - free} slots not free after the schedule")
        return {"prefix_cache": self.prefix_cache, "page": self.page, "window": self.window,
                "min_context": self.gate.decision.min_context, "dense_tail": self.dense_tail, "chunk": self.chunk,
                **self.counts,
                "violations": self.violations[:5], "violation_count": len(self.violations)}


def main(argv: list[str]) -> int:
    steps = 60
    for arg in argv:
        print(json.dumps({"seed": int(arg), **Model(int(arg)).run(steps)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
