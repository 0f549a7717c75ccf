"""Continuous batching over a paged KV cache: each step runs the tokens of every request in flight
(prompt chunks and decoded tokens) in one ragged program, as `scheduler.Scheduler` plans it.

    engine = Engine(model, slots=16, buckets=(16, 32, 64, 128))
    engine.warmup()                                  # every program compiles here, once
    req = engine.submit(prompt_tokens, max_tokens=32)
    while not req.done:
        engine.step()                                # run the next plan, read the last step's tokens
    req.tokens, req.text, req.finish_reason

A `Generator` call runs a batch until its longest row ends, each row holding a whole context of
cache. Here requests come and go at every step, and the cache is a pool of pages (`kv_pages.py`):
a request holds pages for the positions it has written, a short one few, so as many requests run
as their tokens fit, up to `slots`. The engine is split as vLLM v1 splits its own, each part small
enough to read alone:

- the scheduler (`scheduler.py`, pure Python) plans a step within a budget of tokens (the largest
  bucket): which positions of which requests run, which pages hold them, whom to preempt when the
  pool runs short, which prefixes the cache already holds;
- the model runner (`runner.py`) holds the device state (every layer's pages, each slot's newest
  token) and launches one program per step, compiled or lazy;
- the sampler (`sampling.py`) runs inside that program;
- the output side (`outputs.py`) turns tokens into text and log-probabilities and ends requests
  on EOS, a stop string or max_tokens;
- `Engine` (here) ties them together: requests in (any thread), steps (one thread).

One ragged step: a long prompt is prefilled a chunk per step while the others keep decoding
(chunked prefill), prompts that arrive together go in the same step, and each token attends to
its own request's keys (`attention.ragged_attention`: no padding to a common length, no slot
reserved for the longest request). The step's shape is its token count rounded up to a bucket and
the pages it reads rounded up to a bucket (`runner.ModelRunner`: on a TPU each block table's, a
whole context, which the kernel reads up to each sequence's length; elsewhere the step's distinct
pages in all), so a step whose requests are short reads few pages.

Prefix caching: a request whose prompt starts with pages the pool still holds (a system prompt, an
earlier turn, the same prompt with n > 1) reuses them and prefills only the rest
(`kv_pages.page_hashes`); its outputs are the same as without the hit (greedy: the same tokens;
sampled: the same per seed, since the noise is a hash of (seed, position)).

The host never waits for the device in between: a step launches its program, and only then reads
the previous step's tokens (JetStream's one-step lag), so preparing step n + 1 overlaps the device
running step n. The price: a request that ends on EOS or a stop string runs one step longer, and
that extra token is dropped. A decode step's input token is the one the previous step sampled,
which stays on the device for it (`runner.step_program`). While a request with a grammar runs,
the engine reads each step's tokens before launching the next instead: the grammar's mask for
the next token needs the token before it (`grammar.py`).

compile: the runner's program goes through `torch.compile(backend="openxla")`, traced once per
shape, and the pages are donated, so XLA writes them in place (runner.py). Without it, each step
traces the model again as lazy tensors, which costs host time at every step. The default
(`runner.default_compile`) is compiled on every device, the path the benchmark measures faster.
Measured on a 2-core CPU (benchmarks/serve.py, its 56M model, medians of 3, 2026-12-07):
compiled serves 179.0 tokens/s all at once against lazy's 102.9 (the median of the repetitions'
own ratios: 1.67x), with 3.5 ms of host time per batch-8 decode step against 27.6; but its
warm-up compiles every program first (25 in 150 s), so the tests and notebooks that serve a few
requests off a TPU pass compile=False.

Token buckets (`default_buckets`): from 16 on a TPU, whose kernel and matrix units want 16 rows
and more; from 4 elsewhere, where a step's cost follows its rows (measured on that CPU, 8 layers,
32 pages: 20 ms at 4 tokens, 32-36 ms at 16).

The compiled shapes never depend on the requests, so after `warmup()` nothing compiles. A
compile after warm-up (a new shape, or a Python value baked into a graph) raises
`RecompileError` instead of silently costing seconds per step (vLLM's recompile check).

Sampling is per request (temperature, top-k, top-p and a seed as device tensors) and draws its
noise from (seed, position), so a request samples the same tokens whatever shares the step
(`sampling.sample_rows`, which `Generator` uses too). OpenAI's logit_bias, presence and frequency
penalties and a grammar's token bitmask (structured output, `grammar.py`) change a request's
logits in the same program (`sampling.adjusted`), from state the step keeps per slot on the device
(`runner.step_program`), so no parameter adds a program. Text grows incrementally
(`detokenize.TextStream`).

Sources: vLLM v1's scheduler, KV cache manager and TPU model runner, https://github.com/vllm-project/vllm;
Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention"
(SOSP 2023), https://arxiv.org/abs/2309.06180; JetStream's one-step lag,
https://github.com/AI-Hypercomputer/JetStream; vLLM's check for compilations after warm-up,
https://github.com/vllm-project/vllm/issues/14580
"""
import collections
import itertools
import random
import threading
import time

