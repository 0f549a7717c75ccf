"""Generation without recompilation: bucketed prefill, one compiled decode step, EOS early stop.

    gen = Generator(model, buckets=(128, 256, 384, 512))
    tokens, stats = gen.generate(prompt_tokens, max_new_tokens=64, temperature=0.7, top_p=0.9, seed=0)

XLA compiles one graph per distinct input shape (the LLaMA 65B latency post). So the prompts are left-padded
to a bucket length (one prefill graph per bucket; a prompt longer than the largest bucket is
prefilled section by section), and every decode step feeds the same shapes: one token per
row, its cache slot, temperature and top-p as device tensors, the generated tokens written
into a fixed (bsz, max_seq_len) buffer with `index_copy`. Attention reads only the live
context, as the engine's does: the first prefill section its own positions, later sections and
decode steps the smallest of a few cache lengths that holds them (`kv_buckets`, the
smallest bucket doubled up to max_seq_len: a step reads at most twice what it needs). Each
cache length is one more decode graph, compiled the first time a call reaches it, so a call
compiles at most len(kv_buckets) decode graphs (`Stats.compiles` counts them), and a call
that reaches no new length compiles nothing. The host only looks at a device
value every `eos_check_interval` steps, to learn whether every row has produced EOS (the Llama 2 post).

Sources: the LLaMA 65B latency post, "The Path to Achieve Ultra-Low Inference Latency With LLaMA 65B
on PyTorch/XLA", PyTorch blog, https://pytorch.org/blog/path-achieve-low-inference-latency/; the
Llama 2 post, "High-Performance Llama 2 Training and Inference with PyTorch/XLA on Cloud TPUs",
PyTorch blog, https://pytorch.org/blog/high-performance-llama-2/
"""
import functools
import random
import time
from dataclasses import asdict, dataclass

import torch
import torch_xla
import torch_xla.core.xla_model as xm

from .mesh import make_mesh
from .metrics import count_compiles
from .runner import Caches, attach, compiled, default_compile, mark_replicated, put_replicated, replicator
from .sampling import SAMPLE_TOP_K, sample_rows  # noqa: F401  SAMPLE_TOP_K: also generate's, as before
from .tokenizer import ByteTokenizer, load_tokenizer  # noqa: F401  load_tokenizer: also generate's, as before


def prefill_sections(n, buckets):
    """Section lengths that hold an n-token prompt, left-padded into the first section.

    The tokens that are not a multiple of the largest bucket go into the smallest bucket
    that holds them, the rest into largest-bucket sections: with (128, 256, 384, 512),
    100 -> [128], 600 -> [128, 512], 1500 -> [512, 512, 512].
    """
    largest = buckets[-1]
    full, rest = divmod(n, largest)
    first = [min(b for b in buckets if b >= rest)] if rest else []
    return first + [largest] * full


def kv_buckets(buckets, max_seq_len):
    """The cache lengths a decode step reads: the smallest prefill bucket doubled until max_seq_len,
    e.g. (64, 128, 256, 512, 768) for buckets starting at 64 and a 768-slot cache; a step reads
    at most twice what it needs."""
    lengths = [buckets[0]]
    while lengths[-1] < max_seq_len:
        lengths.append(min(2 * lengths[-1], max_seq_len))
    return tuple(lengths)


def round_up(n, lengths):
    return next(k for k in lengths if k >= n)


def prefill_shapes(buckets, max_seq_len):
    """Every (section length, kv_len) a prefill can run at: a first section reads itself, a later
    one (the largest bucket, after at least the smallest) a kv bucket up to the cache's end."""
    kv = kv_buckets(buckets, max_seq_len)
    later = [(buckets[-1], k) for k in kv if k >= buckets[0] + buckets[-1]]
    return [(b, b) for b in buckets] + later


