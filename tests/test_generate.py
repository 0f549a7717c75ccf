"""Generator on the XLA device: greedy tokens equal Hugging Face's, no recompilation per token,
sampling, EOS early stop, bad input, text in / text out."""
import functools

import pytest
import torch
import torch_xla.runtime
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from llama_xla_helpers.configs import get_config
from llama_xla_helpers.data import ByteTokenizer
from llama_xla_helpers import generate
from llama_xla_helpers.generate import (Generator, generate_text, greedy_check, kv_buckets, llama3_chat, load_tokenizer,
                                        prefill_sections, prefill_shapes, sample_rows)
from llama_xla_helpers.metrics import count_compiles
from llama_xla_helpers.model import Llama
from util import hf_model, teacher_forced_agreement

pytestmark = pytest.mark.fixed_dtype  # no test here reads the default dtype (conftest checks)

BUCKETS = (16, 32, 64, 128)
# 150 > the largest bucket: sections [32, 128] (two bucket graphs), 160 padded slots.
LENGTHS = (5, 127, 128, 129, 150)
NEW_TOKENS = 64
MAX_SEQ_LEN = 160 + NEW_TOKENS
LLAMA31_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=32)  # short, so the scaling matters here
VARIANTS = {
    "mha": dict(num_key_value_heads=8),
    "gqa": dict(num_key_value_heads=4),
    "llama3.1": dict(num_key_value_heads=2, rope_theta=500000.0, rope_scaling=LLAMA31_SCALING),
}


def tiny(layers=2, **overrides):
    """The tiny config with large random weights, so greedy tokens vary."""
    return get_config("tiny", num_hidden_layers=layers, initializer_range=0.2, **overrides)


