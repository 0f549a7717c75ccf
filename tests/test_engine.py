"""Engine: continuous batching over a paged KV cache gives each request the tokens it gets alone
(unsharded and tensor-parallel; after a preemption; with a prefix-cache hit), nothing compiles
after warm-up (and a compile raises), bad requests fail alone, the queue is bounded, requests
finish on EOS / stop strings / max_tokens or cancel, the pages are written in place."""
import functools
import json
import re
import threading

import pytest
import torch
import torch_xla.runtime

from llama_xla_helpers import hlo
from llama_xla_helpers.configs import get_config
from llama_xla_helpers.engine import SAMPLE_TOP_K, Engine, QueueFull, RecompileError, sample_rows
from llama_xla_helpers.generate import Generator, greedy_check
from llama_xla_helpers.mesh import make_mesh
from llama_xla_helpers.metrics import count_compiles
from llama_xla_helpers.model import Llama
from llama_xla_helpers.parallel import shard_for_inference
from llama_xla_helpers.runner import default_compile, step_program
from llama_xla_helpers.kv_pages import PagePool
from llama_xla_helpers.scheduler import Scheduler, replay
from util import N, hf_model, teacher_forced_agreement, tp_size

pytestmark = pytest.mark.fixed_dtype  # no test here reads the default dtype (conftest checks)

BUCKETS = (16, 32)  # a step's token counts: its budget is 32
MAX_SEQ_LEN = 128  # pages of 16 positions (kv_pages.page_size_for)
LENGTHS = (5, 20, 40, 3, 31, 12, 33)  # 40 and 33 are prefilled in two chunks at least


