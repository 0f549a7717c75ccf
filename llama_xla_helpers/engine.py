"""Continuous batching: a fixed set of slots; each step prefills prompt sections and decodes one
token for every busy slot, as `scheduler.Scheduler` plans it.

    engine = Engine(model, slots=4, buckets=(16, 32, 64, 128))
    engine.warmup()                                  # every program compiles here, once
    req = engine.submit(prompt_tokens, max_tokens=32)
    while not req.done:
        engine.step()                                # run the next plan, read the last step's tokens
    req.tokens, req.text, req.finish_reason

A `Generator` call runs a batch until its longest row ends: a short request waits for the
longest, and a new one waits for the whole batch. Here each of the B slots holds one request
at its own position; a request that ends frees its slot, and the next waiting one takes it.
The engine is split as vLLM v1 splits its own, each part small enough to read alone:

- the scheduler (`scheduler.py`, pure Python) plans a step within a token budget: which prompt
  sections prefill, which slots decode, and the cache length attention reads;
- the model runner (`runner.py`) holds the device state (every slot's KV cache and decode inputs)
  and launches one program per prefill launch and one per decode step, compiled or lazy;
- the sampler (`sampling.py`) runs inside those programs;
- the output side (`outputs.py`) turns tokens into text and log-probabilities and ends requests
  on EOS, a stop string or max_tokens;
- `Engine` (here) ties them together: requests in (any thread), steps (one thread).

Prefill: one prompt section (left-padded to a bucket, a long prompt in several, one per step
while the others keep decoding), written straight into the request's slot of the cache; attention
reads the section's own positions (`Llama.forward`'s kv_len), not the whole cache. Prompts that
arrive together and fit one section of the same bucket are prefilled together, up to
`prefill_rows` in one program of R rows (R a power of two, or prefill_rows; a group of 3 runs as 4
rows, the last repeated): one launch instead of R (benchmarks/serve.py measures the difference).
Decode: one token for every slot, each at its own cache position, attention over the smallest of a
few cache lengths that holds every busy slot's position (`scheduler.kv_buckets`); a free slot
computes too, and its token is ignored.

The host never waits for the device in between: a step launches its programs, and only then
reads the previous step's tokens (JetStream's one-step lag), so preparing step n + 1 overlaps the
device running step n. The price: a request that ends on EOS or a stop string holds its slot one
step longer, and that extra token is dropped.

compile: the runner's programs go through `torch.compile(backend="openxla")`, traced once per
shape, and their caches are donated, so XLA writes them in place (runner.py). Without it, each
step traces the model again as lazy tensors, which costs host time at every step. The default
(`runner.default_compile`): compiled on a TPU, lazy elsewhere. Measured on a 2-core CPU
(`benchmarks/results/serve.json`, a 56M-parameter model, 8 slots, medians of 3): the compiled
engine makes 3.5x the lazy one's tokens/s (269 against 76; 1.6x Hugging Face's continuous
batching), its batch-1 step takes 6.9 ms against 23.9, and its host time per batch-8 step is 2.4
ms against 10.2; but its warm-up takes 2.4x as long (85 s against 35 s for the same 24 programs:
Dynamo traces each one). On a TPU a step takes milliseconds and warm-up is paid once per server,
so compiled. On the CPU, where this package's tests, notebooks and tour build dozens of engines
that each run a few dozen steps, lazy. A CPU server earns the longer warm-up back after about
2,700 batch-8 steps, half a minute of busy serving: pass `serve --compile` (or compile=True).

The compiled shapes never depend on the requests, so after `warmup()` nothing compiles. A
compile after warm-up (a new shape, or a Python value baked into a graph) raises
`RecompileError` instead of silently costing seconds per step (vLLM's recompile check).

Sampling is per slot (temperature, top-k, top-p and a seed as device tensors) and draws its
noise from (seed, position), so a request samples the same tokens whatever shares the batch
(`sampling.sample_rows`, which `Generator` uses too). Text grows incrementally (`detokenize.TextStream`).

Sources: JetStream's engine API (prefill, insert, generate) and its one-step lag,
https://github.com/AI-Hypercomputer/JetStream; vLLM v1's scheduler, model runner and output
processor, https://github.com/vllm-project/vllm; "The Path to Achieve Ultra-Low Inference Latency
With LLaMA 65B on PyTorch/XLA", PyTorch blog, https://pytorch.org/blog/path-achieve-low-inference-latency/;
vLLM's check for compilations after warm-up, https://github.com/vllm-project/vllm/issues/14580
"""
import collections
import itertools
import random
import threading
import time


