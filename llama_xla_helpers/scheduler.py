"""The serving engine's scheduler: at each step, which tokens of which requests go through the
model, and which pages of the KV cache hold them. Plain Python (no tensors), so it is tested, and
notebook 06 replays it, without a device.

    pool = PagePool(num_pages=64, page_size=16)
    sched = Scheduler(slots=8, budget=256, pool=pool)
    sched.add(req)                  # a Request: its prompt and max_tokens
    plan = sched.schedule()         # Plan(entries=[(req, start, n, samples), ...], preempted=[...])
    ...                             # the engine runs the plan on the device in one ragged step
    sched.finish(req)               # it ended (EOS, a stop string, cancelled): its slot and pages are free

vLLM v1's scheduler, in small. A request's tokens are its prompt, then the tokens it generates;
`computed` of them have gone through the model (their keys and values are in its pages). Each
step has a budget of `budget` tokens, and every request scheduled in it gets a run of
positions [start, start + n): a running request that has caught up decodes one token (its newest,
usually still on the device: the engine reads a step's tokens one step later), one mid-prompt
continues its prompt with as many tokens as the budget leaves (chunked prefill, as in vLLM and
Sarathi-Serve), and waiting requests take free slots with what is left. A run that ends at a
request's newest token samples the next one. Prefill and decode share the step: one flat axis of
tokens, each attending to its own request's pages (`attention.ragged_attention`).

Pages: before a step writes positions up to p, the request holds the pages for them
(`kv_pages.PagePool`); a decode adds a page every page_size tokens. When the pool runs short, the
running request admitted last is preempted: its pages go back to the pool and it waits at the
front of the queue, to be recomputed (its prompt and the tokens it made so far, prefilled again)
when pages free up: vLLM v1's rule, never dropped. Its full pages stay cached, so the recompute
usually reuses most of them. Nothing is admitted in a step that preempted.

Prefix caching: a waiting request looks up its known tokens' full pages (`kv_pages.page_hashes`)
and starts at the end of the longest cached chain (never at its last token, whose logits it
needs). As a request's tokens become known and computed, its full pages are registered. A request
with presence or frequency penalties reuses no generated token's page: the runner counts its
tokens as they go through the model, so after a preemption they run again.

The step in which a request is admitted writes its logit_bias into its slot's row on the device
(`runner.step_program`), at most LOGIT_BIAS_MAX entries a step: a request whose entries would pass
that waits for the next step (one request alone always fits).

A slot is a row of the step's small per-request state (the newest token, sampling settings), not
a context: `slots` bounds how many requests are in flight; the pool's pages bound their tokens.

Sources: vLLM v1's scheduler and KV cache manager, https://github.com/vllm-project/vllm/blob/main/vllm/v1/core/sched/scheduler.py,
https://github.com/vllm-project/vllm/blob/main/vllm/v1/core/kv_cache_manager.py; Sarathi-Serve,
"Taming Throughput-Latency Tradeoff in LLM Inference with Sarathi-Serve" (OSDI 2024),
https://arxiv.org/abs/2403.02310
"""
import collections
import dataclasses

from .kv_pages import page_hashes, pages_for