def prompts(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


@functools.cache
def hf():
    return hf_model(get_config("tiny", num_hidden_layers=2, initializer_range=0.2))


@functools.cache
def expected():
    """Each prompt's greedy tokens from `Generator`, run on that prompt alone (max_tokens 10 + i)."""
    gen = Generator(Llama.from_hf(hf(), max_batch_size=1, max_seq_len=MAX_SEQ_LEN), buckets=BUCKETS)
    out = [gen.generate([p], 10 + i)[0][0] for i, p in enumerate(prompts())]
    assert all(len(set(t)) > 3 for t in out), "the model repeats itself: the test proves nothing"
    return out


def engine(mesh_shape=None, slots=4, **kwargs):
    model = Llama.from_hf(hf(), max_batch_size=slots, max_seq_len=MAX_SEQ_LEN)
    if mesh_shape is not None:
        model = shard_for_inference(model, make_mesh(mesh_shape))
    eng = Engine(model, slots=slots, buckets=BUCKETS, **{"compile": False, **kwargs})  # lazy: a few requests each
    eng.warmup()
    return eng


def decode(tokens):
    """One character per token id (random bytes are rarely valid UTF-8), so text grows token by token."""
    return "".join(chr(0x4E00 + t) for t in tokens)


@functools.cache
def shared_engine():
    return engine(max_queue=4, decode=decode)


def run(eng, reqs):
    while not all(r.done for r in reqs):
        eng.step()
    return reqs


@pytest.mark.devices
@pytest.mark.parametrize("mesh_shape", [None, (N // tp_size(4), tp_size(4))], ids=["unsharded", "tensor-parallel"])
def test_tokens_equal_generator_alone_whatever_shares_the_batch(mesh_shape):
    want, eng = expected(), engine(mesh_shape, slots=4 if mesh_shape is None else max(4, mesh_shape[0]))
    ps, compiles = prompts(), count_compiles()
    reqs = [eng.submit(p, 10 + i) for i, p in enumerate(ps[:3])]
    for _ in range(4):  # the first three decode while the others arrive, more than there are slots
        eng.step()
    reqs += [eng.submit(p, 10 + i) for i, p in enumerate(ps[3:], start=3)]
    run(eng, reqs)
    assert [r.tokens for r in reqs] == list(want)
    assert [r.finish_reason for r in reqs] == ["length"] * len(reqs)
    assert count_compiles() == compiles and eng.compiles_since_warmup == 0
    # Every slot was busy at once, and requests that came later took the slots of those that ended.
    assert max(map(len, eng.timeline)) == eng.slots and len({r.slot for r in reqs}) <= eng.slots


def test_prompts_arriving_together_run_in_one_step_and_get_what_they_get_alone():
    """Four short prompts arrive at once: their prompts go through the model in one step (one
    program), beside each other on the flat token axis; each request's greedy and sampled tokens,
    log-probabilities and echoed prompt equal its own run alone; nothing compiles after warm-up."""
    eng, short = engine(), prompts((5, 7, 9, 3), seed=3)
    kinds = [dict(), dict(temperature=1.0, seed=7), dict(logprobs=2, prompt_logprobs=True)]
    alone = [[run(eng, [eng.submit(p, 8, **kind)])[0] for p in short] for kind in kinds]
    for kind, want in zip(kinds, alone):
        eng.timeline.clear()
        got = run(eng, [eng.submit(p, 8, **kind) for p in short])
        assert list(eng.timeline)[0] == {r.id: 1 for r in got}  # all four in the first step, a page each
        assert [r.tokens for r in got] == [r.tokens for r in want]
        for g, w in zip(got, want):
            for a, b in zip(g.token_logprobs + g.prompt_token_logprobs, w.token_logprobs + w.prompt_token_logprobs):
                assert a[0] == pytest.approx(b[0], abs=1e-5) and [i for i, _ in a[1]] == [i for i, _ in b[1]]
    assert eng.compiles_since_warmup == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(slots=0), r"slots=0 must be an int >= 1"),
    (dict(slots=40), r"the largest bucket \(32 tokens, a step's budget\) < slots=40"),
    (dict(buckets=(32, 16)), r"buckets=\(32, 16\) must be increasing positive ints"),
    (dict(pages=1), r"pages=1 must be an int >= 2"),
    (dict(max_queue=0), "max_queue=0 must be an int >= 1"),
])
def test_a_bad_engine_argument_is_one_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Engine(Llama.from_hf(hf(), max_batch_size=4, max_seq_len=MAX_SEQ_LEN), **{"slots": 4, "buckets": BUCKETS, **kwargs})


def test_a_bf16_engine_compiles_nothing_after_warmup_and_agrees_with_fp32():
    """bf16 requests beside each other, as a TPU serves by default: no compile after warm-up; each
    request's tokens are a bf16 model's greedy choices (teacher-forced, `greedy_check`: no clear
    choice differs, near-ties within 0.05 skipped), and that model's next tokens agree with fp32
    Generator's alone on at least 95% of the generated positions, with bf16 matmuls. Weights of std
    0.05: at tiny()'s 0.2 the logits' top two are so often near ties that Hugging Face's own bf16
    model agrees with its fp32 on only 94% (measured)."""
    hf05, ps = hf_model(get_config("tiny", num_hidden_layers=2, initializer_range=0.05)), prompts()[:4]
    fp32 = Generator(Llama.from_hf(hf05, max_batch_size=1, max_seq_len=MAX_SEQ_LEN), buckets=BUCKETS)
    want = [fp32.generate([p], 12)[0][0] for p in ps]
    assert len({t for w in want for t in w}) > 10, "the model repeats itself: the test proves nothing"
    bf16 = functools.partial(Llama.from_hf, hf05, max_seq_len=MAX_SEQ_LEN, dtype=torch.bfloat16)
    eng = Engine(bf16(max_batch_size=4), slots=4, buckets=BUCKETS, compile=False)
    eng.warmup()
    reqs = run(eng, [eng.submit(p, 12) for p in ps])
    assert eng.compiles_since_warmup == 0 and all(len(r.tokens) == 12 for r in reqs)
    alone = bf16(max_batch_size=1).to(eng.model.embed_tokens.weight.device)  # the engine took its model's caches
    assert all(greedy_check(alone, p, r.tokens, 0.05)[0] == [] for p, r in zip(ps, reqs))
    scores = [teacher_forced_agreement(fp32.model, alone, torch.tensor([p + w]), len(p)) for p, w in zip(ps, want)]
    agreement = sum(a for a, _ in scores) / len(scores)
    print(f"top-1 agreement {agreement:.1%}")
    assert agreement >= 0.95 and all(dots == {"bf16"} for _, dots in scores)


def test_a_compile_after_warmup_raises():
    eng = engine(slots=2)
    eng.model.norm.eps = 1e-3  # a Python float baked into the decode graph: a new graph
    eng.submit(prompts()[0], 4)
    with pytest.raises(RecompileError, match="after warm-up"):
        eng.step()


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=[]), "prompt 0 is empty"),
    (dict(prompt=[1] * 121), r"the longest prompt \(121 tokens\) \+ max_tokens=8 = 129 cache slots > max_seq_len=128"),
    (dict(max_tokens=0), "max_tokens=0 must be an int >= 1"),
    (dict(temperature=-0.5), "temperature=-0.5 must be >= 0"),
    (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
    (dict(prompt=[300]), r"token id 300 outside the vocabulary \[0, 264\)"),
])
def test_bad_request_fails_alone(kwargs, message):
    eng = shared_engine()
    good = eng.submit(prompts()[0], 10)
    request = dict(prompt=[1, 2, 3], max_tokens=8) | kwargs
    with pytest.raises(ValueError, match=message):
        eng.submit(request.pop("prompt"), **request)
    run(eng, [good])
    assert good.tokens == expected()[0]


def test_full_queue_refuses_and_loses_nothing():
    eng = engine(slots=2, max_queue=1)  # fewer than the buckets: warm-up must not need a longer queue
    eng.cancel(eng.submit(prompts()[2], 10))  # a cancelled request no longer counts
    first = eng.submit(prompts()[0], 10)
    with pytest.raises(QueueFull, match=r"1 requests are waiting \(max_queue=1\)"):
        eng.submit([1, 2], 4)
    eng.step()  # `first` takes a slot: the queue has room again
    reqs = [first] + [eng.submit(prompts()[1], 11)]
    run(eng, reqs)
    assert [r.tokens for r in reqs] == list(expected()[:2])


