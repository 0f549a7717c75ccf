"""The serving engine's KV cache as a pool of pages, on the host: which pages each request holds,
which full pages are kept for later requests with the same prefix, and which are evicted.
Plain Python (no tensors), so it is tested, and notebook 06 replays it, without a device.

    pool = PagePool(num_pages=64, page_size=16)
    hashes = page_hashes(prompt, 16)          # one per full page: a chain, each over its parent's
    hit = pool.lookup(hashes)                 # the pages of the longest cached prefix
    pool.hold(hit)                            # the request holds them (so they are not evicted)
    pages = hit + pool.allocate(3)            # its block table: three more pages (None if the pool is short)
    pool.register(pages[i], hashes[i])        # page i is full: later requests may reuse it
    pool.free(pages)                          # it has ended: cached pages stay, least recently used evicted first

Every layer's cache is a (num_pages, page_size, 2 * n_kv_heads, head_dim) tensor (`runner.py`),
and a request's block table lists, in order, the pages that hold its positions: position p is
row p % page_size of page table[p // page_size]. A request needs pages for the positions it has
written, not for the model's whole context, so short requests leave room for more of them, and
none reserves a whole context up front (vLLM's PagedAttention). Page 0 is never handed out: the
padding tokens of a step write their keys and values there.

Prefix caching (vLLM v1's): a full page is named by a hash of (its parent page's hash, its token
ids, extra keys), so a page's hash names the whole prefix up to its end. A page a request has
filled is registered under its hash; when the request ends the page goes back to the free list
but keeps its contents and its name, until the pool hands it out again, least recently freed
first. A new request looks its prompt's page hashes up in order and reuses the longest chain of
cached pages, prefilling only what follows. Two requests reading one page is safe: a full page is
never written again.

Sources: Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention" (SOSP 2023), https://arxiv.org/abs/2309.06180; vLLM's automatic prefix caching
design, https://docs.vllm.ai/en/latest/design/prefix_caching.html
"""
import collections
import hashlib
import struct

ROOT = hashlib.sha256(b"llama-xla prefix cache").digest()  # the first page's parent: fixed, so hashes repeat across runs


def page_size_for(max_seq_len):
    """The page size for a model context of max_seq_len tokens, by vLLM's rule for torch_xla's
    ragged paged attention kernel (`PallasAttentionBackend.get_page_size`): at most 16 pages for the
    longest request's next power of two, clamped to [16, 256] tokens (16 for contexts up to 256
    tokens, 128 for 2,048, 256 for 4,096 and 8,192); above 8,192 tokens 16 again, vLLM's fix for the
    kernel spilling out of VMEM with large pages (Llama 3.1's 131,072: 16)."""
    if max_seq_len > 8192:
        return 16
    return min(max(1 << (max_seq_len - 1).bit_length() >> 4, 16), 256)


def page_hash(parent, tokens, extra=()):
    """The name of a full page: sha256 of its parent's name, its token ids and `extra` (what else
    changes its keys and values, such as a LoRA adapter's name; hashed as its repr)."""
    return hashlib.sha256(parent + struct.pack(f"<{len(tokens)}q", *tokens) + repr(extra).encode()).digest()


def page_hashes(tokens, page_size, hashes=(), extra=()):
    """`hashes` (the names of the first full pages of `tokens`) extended to every full page of tokens."""
    hashes = list(hashes)
    for start in range(len(hashes) * page_size, len(tokens) - page_size + 1, page_size):
        hashes.append(page_hash(hashes[-1] if hashes else ROOT, tokens[start:start + page_size], extra))
    return hashes


def pages_for(n_tokens, page_size):
    return -(-n_tokens // page_size)


class PagePool:
    """Pages 1 .. num_pages - 1 (page 0 takes padding writes), each held by some requests (a count)
    or free. Free pages queue in the order they were freed; `allocate` takes from the front and
    forgets the hash of a cached page it takes (an eviction)."""

    def __init__(self, num_pages, page_size):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages} must be >= 2 (page 0 is the padding's)")
        self.num_pages, self.page_size = num_pages, page_size
        self.refs = [0] * num_pages
        self.free_queue = collections.OrderedDict.fromkeys(range(1, num_pages))  # least recently freed first
        self.cached = {}  # hash -> page
        self.hash_of = {}  # page -> hash
        self.evictions = 0  # cached pages handed out again

    @property
    def free_pages(self):
        return len(self.free_queue)

    @property
    def used_pages(self):  # pages some request holds
        return self.num_pages - 1 - len(self.free_queue)

    def lookup(self, hashes):
        """The cached pages of the longest prefix of `hashes`; nothing is held yet."""
        pages = []
        for h in hashes:
            if h not in self.cached:
                break
            pages.append(self.cached[h])
        return pages

    def hold(self, pages):
        """One more holder for each page (a cache hit): a free one leaves the free queue, keeping its contents."""
        for p in pages:
            if self.refs[p] == 0:
                del self.free_queue[p]
            self.refs[p] += 1

    def allocate(self, n):
        """n fresh pages for one holder, or None (and nothing taken) if fewer than n are free."""
        if n > len(self.free_queue):
            return None
        pages = [self.free_queue.popitem(last=False)[0] for _ in range(n)]
        for p in pages:
            h = self.hash_of.pop(p, None)
            if h is not None:  # it held a cached page: that prefix is gone
                del self.cached[h]
                self.evictions += 1
            self.refs[p] = 1
        return pages

    def register(self, page, h):
        """Page `page` is full and holds the prefix named h: later requests may reuse it (the first
        page registered under a name keeps it)."""
        if h not in self.cached and page not in self.hash_of:
            self.cached[h], self.hash_of[page] = page, h

    def free(self, pages):
        """One holder fewer for each page; a page no one holds goes to the back of the free queue.
        A request's last pages go first, so they are evicted before its first ones, which more
        requests share (vLLM frees in reverse order for the same reason)."""
        for p in reversed(pages):
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free_queue[p] = None