from .detokenize import TextStream
from .generate import check_buckets, check_request
from .metrics import count_compiles
from .outputs import add_prompt_logprobs, add_token, settle
from .runner import ModelRunner, default_compile
from .sampling import SAMPLE_TOP_K, TOP_LOGPROBS, sample_rows  # noqa: F401  the engine's names, as before
from .scheduler import Request, Scheduler, kv_buckets, prefill_sections, prefill_shapes, round_up


class QueueFull(RuntimeError):
    """The waiting queue holds max_queue requests; try again later."""


class RecompileError(RuntimeError):
    """A graph compiled after warm-up."""


def row_counts(prefill_rows):
    """The prefill programs' row counts: powers of two below prefill_rows, and prefill_rows, e.g.
    (1, 2, 4) for 4 and (1, 2, 4, 6) for 6."""
    return tuple(sorted({2 ** i for i in range(prefill_rows.bit_length()) if 2 ** i < prefill_rows} | {prefill_rows}))


class Engine:
    """Continuous batching over `slots` requests with a `Llama` (moved to the XLA device if on
    the CPU; or sharded by `parallel.shard_for_inference`). See the module docstring.

    eos_id: an id or a collection of ids that end a request (Llama 3 has several). decode:
    tokens -> text (a tokenizer's decode), needed for text and stop strings. on_recompile:
    "raise" (a `RecompileError` from `step`) or "count" (only `compiles_since_warmup`).
    budget: tokens per step (decoded tokens + prompt section positions; default: the largest
    bucket + slots). compile: torch.compile the runner's programs (default: on a TPU).
    prefill_rows: at most this many one-section prompts of the same bucket prefill in one
    program (default min(slots, 4); 1: each alone). Each row count in `row_counts` adds a
    prefill program per bucket.
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
        self.slots, self.buckets, self.max_queue = slots, tuple(buckets), max_queue
        self.eos_ids, self.decode, self.on_recompile = eos_ids, decode, on_recompile
        self.max_seq_len, self.vocab_size = args.max_seq_len, args.vocab_size
        self.scheduler = Scheduler(slots, self.buckets, args.max_seq_len, budget)
        self.row_counts = row_counts(prefill_rows)
        self.compile = default_compile() if compile is None else compile
        self.runner = ModelRunner(model, slots, self.compile, shapes=self.programs())
        self.model = self.runner.model
        self.pending = None  # the last step's device outputs, read at the next step
        self.lock = threading.RLock()  # the scheduler's queue: submit (any thread) and step
        self.wake = threading.Condition(threading.Lock())
        self.ids = itertools.count()
        self.requests_total = self.tokens_total = self.compiles_since_warmup = 0
        self.warm = False
        self.timeline = collections.deque(maxlen=4096)  # the last decode steps: request id per slot (None: idle)

    def programs(self):
        """The runner's program shapes, each compiled once: prefill (section, kv_len) at one row,
        one-section prefills at the other row counts, each with and without prompt
        log-probabilities; greedy and sampling decode at every kv_len."""
        one_section = len(self.buckets) * (len(self.row_counts) - 1)
        return 2 * (len(prefill_shapes(self.buckets, self.max_seq_len)) + one_section) \
            + 2 * len(kv_buckets(self.buckets, self.max_seq_len))

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
            whole = start == 0 and n == req.width  # the whole prompt in one section
            head = out[-1][0][0] if out else None
            if (whole and head and head.width == n and out[-1][1] == 0 and head.prompt_logprobs == req.prompt_logprobs
                    and len(out[-1][0]) < self.row_counts[-1]):
                out[-1][0].append(req)
            else:
                out.append(([req], start, n, kv_len))
        return out

    def dispatch(self, plan):
        """Launch the plan's programs (each launch returns at once); returns their device outputs
        for `collect`: prompt log-probabilities, first tokens, decoded tokens."""
        prompts, firsts, decoded = [], [], None
        for reqs, start, n, kv_len in self.groups(plan.prefill):
            rows = round_up(len(reqs), self.row_counts)
            first, first_lp, prompt_lp = self.prefill(reqs + reqs[-1:] * (rows - len(reqs)), start, n, kv_len)
            if prompt_lp is not None:  # (the last request repeated: identical rows)
                prompts.append((reqs, start, n, prompt_lp))
            if start + n == reqs[0].width:  # their last section: the first tokens
                firsts.append((reqs, first, first_lp))
        if plan.decode:
            busy = {r.slot: r for r in plan.decode}
            greedy = all(r.temperature == 0 and r.logprobs is None for r in plan.decode)
            nxt, lp = self.runner.decode(greedy, plan.kv_len)
            self.timeline.append([busy[s].id if s in busy else None for s in range(self.slots)])
            decoded = (plan.decode, nxt, lp)
        return prompts, firsts, decoded

    def prefill(self, reqs, start, n, kv_len):
        """Launch one prompt section of each of reqs (R of them, the same section) into their slots;
        returns `runner.prefill_program`'s device outputs."""
        pads = [r.width - len(r.prompt) for r in reqs]
        if start == 0:
            for r in reqs:
                r.scheduled_at = time.perf_counter()
        padded = [[0] * pad + r.prompt + [0] for r, pad in zip(reqs, pads)]  # left-padded, a stand-in after the last token
        return self.runner.prefill(
            slots=[r.slot for r in reqs], ints=[[0, r.width, pad, r.seed, r.top_k] for r, pad in zip(reqs, pads)],
            floats=[[r.temperature, r.top_p] for r in reqs], tokens=[p[start:start + n] for p in padded], start=start,
            kv_len=kv_len, targets=[p[start + 1:start + n + 1] for p in padded] if reqs[0].prompt_logprobs else None,
            last=start + n == reqs[0].width)

    def collect(self, prompts, firsts, decoded):
        """Bring a step's outputs to the host (this waits for its programs) and hand them to their requests."""
        read = self.runner.read
        for reqs, start, n, lp in prompts:
            lp = read(lp)  # each (R, n, ...)
            for i, req in enumerate(reqs):
                add_prompt_logprobs(req, [t[i] for t in lp], start, n)
        for reqs, first, lp in firsts:
            tokens = first.cpu().tolist()  # R tokens
            lp = read(lp) if any(r.logprobs is not None for r in reqs) else None
            for i, req in enumerate(reqs):
                self.emit(req, tokens[i], lp and [t[i:i + 1] for t in lp])
        if decoded:
            reqs, nxt, lp = decoded
            tokens = nxt.cpu().tolist()  # B tokens
            lp = read(lp) if any(r.logprobs is not None for r in reqs) else None
            for req in reqs:
                self.emit(req, tokens[req.slot], lp and [t[req.slot:req.slot + 1] for t in lp])

    def emit(self, req, token, lp=None):
        """Hand a new token (and its `logprobs_of`, host tensors of one row) to req and finish it on
        EOS, a stop string or max_tokens (`outputs.add_token`). A token of a request that has ended
        (the step after its EOS, or after a cancel) is dropped."""
        if req.done:
            return
        reason = add_token(req, token, lp, self.eos_ids)
        self.tokens_total += 1
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
        """Compile every program: each (section, kv_len) prefill with and without prompt
        log-probabilities (one-section prompts at every row count), and the greedy and sampling
        decode steps at every kv_len, twice over so the second round runs them as steps do, on the
        outputs of earlier programs. Returns the number of compilations."""
        start = count_compiles()
        req = Request([0] * self.max_seq_len, 2, top_k=1, sections=(self.max_seq_len,))  # room for any section
        req.slot = 0
        for _ in range(2):
            for rows in self.row_counts:
                shapes = prefill_shapes(self.buckets, self.max_seq_len) if rows == 1 else [(b, b) for b in self.buckets]
                for n, kv_len in shapes:
                    for req.prompt_logprobs in (True, False):  # a first section (kv_len == n) or a later one
                        self.prefill([req] * rows, kv_len - n, n, kv_len)
            for kv_len in kv_buckets(self.buckets, self.max_seq_len):
                for greedy in (True, False):
                    self.runner.decode(greedy, kv_len)
        self.runner.read(self.runner.state)  # wait for the last program
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