def test_finish_on_eos_stop_string_and_max_tokens():
    eng, want = shared_engine(), expected()[1]
    text = decode(want)
    stop = text[3:5]  # a stop string inside the greedy text
    eng.eos_ids = {want[4], 263}  # Llama 3 has several EOS ids; the one met ends it
    try:
        by_eos = eng.submit(prompts()[1], 11)
        by_stop = eng.submit(prompts()[1], 11, stop=[stop])
        run(eng, [by_eos, by_stop])
    finally:
        eng.eos_ids = frozenset()
    assert by_eos.finish_reason == "stop" and by_eos.tokens == want[:want.index(want[4]) + 1]
    assert by_stop.finish_reason == "stop" and by_stop.text == text[:text.index(stop)]
    one = run(eng, [eng.submit(prompts()[1], 1)])[0]
    assert one.finish_reason == "length" and one.tokens == want[:1]


def test_min_tokens_masks_the_eos_ids_on_the_device_and_ignore_eos_runs_past_them():
    """EOS ids that greedy decoding writes: at step k of one prompt (a decode step's sampling), and
    first for another (its prefill's). A plain request stops there; with ignore_eos it runs to
    max_tokens with the tokens of a run without EOS ids; with min_tokens past them the step masks
    them, and the token there is the next most likely by hand, from Hugging Face's logits with the
    EOS ids' set to -inf."""
    p, want = prompts()[1], expected()[1]
    k = next(k for k in range(2, len(want)) if want[k] not in want[:k])
    j = next(j for j in range(2, len(LENGTHS)) if expected()[j][0] not in want[:k + 1])
    q, first = prompts()[j], expected()[j][0]
    eng = engine(eos_id=[want[k], first])
    plain, ignoring, masked, plain_q, masked_q = run(eng, [
        eng.submit(p, 11), eng.submit(p, 11, ignore_eos=True), eng.submit(p, 11, min_tokens=k + 1),
        eng.submit(q, 4), eng.submit(q, 4, min_tokens=1)])
    assert (plain.tokens, plain.finish_reason, plain_q.tokens) == (want[:k + 1], "stop", [first])
    assert (ignoring.tokens, ignoring.finish_reason) == (want, "length")

    def by_hand(ids):  # the greedy token after ids with the EOS ids masked
        with torch.no_grad():
            logits = hf()(torch.tensor([ids])).logits[0, -1]
        logits[[want[k], first]] = float("-inf")
        top2 = logits.topk(2).values
        assert top2[0] - top2[1] > 1e-3, "a near tie: the test proves nothing"
        return int(logits.argmax())
    assert masked.tokens[:k + 1] == want[:k] + [by_hand(p + want[:k])]
    assert masked_q.tokens[0] == by_hand(q) and eng.compiles_since_warmup == 0
    with pytest.raises(ValueError, match=r"min_tokens=12 must be an int in \[0, max_tokens=11\]"):
        eng.submit(p, 11, min_tokens=12)


def by_hand(prompt, n, bias=None, presence=0.0, frequency=0.0):
    """n greedy tokens after prompt from Hugging Face's logits, changed as OpenAI's logit_bias and
    penalties say: plus the bias, minus frequency x count and presence where the count is above 0,
    the counts over the tokens generated so far."""
    out = []
    for _ in range(n):
        with torch.no_grad():
            logits = hf()(torch.tensor([prompt + out])).logits[0, -1].double()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).double()
        logits = logits - frequency * counts - presence * (counts > 0).double()
        for token, b in (bias or {}).items():
            logits[token] += b
        top2 = logits.topk(2).values
        assert top2[0] - top2[1] > 1e-3, "a near tie: the test proves nothing"
        out.append(int(logits.argmax()))
    return out


def test_logit_bias_and_penalties_equal_a_by_hand_reference_after_preemptions_too():
    """Greedy requests with penalties or a logit_bias (banning the tokens a plain run writes, or
    forcing one) get the tokens of `by_hand`, beside plain ones that get theirs, in a pool short
    enough that the engine preempts (the penalized requests, admitted last, among them: their counts
    are rebuilt as their tokens run again). Afterwards the same slots serve plain requests with
    their plain tokens: a new request's counts and bias start from zero. Nothing compiles."""
    eng, ps, want = engine(pages=7), prompts(), expected()
    plain = [eng.submit(p, 10 + i) for i, p in enumerate(ps[1:3], start=1)]
    chosen = [ps[i] for i in (1, 3, 6)]  # not ps[2]: a near tie of its 12 penalized tokens
    penalized = [eng.submit(p, 12, presence_penalty=0.3, frequency_penalty=1.1) for p in chosen]
    banned = {t: -100 for t in want[4]}
    biased = [eng.submit(ps[4], 12, logit_bias=banned), eng.submit(ps[5], 6, logit_bias={7: 100})]
    run(eng, plain + penalized + biased)
    assert any(r.preemptions for r in penalized) and eng.compiles_since_warmup == 0
    assert [r.tokens for r in plain] == list(want[1:3])
    hand = [by_hand(p, 12, presence=0.3, frequency=1.1) for p in chosen]
    assert [r.tokens for r in penalized] == hand and hand != [want[i][:12] for i in (1, 3, 6)]
    assert biased[0].tokens == by_hand(ps[4], 12, banned) and not set(biased[0].tokens) & set(banned)
    assert biased[1].tokens == [7] * 6
    again = run(eng, [eng.submit(p, 10 + i) for i, p in enumerate(ps[:4])])
    assert [r.tokens for r in again] == list(want[:4]) and eng.compiles_since_warmup == 0


