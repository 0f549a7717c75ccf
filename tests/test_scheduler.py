"""The scheduler, without a device: the budget, chunked prefill beside decoding, pages (growth,
preemption and recompute), the prefix cache, slots."""
import itertools

from llama_xla_helpers.kv_pages import PagePool
from llama_xla_helpers.scheduler import Request, Scheduler, replay


FRESH = itertools.count(1000)  # token ids no other prompt has: no prefix-cache hits unless a test wants them


def req(prompt, max_tokens):
    """A request with prompt (a list of ids, or a length: that many fresh ids)."""
    return Request(list(prompt) if not isinstance(prompt, int) else list(itertools.islice(FRESH, prompt)), max_tokens)


def runs(plan):
    return [(r, start, n) for r, start, n, _ in plan.entries]


def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_decode():
    sched = Scheduler(slots=3, budget=32, pool=PagePool(64, 16))
    a, b = req(10, 50), req(20, 50)
    sched.add(a), sched.add(b)
    first = sched.schedule()
    assert runs(first) == [(a, 0, 10), (b, 0, 20)] and first.tokens == 30
    assert [s for *_, s in first.entries] == [True, True]  # both prompts whole: each samples its first token
    long = req(100, 5)
    sched.add(long)
    plans = [sched.schedule() for _ in range(4)]
    assert [runs(p) for p in plans] == [
        [(a, 10, 1), (b, 20, 1), (long, 0, 30)], [(a, 11, 1), (b, 21, 1), (long, 30, 30)],
        [(a, 12, 1), (b, 22, 1), (long, 60, 30)], [(a, 13, 1), (b, 23, 1), (long, 90, 10)]]
    assert [p.entries[-1][3] for p in plans] == [False, False, False, True]  # only its last chunk samples
    assert all(p.tokens <= 32 for p in plans)


def test_pages_grow_with_the_positions_and_free_when_the_last_token_is_asked_for():
    pool = PagePool(16, 4)
    sched = Scheduler(slots=2, budget=64, pool=pool)
    a = req(6, 5)
    sched.add(a)
    held = []
    while a.dispatched < a.max_tokens:
        sched.schedule()
        held.append(len(a.pages))
    # positions written: 6, 7, 8, 9, 10 (the 5th token is asked for and never written)
    assert held == [2, 2, 2, 3, 3] and sched.running == [None, None]
    assert pool.used_pages == 0  # back in the pool, and its full page of known tokens cached (positions 0-3:
    assert len(pool.cached) == 1  # no token was read back here, so positions 4-7 are not known)


def test_a_short_pool_preempts_the_last_admitted_which_is_recomputed_from_its_cached_pages():
    pool = PagePool(7, 4)  # 6 usable pages: 24 positions
    sched = Scheduler(slots=2, budget=64, pool=pool)
    a, b = req(range(100, 108), 30), req(range(200, 208), 30)
    timeline = replay(sched, [(a.prompt, 12, 12), (b.prompt, 12, 12)])
    # both fit at first (2 + 2 pages + growth); when the pool runs short, b (admitted last) is preempted
    assert sched.preemptions >= 1
    preempted_at = next(i for i, step in enumerate(timeline) if 1 not in step and i > 0)
    assert 0 in timeline[preempted_at]
    assert all(sum(step.values()) <= 6 for step in timeline)  # never more pages than the pool has
    assert sched.hits > 0  # its recompute found its own full pages still cached
    assert not sched.busy() and pool.used_pages == 0


def test_nothing_is_admitted_in_a_step_that_preempts_and_a_preempted_request_waits_first():
    pool = PagePool(5, 2)  # 4 pages: 8 positions
    sched = Scheduler(slots=3, budget=16, pool=pool)
    a, b, c = req(3, 10), req(3, 10), req(1, 10)
    for r in (a, b):
        sched.add(r)
    sched.schedule()  # a: 2 pages, b: 2 pages
    sched.add(c)
    plan = sched.schedule()  # a writes position 3 (its page 2 has room), b position 3: no page needed
    assert runs(plan) == [(a, 3, 1), (b, 3, 1)] and list(sched.waiting) == [c]  # c: no page left
    plan = sched.schedule()  # a needs a third page: b is preempted
    assert plan.preempted == [b] and runs(plan) == [(a, 4, 1)]
    assert list(sched.waiting) == [b, c] and b.pages == [] and b.computed == 0 and b.slot is not None
    b.tokens = [5, 6]  # the tokens it made, read back by the engine (one step late)
    sched.finish(a)
    plan = sched.schedule()
    assert runs(plan)[0][0] is b  # the preempted request goes first
    assert b.dispatched == 3 and b.length == 6  # its prompt and both tokens, its third token asked for now


