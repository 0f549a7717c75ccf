"""The serving engine's scheduler: at each step, which prompt sections prefill and which slots
decode. Plain Python (no tensors), so it is tested, and notebook 06 replays it, without a device.

    sched = Scheduler(slots=4, buckets=(16, 32), max_seq_len=128)
    sched.add(req)                  # a Request: its prompt and max_tokens
    plan = sched.schedule()         # Plan(prefill=[(req, start, n, kv_len), ...], decode=[req, ...], kv_len=...)
    ...                             # the engine runs the plan on the device
    sched.finish(req)               # it ended (EOS, a stop string, cancelled): its slot is free

vLLM v1's split: the scheduler decides within a token budget, the engine (the runner) executes.
Each step has a budget of `budget` tokens. Every request that holds a slot and has finished its
prefill decodes one token (one whose last section runs too, in the same step: the engine's
decode step advances every slot); prompt sections fill the rest of the budget, so a long
prompt is prefilled a section per step while the others keep decoding (chunked prefill, as in
vLLM and Sarathi-Serve), instead of stalling every slot until it is done. A step always takes at
least one section when one waits, whatever its size. Sections are those of `Generator`: a prompt
left-padded into its smallest bucket, then sections of the largest bucket
(`generate.prefill_sections`). A request takes a free slot when its first section runs, and its
slot is free again as soon as its last token is dispatched (max_tokens) or it has finished.

Attention reads only the cache positions in use (`Llama.forward`'s kv_len): a decode step reads
the smallest of `kv_buckets` that holds every decoding slot's position, a section reads up to its
own end (rounded up to a bucket). Few lengths, so few graphs, each compiled at warm-up.

Sources: vLLM v1's scheduler, https://github.com/vllm-project/vllm/blob/main/vllm/v1/core/sched/scheduler.py;
Sarathi-Serve, "Taming Throughput-Latency Tradeoff in LLM Inference with Sarathi-Serve" (OSDI 2024),
https://arxiv.org/abs/2403.02310
"""
import collections
import dataclasses