from .attention import on_tpu
from .detokenize import TextStream
from .generate import check_request
from .grammar import matcher
from .kv_pages import PagePool, page_size_for, pages_for
from .metrics import count_compiles
from .outputs import add_prompt_logprobs, add_token, settle
from .runner import ModelRunner, default_compile
from .sampling import SAMPLE_TOP_K, TOP_LOGPROBS, sample_rows  # noqa: F401  the engine's names, as before
from .scheduler import LOGIT_BIAS_MAX, Request, Scheduler

BUCKETS = (16, 32, 64, 128, 256, 512)  # a step's token counts on a TPU (the kernel's and the MXU's: 16 and up)
CPU_BUCKETS = (4, 8) + BUCKETS  # elsewhere: a few requests decoding pay for 4 or 8 rows, not 16 (module docstring)


def default_buckets():
    """A step's token counts when not given (the largest is its budget): `BUCKETS` on a TPU,
    `CPU_BUCKETS` elsewhere."""
    return BUCKETS if on_tpu() else CPU_BUCKETS


class QueueFull(RuntimeError):
    """The waiting queue holds max_queue requests; try again later."""


class RecompileError(RuntimeError):
    """A graph compiled after warm-up."""


def check_logit_bias(logit_bias, vocab_size):
    """{token id: bias} as ints and floats; ValueError naming the entry that is not an id in
    [0, vocab_size) with a number in [-100, 100], or more than LOGIT_BIAS_MAX entries (OpenAI's limits)."""
    logit_bias = dict(logit_bias or {})
    if len(logit_bias) > LOGIT_BIAS_MAX:
        raise ValueError(f"logit_bias=<{len(logit_bias)} entries> holds more than {LOGIT_BIAS_MAX}; send fewer")
    for token, bias in logit_bias.items():
        if not isinstance(token, int) or not 0 <= token < vocab_size or not isinstance(bias, (int, float)) \
                or not -100 <= bias <= 100:
            raise ValueError(f"logit_bias={{{token!r}: {bias!r}}} must map token ids in [0, {vocab_size}) to "
                             f"numbers in [-100, 100]")
    return {token: float(bias) for token, bias in logit_bias.items()}


def check_buckets(buckets, slots):
    buckets = tuple(buckets)
    if not buckets or list(buckets) != sorted(set(buckets)) or not all(isinstance(b, int) and b >= 1 for b in buckets):
        raise ValueError(f"buckets={buckets} must be increasing positive ints, e.g. {BUCKETS}")
    if buckets[-1] < slots:
        raise ValueError(f"the largest bucket ({buckets[-1]} tokens, a step's budget) < slots={slots}: a step could "
                         f"not decode every request in flight; add a bucket >= {slots} or use fewer slots")
    return buckets