LOGIT_BIAS_MAX = 300  # logit_bias entries a request may set (OpenAI's limit), and all a step writes


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
    ignore_eos: bool = False  # an EOS id does not end it
    min_tokens: int = 0  # no EOS id is sampled before this many tokens (masked on the device)
    logit_bias: dict = dataclasses.field(default_factory=dict)  # {token id: added to its logit}, at most LOGIT_BIAS_MAX
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    grammar: object = None  # an xgrammar GrammarMatcher its tokens must follow (`grammar.py`), or None
    token_logprobs: list = dataclasses.field(default_factory=list)  # per token: (logprob, [(id, logprob), ...])
    prompt_token_logprobs: list = dataclasses.field(default_factory=list)  # the same, prompt tokens 1, 2, ...
    tokens: list = dataclasses.field(default_factory=list)  # generated so far (an EOS is kept)
    text: str = None  # the text of tokens, cut before the first stop string (None without `decode`)
    finish_reason: str = None  # "stop" (EOS or a stop string), "length" (max_tokens), "cancelled", "error"
    error: str = None  # with finish_reason "error": what went wrong
    cancelled: bool = False
    submitted_at: float = 0.0
    scheduled_at: float = None  # its first prompt tokens ran
    first_token_at: float = None
    finished_at: float = None
    stream: object = None  # the engine's detokenize.TextStream (with `decode`)
    # The scheduler's bookkeeping
    slot: int = None  # its row of the step's state while it runs
    pages: list = dataclasses.field(default_factory=list)  # its block table: the pages of positions 0, page_size, ...
    hashes: list = dataclasses.field(default_factory=list)  # the names of its known full pages (kv_pages.page_hashes)
    registered: int = 0  # its first pages registered in the prefix cache
    computed: int = 0  # positions whose keys and values are written (or being written by a step in flight)
    dispatched: int = 0  # tokens the device has been asked for
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at its (last) admission
    preemptions: int = 0

    @property
    def done(self):
        return self.finish_reason is not None

    @property
    def known(self):  # its tokens the host knows: the prompt and the tokens read back
        return self.prompt + self.tokens

    def known_tokens(self, start, end):
        """Its known tokens at positions start .. end - 1 (fewer past the last one known), without
        joining the two lists: a step's work follows its new tokens, not the context."""
        p = len(self.prompt)
        return self.prompt[start:end] + self.tokens[max(start - p, 0):max(end - p, 0)]

    @property
    def length(self):  # its positions: the prompt and every token asked for
        return len(self.prompt) + self.dispatched

    @property
    def penalized(self):  # its generated tokens are counted as they go through the model (`runner.step_program`)
        return bool(self.presence_penalty or self.frequency_penalty)


@dataclasses.dataclass
class Plan:
    entries: list  # (request, start, n, samples): positions start .. start + n - 1 go through the model, in
    # this order; samples: the run ends at the request's newest token, so it samples the next one
    preempted: list  # requests preempted this step (back in the queue)

    @property
    def tokens(self):  # the budget used
        return sum(e[2] for e in self.entries)