def test_a_step_writes_at_most_300_logit_bias_entries_and_bad_values_are_named():
    """Two requests of 200 entries each (the vocabulary's 264 ids hold no 300): the second is admitted
    a step after the first (the step's budget of 300 bias writes), and both get their by-hand tokens.
    Out-of-range values are refused."""
    eng, ps = engine(), prompts()
    bias = [{t: (-1) ** t * 5.0 for t in range(k, k + 200)} for k in (0, 64)]
    reqs = run(eng, [eng.submit(p, 4, logit_bias=b) for p, b in zip(ps[:2], bias)])
    first = [min(k for k, step in enumerate(eng.timeline) if r.id in step) for r in reqs]
    assert first[1] == first[0] + 1
    assert [r.tokens for r in reqs] == [by_hand(p, 4, b) for p, b in zip(ps[:2], bias)]
    for kwargs, message in ((dict(logit_bias={t: 1 for t in range(301)}), "logit_bias=<301 entries> holds more"),
                            (dict(logit_bias={999: 1}), r"logit_bias=\{999: 1\} must map token ids in \[0, 264\)"),
                            (dict(logit_bias={3: 101}), "to numbers in \\[-100, 100\\]"),
                            (dict(presence_penalty=2.5), r"presence_penalty=2.5 must be a number in \[-2, 2\]")):
        with pytest.raises(ValueError, match=message):
            eng.submit(ps[0], 4, **kwargs)


SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["colour", "ok", "n"], "additionalProperties": False}