def test_a_cached_prefix_is_reused_and_the_last_token_always_runs():
    pool = PagePool(32, 4)
    sched = Scheduler(slots=4, budget=64, pool=pool)
    system = list(range(10, 22))  # 12 tokens: 3 full pages
    a = req(system + [1, 2], 1)
    sched.add(a)
    sched.schedule()  # a's one token asked for: it is released, its pages cached
    assert a not in sched.order and pool.used_pages == 0 and len(pool.cached) == 3
    b, c = req(system + [3, 4, 5], 2), req(system, 2)
    sched.add(b), sched.add(c)
    plan = sched.schedule()
    assert runs(plan) == [(b, 12, 3), (c, 8, 4)]  # c's whole prompt is cached, but its last page runs again
    assert (b.cached_tokens, c.cached_tokens) == (12, 8)
    assert b.pages[:3] == c.pages[:2] + [b.pages[2]] and pool.refs[b.pages[0]] == 2
    assert sched.queries == 14 + 15 + 12 and sched.hits == 20


def test_requests_admitted_in_one_step_share_the_pages_an_earlier_one_fills():
    pool = PagePool(32, 4)
    sched = Scheduler(slots=4, budget=64, pool=pool)
    prompt = list(range(30, 39))  # 2 full pages and one token
    reqs = [req(prompt, 3) for _ in range(3)]  # n = 3: the same prompt three times
    for r in reqs:
        sched.add(r)
    plan = sched.schedule()
    assert runs(plan) == [(reqs[0], 0, 9), (reqs[1], 8, 1), (reqs[2], 8, 1)]
    assert reqs[1].pages[:2] == reqs[2].pages[:2] == reqs[0].pages[:2] and pool.used_pages == 2 + 3


def test_a_finished_or_cancelled_request_frees_its_slot_and_pages():
    pool = PagePool(8, 4)
    sched = Scheduler(slots=1, budget=8, pool=pool)
    a, b = req(5, 50), req(5, 50)
    sched.add(a), sched.add(b)
    sched.schedule()
    sched.finish(b)  # cancelled while waiting
    assert list(sched.waiting) == [] and sched.running == [a]
    sched.finish(a)
    assert sched.running == [None] and pool.used_pages == 0 and not sched.busy()


def test_replay_counts_each_requests_pages_per_step():
    sched = Scheduler(slots=2, budget=8, pool=PagePool(16, 4))
    timeline = replay(sched, [(6, 3, 3), (3, 2, 1), (2, 2, 2)], arrivals=[0, 0, 1])
    # step 0: 6 + 2 of the second's 3 prompt tokens (budget 8); the third waits for a slot
    assert timeline[0] == {0: 2, 1: 1}
    assert timeline[1] == {0: 2, 1: 1}
    assert 2 in timeline[3] and 1 not in timeline[3]  # the second ended on its first token (an EOS)


def test_a_decode_step_hashes_a_page_once_when_it_fills_whatever_the_context(monkeypatch):
    """The scheduler's work per step follows the step's new tokens: after a 4,000-token prompt, 64
    decode steps of 16-position pages name 4 new pages (one each time a page fills) and never join
    the prompt and the tokens into one list (`Request.known`), which would cost the whole context."""
    from llama_xla_helpers import kv_pages
    hashed, joined = [], []
    monkeypatch.setattr(kv_pages, "page_hash", lambda parent, tokens, extra=(): hashed.append(len(tokens)) or parent)
    monkeypatch.setattr(Request, "known", property(lambda r: joined.append(1) or r.prompt + r.tokens))
    sched = Scheduler(slots=1, budget=4096, pool=PagePool(300, 16))
    long = req(4000, 65)
    sched.add(long)
    sched.schedule()  # the whole prompt: its 250 pages named when admitted
    hashed.clear(), joined.clear()
    for _ in range(64):
        long.tokens.append(7)  # the token the last step made, read back
        assert runs(sched.schedule()) == [(long, len(long.prompt) + len(long.tokens) - 1, 1)]
    assert hashed == [16] * 4 and joined == []
