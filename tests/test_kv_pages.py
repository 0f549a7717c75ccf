"""The page pool and the prefix cache's page names, without a device."""
import hashlib
import struct

import pytest

from llama_xla_helpers.kv_pages import ROOT, PagePool, page_hash, page_hashes, page_size_for


def test_page_size_follows_vllms_rule_for_the_kernel():
    # next_pow2(max_len) // 16, clamped to [16, 256]; above 8,192 tokens 16 (vLLM's VMEM fix)
    assert [page_size_for(n) for n in (100, 256, 257, 768, 2048, 8192, 8193, 131072)] == \
        [16, 16, 32, 64, 128, 256, 16, 16]


def test_a_page_is_named_by_its_parent_its_tokens_and_extra_keys():
    tokens = list(range(40))
    hashes = page_hashes(tokens, 16)
    assert len(hashes) == 2  # full pages only: the last 8 tokens are not named
    # the definition, written out: sha256(parent || int64 tokens || repr(extra)), the first page's parent fixed
    first = hashlib.sha256(ROOT + struct.pack("<16q", *range(16)) + b"()").digest()
    assert hashes[0] == first and hashes[1] == page_hash(first, tokens[16:32])
    other = page_hashes(list(range(16)) + [99] + list(range(17, 40)), 16)
    assert other[0] == hashes[0] and other[1] != hashes[1]  # the same first page, a different second
    shifted = page_hashes([7] + tokens[:39], 16)
    assert shifted[0] != hashes[0]
    assert page_hashes(tokens, 16, extra=("adapter-a",))[0] != hashes[0]
    # extended page by page as tokens arrive: the same names as all at once
    assert page_hashes(tokens + list(range(40, 48)), 16, hashes[:1]) == page_hashes(tokens + list(range(40, 48)), 16)


def test_pages_are_handed_out_least_recently_freed_first_and_page_0_never():
    pool = PagePool(6, 16)
    a = pool.allocate(3)
    b = pool.allocate(2)
    assert a == [1, 2, 3] and b == [4, 5] and pool.free_pages == 0 and pool.used_pages == 5
    assert pool.allocate(1) is None and pool.free_pages == 0  # short: nothing taken
    pool.free(a)  # its last page first: evicted first
    assert list(pool.free_queue) == [3, 2, 1]
    assert pool.allocate(2) == [3, 2] and pool.used_pages == 4


def test_cached_pages_are_found_held_shared_and_evicted_last_freed_last():
    pool = PagePool(5, 4)
    a_tokens = list(range(10))
    a_hashes = page_hashes(a_tokens, 4)
    a = pool.allocate(3)
    for page, h in zip(a, a_hashes):  # two full pages
        pool.register(page, h)
    b_hashes = page_hashes(list(range(8)) + [50, 51, 52, 53], 4)
    assert pool.lookup(b_hashes) == a[:2]  # the shared prefix; then a miss
    pool.hold(a[:2])  # b shares them while a still runs
    assert pool.refs[a[0]] == 2
    pool.free(a)
    assert list(pool.free_queue) == [4, a[2]]  # a's shared pages are still held (by b)
    assert pool.lookup(a_hashes) == a[:2]
    pool.free(a[:2])  # b ends too: the pages stay cached, free
    assert pool.lookup(a_hashes) == a[:2] and pool.free_pages == 4
    pool.hold(pool.lookup(a_hashes))  # a hit on free pages takes them out of the free queue
    assert pool.free_pages == 2 and pool.evictions == 0
    pool.free(a[:2])
    taken = pool.allocate(3)  # 4, a[2], then a[1] (a's second page was freed before its first)
    assert taken == [4, a[2], a[1]] and pool.evictions == 1
    assert pool.lookup(a_hashes) == a[:1]  # the chain now ends at its first page


def test_a_name_keeps_its_first_page():
    pool = PagePool(4, 4)
    h = page_hashes([1, 2, 3, 4], 4)[0]
    p, q = pool.allocate(2)
    pool.register(p, h)
    pool.register(q, h)  # the same prefix computed twice (two requests in one step)
    assert pool.lookup([h]) == [p] and q not in pool.hash_of


def test_bad_sizes():
    with pytest.raises(ValueError, match="num_pages=1 must be >= 2"):
        PagePool(1, 16)