def test_a_grammar_constrains_every_token_greedy_or_sampled_and_ends_the_request():
    """A JSON schema over the byte tokenizer (`grammar.Grammars`): a greedy answer is the by-hand
    loop's (at each step the argmax of Hugging Face's logits among the tokens the grammar allows,
    `sampling.allowed_by` of the matcher's bitmask) and ends on EOS once complete ("stop"); sampled
    ones parse and validate too; max_tokens cuts one ("length"); a plain request beside them gets
    its tokens (the engine reads every step before the next while a grammar runs), and one
    cancelled mid-answer ends alone. Nothing compiles."""
    import jsonschema

    from llama_xla_helpers.grammar import Grammars, matcher
    from llama_xla_helpers.sampling import allowed_by
    from llama_xla_helpers.tokenizer import ByteTokenizer
    tok, eng, ps = ByteTokenizer(), engine(eos_id=ByteTokenizer.eos_id), prompts()
    vocab = eng.vocab_size
    compiled = Grammars(tok, vocab, eng.eos_ids).json_schema(SCHEMA)
    greedy, cut, plain = eng.submit(ps[0], 60, grammar=compiled), eng.submit(ps[1], 3, grammar=compiled), \
        eng.submit(ps[2], 12)
    sampled = [eng.submit(p, 60, temperature=1.0, seed=i, grammar=compiled) for i, p in enumerate(ps[3:6])]
    cancelled = eng.submit(ps[6], 60, grammar=compiled)
    while len(cancelled.tokens) < 3:
        eng.step()
    eng.cancel(cancelled)
    run(eng, [greedy, cut, plain, *sampled, cancelled])
    assert cancelled.finish_reason == "cancelled" and 0 < len(cancelled.tokens) < 20
    state, out, mask = matcher(compiled), [], torch.full((1, -(-vocab // 32)), -1, dtype=torch.int32)
    while not state.is_terminated():
        with torch.no_grad():
            logits = hf()(torch.tensor([ps[0] + out])).logits[0, -1]
        state.fill_next_token_bitmask(mask, 0)
        logits = logits.masked_fill(~allowed_by(mask, vocab)[0], float("-inf"))
        assert logits.topk(2).values.diff().abs() > 1e-3 or logits.isfinite().sum() == 1, "a near tie"
        out.append(int(logits.argmax()))
        assert state.accept_token(out[-1])
    assert greedy.tokens == out and out[-1] == tok.eos_id and greedy.finish_reason == "stop"
    for r in [greedy, *sampled]:
        assert r.finish_reason == "stop", tok.decode(r.tokens)
        jsonschema.validate(json.loads(tok.decode(r.tokens)), SCHEMA)
    assert (len(cut.tokens), cut.finish_reason) == (3, "length") and tok.decode(cut.tokens).startswith('{"')
    want = expected()[2]
    assert plain.tokens == want[:want.index(tok.eos_id) + 1 if tok.eos_id in want else None]  # EOS ends it
    assert eng.compiles_since_warmup == 0
    with pytest.raises(ValueError, match="min_tokens=2 with a grammar"):
        eng.submit(ps[0], 8, min_tokens=2, grammar=compiled)


def test_a_steps_integers_and_its_bitmask_go_in_one_transfer_and_come_back_whole():
    """`runner.packed` puts a step's lists, 2-D lists and a host tensor (the grammar's int32 bitmask,
    words with bit 31 set among them) in one int64 tensor, through one `put`; `unpacked` gives each
    back with its values and shape, the bitmask's too once cast back to int32."""
    from llama_xla_helpers.runner import packed, unpacked
    mask = torch.tensor([[-1, -2 ** 31], [5, 2 ** 31 - 1]], dtype=torch.int32)
    fields = dict(tokens=[3, 1, 4], targets=None, rows=[[1, 5], [9, 2]], bitmask=mask, seq=[6])
    puts = []
    flat, layout = packed(fields, lambda t: puts.append(t) or t, torch.long)
    assert len(puts) == 1 and flat.dtype == torch.long and flat.numel() == 3 + 4 + 4 + 1
    x = unpacked(flat, layout)
    assert set(x) == {"tokens", "rows", "bitmask", "seq"}
    for name in x.keys() - {"bitmask"}:
        assert x[name].tolist() == fields[name]
    assert torch.equal(x["bitmask"].int(), mask)


def test_cancel_frees_the_slot():
    eng = engine(slots=1)
    first, second = eng.submit(prompts()[0], 50), eng.submit(prompts()[1], 11)
    eng.step()
    assert first.slot == 0 and eng.metrics()["queue_length"] == 1
    eng.cancel(first)
    run(eng, [second])
    assert first.finish_reason == "cancelled" and len(first.tokens) < 50
    assert second.tokens == expected()[1]


def test_metrics_reads_the_queue_under_the_engines_lock():
    """/metrics runs in the server's thread while `submit` appends to the waiting queue (under the
    lock): metrics() reads under the lock too, else iterating the deque can raise "deque mutated
    during iteration"."""
    eng, out = shared_engine(), []
    with eng.lock:  # another thread inside submit
        reader = threading.Thread(target=lambda: out.append(eng.metrics()))
        reader.start()
        reader.join(timeout=0.5)
        assert reader.is_alive() and not out, "metrics() did not wait for the engine's lock"
    reader.join()
    assert out[0]["queue_length"] == 0 and out[0]["slots"] == eng.slots


def test_sampling_is_per_request_and_reproducible():
    eng, p = shared_engine(), prompts()[0]
    alone = run(eng, [eng.submit(p, 12, temperature=0.8, seed=7)])[0].tokens
    batch = run(eng, [eng.submit(q, 12, temperature=0.8, seed=7 if q is p else i)
                      for i, q in enumerate([prompts()[2], p, prompts()[3]])])
    other = run(eng, [eng.submit(p, 12, temperature=0.8, seed=8)])[0].tokens
    assert batch[1].tokens == alone and other != alone
    # top_p so small that only the most likely token is left: sampling gives the greedy tokens.
    nucleus = run(eng, [eng.submit(p, 10, temperature=1.0, top_p=1e-6, seed=3)])[0].tokens
    assert nucleus == expected()[0]


def test_generator_samples_with_the_engines_sampler():
    """One sampler (`generate.sample_rows`, noise from (seed, position)): Generator's row seeded s
    draws the tokens the engine's request seeded s draws."""
    gen = Generator(Llama.from_hf(hf(), max_batch_size=1, max_seq_len=MAX_SEQ_LEN), buckets=BUCKETS)
    eng, p = shared_engine(), prompts()[2]
    want = run(eng, [eng.submit(p, 12, temperature=0.9, top_p=0.95, seed=11)])[0].tokens
    assert want != expected()[2]  # sampled, not greedy
    assert gen.generate([p], 12, temperature=0.9, top_p=0.95, seed=11)[0] == [want]


def test_sample_rows_draws_from_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0]).repeat(20000, 1)  # (rows, vocab_size)
    n = logits.shape[0]
    seed, pos = torch.arange(n), torch.full((n,), 5)
    for temperature, top_p in [(1.0, 1.0), (0.5, 1.0), (1.0, 0.7)]:
        t = torch.tensor([temperature] * n)
        drawn = sample_rows(logits, t, torch.tensor([top_p] * n), seed, pos)
        probs = torch.softmax(logits[0] / temperature, -1)
        keep = probs.cumsum(-1) - probs <= top_p  # the nucleus
        probs = probs * keep / (probs * keep).sum()
        freq = torch.bincount(drawn, minlength=4).float() / n
        assert torch.allclose(freq, probs, atol=0.015), (temperature, top_p, freq, probs)
    greedy = sample_rows(logits[:3], torch.zeros(3), torch.ones(3), seed[:3], pos[:3])
    assert greedy.tolist() == [0, 0, 0]


def test_sample_rows_top_k_keeps_the_k_most_likely():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0]).repeat(20000, 1)
    n = logits.shape[0]
    seed, pos, ones = torch.arange(n), torch.full((n,), 5), torch.ones(n)
    drawn = sample_rows(logits, ones, ones, seed, pos, torch.full((n,), 2))
    probs = torch.softmax(logits[0, :2], -1)
    freq = torch.bincount(drawn, minlength=4).float() / n
    assert freq[2:].sum() == 0 and torch.allclose(freq[:2], probs, atol=0.015), freq
    assert SAMPLE_TOP_K < 264  # the tiny model's vocabulary: the engine's bound matters below