@dataclass
class Stats:
    """Timings with the LLaMA 65B latency post's definitions: B batch size, L generated length, T time."""

    batch_size: int     # B
    new_tokens: int     # L: tokens generated per row (all rows step together, EOS or not)
    prefill_runs: int   # prefill graph executions (prompt sections)
    prefill_s: float    # time to fill the KV cache and pick the first token
    decode_s: float     # time of the L - 1 decode steps
    compiles: int       # XLA compilations during the call (0 when every graph was cached)

    @property
    def latency_s(self):  # T: until the whole result is there
        return self.prefill_s + self.decode_s

    @property
    def per_token_latency_s(self):  # T / L
        return self.latency_s / self.new_tokens

    @property
    def decode_step_s(self):  # one decode step, prefill excluded
        return self.decode_s / max(self.new_tokens - 1, 1)

    @property
    def throughput(self):  # B * L / T tokens/s
        return self.batch_size * self.new_tokens / self.latency_s

    def as_dict(self):
        derived = ("latency_s", "per_token_latency_s", "decode_step_s", "throughput")
        return {**asdict(self), **{k: getattr(self, k) for k in derived}}


def step(model, views, caches, pin, tokens, input_pos, pad, out, out_pos, done, temperature, top_p, eos_id, greedy,
         seed=None, kv_len=None):
    """Feed tokens (bsz, seqlen) at cache slots input_pos (seqlen,); write the next token into out.

    A program for `runner.Caches.run` (views, caches: the KV caches in and out, so a compiled step
    updates them in place). The same function prefills a section (seqlen = bucket) and decodes
    (seqlen = 1); the LM head runs at the last position only. Every value that changes between
    calls is a tensor, so each shape compiles once. temperature, top_p: (1,); seed (bsz,) int64,
    each row's (needed unless greedy): `sample_rows`. kv_len (a Python int, one graph each; None:
    max_seq_len): attention reads the first kv_len cache slots.
    """
    attach(views, caches)
    logits = model(tokens, input_pos, pad, kv_len, last_only=True)[:, -1]  # (bsz, vocab_size)
    bsz = logits.shape[0]
    nxt = logits.argmax(dim=-1) if greedy else sample_rows(  # (bsz,), each row's noise at its own position
        logits, temperature.expand(bsz), top_p.expand(bsz), seed, input_pos[-1] - pad)  # (not its padded slot)
    out = out.index_copy(1, out_pos, nxt[:, None])  # (bsz, max_seq_len): generated tokens so far
    done = done | (nxt == eos_id)  # (bsz,)
    nxt, out, done = pin(nxt), pin(out), pin(done)
    return nxt[:, None], input_pos[-1:] + 1, out_pos + 1, out, done, done.all(), [(v.k, v.v) for v in views]


