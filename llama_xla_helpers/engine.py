"""Continuous batching: a fixed set of slots; each step prefills prompt sections and decodes one
token for every busy slot, as `scheduler.Scheduler` plans it.

    engine = Engine(model, slots=4, buckets=(16, 32, 64, 128))
    engine.warmup()                                  # every graph compiles here, once
    req = engine.submit(prompt_tokens, max_tokens=32)
    while not req.done:
        engine.step()                                # run the next plan, read the last step's tokens
    req.tokens, req.text, req.finish_reason

A `Generator` call runs a batch until its longest row ends: a short request waits for the
longest, and a new one waits for the whole batch. Here each of the B slots holds one request
at its own position; a request that ends frees its slot, and the next waiting one takes it.
This is JetStream's engine (prefill / insert / generate) in PyTorch/XLA, with vLLM's split
between a scheduler that plans a step within a token budget and the engine that runs it:

- prefill: one prompt section (left-padded to a bucket, a long prompt in several, one per
  step while the others keep decoding) into a one-row KV cache; attention reads the section's
  own positions (`Llama.forward`'s kv_len), not the whole cache. The last section picks the
  first token, on the device. Prompts that arrive together and fit one section of the same
  bucket are prefilled together, up to `prefill_rows` in one graph of R rows (R a power of
  two, or prefill_rows; a group of 3 runs as 4 rows, the last repeated): one launch instead of
  R (benchmarks/serve.py measures the difference);
- insert: copy those cache rows into the requests' slots of the B-row cache (`index_copy` on
  the slot dimension) and set each slot's state: last token, position, padding, sampling;
- decode: one token for every slot, each at its own cache position (input_pos (B, 1)),
  attention over the smallest of a few cache lengths that holds every busy slot's position
  (`scheduler.kv_buckets`); a free slot computes too, and its token is ignored.

The host never waits for the device in between: a step traces and dispatches its graphs, and
only then reads the previous step's tokens (JetStream's one-step lag), so tracing step n + 1
overlaps the device running step n. The price: a request that ends on EOS or a stop string
holds its slot one step longer, and that extra token is dropped. compile=True traces the
model's forward once per shape with `torch.compile(backend="openxla")` instead of at every
step (the default on a TPU, where a step takes milliseconds and tracing would dominate); the
small sampling graph around it stays lazy (compiled with it, sampled tokens came out wrong:
measured, with torch_xla 2.9).

The compiled shapes never depend on the requests, so after `warmup()` nothing compiles. A
compile after warm-up (a new shape, or a Python value baked into a graph) raises
`RecompileError` instead of silently costing seconds per step (vLLM's recompile check).

Sampling is per slot (temperature, top-k, top-p and a seed as device tensors) and draws its
noise from (seed, position), so a request samples the same tokens whatever shares the batch.
It first keeps the SAMPLE_TOP_K most likely tokens (vLLM's and JetStream's TPU samplers bound
the vocabulary the same way), so no step sorts the vocabulary; when every busy slot is greedy,
the step is an argmax. `Generator` samples with the same function (`generate.sample_rows`). Text grows incrementally (`detokenize.TextStream`).

Sources: JetStream's engine API (prefill, insert, generate) and its one-step lag,
https://github.com/AI-Hypercomputer/JetStream; vLLM v1's scheduler and model runner,
https://github.com/vllm-project/vllm; "The Path to Achieve Ultra-Low Inference Latency With LLaMA 65B
on PyTorch/XLA", PyTorch blog, https://pytorch.org/blog/path-achieve-low-inference-latency/; vLLM's check
for compilations after warm-up, https://github.com/vllm-project/vllm/issues/14580
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
import torch_xla.runtime as xr

from .detokenize import TextStream
from .generate import SAMPLE_TOP_K, check_buckets, check_request, mark_replicated, replicator, sample_rows
from .mesh import make_mesh
from .metrics import count_compiles
from .model import KVCache
from .scheduler import Request, Scheduler, kv_buckets, prefill_sections, prefill_shapes, round_up

TOP_LOGPROBS = 20  # alternatives a token's log-probabilities can list (OpenAI's limit)


class QueueFull(RuntimeError):
    """The waiting queue holds max_queue requests; try again later."""


class RecompileError(RuntimeError):
    """A graph compiled after warm-up."""


# --- The three graphs -----------------------------------------------------------------------

def logprobs_of(logits, tokens):
    """Log-probabilities of tokens (...) under logits (..., vocab_size), and the TOP_LOGPROBS
    most likely tokens' (values, ids), each (..., TOP_LOGPROBS)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = lp.topk(min(TOP_LOGPROBS, lp.shape[-1]), dim=-1)
    return lp.gather(-1, tokens[..., None])[..., 0], top.values, top.indices


