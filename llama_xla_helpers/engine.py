"""Continuous batching: a fixed set of slots, prefill / insert / one decode step for all slots.

    engine = Engine(model, slots=4, buckets=(16, 32, 64, 128))
    engine.warmup()                                  # every graph compiles here, once
    req = engine.submit(prompt_tokens, max_tokens=32)
    while not req.done:
        engine.step()                                # admit waiting requests, decode one token for all
    req.tokens, req.finish_reason

A `Generator` call runs a batch until its longest row ends: a short request waits for the
longest, and a new one waits for the whole batch. Here each of the B slots holds one request
at its own position. Every step decodes one token for all B slots (one compiled graph);
a request that ends frees its slot, and the next waiting request takes it at once.
This is JetStream's engine (prefill / insert / generate) in PyTorch/XLA:

- prefill: one request's prompt, left-padded to a bucket, into a one-row KV cache (one graph
  per bucket; a longer prompt runs section by section, as in `Generator`);
- insert: copy that cache row into the request's slot of the B-row cache (`index_copy` on
  the slot dimension) and set the slot's state: last token, position, padding, sampling;
- decode: one token for every slot, each at its own cache position (`model(tokens, input_pos)`
  with input_pos (B, 1)); a free slot computes too, and its token is ignored.

The compiled shapes never depend on the requests, so after `warmup()` nothing compiles. A
compile after warm-up (a new shape, or a Python value baked into a graph) raises
`RecompileError` instead of silently costing seconds per step (vLLM's recompile check).

Sampling is per slot (temperature, top-p and a seed as device tensors) and draws its noise
from (seed, position), so a request samples the same tokens whatever shares the batch.

Sources: JetStream's engine API (prefill, insert, generate), https://github.com/AI-Hypercomputer/JetStream;
"The Path to Achieve Ultra-Low Inference Latency With LLaMA 65B on PyTorch/XLA", PyTorch blog,
https://pytorch.org/blog/path-achieve-low-inference-latency/; vLLM's check for compilations after
warm-up, https://github.com/vllm-project/vllm/issues/14580
"""
import collections
import dataclasses
import itertools
import random
import threading
import time

import torch
import torch_xla
import torch_xla.distributed.spmd as xs

from .generate import check_buckets, check_request, mark_replicated, prefill_sections, replicator
from .mesh import make_mesh
from .metrics import count_compiles
from .model import KVCache


class QueueFull(RuntimeError):
    """The waiting queue holds max_queue requests; try again later."""


class RecompileError(RuntimeError):
    """A graph compiled after warm-up."""


@dataclasses.dataclass(eq=False)
class Request:
    prompt: list
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple = ()
    callback: object = None  # callback(request), in the engine's thread: after each new token, and at the end
    id: int = 0
    tokens: list = dataclasses.field(default_factory=list)  # generated so far (an EOS is kept)
    text: str = None  # decode(tokens), cut before the first stop string (None without `decode`)
    finish_reason: str = None  # "stop" (EOS or a stop string), "length" (max_tokens), "cancelled"
    slot: int = None
    cancelled: bool = False
    submitted_at: float = 0.0
    first_token_at: float = None
    finished_at: float = None

    @property
    def done(self):
        return self.finish_reason is not None


# --- The three graphs -----------------------------------------------------------------------

def uniform(seed, pos, n):
    """(B, n) numbers in (0, 1), a hash of (seed, pos, index): the same draw for a request's
    position wherever it sits in the batch. seed, pos: (B,) int64."""
    x = (seed[:, None] * 0x9E3779B1 + pos[:, None] * 0x85EBCA77 + torch.arange(n, device=seed.device)) & 0xFFFFFFFF
    for _ in range(2):  # mix the bits (a 32-bit integer hash; the masks keep it in 32 bits)
        x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    x = (x >> 16) ^ x
    return ((x >> 8).float() + 0.5) / 2 ** 24  # 24 bits: exact in fp32, never 0 or 1