class Generator:
    """Generate with a `Llama` on the XLA device (moved there if on the CPU; see
    `parallel.shard_for_inference` for tensor parallelism).

    compile=True runs the same step through `torch.compile(backend="openxla")` (Dynamo traces
    the Python once per shape) instead of lazy tensor tracing every call; both compile one
    XLA graph per shape, and both update the KV caches in place (`runner.Caches`: a compiled
    step's caches are donated). The default (None, `runner.default_compile(engine=False)`):
    compiled on a TPU, where a step takes milliseconds and tracing it every token would dominate;
    lazy elsewhere, where a call's few dozen tokens per shape end sooner traced. A compiled
    step's graphs may hold the model's weights as constants (`runner.compiled`): after changing
    them in place, build a new Generator.
    """

    def __init__(self, model, buckets=(128, 256, 384, 512), eos_check_interval=10, compile=None):
        buckets = check_buckets(buckets, model.args.max_seq_len)
        if not isinstance(eos_check_interval, int) or eos_check_interval < 1:
            raise ValueError(f"eos_check_interval={eos_check_interval!r} must be an int >= 1")
        self.device = torch_xla.device()
        self.model = model if model.embed_tokens.weight.device.type == "xla" else model.to(self.device)
        if getattr(self.model, "mesh", None) is None:
            mark_replicated(self.model)
        self.buckets, self.eos_check_interval = buckets, eos_check_interval
        self.kv_lens = kv_buckets(buckets, model.args.max_seq_len)
        self.pin = replicator(self.model)
        self.put = functools.partial(put_replicated, mesh=getattr(self.model, "mesh", None) or make_mesh())
        compile = default_compile(engine=False) if compile is None else compile
        shapes = 2 * (len(prefill_shapes(buckets, model.args.max_seq_len)) + len(self.kv_lens))  # greedy, sampled
        self.step = compiled(step, shapes) if compile else step
        self.caches = Caches(self.model, compile)  # the model's KV caches, in and out of each step

    @torch.no_grad()
    def generate(self, prompt_tokens, max_new_tokens, temperature=0.0, top_p=1.0, eos_id=None, seed=None):
        """Continue each prompt (a list of token ids) by up to max_new_tokens tokens.

        temperature 0 is greedy; > 0 samples from softmax(logits / temperature) restricted
        to the SAMPLE_TOP_K most likely tokens and the top-p nucleus (`sample_rows`; row b draws
        with seed + b, so a seed reproduces the draws; None: a random one). Returns (tokens,
        Stats): tokens[b] leaves out the prompt and ends at the first eos_id (kept) if there is one.
        """
        sections = self.check(prompt_tokens, max_new_tokens, temperature, top_p, eos_id)
        seed = random.getrandbits(31) if seed is None else seed  # as the engine; torch's generator stays as it was
        compiles, start = count_compiles(), time.perf_counter()
        # Shape (1,), not 0-dim: XLA bakes 0-dim zeros and ones into the graph as constants.
        sampling = [torch.tensor([v]) for v in  # tensors: new values, same graph
                    (float(temperature or 1.0), float(top_p), -1 if eos_id is None else eos_id)]
        sampling += [temperature == 0, (torch.arange(len(prompt_tokens)) + seed) & 0x7FFFFFFF]  # greedy (two graphs), seeds
        state, pad = self.prefill(prompt_tokens, sections, sampling)
        xm.wait_device_ops()
        prefill_s = time.perf_counter() - start
        state, steps = self.decode(state, pad, sampling, max_new_tokens, eos_id is not None, sum(sections))
        generated = state[3].cpu()[:, :steps].tolist()
        decode_s = time.perf_counter() - start - prefill_s
        stats = Stats(len(prompt_tokens), steps, len(sections), prefill_s, decode_s, count_compiles() - compiles)
        return [cut_at_eos(row, eos_id) for row in generated], stats

    def run(self, tokens, input_pos, pad, out, out_pos, done, sampling, kv_len):
        """Launch the step (`runner.Caches.run`) and return its state. pad (bsz,) and sampling
        (temperature, top_p, eos_id, greedy, seeds (bsz,)) are host tensors, put on the device
        afresh for every program: an input handed to two programs that compile in turn would be
        a constant of the second (`runner.put_replicated`)."""
        temperature, top_p, eos_id, greedy, seeds = sampling
        pad, temperature, top_p, eos_id, seeds = map(self.put, (pad, temperature, top_p, eos_id, seeds))
        return self.caches.run(self.step, self.pin, tokens, input_pos, pad, out, out_pos, done, temperature, top_p,
                               eos_id, greedy, seed=seeds, kv_len=kv_len)

    def prefill(self, prompt_tokens, sections, sampling):
        """Left-pad the prompts to sum(sections) slots and run the sections (`run`'s sampling);
        returns (step state, pad (bsz,) on the host)."""
        bsz, width = len(prompt_tokens), sum(sections)
        padded = torch.zeros(bsz, width, dtype=torch.long)  # the padding's token id never matters
        for b, p in enumerate(prompt_tokens):
            padded[b, width - len(p):] = torch.tensor(p)
        pad = torch.tensor([width - len(p) for p in prompt_tokens])  # (bsz,)
        out = self.put(torch.zeros(bsz, self.model.args.max_seq_len, dtype=torch.long))
        out_pos = self.put(torch.zeros(1, dtype=torch.long))
        done = self.put(torch.zeros(bsz, dtype=torch.bool))
        pos = 0
        for n in sections:  # each section writes token 0 (the same graph); the last one's is kept
            tokens, input_pos = self.put(padded[:, pos:pos + n]), self.put(torch.arange(pos, pos + n))
            kv_len = n if pos == 0 else round_up(pos + n, self.kv_lens)  # a first section reads only itself
            state = self.run(tokens, input_pos, pad, out, out_pos, done, sampling, kv_len)
            out = state[3]
            pos += n
        return state, pad

    def decode(self, state, pad, sampling, max_new_tokens, check_eos, width):
        """Step until max_new_tokens tokens or until every row has produced EOS, the first input at
        cache slot `width` (the padded prompt's length); returns (state, tokens)."""
        steps = 1  # prefill made the first token
        while steps < max_new_tokens:
            if check_eos and steps % self.eos_check_interval == 0 and state[5].item():
                break  # the one read of a device value, every eos_check_interval steps (Llama 2 post)
            tokens, input_pos, out_pos, out, done, _ = state
            kv_len = round_up(width + steps, self.kv_lens)  # holds the input's slot, width + steps - 1
            state = self.run(tokens, input_pos, pad, out, out_pos, done, sampling, kv_len)
            steps += 1
        return state, steps

    def check(self, prompt_tokens, max_new_tokens, temperature, top_p, eos_id):
        """ValueError for bad input, before any device work; returns the prefill sections."""
        return check_request(self.model.args, self.buckets, prompt_tokens, max_new_tokens, temperature, top_p, eos_id)