def forward_logits(model, tokens, input_pos, pad, kv_len, every=False):
    """The model's forward (the step's bulk; compile=True compiles this): the logits of the last
    position (bsz, vocab_size), or of every position (bsz, seqlen, vocab_size) if `every`."""
    logits = model(tokens, input_pos, pad, kv_len)
    return logits if every else logits[:, -1]


def prefill_step(forward, model, pin, tokens, input_pos, pad, row, kv_len, targets=None):
    """One prompt section of R requests: tokens (R, n) at cache slots input_pos (n,) of the
    R-row prefill cache, attention over its first kv_len slots. row: ints (R, 5) [last token,
    position, pad, seed, top_k] and floats (R, 2) [temperature, top_p]. Returns the next tokens
    (R,) and their `logprobs_of` (only the last section's count), and with targets (R, n) (the
    next prompt token at each position) their `logprobs_of` each (R, n, ...), else None."""
    ints, floats = row
    logits = forward(model, tokens, input_pos, pad, kv_len, every=targets is not None)
    prompt = None
    if targets is not None:  # logits: (R, n, vocab_size)
        prompt, logits = tuple(map(pin, logprobs_of(logits, targets))), logits[:, -1]
    pos = input_pos[-1].expand(tokens.shape[0])  # (R,): the last position, the same in every row
    first = sample_rows(logits, floats[:, 0], floats[:, 1], ints[:, 3], pos, ints[:, 4])  # (R,)
    return pin(first), tuple(map(pin, logprobs_of(logits, first))), prompt


def insert(decode_caches, prefill_caches, state, slot, row, first):
    """Copy the R-row prefill caches into slots `slot` (R,) of every layer's (B, ...) cache and
    set those slots' state: ints (B, 5) [last token, position, pad, seed, top_k], floats (B, 2)
    [temperature, top_p], with the prefill's first tokens (R,) as the last tokens. A slot may
    repeat (a padded group) only with identical rows."""
    for d, p in zip(decode_caches, prefill_caches):
        d.k_cache.index_copy_(0, slot, p.k_cache)  # (B, max_seq_len, n_kv_heads, head_dim)
        d.v_cache.index_copy_(0, slot, p.v_cache)
    ints, floats = row
    row = (torch.cat([first[:, None], ints[:, 1:]], dim=-1), floats)
    return tuple(s.index_copy(0, slot, r) for s, r in zip(state, row))


def decode_step(forward, model, pin, state, greedy, kv_len, max_seq_len):
    """One token for every slot, each at its own position, attention over the first kv_len cache
    slots. Every busy slot decodes (the scheduler sees to it); a free slot computes too, its token
    is ignored, and insert resets it. greedy (a Python bool: two graphs) is a bare argmax, for when
    no busy slot samples or asks for log-probabilities. Returns (new tokens (B,), their
    `logprobs_of` (None if greedy), new state)."""
    ints, floats = state
    tokens, pos, pad, seed, top_k = ints.unbind(dim=-1)  # each (B,)
    logits = forward(model, tokens[:, None], pos[:, None], pad, kv_len)  # (B, vocab_size)
    if greedy:
        nxt, logprobs = logits.argmax(dim=-1), None
    else:
        nxt = sample_rows(logits, floats[:, 0], floats[:, 1], seed, pos, top_k)
        logprobs = tuple(map(pin, logprobs_of(logits, nxt)))
    pos = (pos + 1).clamp(max=max_seq_len - 1)  # a free slot stays in its row
    ints = torch.stack([nxt, pos, pad, seed, top_k], dim=-1)  # (B, 5)
    return pin(nxt), logprobs, (pin(ints), floats)


