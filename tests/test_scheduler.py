"""The scheduler, without a device: the budget, chunked prefill beside decoding, kv lengths, slots."""
import pytest

from llama_xla_helpers.scheduler import Request, Scheduler, kv_buckets, prefill_shapes, replay

BUCKETS, MAX_SEQ_LEN = (16, 32), 128


def req(prompt_len, max_tokens):
    return Request([1] * prompt_len, max_tokens)


def test_kv_buckets_double_up_to_the_cache_and_prefill_shapes_cover_every_section():
    assert kv_buckets((64, 128, 256, 512), 768) == (64, 128, 256, 512, 768)
    assert kv_buckets(BUCKETS, MAX_SEQ_LEN) == (16, 32, 64, 128)
    assert prefill_shapes(BUCKETS, MAX_SEQ_LEN) == [(16, 16), (32, 32), (32, 64), (32, 128)]
    sched = Scheduler(1, BUCKETS, MAX_SEQ_LEN, budget=32)
    sched.add(req(100, 2))  # sections 16 + 32 + 32 + 32 = 112
    shapes = [(n, kv) for _ in range(4) for _, _, n, kv in sched.schedule().prefill]
    assert shapes == [(16, 16), (32, 64), (32, 128), (32, 128)]  # ends 16, 48, 80, 112, rounded up
    assert set(shapes) <= set(prefill_shapes(BUCKETS, MAX_SEQ_LEN))


def test_a_long_prompt_is_prefilled_a_section_per_step_while_the_others_decode():
    sched = Scheduler(3, BUCKETS, MAX_SEQ_LEN, budget=35)  # one 32-token section + 3 decoded tokens
    a, b = req(10, 50), req(20, 50)
    sched.add(a), sched.add(b)
    first = sched.schedule()
    assert [(r, n) for r, _, n, _ in first.prefill] == [(a, 16)]  # b's 32 does not fit after a's 16 + a's token
    assert first.decode == [a] and first.kv_len == 32  # a decodes at once: position 16 -> kv 32
    long = req(100, 5)
    sched.add(long)
    plans = [sched.schedule() for _ in range(5)]
    assert [[(r, n) for r, _, n, _ in p.prefill] for p in plans] == [
        [(b, 32)], [(long, 16)], [(long, 32)], [(long, 32)], [(long, 32)]]
    assert all(a in p.decode and b in p.decode for p in plans)  # never stalled
    assert long in plans[-1].decode and all(p.tokens <= 35 for p in plans)
    assert [p.kv_len for p in plans] == [64, 64, 64, 64, 128]  # b at 32 + 2, ..., long at 112 + 1


def test_a_slot_frees_when_its_last_token_is_asked_for_and_one_request_prefills_at_a_time():
    sched = Scheduler(1, BUCKETS, MAX_SEQ_LEN, budget=100)
    a, b = req(5, 2), req(5, 3)
    sched.add(a), sched.add(b)
    p1 = sched.schedule()
    assert [r for r, *_ in p1.prefill] == [a] and p1.decode == [a]  # both of a's tokens asked for
    p2 = sched.schedule()  # a's slot is already free: b takes it before a's tokens are read
    assert [r for r, *_ in p2.prefill] == [b] and b.slot == 0
    sched.finish(a)  # a is read late: its slot is b's now and stays b's
    assert sched.running == [b]


def test_finish_frees_a_slot_or_leaves_the_queue():
    sched = Scheduler(1, BUCKETS, MAX_SEQ_LEN)
    a, b = req(5, 50), req(5, 50)
    sched.add(a), sched.add(b)
    sched.schedule()
    sched.finish(b)  # cancelled while waiting
    assert list(sched.waiting) == [] and sched.running == [a]
    sched.finish(a)
    assert sched.running == [None] and not sched.busy()


def test_budget_must_be_positive():
    with pytest.raises(ValueError, match="budget=-1 must be >= 1"):
        Scheduler(1, BUCKETS, MAX_SEQ_LEN, budget=-1)


def test_replay_learns_each_end_one_step_late():
    # (prompt length, max_tokens, tokens made): the second ends early (EOS), the others at max_tokens.
    timeline = replay(Scheduler(2, BUCKETS, MAX_SEQ_LEN), [(5, 3, 3), (5, 9, 2), (5, 2, 2)])
    assert timeline == [[0, 1], [0, 1], [2, None]]  # 1 ended at its 2nd token, known after its 3rd was asked for