def check_buckets(buckets, max_seq_len, room=0):
    """The buckets as a tuple; ValueError unless they are increasing positive ints that leave
    `room` cache slots of max_seq_len after the largest."""
    buckets = tuple(buckets)
    increasing = list(buckets) == sorted(set(buckets))
    if not buckets or not increasing or not all(isinstance(b, int) and b >= 1 for b in buckets):
        raise ValueError(f"buckets={buckets} must be increasing positive ints, e.g. (128, 256, 384, 512)")
    if buckets[-1] + room > max_seq_len:
        raise ValueError(f"largest bucket {buckets[-1]}{f' + {room} tokens' if room else ''} > the model's "
                         f"max_seq_len={max_seq_len}; drop it or build the model with a larger max_seq_len")
    return buckets


def check_request(args, buckets, prompt_tokens, max_new_tokens, temperature, top_p, eos_id, name="max_new_tokens"):
    """ValueError (TypeError) for a bad request to a model with ModelArgs `args`, before any device
    work; returns the prefill sections (None for buckets None: prompts that are not padded, as the
    serving engine's). `name`: what the caller calls max_new_tokens."""
    if not isinstance(prompt_tokens, (list, tuple)) or not all(isinstance(p, (list, tuple))
                                                                  for p in prompt_tokens):
        raise TypeError("prompt_tokens must be a list of prompts, each a list of token ids")
    if not prompt_tokens:
        raise ValueError("prompt_tokens is empty; pass a non-empty list of prompts")
    if len(prompt_tokens) > args.max_batch_size:
        raise ValueError(f"batch of {len(prompt_tokens)} prompts > max_batch_size={args.max_batch_size}; "
                         "split the batch or build the model with a larger max_batch_size")
    for b, p in enumerate(prompt_tokens):
        if len(p) == 0:
            raise ValueError(f"prompt {b} is empty; every prompt needs at least one token (e.g. BOS)")
        if not all(isinstance(t, int) for t in p):
            raise TypeError(f"prompt {b} holds a token id that is not an int")
        bad = [t for t in p if not 0 <= t < args.vocab_size]
        if bad:
            raise ValueError(f"prompt {b} has token id {bad[0]} outside the vocabulary [0, {args.vocab_size})")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"{name}={max_new_tokens!r} must be an int >= 1")
    if not temperature >= 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 is greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1] (1 keeps every token)")
    if eos_id is not None and not 0 <= eos_id < args.vocab_size:
        raise ValueError(f"eos_id={eos_id} is outside the vocabulary [0, {args.vocab_size})")
    longest = max(len(p) for p in prompt_tokens)
    sections = None if buckets is None else prefill_sections(longest, buckets)
    need = (longest if buckets is None else sum(sections)) + max_new_tokens
    if need > args.max_seq_len:
        padded = "" if buckets is None else f", padded to {sum(sections)} for buckets {buckets}"
        raise ValueError(f"the longest prompt ({longest} tokens{padded}) + {name}={max_new_tokens} = {need} cache slots > "
                         f"max_seq_len={args.max_seq_len}; ask for fewer tokens or build the model "
                         f"with max_seq_len >= {need}")
    return sections