@dataclasses.dataclass(eq=False)
class Request:
    prompt: list
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit (beyond the engine's SAMPLE_TOP_K)
    seed: int = 0
    stop: tuple = ()
    callback: object = None  # callback(request), in the engine's thread: after each new token, and at the end
    id: int = 0
    logprobs: int = None  # None, or alternatives to report with each token's log-probability
    prompt_logprobs: bool = False
    token_logprobs: list = dataclasses.field(default_factory=list)  # per token: (logprob, [(id, logprob), ...])
    prompt_token_logprobs: list = dataclasses.field(default_factory=list)  # the same, prompt tokens 1, 2, ...
    tokens: list = dataclasses.field(default_factory=list)  # generated so far (an EOS is kept)
    text: str = None  # the text of tokens, cut before the first stop string (None without `decode`)
    finish_reason: str = None  # "stop" (EOS or a stop string), "length" (max_tokens), "cancelled", "error"
    error: str = None  # with finish_reason "error": what went wrong
    cancelled: bool = False
    submitted_at: float = 0.0
    scheduled_at: float = None  # its first prompt section ran
    first_token_at: float = None
    finished_at: float = None
    stream: object = None  # the engine's detokenize.TextStream (with `decode`)
    # The scheduler's bookkeeping
    slot: int = None
    sections: tuple = ()  # prompt section lengths (the first holds the left padding)
    prefilled: int = 0  # sections run
    dispatched: int = 0  # tokens the device has been asked for: the first (last section), then one per decode

    @property
    def done(self):
        return self.finish_reason is not None

    @property
    def width(self):  # cache positions of the padded prompt
        return sum(self.sections)


@dataclasses.dataclass
class Plan:
    prefill: list  # (request, start position, section length, kv_len) to run in this order
    decode: list  # requests that decode one token
    kv_len: int  # cache positions the decode step reads (0 when nothing decodes)

    @property
    def tokens(self):  # the budget used: prompt positions (padding included) and decoded tokens
        return sum(n for _, _, n, _ in self.prefill) + len(self.decode)


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
    """The cache lengths attention reads: the smallest prefill bucket doubled until max_seq_len,
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


class Scheduler:
    def __init__(self, slots, buckets, max_seq_len, budget=None):
        self.buckets, self.kv_buckets = tuple(buckets), kv_buckets(buckets, max_seq_len)
        self.budget = budget or buckets[-1] + slots
        if self.budget < 1:
            raise ValueError(f"budget={budget} must be >= 1 token per step")
        self.running = [None] * slots  # the request holding each slot
        self.waiting = collections.deque()

    def add(self, req):
        req.sections = tuple(prefill_sections(len(req.prompt), self.buckets))
        self.waiting.append(req)

    def finish(self, req):
        """req has ended: out of the queue, and its slot (if it still holds one) free."""
        if req.slot is not None and self.running[req.slot] is req:
            self.running[req.slot] = None
        elif req in self.waiting:
            self.waiting.remove(req)

    def schedule(self):
        """The next step's plan. A request mid-prefill goes first (one long prompt at a time, a
        section per step), then waiting ones take free slots, while the budget lasts."""
        decode = [r for r in self.running if r is not None and r.prefilled == len(r.sections)
                  and r.dispatched < r.max_tokens]
        left, prefill = self.budget - len(decode), []
        while True:
            req = next((r for r in self.running if r is not None and r.prefilled < len(r.sections)), None)
            if req is None:
                if not self.waiting or None not in self.running:
                    break
                req = self.waiting[0]
            n = req.sections[req.prefilled]
            if prefill and n > left:
                break
            if req.slot is None:  # its first section: it takes a slot
                self.waiting.popleft()
                req.slot = self.running.index(None)
                self.running[req.slot] = req
            start = sum(req.sections[:req.prefilled])
            prefill.append((req, start, n, n if start == 0 else round_up(start + n, self.kv_buckets)))
            req.prefilled += 1
            left -= n
            if req.prefilled == len(req.sections):
                req.dispatched = 1  # the last section picks the first token
                if req.max_tokens > 1:  # its slot is set before this step's decode
                    decode.append(req)
                    left -= 1
        kv_len = round_up(max(r.width + r.dispatched for r in decode), self.kv_buckets) if decode else 0
        for r in decode:
            r.dispatched += 1
        for r in self.running:  # every token asked for: the slot can take the next request
            if r is not None and r.prefilled == len(r.sections) and r.dispatched >= r.max_tokens:
                self.running[r.slot] = None
        return Plan(prefill, decode, kv_len)

    def busy(self):
        return any(r is not None for r in self.running) or bool(self.waiting)


def replay(scheduler, requests, arrivals=None):
    """The decode timeline (per decode step, the index of the request in each slot, None if idle)
    that `scheduler` gives `requests`, (prompt length, max_tokens, tokens it makes) each, arriving
    at step `arrivals[i]` (default: all at the first). Like `Engine`, it learns a step's tokens
    one step later, so a request that ends before max_tokens (EOS) decodes once more."""
    reqs = [Request([0] * n, max_tokens, id=i) for i, (n, max_tokens, _) in enumerate(requests)]
    arrivals = arrivals or [0] * len(reqs)
    made, timeline, last, step = [0] * len(reqs), [], [], 0
    while any(not r.done for r in reqs):
        for r, a in zip(reqs, arrivals):
            if a == step:
                scheduler.add(r)
        plan = scheduler.schedule()
        if plan.decode:
            slots = {r.slot: r.id for r in plan.decode}
            timeline.append([slots.get(s) for s in range(len(scheduler.running))])
        for r in last:  # the previous step's tokens, read now
            made[r.id] += not r.done
            if made[r.id] == requests[r.id][2]:
                r.finish_reason = "stop"
                scheduler.finish(r)
        last = [r for r, start, n, _ in plan.prefill if start + n == r.width] + plan.decode
        step += 1
    return timeline