class Engine:
    """Continuous batching of up to `slots` requests with a `Llama` (moved to the XLA device if on
    the CPU; or sharded by `parallel.shard_for_inference`). See the module docstring.

    buckets: a step's token counts (its flat axis padded up to one), the largest its budget
    (default: `default_buckets()`).
    pages: the pool's pages, each of page_size positions (default `kv_pages.page_size_for`): by
    default as many as the model's own caches held (max_batch_size whole contexts), plus page 0.
    prefix_caching: reuse cached pages of earlier requests. eos_id: an id or a collection of ids
    that end a request (Llama 3 has several). decode: tokens -> text (a tokenizer's decode), needed
    for text and stop strings. on_recompile: "raise" (a `RecompileError` from `step`) or "count"
    (only `compiles_since_warmup`). compile: torch.compile the runner's program (default: on a TPU;
    its graphs may hold the weights as constants, `runner.compiled`: a new engine after changing them).
    """

    def __init__(self, model, slots=None, buckets=None, max_queue=64, eos_id=None, decode=None,
                 on_recompile="raise", compile=None, pages=None, page_size=None, prefix_caching=True):
        args = model.args
        slots = args.max_batch_size if slots is None else slots
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots={slots!r} must be an int >= 1 (requests in flight at most)")
        if not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue={max_queue!r} must be an int >= 1")
        if on_recompile not in ("raise", "count"):
            raise ValueError(f"on_recompile={on_recompile!r} must be 'raise' or 'count'")
        buckets = check_buckets(default_buckets() if buckets is None else buckets, slots)
        page_size = page_size or page_size_for(args.max_seq_len)
        pages = pages or args.max_batch_size * pages_for(args.max_seq_len, page_size) + 1
        if not isinstance(pages, int) or pages < 2:
            raise ValueError(f"pages={pages!r} must be an int >= 2 (page 0 takes the padding's writes)")
        eos_ids = frozenset([] if eos_id is None else [eos_id] if isinstance(eos_id, int) else eos_id)
        for i in eos_ids:
            if not 0 <= i < args.vocab_size:
                raise ValueError(f"eos_id {i} is outside the vocabulary [0, {args.vocab_size})")
        self.slots, self.buckets, self.max_queue = slots, buckets, max_queue
        self.eos_ids, self.decode, self.on_recompile = eos_ids, decode, on_recompile
        self.max_seq_len, self.vocab_size = args.max_seq_len, args.vocab_size
        self.pool = PagePool(pages, page_size)
        self.scheduler = Scheduler(slots, buckets[-1], self.pool, prefix_caching)
        self.compile = default_compile() if compile is None else compile
        self.runner = ModelRunner(model, slots, pages, page_size, buckets, self.compile, tuple(sorted(eos_ids)))
        self.model = self.runner.model
        self.pending = None  # the last step's device outputs, read at the next step
        self.lock = threading.RLock()  # the scheduler's queue: submit (any thread) and step
        self.wake = threading.Condition(threading.Lock())
        self.ids = itertools.count()
        self.requests_total = self.tokens_total = self.compiles_since_warmup = 0
        self.warm = False
        self.timeline = collections.deque(maxlen=4096)  # the last steps: {request id: pages held} each

    def programs(self):
        """The runner's program shapes, each compiled once (`ModelRunner.shapes`)."""
        return len(self.runner.shapes())

    # --- requests (any thread) ---

    def submit(self, prompt, max_tokens, temperature=0.0, top_p=1.0, seed=None, stop=(), callback=None, top_k=0,
               logprobs=None, prompt_logprobs=False, ignore_eos=False, min_tokens=0, logit_bias=None,
               presence_penalty=0.0, frequency_penalty=0.0, grammar=None):
        """Queue a request; returns its `Request` at once. ValueError for bad input (before any
        work), QueueFull when max_queue requests are waiting.

        logprobs: None, or the number of alternatives (0 to TOP_LOGPROBS) to report with each new
        token's log-probability (req.token_logprobs); prompt_logprobs: also those of the prompt's
        tokens after the first (req.prompt_token_logprobs; such a request reuses no cached prefix,
        whose log-probabilities were never computed). Log-probabilities are the model's, before
        temperature, top-k and top-p (and min_tokens' mask).

        ignore_eos: an EOS id does not end the request (it runs to max_tokens or a stop string);
        min_tokens: no EOS id is sampled before the request has that many tokens (the step masks
        their logits on the device, `runner.step_program`), vLLM's two extensions.

        OpenAI's logit_bias ({token id: -100 to 100}, at most LOGIT_BIAS_MAX entries, added to
        the logits), presence_penalty and frequency_penalty (-2 to 2, over the tokens generated so
        far), and grammar (a compiled grammar, `grammar.Grammars`: only tokens it allows are
        sampled, and the request ends once it is complete) are applied on the device inside the
        step (`sampling.adjusted`)."""
        check_request(self.model.args, None, [prompt], max_tokens, temperature, top_p, None, "max_tokens")
        need = pages_for(len(prompt) + max_tokens - 1, self.pool.page_size)  # the last token is never written
        if need > self.pool.num_pages - 1:
            raise ValueError(f"a prompt of {len(prompt)} tokens + max_tokens={max_tokens} needs {need} pages of "
                             f"{self.pool.page_size} positions, more than the pool's {self.pool.num_pages - 1}; "
                             f"ask for fewer tokens or start the engine with more pages")
        if not isinstance(top_k, int) or not 0 <= top_k <= SAMPLE_TOP_K:
            raise ValueError(f"top_k={top_k!r} must be an int in [0, {SAMPLE_TOP_K}] (0: no limit but the "
                             f"engine's, the {SAMPLE_TOP_K} most likely tokens)")
        if logprobs is not None and (not isinstance(logprobs, int) or not 0 <= logprobs <= TOP_LOGPROBS):
            raise ValueError(f"logprobs={logprobs!r} must be None or an int in [0, {TOP_LOGPROBS}]")
        if not isinstance(min_tokens, int) or not 0 <= min_tokens <= max_tokens:
            raise ValueError(f"min_tokens={min_tokens!r} must be an int in [0, max_tokens={max_tokens}]")
        logit_bias = check_logit_bias(logit_bias, self.vocab_size)
        for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
            if not isinstance(value, (int, float)) or not -2 <= value <= 2:
                raise ValueError(f"{name}={value!r} must be a number in [-2, 2]")
        if grammar is not None and min_tokens:
            raise ValueError(f"min_tokens={min_tokens} with a grammar: the grammar decides where the output ends; "
                             "leave min_tokens out")
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop={list(stop)!r}: every stop string must be a non-empty string")
        if stop and self.decode is None:
            raise ValueError("stop strings need text: build the Engine with decode=tokenizer.decode")
        seed = random.getrandbits(31) if seed is None else seed
        req = Request(list(prompt), max_tokens, float(temperature), float(top_p), top_k, int(seed) & 0x7FFFFFFF,
                      stop, callback, next(self.ids), logprobs=logprobs, prompt_logprobs=bool(prompt_logprobs),
                      ignore_eos=bool(ignore_eos), min_tokens=min_tokens, logit_bias=logit_bias,
                      presence_penalty=float(presence_penalty), frequency_penalty=float(frequency_penalty),
                      grammar=None if grammar is None else matcher(grammar), submitted_at=time.perf_counter())
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
        """End a waiting or running request ("cancelled") at the next step; its slot and pages free then."""
        req.cancelled = True
        self.notify()

    def notify(self):
        with self.wake:
            self.wake.notify()

    def room(self, prompt_len):
        """The most tokens a request with a prompt of prompt_len tokens may ask for: the model's
        context after the prompt, or what the pool holds."""
        pool = (self.pool.num_pages - 1) * self.pool.page_size + 1
        return min(self.max_seq_len, pool) - prompt_len

    def queue_length(self):
        return sum(not r.cancelled for r in self.scheduler.waiting)

    # --- the steps (one thread) ---

    def step(self):
        """Run the scheduler's next plan on the device, then read the previous step's tokens and
        hand them to their requests. Returns True if there was work. While a request with a grammar
        runs, the previous step's tokens are read first: its grammar needs its newest token to
        fill the next step's mask (`grammar.py`)."""
        compiles = count_compiles()
        with self.lock:
            for req in [r for r in (*self.scheduler.order, *self.scheduler.waiting) if r.cancelled]:
                self.finish(req, "cancelled")
            grammar = any(r.grammar is not None for r in self.scheduler.order)
        early, self.pending = (self.pending, None) if grammar else (None, self.pending)
        if early is not None:
            self.collect(*early)
        with self.lock:
            plan = self.scheduler.schedule()
        read, self.pending = self.pending, self.dispatch(plan) if plan.entries else None
        if read is not None:
            self.collect(*read)
        self.check_compiles(count_compiles() - compiles)
        return bool(plan.entries) or read is not None or early is not None

    def dispatch(self, plan):
        """Launch the plan's step (it returns at once); returns what `collect` reads of it."""
        now = time.perf_counter()
        for req, *_ in plan.entries:
            req.scheduled_at = req.scheduled_at or now
        echo = any(r.prompt_logprobs and start < len(r.prompt) - 1 for r, start, _, _ in plan.entries)
        self.timeline.append({r.id: len(r.pages) for r, *_ in plan.entries})
        return (plan.entries, *self.runner.step(plan.entries, echo))

    def collect(self, entries, tokens, lp, prompt_lp):
        """Bring a step's outputs to the host (this waits for its program) and hand them to their requests."""
        tokens = tokens.cpu().tolist()  # one per sequence
        lp = self.runner.read(lp) if any(r.logprobs is not None for r, *_ in entries) else None
        prompt_lp = self.runner.read(prompt_lp)  # each (T, ...) or None
        first = 0
        for i, (req, start, n, samples) in enumerate(entries):
            if prompt_lp is not None and req.prompt_logprobs:
                add_prompt_logprobs(req, [t[first:first + n] for t in prompt_lp], start, n)
            if samples:
                self.emit(req, tokens[i], lp and [t[i:i + 1] for t in lp])
            first += n

    def emit(self, req, token, lp=None):
        """Hand a new token (and its `logprobs_of`, host tensors of one row) to req and finish it on
        EOS, a stop string or max_tokens (`outputs.add_token`). A token of a request that has ended
        (the step after its EOS, or after a cancel) is dropped."""
        if req.done:
            return
        reason = add_token(req, token, lp, self.eos_ids)
        self.tokens_total += 1
        if req.grammar is not None and not reason:
            if not req.grammar.accept_token(token):  # the step's mask allowed only what it accepts: a bug
                return self.finish(req, "error", f"token {token} is not one its grammar allows")
            reason = "stop" if req.grammar.is_terminated() else None
        if reason:
            return self.finish(req, reason)
        if req.callback:
            req.callback(req)

    def finish(self, req, reason, error=None):
        settle(req, reason, error)
        with self.lock:
            self.scheduler.finish(req)
        if req.callback:
            req.callback(req)

    def abort(self, message):
        """Finish every waiting and running request with finish_reason "error" (after a failed step)."""
        with self.lock:
            for req in [*self.scheduler.order, *self.scheduler.waiting]:
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
        """Compile the step at every shape (`ModelRunner.shapes`), twice over so the second round
        runs them as steps do, on the outputs of earlier programs. A stand-in request writes
        page 0 only (the padding's). Returns the number of compilations."""
        start = count_compiles()
        req = Request([0], 2, top_k=1, slot=0, pages=[0])
        for _ in range(2):
            for tokens, pages, chunk, echo, greedy in self.runner.shapes():
                self.runner.step([(req, 0, 1, True)], echo, shape=(tokens, pages, chunk), greedy=greedy)
        self.runner.read((self.runner.last,))  # wait for the last program
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
        """Every prompt's tokens (a list each), run through the engine as room frees up."""
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
            sched = self.scheduler
            return dict(requests_total=self.requests_total, tokens_total=self.tokens_total,
                        slots_busy=len(sched.order), queue_length=self.queue_length(),
                        compiles_since_warmup=self.compiles_since_warmup, slots=self.slots,
                        pages_total=self.pool.num_pages - 1, pages_used=self.pool.used_pages,
                        prefix_queries_total=sched.queries, prefix_hits_total=sched.hits,
                        preemptions_total=sched.preemptions)