def sample_rows(logits, temperature, top_p, seed, pos):
    """Next token per row (B,) from logits (B, vocab_size), each row with its own temperature,
    top_p (B,) fp32 and seed (B,) int64: greedy where temperature is 0, else top-p sampling."""
    greedy = logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature.clamp(min=1e-6)[:, None], dim=-1)
    probs_sort, order = probs.sort(dim=-1, descending=True)  # (B, vocab_size)
    drop = probs_sort.cumsum(dim=-1) - probs_sort > top_p[:, None]  # the nucleus, as in generate.sample
    probs_sort = probs_sort.masked_fill(drop, 0.0)
    # The exponential race: argmax(p / E) with E ~ Exp(1) (E = -log U) draws index i with probability p_i.
    pick = (probs_sort / -uniform(seed, pos, logits.shape[-1]).log()).argmax(dim=-1)  # (B,)
    sampled = order.gather(-1, pick[:, None])[:, 0]
    return torch.where(temperature > 0, sampled, greedy)


def prefill_step(model, pin, tokens, input_pos, pad, row):
    """One prompt section: tokens (1, n) at cache slots input_pos (n,) of the one-row cache.
    row (1, 4) int64 holds [last token, position, pad, seed] and (1, 2) fp32 sampling comes
    with it; returns the next token (1,) (only the last section's counts)."""
    ints, floats = row
    logits = model(tokens, input_pos, pad)[:, -1]  # (1, vocab_size)
    return pin(sample_rows(logits, floats[:, 0], floats[:, 1], ints[:, 3], input_pos[-1:]))


def insert(decode_caches, prefill_caches, state, slot, row):
    """Copy the one-row cache into slot `slot` (1,) of every layer's (B, ...) cache and set the
    slot's state: ints (B, 4) [last token, position, pad, seed], floats (B, 2) [temperature, top_p]."""
    for d, p in zip(decode_caches, prefill_caches):
        d.k_cache.index_copy_(0, slot, p.k_cache)  # (B, max_seq_len, n_kv_heads, head_dim)
        d.v_cache.index_copy_(0, slot, p.v_cache)
    return tuple(s.index_copy(0, slot, r) for s, r in zip(state, row))


def decode_step(model, pin, state, active, greedy):
    """One token for every slot, each at its own position; a free slot's (active False) is
    ignored and its position stays. greedy (a Python bool: two graphs) skips the sampling's
    softmax and sort over the vocabulary when no busy slot samples. Returns (new tokens (B,), new state)."""
    ints, floats = state
    tokens, pos, pad, seed = ints.unbind(dim=-1)  # each (B,)
    logits = model(tokens[:, None], pos[:, None], pad)[:, -1]  # (B, vocab_size)
    nxt = logits.argmax(dim=-1) if greedy else sample_rows(logits, floats[:, 0], floats[:, 1], seed, pos)
    ints = torch.stack([nxt, pos + active.long(), pad, seed], dim=-1)  # (B, 4)
    return pin(nxt), (pin(ints), pin(floats))


# --- The engine -----------------------------------------------------------------------------