def test_top_k_1_is_greedy_and_the_engine_rejects_a_top_k_beyond_its_bound():
    eng, p = shared_engine(), prompts()[0]
    assert run(eng, [eng.submit(p, 10, temperature=5.0, top_k=1, seed=1)])[0].tokens == expected()[0]
    with pytest.raises(ValueError, match=f"top_k={SAMPLE_TOP_K + 1} must be an int in \\[0, {SAMPLE_TOP_K}\\]"):
        eng.submit(p, 10, top_k=SAMPLE_TOP_K + 1)
    with pytest.raises(ValueError, match="every stop string must be a non-empty string"):
        eng.submit(p, 10, stop=["a", ""])


def test_the_engine_runs_its_schedulers_plan_and_a_long_prompt_never_stalls_decoding():
    """The requests and pages of each step are those of a pure-Python replay of the engine's
    scheduler, one-step lag included; a prompt of 80 tokens arriving mid-way is prefilled a chunk
    per step while the running requests decode at every step."""
    eng, ps = engine(prefix_caching=False), prompts()  # (a shared engine's cached pages would shorten prefills)
    eng.eos_ids = {expected()[1][5]}  # request 1 ends early, on an EOS its engine learns a step late
    try:
        reqs = [eng.submit(ps[i], 10 + i) for i in range(3)]
        eng.timeline.clear()
        eng.step(), eng.step()
        reqs.append(eng.submit(ps[0] * 16, 6))  # 80 tokens: chunks of the budget left after the decodes
        run(eng, reqs)
    finally:
        eng.eos_ids = frozenset()
    made = [len(r.tokens) for r in reqs]
    assert reqs[1].finish_reason == "stop" and made[1] < 11
    work = [(r.prompt, r.max_tokens, n) for r, n in zip(reqs, made)]
    pool = PagePool(eng.pool.num_pages, eng.pool.page_size)
    want = replay(Scheduler(eng.slots, eng.buckets[-1], pool, prefix_caching=False), work, arrivals=[0, 0, 0, 2])
    assert list(eng.timeline) == [{reqs[i].id: pages for i, pages in step.items()} for step in want]
    for r in reqs:  # from its first step to its last, a request is in every step
        steps = [k for k, step in enumerate(eng.timeline) if r.id in step]
        assert steps == list(range(steps[0], steps[-1] + 1))
    assert [r.tokens for r in reqs[:1] + reqs[2:3]] == [expected()[0], expected()[2]]


def test_a_short_pool_preempts_and_recomputes_without_changing_a_token():
    """A pool of 6 pages (96 positions) for four requests that need 3 to 4 pages each: the engine
    preempts the request admitted last whenever a running one needs a page, recomputes it later
    (its cached pages reused), and every request's greedy and sampled tokens are those it gets alone."""
    eng, ps = engine(pages=7), prompts()
    greedy = [eng.submit(p, 10 + i) for i, p in enumerate(ps[1:5], start=1)]
    sampled = [eng.submit(p, 12, temperature=0.9, seed=i) for i, p in enumerate(ps[1:5])]
    run(eng, greedy + sampled)
    m = eng.metrics()
    assert m["preemptions_total"] > 0 and any(r.preemptions for r in sampled)  # a seeded request recomputed too
    assert m["prefix_hits_total"] > 0 and m["pages_used"] == 0
    assert [r.tokens for r in greedy] == list(expected()[1:5])
    alone = engine()
    assert [r.tokens for r in sampled] == [run(alone, [alone.submit(p, 12, temperature=0.9, seed=i)])[0].tokens
                                           for i, p in enumerate(ps[1:5])]
    assert eng.compiles_since_warmup == 0


def test_a_cached_prefix_is_reused_and_changes_no_token():
    """A second request with the first's 40-token prompt (plus a turn) finds its two full pages
    cached and prefills only the rest; greedy and sampled tokens equal those without the cache."""
    cached, cold, ps = engine(), engine(prefix_caching=False), prompts()
    system, turn = ps[2][:40], ps[4][:9]
    for eng in (cached, cold):
        run(eng, [eng.submit(system + [7], 4)])  # the first turn fills the pages
    got = run(cached, [cached.submit(system + turn, 10), cached.submit(system + turn, 10, temperature=1.0, seed=3)])
    want = run(cold, [cold.submit(system + turn, 10), cold.submit(system + turn, 10, temperature=1.0, seed=3)])
    # the second also finds the page the first filled in the same step (49 tokens: 3 full pages)
    assert [r.cached_tokens for r in got] == [32, 48] and [r.cached_tokens for r in want] == [0, 0]
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert cached.metrics()["prefix_hits_total"] == 80 and cold.metrics()["prefix_hits_total"] == 0