def prompts(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


@functools.cache
def reference(variant):
    """(HF model, its greedy tokens for each prompt run alone): eager, CPU, fp32, no EOS stop."""
    hf = hf_model(tiny(**VARIANTS[variant]))
    hf.generation_config.eos_token_id = None
    expected = []
    for p in prompts():
        ids = torch.tensor([p])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
        expected.append(out[0, len(p):].tolist())
    assert all(len(set(row)) > 10 for row in expected), "random model repeats itself: the test proves nothing"
    return hf, expected


def small_generator(max_batch_size=2, max_seq_len=320, **kwargs):
    """A 1-layer model, for tests about the loop rather than the numbers."""
    model = Llama.from_hf(hf_model(tiny(layers=1)), max_batch_size=max_batch_size, max_seq_len=max_seq_len)
    return Generator(model, buckets=BUCKETS, **kwargs)


def test_prefill_sections():
    assert [prefill_sections(n, BUCKETS) for n in (1, 16, 17, 127, 128, 129, 150, 256)] == [
        [16], [16], [32], [128], [128], [16, 128], [32, 128], [128, 128]]
    default = (128, 256, 384, 512)
    assert prefill_sections(1500, default) == [512, 512, 512]  # 476 tokens fill a 512 bucket, then 2 more
    assert len(prefill_sections(2047, default)) == 4  # the post: "up to 2,047 tokens ... up to 4"


def test_kv_buckets_double_up_to_the_cache_and_prefill_shapes_cover_every_section():
    assert kv_buckets((64, 128, 256, 512), 768) == (64, 128, 256, 512, 768)
    assert kv_buckets((16, 32), 128) == (16, 32, 64, 128)
    assert prefill_shapes((16, 32), 128) == [(16, 16), (32, 32), (32, 64), (32, 128)]


# MHA (Llama 2 7B's layout) is GQA with one query head per KV head: make check-variants runs it.
@pytest.mark.parametrize("variant", [pytest.param(v, marks=pytest.mark.variants) if v == "mha" else v for v in VARIANTS])
def test_greedy_matches_hugging_face(variant):
    hf, expected = reference(variant)
    model = Llama.from_hf(hf, max_batch_size=len(LENGTHS), max_seq_len=MAX_SEQ_LEN)
    tokens, stats = Generator(model, buckets=BUCKETS).generate(prompts(), NEW_TOKENS)
    assert tokens == expected
    assert (stats.batch_size, stats.new_tokens, stats.prefill_runs) == (5, NEW_TOKENS, 2)
    assert stats.compiles <= 2 + 2  # buckets 32 and 128, the decode step (+1 spare)


def test_compiles_grow_with_the_cache_lengths_reached_not_with_new_tokens():
    gen = small_generator()  # kv lengths (16, 32, 64, 128, 256, 320)
    batch = prompts((3, 20))  # bucket 16 for the first prompt alone, 32 for both
    counts = []
    for bsz, n in ((1, 64), (2, 256)):  # a fresh batch size each: nothing comes from the cache
        tokens, stats = gen.generate(batch[:bsz], n)
        assert [len(t) for t in tokens] == [n] * bsz
        counts.append(stats.compiles)
    # the prefill bucket, and one decode graph per cache length reached: inputs at slots 16-78 read
    # 32, 64, 128 slots; at slots 32-286, 64, 128, 256, 320
    assert counts == [1 + 3, 1 + 4], counts
    assert gen.generate(batch, 100)[1].compiles == 0
    assert gen.kv_lens == (16, 32, 64, 128, 256, 320)


def test_a_bf16_model_compiles_nothing_on_the_second_call():
    """bf16 (the TPU default): the second call reuses every graph, as fp32 does."""
    model = Llama.from_hf(hf_model(tiny(layers=1)), max_batch_size=2, max_seq_len=128, dtype=torch.bfloat16)
    gen = Generator(model, buckets=BUCKETS)
    assert [gen.generate(prompts((7, 30)), 8)[1].compiles for _ in range(3)][1:] == [0, 0]


def test_bf16_tokens_agree_with_fp32_teacher_forced():
    """bf16 (the TPU default) after warm-up: no compile, bf16 matmuls, and the next token of fp32's own
    greedy continuation predicted the same on at least 95% of the generated positions (exact equality
    would flip on near-ties). Weights of std 0.05: at tiny()'s 0.2 the logits' top two are so often near
    ties that Hugging Face's own bf16 model agrees with its fp32 on only 94% (measured)."""
    hf, rows = hf_model(get_config("tiny", num_hidden_layers=2, initializer_range=0.05)), prompts((40, 40), seed=1)
    fp32 = Generator(Llama.from_hf(hf, max_batch_size=2, max_seq_len=128), buckets=BUCKETS)
    bf16 = Generator(Llama.from_hf(hf, max_batch_size=2, max_seq_len=128, dtype=torch.bfloat16), buckets=BUCKETS)
    tokens, _ = fp32.generate(rows, 48)
    assert len({t for row in tokens for t in row}) > 10, "the model repeats itself: the test proves nothing"
    bf16.generate(rows, 48)
    assert bf16.generate(rows, 48)[1].compiles == 0
    sequences = torch.tensor([p + t for p, t in zip(rows, tokens)])  # (2, 40 + 48)
    agreement, dots = teacher_forced_agreement(fp32.model, bf16.model, sequences, generated_from=40)
    print(f"top-1 agreement {agreement:.1%}")
    assert agreement >= 0.95 and dots == {"bf16"}


def test_sampling_reproducible_and_no_recompile():
    gen = small_generator()
    batch = prompts((7, 30))
    greedy, _ = gen.generate(batch, 24)
    first, stats = gen.generate(batch, 24, temperature=0.8, top_p=0.9, seed=1)
    again, _ = gen.generate(batch, 24, temperature=0.8, top_p=0.9, seed=1)
    assert again == first
    assert gen.generate(batch, 24, temperature=0.8, top_p=0.9, seed=2)[0] != first
    assert first != greedy
    other, stats = gen.generate(batch, 24, temperature=1.3, top_p=0.5, seed=1)
    assert stats.compiles == 0  # temperature and top-p are tensors: same graph
    nucleus_of_one, stats = gen.generate(batch, 24, temperature=1.0, top_p=1e-6, seed=3)
    assert nucleus_of_one == greedy and stats.compiles == 0


@pytest.mark.parametrize("temperature, top_p", [(1.0, 0.7), (0.5, 0.7), (2.0, 0.9), (1.0, 1.0)])
def test_top_p_draws_from_the_renormalized_nucleus(temperature, top_p):
    """`sample_rows` (Generator's and the engine's sampler) on the CPU: 20,000 draws from one row
    of logits, one seed each."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    probs = torch.softmax(logits / temperature, dim=-1)  # temperature scales the logits
    before = probs.cumsum(0) - probs                     # mass of the more likely tokens (sorted already)
    nucleus = before <= top_p                            # the most likely tokens up to top_p, at least one
    expected = torch.where(nucleus, probs, 0.0) / probs[nucleus].sum()
    n = 20_000
    draws = sample_rows(logits.expand(n, -1), torch.full((n,), temperature), torch.full((n,), top_p),
                        torch.arange(n), torch.zeros(n, dtype=torch.long))
    freq = torch.bincount(draws, minlength=len(logits)) / len(draws)
    assert (freq[~nucleus] == 0).all()                   # never a token outside the nucleus
    assert (freq[nucleus] > 0).all()
    assert torch.allclose(freq, expected, atol=0.015)    # 3.5 standard errors at p = 0.5
    if temperature != 1.0:  # and the nucleus' frequencies are not those of temperature 1
        plain = torch.softmax(logits, -1)
        assert not torch.allclose(freq, torch.where(nucleus, plain, 0.0) / plain[nucleus].sum(), atol=0.05)


def test_eos_stops_within_check_interval():
    gen = small_generator(eos_check_interval=4)
    batch = prompts((9, 40), seed=5)
    rows, _ = gen.generate(batch, 64)
    # the token that every row produces soonest; generation can stop once all rows have it
    shared = set(rows[0]).intersection(*rows[1:])
    assert shared, "no token is common to all rows; pick other prompts"
    eos = min(shared, key=lambda t: max(r.index(t) for r in rows))
    last = max(r.index(eos) for r in rows) + 1  # tokens made when the last row ended
    assert last + 4 < 64, "EOS comes too late to show early stopping; pick other prompts"

    tokens, stats = gen.generate(batch, 64, eos_id=eos)
    assert tokens == [r[:r.index(eos) + 1] for r in rows]  # ends at EOS, nothing after it
    assert last <= stats.new_tokens < last + 4
    assert stats.new_tokens % 4 == 0  # the host looked only every 4 steps
    assert stats.compiles == 0  # eos_id is a tensor too


def test_torch_compile_variant_matches_lazy_call_after_call():
    """Calls of other paddings, sections, EOS ids and sampling values, one after another: the compiled
    Generator gives lazy tracing's tokens in each, whichever call traced the program it runs. (A
    program input that an earlier program also read became a constant of it in torch_xla's dynamo
    bridge: the second call decoded with the first one's padding. `Generator.run`.)"""
    hf = hf_model(tiny(layers=1))
    lazy = Generator(Llama.from_hf(hf, 2, 128), buckets=BUCKETS)
    dynamo = Generator(Llama.from_hf(hf, 2, 128), buckets=BUCKETS, compile=True)
    calls = [(prompts((6, 33)), {}), (prompts((20, 25), seed=5), {}), (prompts((40, 9), seed=2), {}),
             (prompts((20, 25), seed=5), dict(temperature=0.8, seed=3)),
             (prompts((40, 9), seed=2), dict(temperature=1.0, top_p=0.9, seed=4))]
    want = [lazy.generate(batch, 16, **kw)[0] for batch, kw in calls]
    eos = want[1][0][5]
    calls.append((calls[1][0], dict(eos_id=eos)))
    want.append(lazy.generate(*calls[-1][:1], 16, **calls[-1][1])[0])
    assert want[-1][0] == want[1][0][:6] and want[-1] != want[1]  # EOS ends row 0 early
    assert all(len(set(row)) > 3 for rows in want for row in rows), "the model repeats itself: the test proves nothing"
    got = [dynamo.generate(batch, 16, **kw) for batch, kw in calls]
    assert [tokens for tokens, _ in got] == want
    assert [dynamo.generate(batch, 16, **kw)[1].compiles for batch, kw in calls] == [0] * len(calls)


def test_compiled_generators_over_two_models_of_the_same_shapes_each_run_their_own_weights():
    """(Dynamo's cache is per function, and torch_xla's bridge keeps some weights as constants of a
    graph: the second model's decode steps once ran the first one's weights. `runner.compiled`.)"""
    batch = prompts((6, 33))
    for seed in (0, 1):
        hf = hf_model(tiny(layers=1), seed=seed)
        lazy, _ = Generator(Llama.from_hf(hf, 2, 128), buckets=BUCKETS).generate(batch, 8)
        dynamo, _ = Generator(Llama.from_hf(hf, 2, 128), buckets=BUCKETS, compile=True).generate(batch, 8)
        assert dynamo == lazy, f"model {seed}"


def test_compile_defaults_to_torch_compile_on_a_tpu_and_lazy_tracing_elsewhere(monkeypatch):
    model = small_generator().model
    assert Generator(model, buckets=BUCKETS).step is generate.step  # the CPU: lazy tracing
    monkeypatch.setattr(torch_xla.runtime, "device_type", lambda: "TPU")
    monkeypatch.setattr(generate, "mark_replicated", lambda model: None)  # a TPU's mesh needs TPU devices
    monkeypatch.setattr(generate, "make_mesh", lambda: None)
    assert Generator(model, buckets=BUCKETS).step is not generate.step  # Dynamo's wrapper
    assert Generator(model, buckets=BUCKETS, compile=False).step is generate.step


@pytest.fixture(scope="module")
def gen():
    return small_generator(max_batch_size=2, max_seq_len=128)


@pytest.mark.parametrize("prompt_tokens, kwargs, message", [
    ([], {}, "prompt_tokens is empty"),
    ([[1, 2], []], {}, "prompt 1 is empty"),
    ([[1, 264]], {}, r"token id 264 outside the vocabulary \[0, 264\)"),
    ([[-1, 2]], {}, r"token id -1 outside the vocabulary"),
    ([[1], [2], [3]], {}, "batch of 3 prompts > max_batch_size=2"),
    ([[1] * 40], dict(max_new_tokens=100), r"padded to 64 .* = 164 cache slots > max_seq_len=128"),
    ([[1]], dict(max_new_tokens=0), "max_new_tokens=0 must be an int >= 1"),
    ([[1]], dict(temperature=-0.1), r"temperature=-0.1 must be >= 0"),
    ([[1]], dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
    ([[1]], dict(top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
    ([[1]], dict(eos_id=300), r"eos_id=300 is outside the vocabulary"),
])
def test_bad_input_raises_before_work(gen, prompt_tokens, kwargs, message):
    compiles = count_compiles()
    with pytest.raises(ValueError, match=message):
        gen.generate(prompt_tokens, **{"max_new_tokens": 8, **kwargs})
    assert count_compiles() == compiles


@pytest.mark.parametrize("prompt_tokens", ["hello", [1, 2], [[1, 2.0]]])
def test_prompts_that_are_not_lists_of_ints_raise_type_error(gen, prompt_tokens):
    with pytest.raises(TypeError):
        gen.generate(prompt_tokens, 8)


@pytest.mark.parametrize("kwargs, message", [
    (dict(buckets=(32, 16)), "must be increasing positive ints"),
    (dict(buckets=(16, 256)), "largest bucket 256 > the model's max_seq_len=128"),
    (dict(eos_check_interval=0), "eos_check_interval=0 must be an int >= 1"),
])
def test_bad_generator_arguments(gen, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Generator(gen.model, **{"buckets": BUCKETS, **kwargs})


def test_llama3_chat_format():
    assert llama3_chat("Hi!") == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
                                  "<|start_header_id|>assistant<|end_header_id|>\n\n")
    two = llama3_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert two.count("<|begin_of_text|>") == 1 and "system<|end_header_id|>\n\nBe brief.<|eot_id|>" in two


def test_generate_text_with_byte_tokenizer(gen):
    tok = ByteTokenizer()
    texts, stats = generate_text(gen, tok, ["Hello", "The"], max_new_tokens=12)
    tokens, _ = gen.generate([tok.encode("Hello"), tok.encode("The")], 12, eos_id=tok.eos_id)
    assert texts == [tok.decode(t) for t in tokens]
    assert stats.batch_size == 2


def word_tokenizer(path):
    """A small word-level Hugging Face tokenizer with Llama 3's chat tokens, saved to `path`."""
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
               "<|eot_id|>", "<unk>"]
    words = special + "user assistant system hello world how are you the a cat sat".split()
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|begin_of_text|>",
                                  eos_token="<|eot_id|>", unk_token="<unk>", additional_special_tokens=special[:4])
    tok.save_pretrained(path)
    return path


def test_generate_text_with_local_hf_tokenizer(gen, tmp_path):
    tok = load_tokenizer(word_tokenizer(tmp_path))
    chat = llama3_chat("hello how are you")
    ids = tok.encode(chat, add_special_tokens=False)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    texts, _ = generate_text(gen, tok, [chat, "the cat"], max_new_tokens=10)
    tokens, _ = gen.generate([ids, tok.encode("the cat")], 10, eos_id=tok.eos_token_id)
    assert texts == [tok.decode(t, skip_special_tokens=True) for t in tokens]


def test_greedy_check_finds_a_changed_token_and_skips_near_ties():
    gen = Generator(Llama.from_hf(hf_model(tiny()), max_batch_size=1, max_seq_len=64), buckets=(16,))
    model, prompt = gen.model, prompts((8,))[0]
    tokens = gen.generate([prompt], 24)[0][0]
    assert greedy_check(model, prompt, tokens, margin=1e-4)[0] == []  # its own greedy tokens
    dev = model.embed_tokens.weight.device
    logits = model(torch.tensor([prompt + tokens], device=dev), torch.arange(32, device=dev))[0, 7:-1].cpu()
    top2 = logits.topk(2, dim=-1)  # (24, 2) at the positions that predict the 24 tokens
    gaps = top2.values[:, 0] - top2.values[:, 1]
    i = int(gaps.argmax())  # the clearest choice
    changed = tokens[:i] + [int(top2.indices[i, 1])] + tokens[i + 1:]  # its runner-up instead
    assert greedy_check(model, prompt, changed, margin=1e-4)[0][0] == i  # (the later ones follow another prefix)
    assert greedy_check(model, prompt, changed, margin=1e3) == ([], 24)  # every position a near-tie: skipped