class Engine:
    """Continuous batching over `slots` requests with a `Llama` (moved to the XLA device if on
    the CPU; or sharded by `parallel.shard_for_inference`). See the module docstring.

    decode: tokens -> text (a tokenizer's decode), needed for stop strings. on_recompile:
    "raise" (a `RecompileError` from `step`) or "count" (only `compiles_since_warmup`).
    """

    def __init__(self, model, slots=None, buckets=(128, 256, 384, 512), max_queue=64, eos_id=None,
                 decode=None, on_recompile="raise"):
        args = model.args
        slots = args.max_batch_size if slots is None else slots
        if not isinstance(slots, int) or not 1 <= slots <= args.max_batch_size:
            raise ValueError(f"slots={slots!r} must be an int in [1, max_batch_size={args.max_batch_size}]; "
                             "build the model with max_batch_size >= slots")
        if not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue={max_queue!r} must be an int >= 1")
        if on_recompile not in ("raise", "count"):
            raise ValueError(f"on_recompile={on_recompile!r} must be 'raise' or 'count'")
        check_buckets(buckets, args.max_seq_len, room=2)  # warm-up generates 2 tokens after the largest bucket
        if eos_id is not None and not 0 <= eos_id < args.vocab_size:
            raise ValueError(f"eos_id={eos_id} is outside the vocabulary [0, {args.vocab_size})")
        self.device = torch_xla.device()
        self.model = model if model.embed_tokens.weight.device.type == "xla" else model.to(self.device)
        if getattr(self.model, "mesh", None) is None:
            mark_replicated(self.model)
        self.pin = replicator(self.model)
        self.mesh = self.model.mesh if hasattr(self.model, "mesh") else make_mesh()
        self.slots, self.buckets, self.max_queue = slots, tuple(buckets), max_queue
        self.eos_id, self.decode, self.on_recompile = eos_id, decode, on_recompile
        self.max_seq_len, self.vocab_size = args.max_seq_len, args.vocab_size
        self.decode_caches = [layer.self_attn.kv_cache for layer in self.model.layers]
        self.prefill_caches = [self.one_row_cache() for _ in self.model.layers]
        self.state = (self.put(torch.zeros(slots, 4, dtype=torch.long)), self.put(torch.ones(slots, 2)))
        self.running = [None] * slots  # the request in each slot
        self.waiting = collections.deque()
        self.lock, self.wake = threading.Lock(), threading.Condition(threading.Lock())
        self.ids = itertools.count()
        self.requests_total = self.tokens_total = self.compiles_since_warmup = 0
        self.warm = False
        self.timeline = collections.deque(maxlen=4096)  # the last decode steps: request id per slot (None: free)

    def one_row_cache(self):
        """A (1, max_seq_len, n_kv_heads, head_dim) cache for prefill, split on heads like the model's."""
        weight, tp = self.model.embed_tokens.weight, hasattr(self.model, "mesh")
        cache = KVCache(dataclasses.replace(self.model.args, max_batch_size=1), weight.dtype, self.device)
        for t in (cache.k_cache, cache.v_cache):  # (1, max_seq_len, n_kv_heads, head_dim)
            xs.mark_sharding(t, self.mesh, (None, None, "model" if tp else None, None))
        return cache

    def put(self, t):
        """A host tensor on the device, annotated 'replicated' as data (not as a graph op, which
        would make its first use a different graph from its later ones)."""
        t = t.to(self.device)
        xs.mark_sharding(t, self.mesh, (None,) * t.dim())
        return t

    # --- requests (any thread) ---

    def submit(self, prompt, max_tokens, temperature=0.0, top_p=1.0, seed=None, stop=(), callback=None):
        """Queue a request; returns its `Request` at once. ValueError for bad input (before any
        work), QueueFull when max_queue requests are waiting."""
        check_request(self.model.args, self.buckets, [prompt], max_tokens, temperature, top_p, None, "max_tokens")
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if stop and self.decode is None:
            raise ValueError("stop strings need text: build the Engine with decode=tokenizer.decode")
        seed = random.getrandbits(31) if seed is None else seed
        req = Request(list(prompt), max_tokens, float(temperature), float(top_p), int(seed) & 0x7FFFFFFF, stop,
                      callback, next(self.ids), submitted_at=time.perf_counter())
        with self.lock:
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting (max_queue={self.max_queue}); "
                                "retry later, or start the engine with a larger max_queue")
            self.waiting.append(req)
            self.requests_total += 1
        self.notify()
        return req

    def cancel(self, req):
        """End a waiting or running request ("cancelled"); a running one frees its slot at the next step."""
        req.cancelled = True
        self.notify()

    def notify(self):
        with self.wake:
            self.wake.notify()

    # --- the scheduler (one thread) ---

    def step(self):
        """Admit waiting requests into free slots, then decode one token for all slots.
        Returns True if there was work."""
        compiles = count_compiles()
        self.drop_cancelled()
        self.admit()
        busy = [r is not None for r in self.running]
        if any(busy):
            greedy = all(r.temperature == 0 for r in self.running if r is not None)
            nxt, self.state = decode_step(self.model, self.pin, self.state, self.put(torch.tensor(busy)), greedy)
            torch_xla.sync()
            self.timeline.append([None if r is None else r.id for r in self.running])
            for slot, token in enumerate(nxt.cpu().tolist()):  # the one copy to the host per step: B tokens
                if self.running[slot] is not None:
                    self.emit(self.running[slot], token)
        self.check_compiles(count_compiles() - compiles)
        return any(busy) or bool(self.waiting)

    def admit(self):
        """Prefill and insert waiting requests while a slot is free."""
        while None in self.running:
            with self.lock:
                if not self.waiting:
                    return
                req = self.waiting.popleft()
            if req.cancelled:
                self.finish(req, "cancelled")
                continue
            first, row = self.prefill(req)
            self.emit(req, first)
            if not req.done:  # a one-token request, or EOS at once, never takes a slot
                req.slot = self.running.index(None)
                self.running[req.slot] = req
                slot = self.put(torch.tensor([req.slot]))
                self.state = insert(self.decode_caches, self.prefill_caches, self.state, slot, row)
                self.state = tuple(self.pin(s) for s in self.state)
                torch_xla.sync()

    def prefill(self, req):
        """Run the prompt's sections into the one-row cache; returns (first token, the slot's state row)."""
        sections = prefill_sections(len(req.prompt), self.buckets)  # submit() checked the request
        width = sum(sections)
        pad = width - len(req.prompt)
        padded = torch.tensor([[0] * pad + req.prompt])  # (1, width) left-padded
        ints = self.put(torch.tensor([[0, width, pad, req.seed]]))  # (1, 4)
        row = (ints, self.put(torch.tensor([[req.temperature, req.top_p]])))  # (1, 2)
        pad_t = self.put(torch.tensor([pad]))
        self.use(self.prefill_caches)
        pos = 0
        for n in sections:
            tokens, input_pos = padded[:, pos:pos + n].to(self.device), self.put(torch.arange(pos, pos + n))
            first = prefill_step(self.model, self.pin, tokens, input_pos, pad_t, row)
            torch_xla.sync()
            pos += n
        self.use(self.decode_caches)
        first = first.cpu().item()
        ints = self.put(torch.tensor([[first, width, pad, req.seed]]))
        return first, (ints, row[1])

    def use(self, caches):
        """Point every layer's attention at these KV caches."""
        for layer, cache in zip(self.model.layers, caches):
            layer.self_attn.kv_cache = cache

    def emit(self, req, token):
        """Append a new token to req and finish it on EOS, a stop string or max_tokens."""
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
        req.tokens.append(token)
        self.tokens_total += 1
        if self.decode is not None:
            req.text = self.decode(req.tokens)
            cut = min((req.text.find(s) for s in req.stop if s in req.text), default=-1)
            if cut >= 0:
                req.text = req.text[:cut]
                return self.finish(req, "stop")
        if token == self.eos_id:
            return self.finish(req, "stop")
        if len(req.tokens) >= req.max_tokens:
            return self.finish(req, "length")
        if req.callback:
            req.callback(req)

    def finish(self, req, reason):
        req.finish_reason, req.finished_at = reason, time.perf_counter()
        if req.slot is not None:
            self.running[req.slot] = None
        if req.callback:
            req.callback(req)

    def drop_cancelled(self):
        for req in self.running:
            if req is not None and req.cancelled:
                self.finish(req, "cancelled")

    def check_compiles(self, new):
        """Count (or raise for) the compilations of a step after warm-up."""
        if self.warm and new:
            self.compiles_since_warmup += new
            if self.on_recompile == "raise":
                raise RecompileError(
                    f"{new} XLA compilation(s) in a step after warm-up: a graph changed shape or baked in "
                    "a new Python value; run with PT_XLA_DEBUG_LEVEL=2 to see which and why")

    def warmup(self):
        """Compile every graph: each bucket's prefill, insert, and the greedy and sampling decode
        steps, twice over so the second round runs the steady-state graphs (the first round's
        inputs come from the host, later ones from earlier graphs). Returns the number of compilations."""
        start = count_compiles()
        for _ in range(2):
            reqs = []
            for b, temperature in [(b, 0.0) for b in self.buckets] + [(self.buckets[0], 1.0)]:
                reqs.append(self.submit([0] * b, max_tokens=2, temperature=temperature))
                self.step()  # one at a time: a slot is free at each step, so any max_queue will do
            while not all(r.done for r in reqs):
                self.step()
        self.requests_total = self.tokens_total = 0
        self.timeline.clear()
        self.warm = True
        return count_compiles() - start

    def run(self, stop_event):
        """The scheduler loop for a background thread: step while there is work, otherwise
        sleep until a request arrives or stop_event is set (then return once idle)."""
        while True:
            if not self.step():
                if stop_event.is_set():
                    return
                with self.wake:
                    self.wake.wait(timeout=0.1)

    def generate(self, prompts, max_tokens, **sampling):
        """Every prompt's tokens (a list each), run through the slots as they free up."""
        pending, reqs = list(prompts), []
        while pending or not all(r.done for r in reqs):
            while pending and len(self.waiting) < self.max_queue:
                reqs.append(self.submit(pending.pop(0), max_tokens, **sampling))
            self.step()
        return [r.tokens for r in reqs]

    def metrics(self):
        return dict(requests_total=self.requests_total, tokens_total=self.tokens_total,
                    slots_busy=sum(r is not None for r in self.running), queue_length=len(self.waiting),
                    compiles_since_warmup=self.compiles_since_warmup, slots=self.slots)