def test_a_request_the_pool_cannot_hold_is_refused_before_any_work():
    eng = engine(pages=3)  # 2 pages of 16: 32 positions
    with pytest.raises(ValueError, match=r"a prompt of 20 tokens \+ max_tokens=14 needs 3 pages of 16 positions, "
                                         r"more than the pool's 2"):
        eng.submit(prompts()[1], 14)
    assert eng.room(20) == 13 and run(eng, [eng.submit(prompts()[1], 13)])[0].tokens[:11] == expected()[1]


def test_compiled_with_dynamo_it_gives_the_same_tokens_and_compiles_nothing_after_warmup():
    """compile=True: torch.compile(backend="openxla") traces each step once (the TPU default):
    the same greedy tokens, the same sampled ones (seeds and temperatures differ per request)."""
    want, lazy, eng, ps = expected(), shared_engine(), engine(compile=True), prompts()
    compiles = count_compiles()
    reqs = run(eng, [eng.submit(p, 10 + i) for i, p in enumerate(ps[:5])])
    sampled = run(eng, [eng.submit(p, 8, temperature=0.5 + i, seed=i) for i, p in enumerate(ps[:3])])
    assert count_compiles() == compiles
    assert [r.tokens for r in reqs] == list(want[:5])
    assert [r.tokens for r in sampled] == [r.tokens for r in run(lazy, [
        lazy.submit(p, 8, temperature=0.5 + i, seed=i) for i, p in enumerate(ps[:3])])]


def test_the_engine_compiles_by_default_on_every_device(monkeypatch):
    """compile=None: the path benchmarks/serve.py measures faster (`runner.default_compile`), on the
    CPU as on a (faked) TPU; Generator's default stays lazy off a TPU (test_generate.py)."""
    model = Llama.from_hf(hf(), max_batch_size=1, max_seq_len=MAX_SEQ_LEN)
    assert Engine(model, slots=1, buckets=(8,)).compile and default_compile()
    assert Engine(model, slots=1, buckets=(8,), compile=False).runner.program is step_program
    assert not default_compile(engine=False)
    monkeypatch.setattr(torch_xla.runtime, "device_type", lambda: "TPU")
    assert default_compile() and default_compile(engine=False)


def test_a_compiled_engine_over_another_model_of_the_same_shapes_runs_its_own_weights():
    """Two compiled engines, over models of the same shapes and other weights: each gives its lazy
    engine's tokens. (Dynamo's cache is per function, and torch_xla's bridge keeps some weights as
    constants of a graph: the second engine once ran the first one's weights. `runner.compiled`.)"""
    ps = prompts()[:3]
    for seed in (0, 1):
        hf_seed = hf_model(get_config("tiny", num_hidden_layers=2, initializer_range=0.2), seed=seed)
        got = {}
        for compile in (False, True):
            eng = Engine(Llama.from_hf(hf_seed, max_batch_size=2, max_seq_len=MAX_SEQ_LEN), slots=2, buckets=BUCKETS,
                         compile=compile)
            eng.warmup()
            got[compile] = eng.generate(ps, 8)
        assert got[True] == got[False], f"model {seed}"


def test_an_all_greedy_decode_step_runs_the_argmax_program_and_gets_the_same_tokens():
    """A decode-sized step (T <= slots, 16 sampler rows or more: `ModelRunner.greedy_at`) whose requests
    are all greedy and ask for no log-probabilities runs the argmax variant, warmed beside the
    sampler's; the tokens are those Generator gives each prompt alone. One sampled request, or one
    asking for log-probabilities, sends its steps to the sampler's program."""
    eng, ps, ran = engine(slots=16), prompts(), []
    assert {(t, g) for t, _, _, _, g in eng.runner.shapes()} == {(16, False), (16, True), (32, False)}
    program = eng.runner.program
    eng.runner.program = lambda *args: ran.append(args[-2]) or program(*args)  # (..., greedy, eos)
    reqs = run(eng, [eng.submit(p, 10 + i) for i, p in enumerate(ps)])
    assert [r.tokens for r in reqs] == list(expected()) and True in ran
    ran.clear()
    run(eng, [eng.submit(ps[0], 10), eng.submit(ps[1], 10, temperature=0.7, seed=1)])  # decoding together
    run(eng, [eng.submit(ps[0], 10, logprobs=2)])
    assert ran and True not in ran
    assert eng.compiles_since_warmup == 0


def test_abort_ends_every_request_with_an_error():
    eng = engine(slots=1)
    running, waiting = eng.submit(prompts()[0], 50), eng.submit(prompts()[1], 11)
    eng.step(), eng.step()
    eng.abort("the step failed")
    assert [(r.finish_reason, r.error) for r in (running, waiting)] == [("error", "the step failed")] * 2
    assert eng.metrics()["slots_busy"] == 0 and eng.metrics()["queue_length"] == 0
    assert run(eng, [eng.submit(prompts()[1], 11)])[0].tokens == expected()[1]