def row_counts(prefill_rows):
    """The prefill graphs' row counts: powers of two below prefill_rows, and prefill_rows, e.g.
    (1, 2, 4) for 4 and (1, 2, 4, 6) for 6."""
    return tuple(sorted({2 ** i for i in range(prefill_rows.bit_length()) if 2 ** i < prefill_rows} | {prefill_rows}))


def entry(req, lp, i):
    """Row i of host `logprobs_of` outputs as req reports it: (log-probability, [(id, log-probability)]
    of its req.logprobs most likely tokens)."""
    chosen, values, ids = lp
    k = req.logprobs or 0
    return float(chosen[i]), list(zip(ids[i, :k].tolist(), values[i, :k].tolist()))


# --- The engine -----------------------------------------------------------------------------

class Engine:
    """Continuous batching over `slots` requests with a `Llama` (moved to the XLA device if on
    the CPU; or sharded by `parallel.shard_for_inference`). See the module docstring.

    eos_id: an id or a collection of ids that end a request (Llama 3 has several). decode:
    tokens -> text (a tokenizer's decode), needed for text and stop strings. on_recompile:
    "raise" (a `RecompileError` from `step`) or "count" (only `compiles_since_warmup`).
    budget: tokens per step (decoded tokens + prompt section positions; default: the largest
    bucket + slots). compile: torch.compile(backend="openxla") the model's forward (default: on
    a TPU). prefill_rows: at most this many one-section prompts of the same bucket prefill in
    one graph (default min(slots, 4); 1: each alone). Each row count in `row_counts` adds a
    prefill graph per bucket and an insert, and a prefill cache of that many rows.
    """

    def __init__(self, model, slots=None, buckets=(128, 256, 384, 512), max_queue=64, eos_id=None,
                 decode=None, on_recompile="raise", budget=None, compile=None, prefill_rows=None):
        args = model.args
        slots = args.max_batch_size if slots is None else slots
        if not isinstance(slots, int) or not 1 <= slots <= args.max_batch_size:
            raise ValueError(f"slots={slots!r} must be an int in [1, max_batch_size={args.max_batch_size}]; "
                             "build the model with max_batch_size >= slots")
        if not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue={max_queue!r} must be an int >= 1")
        prefill_rows = min(slots, 4) if prefill_rows is None else prefill_rows
        if not isinstance(prefill_rows, int) or not 1 <= prefill_rows <= slots:
            raise ValueError(f"prefill_rows={prefill_rows!r} must be an int in [1, slots={slots}]")
        if on_recompile not in ("raise", "count"):
            raise ValueError(f"on_recompile={on_recompile!r} must be 'raise' or 'count'")
        check_buckets(buckets, args.max_seq_len, room=2)  # the largest prompt section and 2 new tokens fit
        eos_ids = frozenset([] if eos_id is None else [eos_id] if isinstance(eos_id, int) else eos_id)
        for i in eos_ids:
            if not 0 <= i < args.vocab_size:
                raise ValueError(f"eos_id {i} is outside the vocabulary [0, {args.vocab_size})")
        self.device = torch_xla.device()
        self.model = model if model.embed_tokens.weight.device.type == "xla" else model.to(self.device)
        if getattr(self.model, "mesh", None) is None:
            mark_replicated(self.model)
        self.pin = replicator(self.model)
        self.mesh = self.model.mesh if hasattr(self.model, "mesh") else make_mesh()
        self.slots, self.buckets, self.max_queue = slots, tuple(buckets), max_queue
        self.eos_ids, self.decode, self.on_recompile = eos_ids, decode, on_recompile
        self.max_seq_len, self.vocab_size = args.max_seq_len, args.vocab_size
        self.scheduler = Scheduler(slots, self.buckets, args.max_seq_len, budget)
        compile = xr.device_type() == "TPU" if compile is None else compile
        self.row_counts = row_counts(prefill_rows)
        if compile:  # Dynamo traces the forward once per shape: raise its limit (8) to the engine's shapes
            shapes = 2 * (len(prefill_shapes(buckets, args.max_seq_len)) + len(buckets) * (len(self.row_counts) - 1)) \
                + len(kv_buckets(buckets, args.max_seq_len))
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, shapes)
        self.forward = torch.compile(forward_logits, backend="openxla", fullgraph=True, dynamic=False) if compile \
            else forward_logits
        self.decode_caches = [layer.self_attn.kv_cache for layer in self.model.layers]
        self.row_caches = {r: [self.prefill_cache(r) for _ in self.model.layers] for r in self.row_counts}
        self.prefill_caches = self.row_caches[1]  # the one-row caches: a long prompt's sections go here
        self.state = (self.put(torch.zeros(slots, 5, dtype=torch.long)), self.put(torch.ones(slots, 2)))
        self.pending = None  # the last step's device outputs, read at the next step
        self.lock = threading.RLock()  # the scheduler's queue: submit (any thread) and step
        self.wake = threading.Condition(threading.Lock())
        self.ids = itertools.count()
        self.requests_total = self.tokens_total = self.compiles_since_warmup = 0
        self.warm = False
        self.timeline = collections.deque(maxlen=4096)  # the last decode steps: request id per slot (None: idle)

    def prefill_cache(self, rows=1):
        """A (rows, max_seq_len, n_kv_heads, head_dim) cache for prefill, split on heads like the model's."""
        weight, tp = self.model.embed_tokens.weight, hasattr(self.model, "mesh")
        cache = KVCache(dataclasses.replace(self.model.args, max_batch_size=rows), weight.dtype, self.device)
        for t in (cache.k_cache, cache.v_cache):  # (rows, max_seq_len, n_kv_heads, head_dim)
            xs.mark_sharding(t, self.mesh, (None, None, "model" if tp else None, None))
        return cache

    def put(self, t):
        """A host tensor on the device, annotated 'replicated' as data (not as a graph op, which
        would make its first use a different graph from its later ones)."""
        t = t.to(self.device)
        xs.mark_sharding(t, self.mesh, (None,) * t.dim())
        return t

    # --- requests (any thread) ---

    def submit(self, prompt, max_tokens, temperature=0.0, top_p=1.0, seed=None, stop=(), callback=None, top_k=0,
               logprobs=None, prompt_logprobs=False):
        """Queue a request; returns its `Request` at once. ValueError for bad input (before any
        work), QueueFull when max_queue requests are waiting.

        logprobs: None, or the number of alternatives (0 to TOP_LOGPROBS) to report with each new
        token's log-probability (req.token_logprobs); prompt_logprobs: also those of the prompt's
        tokens after the first (req.prompt_token_logprobs). Log-probabilities are the model's,
        before temperature, top-k and top-p."""
        check_request(self.model.args, self.buckets, [prompt], max_tokens, temperature, top_p, None, "max_tokens")
        if not isinstance(top_k, int) or not 0 <= top_k <= SAMPLE_TOP_K:
            raise ValueError(f"top_k={top_k!r} must be an int in [0, {SAMPLE_TOP_K}] (0: no limit but the "
                             f"engine's, the {SAMPLE_TOP_K} most likely tokens)")
        if logprobs is not None and (not isinstance(logprobs, int) or not 0 <= logprobs <= TOP_LOGPROBS):
            raise ValueError(f"logprobs={logprobs!r} must be None or an int in [0, {TOP_LOGPROBS}]")
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop={list(stop)!r}: every stop string must be a non-empty string")
        if stop and self.decode is None:
            raise ValueError("stop strings need text: build the Engine with decode=tokenizer.decode")
        seed = random.getrandbits(31) if seed is None else seed
        req = Request(list(prompt), max_tokens, float(temperature), float(top_p), top_k, int(seed) & 0x7FFFFFFF,
                      stop, callback, next(self.ids), logprobs=logprobs, prompt_logprobs=bool(prompt_logprobs),
                      submitted_at=time.perf_counter())
        req.stream = None if self.decode is None else TextStream(self.decode, req.prompt, stop)
        with self.lock:
            waiting = self.queue_length()
            if waiting >= self.max_queue:
                raise QueueFull(f"{waiting} requests are waiting (max_queue={self.max_queue}); "
                                "retry later, or start the engine with a larger max_queue")
            self.scheduler.add(req)
            self.requests_total += 1
        self.notify()
        return req

    def cancel(self, req):
        """End a waiting or running request ("cancelled") at the next step; its slot frees then."""
        req.cancelled = True
        self.notify()

    def notify(self):
        with self.wake:
            self.wake.notify()

    def room(self, prompt_len):
        """The most tokens a request with a prompt of prompt_len tokens may ask for: the cache
        positions after its left-padded prompt."""
        return self.max_seq_len - sum(prefill_sections(prompt_len, self.buckets))

    def queue_length(self):
        return sum(not r.cancelled for r in self.scheduler.waiting)

    # --- the steps (one thread) ---

    def step(self):
        """Run the scheduler's next plan on the device, then read the previous step's tokens and
        hand them to their requests. Returns True if there was work."""
        compiles = count_compiles()
        with self.lock:
            for req in [r for r in (*self.scheduler.running, *self.scheduler.waiting) if r and r.cancelled]:
                self.finish(req, "cancelled")
            plan = self.scheduler.schedule()
        work = bool(plan.prefill or plan.decode)
        read, self.pending = self.pending, self.dispatch(plan) if work else None
        if read is not None:
            self.collect(*read)
        self.check_compiles(count_compiles() - compiles)
        return work or read is not None

    def groups(self, prefill):
        """The plan's prefill entries as launches: (requests, start, n, kv_len), one-section
        prompts of the same length and echo together, up to the largest row count each."""
        out = []
        for req, start, n, kv_len in prefill:
            whole = start == 0 and n == req.width  # the whole prompt in one section (else: the one-row cache)
            head = out[-1][0][0] if out else None
            if (whole and head and head.width == n and out[-1][1] == 0 and head.prompt_logprobs == req.prompt_logprobs
                    and len(out[-1][0]) < self.row_counts[-1]):
                out[-1][0].append(req)
            else:
                out.append(([req], start, n, kv_len))
        return out

    def dispatch(self, plan):
        """Trace and launch the plan's graphs (each launch returns at once); returns their device
        outputs for `collect`: prompt log-probabilities, first tokens, decoded tokens."""
        prompts, firsts, decoded = [], [], None
        for reqs, start, n, kv_len in self.groups(plan.prefill):
            rows = round_up(len(reqs), self.row_counts)
            padded = reqs + reqs[-1:] * (rows - len(reqs))  # the last request repeated: identical rows
            first, first_lp, prompt_lp, row = self.prefill(padded, start, n, kv_len)
            if prompt_lp is not None:
                prompts.append((reqs, start, n, prompt_lp))
            if start + n == reqs[0].width:  # their last section: into their slots
                slots = self.put(torch.tensor([r.slot for r in padded]))
                self.state = insert(self.decode_caches, self.row_caches[rows], self.state, slots, row[:2], first)
                self.state = tuple(self.pin(s) for s in self.state)
                torch_xla.sync()
                firsts.append((reqs, first, first_lp))
        if plan.decode:
            busy = {r.slot: r for r in plan.decode}
            greedy = all(r.temperature == 0 and r.logprobs is None for r in plan.decode)
            nxt, lp, self.state = decode_step(self.forward, self.model, self.pin, self.state, greedy, plan.kv_len,
                                              self.max_seq_len)
            torch_xla.sync()
            self.timeline.append([busy[s].id if s in busy else None for s in range(self.slots)])
            decoded = (plan.decode, nxt, lp)
        return prompts, firsts, decoded

    def prefill(self, reqs, start, n, kv_len):
        """Run one prompt section of each of reqs (R of them, the same section) into the R-row
        prefill caches; returns `prefill_step`'s device outputs and the requests' sampling rows."""
        pads = [r.width - len(r.prompt) for r in reqs]
        if start == 0:  # the requests' sampling rows (for their insert) and padding
            for r in reqs:
                r.scheduled_at = time.perf_counter()
            ints = self.put(torch.tensor([[0, r.width, pad, r.seed, r.top_k] for r, pad in zip(reqs, pads)]))  # (R, 5)
            row = (ints, self.put(torch.tensor([[r.temperature, r.top_p] for r in reqs])), self.put(torch.tensor(pads)))
            reqs[0].row = row  # kept for the later sections of a long prompt (R = 1)
        row = reqs[0].row
        padded = [[0] * pad + r.prompt + [0] for r, pad in zip(reqs, pads)]  # left-padded, a stand-in after the last token
        tokens = torch.tensor([p[start:start + n] for p in padded]).to(self.device)  # (R, n)
        targets = self.put(torch.tensor([p[start + 1:start + n + 1] for p in padded])) if reqs[0].prompt_logprobs else None
        self.use(self.row_caches[len(reqs)])
        input_pos = self.put(torch.arange(start, start + n))
        out = prefill_step(self.forward, self.model, self.pin, tokens, input_pos, row[2], row[:2], kv_len, targets)
        self.use(self.decode_caches)
        torch_xla.sync()
        return (*out, row)

    def use(self, caches):
        """Point every layer's attention at these KV caches."""
        for layer, cache in zip(self.model.layers, caches):
            layer.self_attn.kv_cache = cache

    def collect(self, prompts, firsts, decoded):
        """Bring a step's outputs to the host (this waits for its graphs) and hand them to their requests."""
        for reqs, start, n, lp in prompts:  # position p predicts prompt token p + 1 - pad
            lp = [t.cpu() for t in lp]  # each (R, n, ...)
            for i, req in enumerate(reqs):
                pad, row = req.width - len(req.prompt), [t[i] for t in lp]
                req.prompt_token_logprobs += [entry(req, row, p - start) for p in range(max(start, pad), start + n)
                                              if p < req.width - 1]
        for reqs, first, lp in firsts:
            tokens = first.cpu().tolist()  # R tokens
            lp = [t.cpu() for t in lp] if any(r.logprobs is not None for r in reqs) else None
            for i, req in enumerate(reqs):
                self.emit(req, tokens[i], lp and [t[i:i + 1] for t in lp])
        if decoded:
            reqs, nxt, lp = decoded
            tokens = nxt.cpu().tolist()  # B tokens
            lp = [t.cpu() for t in lp] if any(r.logprobs is not None for r in reqs) else None
            for req in reqs:
                self.emit(req, tokens[req.slot], lp and [t[req.slot:req.slot + 1] for t in lp])

    def emit(self, req, token, lp=None):
        """Append a new token (and its `logprobs_of`, host tensors of one row) to req and finish it
        on EOS, a stop string or max_tokens. A token of a request that has ended (the step after
        its EOS, or after a cancel) is dropped."""
        if req.done:
            return
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
        req.tokens.append(token)
        if req.logprobs is not None:
            req.token_logprobs.append(entry(req, lp, 0))
        self.tokens_total += 1
        if req.stream is not None:
            req.stream.add(token)
            req.text = req.stream.text
            if req.stream.stopped:
                return self.finish(req, "stop")
        if token in self.eos_ids:
            return self.finish(req, "stop")
        if len(req.tokens) >= req.max_tokens:
            return self.finish(req, "length")
        if req.callback:
            req.callback(req)

    def finish(self, req, reason, error=None):
        if req.stream is not None:
            req.stream.flush()
            req.text = req.stream.text
        req.finish_reason, req.error, req.finished_at = reason, error, time.perf_counter()
        with self.lock:
            self.scheduler.finish(req)
        if req.callback:
            req.callback(req)

    def abort(self, message):
        """Finish every waiting and running request with finish_reason "error" (after a failed step)."""
        with self.lock:
            reqs = [r for r in (*self.scheduler.running, *self.scheduler.waiting) if r is not None]
            for req in reqs:
                self.finish(req, "error", message)
        self.pending = None

    def check_compiles(self, new):
        """Count (or raise for) the compilations of a step after warm-up."""
        if self.warm and new:
            self.compiles_since_warmup += new
            if self.on_recompile == "raise":
                raise RecompileError(
                    f"{new} XLA compilation(s) in a step after warm-up: a graph changed shape or baked in "
                    "a new Python value; run with PT_XLA_DEBUG_LEVEL=2 to see which and why")

    def warmup(self):
        """Compile every graph: each (section, kv_len) prefill with and without prompt
        log-probabilities (one-section prompts at every row count), the insert of each row count,
        and the greedy and sampling decode steps at every kv_len, twice over so the second round
        runs them as steps do, on the outputs of earlier graphs. Returns the number of compilations."""
        start = count_compiles()
        req = Request([0] * self.max_seq_len, 2, top_k=1, sections=(self.max_seq_len,))  # room for any section
        for _ in range(2):
            for rows in self.row_counts:
                shapes = prefill_shapes(self.buckets, self.max_seq_len) if rows == 1 else [(b, b) for b in self.buckets]
                for n, kv_len in shapes:
                    for req.prompt_logprobs in (True, False):  # a first section (kv_len == n) or a later one
                        first, _, _, row = self.prefill([req] * rows, kv_len - n, n, kv_len)
                self.state = insert(self.decode_caches, self.row_caches[rows], self.state,
                                    self.put(torch.tensor([0] * rows)), row[:2], first)
                self.state = tuple(self.pin(s) for s in self.state)
                torch_xla.sync()
            for kv_len in kv_buckets(self.buckets, self.max_seq_len):
                for greedy in (True, False):
                    out = decode_step(self.forward, self.model, self.pin, self.state, greedy, kv_len, self.max_seq_len)
                    self.state = out[2]
                    torch_xla.sync()  # with every output alive, as in a step (a dropped one makes another graph)
        self.warm = True
        return count_compiles() - start

    def run(self, stop_event):
        """The step loop for a background thread: step while there is work, otherwise sleep until
        a request arrives or stop_event is set (then return once idle)."""
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
            while pending and self.queue_length() < self.max_queue:
                reqs.append(self.submit(pending.pop(0), max_tokens, **sampling))
            self.step()
        return [r.tokens for r in reqs]

    def metrics(self):
        """The counters /metrics reports, read under the lock: `submit` (another thread) may be
        appending to the waiting queue, and iterating a deque that changes raises."""
        with self.lock:
            return dict(requests_total=self.requests_total, tokens_total=self.tokens_total,
                        slots_busy=sum(r is not None for r in self.scheduler.running),
                        queue_length=self.queue_length(), compiles_since_warmup=self.compiles_since_warmup,
                        slots=self.slots)