def cut_at_eos(tokens, eos_id):
    """tokens up to and including the first eos_id."""
    return tokens[:tokens.index(eos_id) + 1] if eos_id in tokens else tokens


@torch.no_grad()
def greedy_check(model, prompt, tokens, margin):
    """Are `tokens`, generated after `prompt` (lists of ids), `model`'s greedy choices? Teacher-forced:
    one forward over prompt + tokens, so one flipped token does not derail the rest.

    Returns (differ, near_ties): the positions where `model`'s top-1 is another token while its top
    two logits are at least `margin` apart (real differences), and how many positions were skipped
    because they are closer. Another sharding, dtype or backend rounds differently and may flip such
    a near-tie; it cannot flip a clear choice. The model's batch and cache must hold the sequence."""
    device = model.embed_tokens.weight.device
    seq = torch.tensor([prompt + tokens], device=device)  # (1, seqlen)
    logits = model(seq, torch.arange(seq.shape[1], device=device))[0, len(prompt) - 1:-1]  # (n, vocab)
    torch_xla.sync()  # with the model's cache writes, which a later sync would compile into another graph
    logits = logits.cpu()
    top2 = logits.topk(2, dim=-1).values  # (n, 2)
    tie = top2[:, 0] - top2[:, 1] < margin
    wrong = logits.argmax(-1) != torch.tensor(tokens)
    return (wrong & ~tie).nonzero().flatten().tolist(), int(tie.sum())


# --- Text in, text out ---------------------------------------------------------------------

def llama3_chat(messages):
    """A Llama 3 chat prompt: messages [{"role": ..., "content": ...}] (or one user string),
    ending with the assistant header so the model writes the reply."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    turns = "".join(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>"
                    for m in messages)
    return f"<|begin_of_text|>{turns}<|start_header_id|>assistant<|end_header_id|>\n\n"


def generate_text(generator, tokenizer, prompts, max_new_tokens=64, **kwargs):
    """Generate from text prompts with the tutorial's `ByteTokenizer` or a Hugging Face tokenizer.

    eos_id defaults to the tokenizer's EOS (for Llama 3 chat pass the id of "<|eot_id|>").
    Returns (texts, stats); the texts leave out the prompts and special tokens.
    """
    if isinstance(tokenizer, ByteTokenizer):
        ids = [tokenizer.encode(p) for p in prompts]
        eos_id, decode = tokenizer.eos_id, tokenizer.decode
    else:  # a prompt that already starts with BOS (a chat prompt) gets no second one
        bos = tokenizer.bos_token
        ids = [tokenizer.encode(p, add_special_tokens=not (bos and p.startswith(bos))) for p in prompts]
        eos_id, decode = tokenizer.eos_token_id, lambda t: tokenizer.decode(t, skip_special_tokens=True)
    tokens, stats = generator.generate(ids, max_new_tokens, **{"eos_id": eos_id, **kwargs})
    return [decode(t) for t in tokens], stats