def test_log_probabilities_are_a_log_softmax_of_hugging_faces_logits():
    """For greedy and sampled tokens, and the prompt's own tokens (echo), with the top alternatives."""
    eng, p = shared_engine(), prompts()[2]  # 40 tokens: two prompt sections
    reqs = run(eng, [eng.submit(p, 6, logprobs=3, prompt_logprobs=True),
                     eng.submit(p, 6, temperature=1.0, seed=5, logprobs=2)])
    assert reqs[0].tokens != reqs[1].tokens
    for r in reqs:
        with torch.no_grad():
            lp = torch.log_softmax(hf()(torch.tensor([p + r.tokens])).logits[0].float(), -1)  # (n, vocab_size)
        rows = lp[len(p) - 1:-1]  # the rows that predict the new tokens
        assert len(r.token_logprobs) == len(r.tokens)
        for row, token, (value, top) in zip(rows, r.tokens, r.token_logprobs):
            assert value == pytest.approx(row[token].item(), abs=1e-4)
            assert [i for i, _ in top] == row.topk(r.logprobs).indices.tolist()
            assert [v for _, v in top] == pytest.approx(row.topk(r.logprobs).values.tolist(), abs=1e-4)
    echo = reqs[0].prompt_token_logprobs
    assert len(echo) == len(p) - 1 and not reqs[1].prompt_token_logprobs
    assert [v for v, _ in echo] == pytest.approx([lp[i, p[i + 1]].item() for i in range(len(p) - 1)], abs=1e-4)


@pytest.mark.parametrize("runner,compile", [("engine", False), ("engine", True), ("generator", False),
                                            ("generator", True)])
def test_every_program_writes_the_kv_caches_in_place(runner, compile):
    """Each program that writes the KV caches (the engine's pages, Generator's slots) aliases them
    input to output (`hlo.aliased_parameters`): the caches are updated where they are, never
    copied: lazy tensors because the runner writes the new caches into the old (`copy_`), compiled
    programs because the caches are donated. And no program copies a cache before writing it (the
    engine's one-token step did: XLA makes a one-row write a bounds-checked dynamic-update-slice;
    Generator's batch-1 decode is checked too). Shapes no other test compiles, so every program
    compiles here."""
    model = Llama.from_hf(hf(), max_batch_size=3, max_seq_len=64)
    args, layers = model.args, len(model.layers)
    dtype = {torch.float32: "f32", torch.bfloat16: "bf16"}[model.embed_tokens.weight.dtype]
    if runner == "engine":  # off a TPU, K and V apart: (2, n_kv_heads, num_pages, page_size, head_dim)
        eng = Engine(model, slots=3, buckets=(1, 8, 16), compile=compile)
        shape = ",".join(map(str, eng.runner.pages[0].shape))  # the pool's (the step's gathered pages are not a cache)
    else:  # (any row count, max_seq_len, n_kv_heads, head_dim)
        shape = rf"\d+,64,{args.n_kv_heads},{args.head_dim}"
    is_cache = re.compile(rf"{dtype}\[{shape}\]").fullmatch
    with hlo.compiled_hlo() as modules:
        if runner == "engine":
            eng.warmup()
        else:
            Generator(model, buckets=(8, 16), compile=compile).generate([[1, 2, 3]], 4)
    writes = [[p for p in hlo.aliased_parameters(m)[0] if is_cache(p)] for m in modules
              if any(map(is_cache, hlo.aliased_parameters(m)[1]))]
    assert writes and all(len(w) == (1 if runner == "engine" else 2) * layers for w in writes), [len(w) for w in writes]
    copies = [line for m in modules for line in hlo.instructions(m, "copy") if is_cache(line.split(" = ")[1].split("{")[0])]
    assert not copies, copies[:2]


@pytest.mark.parametrize("compile", [False, True], ids=["lazy", "compiled"])
def test_steps_allocate_no_cache(compile):
    """The memory N steps use does not grow by a cache per step: each step program's outputs (XLA's
    buffer assignment, `hlo.output_bytes`) take less than one layer's pages, so every layer's pages
    are written where they are. (A runtime reading cannot show it here: torch_xla reports no memory
    for the CPU's SPMD device.) A pool of 64 pages of 16 positions, larger than all else a step returns."""
    model = Llama.from_hf(hf(), max_batch_size=2, max_seq_len=256)
    eng = Engine(model, slots=2, buckets=(8,), compile=compile, pages=64)
    pages = eng.runner.pages[0]  # (2, n_kv_heads, 64, 16, head_dim)
    with hlo.compiled_hlo(hlo.BUFFER_ASSIGNMENT) as buffers:
        reqs = run(eng, [eng.submit(p, 40, temperature=1.0, seed=1) for p in prompts((5, 7), seed=4)])
    assert all(len(r.tokens) == 40 for r in reqs)
    steps = [b for b in buffers if "s64[3]" in b]  # the programs that return the slots' newest tokens: the steps
    assert steps and max(map(hlo.output_bytes, steps)) < pages.numel() * pages.element_size()