class Scheduler:
    def __init__(self, slots, budget, pool, prefix_caching=True):
        if not isinstance(budget, int) or budget < 1:
            raise ValueError(f"budget={budget!r} must be an int >= 1 token per step")
        self.budget, self.pool, self.prefix_caching = budget, pool, prefix_caching
        self.running = [None] * slots  # the request holding each slot
        self.waiting = collections.deque()
        self.order = []  # the running requests, first admitted first (the last is preempted first)
        self.preemptions = self.queries = self.hits = 0  # preemptions; prefix-cache tokens looked up, tokens found

    def add(self, req):
        self.waiting.append(req)

    def finish(self, req):
        """req has ended: out of the queue, its slot and pages free."""
        if req in self.order:
            self.release(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def release(self, req):
        """req's slot and pages go back (req.pages keeps the list: a step just planned still writes there)."""
        self.register(req)
        self.pool.free(req.pages)
        self.order.remove(req)
        self.running[req.slot] = None

    def register(self, req):
        """Register req's full pages whose tokens are known and computed (naming pages only when one
        has filled, so a decode step does no work proportional to the context in between)."""
        ps = self.pool.page_size
        full = min(len(req.prompt) + len(req.tokens), req.computed) // ps
        if full > len(req.hashes):
            req.hashes = page_hashes(req.known_tokens(0, full * ps), ps, req.hashes)
        for i in range(req.registered, full):
            self.pool.register(req.pages[i], req.hashes[i])
        req.registered = max(req.registered, full)

    def preempt(self, req):
        """Back to the front of the queue, its pages freed; it will prefill its tokens again."""
        self.release(req)
        req.pages, req.computed, req.registered = [], 0, 0
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    def grow(self, req, end):
        """Pages for req's positions up to `end`; False if the pool is short."""
        new = self.pool.allocate(max(pages_for(end, self.pool.page_size) - len(req.pages), 0))
        if new is None:
            return False
        req.pages += new
        return True

    def schedule(self):
        """The next step's plan: running requests first (in admission order), then waiting ones
        while slots, pages and the budget last."""
        self.left, entries, preempted = self.budget, [], []
        for req in list(self.order):
            if req not in self.order:  # preempted for an earlier one
                continue
            n = min(req.length - req.computed, self.left)
            while n and not self.grow(req, req.computed + n):
                victim = self.order[-1]
                self.preempt(victim)
                preempted.append(victim)
                n = 0 if victim is req else n
            if n:
                entries.append(self.take(req, n))
        bias_left = LOGIT_BIAS_MAX  # the logit_bias entries the step writes, for the requests it admits
        while self.waiting and not preempted and self.left and None in self.running and \
                len(self.waiting[0].logit_bias) <= bias_left and self.admit(self.waiting[0]):
            req = self.waiting.popleft()
            bias_left -= len(req.logit_bias)
            entries.append(self.take(req, min(req.length - req.computed, self.left)))
        for req, _, _, samples in entries:
            req.dispatched += samples
            if req.dispatched == req.max_tokens:  # every token asked for: its slot and pages go to the next request
                self.release(req)
        return Plan(entries, preempted)

    def take(self, req, n):
        """req's next n positions run this step: an entry of the plan. Its pages filled by them
        are registered now, so a request admitted after it in the same step can reuse them (the
        step writes every token's keys and values before any attention reads them)."""
        start, self.left = req.computed, self.left - n
        req.computed += n
        self.register(req)
        return req, start, n, start + n == req.length

    def admit(self, req):
        """Give req (the queue's first) a slot, its cached prefix and pages for what it runs first;
        False (nothing taken) if the pool is short."""
        ps = self.pool.page_size
        req.dispatched = len(req.tokens)  # after a preemption: every token it made is known again
        req.hashes = page_hashes(req.known, ps, req.hashes)
        # never its last token (its logits are needed), nor for the prompt's log-probabilities (never computed), nor,
        # for a request with penalties, past its prompt (its generated tokens are counted as they run again)
        last = min(req.length - 1, len(req.prompt)) if req.penalized else req.length - 1
        hit = self.pool.lookup(req.hashes[:last // ps]) if self.prefix_caching and not req.prompt_logprobs else []
        self.pool.hold(hit)
        req.pages, req.computed = list(hit), len(hit) * ps
        if not self.grow(req, req.computed + min(req.length - req.computed, self.left)):
            self.pool.free(hit)
            req.pages, req.computed = [], 0
            return False
        req.registered, req.cached_tokens = len(hit), req.computed
        self.queries, self.hits = self.queries + req.length, self.hits + req.cached_tokens
        req.slot = self.running.index(None)
        self.running[req.slot] = req
        self.order.append(req)
        return True

    def busy(self):
        return bool(self.order) or bool(self.waiting)


def replay(scheduler, requests, arrivals=None):
    """The timeline that `scheduler` gives `requests`, (prompt, max_tokens, tokens it makes) each
    (a prompt: a list of token ids, or a length), arriving at step `arrivals[i]` (default: all at
    the first): per step that runs anything, the pages each request in it holds ({request index: pages}). Like
    `Engine`, it learns a step's tokens one step later, so a request that ends before max_tokens
    (EOS) decodes once more. The tokens it makes are stand-ins (0)."""
    reqs = [Request(list(p) if isinstance(p, (list, tuple)) else [0] * p, m, id=i)
            for i, (p, m, _) in enumerate(requests)]
    arrivals = arrivals or [0] * len(reqs)
    timeline, last, step = [], [], 0
    while any(not r.done for r in reqs):
        for r, a in zip(reqs, arrivals):
            if a == step:
                scheduler.add(r)
        plan = scheduler.schedule()
        if plan.entries:
            timeline.append({e[0].id: len(e[0].pages) for e in plan.entries})
        for r in last:  # the previous step's tokens, read now
            if not r.done:
                r.tokens.append(0)
                if len(r.tokens) in (requests[r.id][2], r.max_tokens):
                    r.finish_reason = "stop"
                    scheduler.finish(r)
        last = [req for req, _, _, samples in plan.entries if samples]
        step += 1
    return timeline
