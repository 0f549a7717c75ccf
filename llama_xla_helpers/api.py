"""The HTTP API over the continuous-batching `Engine`: the FastAPI app (`app`), its handlers, the
streaming, the metrics and the errors. What a request may hold and how it is checked is
`protocol.py`'s; loading a model and running the app under uvicorn, `serve.py`'s.

Two threads share the work. uvicorn's event loop answers HTTP; the engine loop (`Engine.run`)
steps in a thread of its own, which the app starts and stops with itself (its lifespan). A
request is submitted from the event loop; after each of its tokens the engine calls back in the
engine's thread, and the callback only hands a snapshot (text, token count, finish reason) to
the request's asyncio.Queue with `loop.call_soon_threadsafe`: the engine never waits for HTTP.

Endpoints, with OpenAI's names (their parameters and defaults: `protocol.py`):

- POST /v1/completions and POST /v1/chat/completions. Responses carry `usage` (summed over the
  choices) and `finish_reason` ("stop": an EOS id of the model (the tokenizer's and all of those in
  its config.json and generation_config.json, `serve.decoder`) or a stop string; "length";
  "tool_calls", a chat answer that is a call of one of its tools (`protocol.tool_calls`);
  "cancelled", see Faults).
  `stream: true` sends server-sent events, one chunk per new piece of text (with its choice's
  `index` and its tokens' logprobs), then `data: [DONE]`. A streamed chunk holds back a tail that
  may be the start of a stop string, so the chunks add up to exactly the text a non-streamed
  request returns.
- GET /v1/models; GET /health ({"status": "ok"}, or 503 with the reason once the engine loop has
  stopped or failed); GET /metrics (Prometheus text by prometheus_client, one registry per app, no
  `_created` series): requests, tokens, busy slots, queue length, compilations since warm-up, and
  histograms of queue time, time to first token, time per output token and end-to-end latency
  of the requests that finished ("stop" or "length").

Access, as vLLM's --api-key: with a key (`app(api_key=)`; the command line's --api-key, default
$LLAMA_XLA_API_KEY) every /v1 request needs `Authorization: Bearer KEY`, else a 401; /health and
/metrics stay open.

Errors are OpenAI's JSON (`protocol.api_error`), whatever goes wrong: 400 for a bad parameter
(`param` names it) or a chat template that fails, 401 without the key, 404 for an unknown model or
route, 413 for a body over MAX_BODY_BYTES = 4 MiB (before it is parsed: at once by its
Content-Length, or once that much of a chunked body has arrived; a 128k-token prompt of ids is
about 1 MB of JSON), 429 when max_queue requests wait, 500 for anything unexpected (its traceback
goes to the log), 503 once the engine has failed. Each 4xx is logged with its status, route and
message at the default log level (`--debug` adds uvicorn's log of every request).

Faults:
- A client that disconnects, streamed or not, cancels its requests: their slots free at the next
  step, and cancelled requests still waiting no longer count against max_queue.
- An exception in an engine step ends every running and waiting request with an error (a JSON 500,
  or a streamed `data: {"error": ...}` event then `data: [DONE]`); /health answers 503 with the
  reason, and the server stops (`serve.Server`; the command line exits with status 1). Nothing
  tries to recover: after a failed step the state of the device (caches, slots) is unknown.
- The app's lifespan stops the engine loop once uvicorn has finished every request; `serve.Server`
  cancels those still running after its drain timeout ("cancelled", `Served.cancel_all`).

Sources: the OpenAI API reference, streaming https://platform.openai.com/docs/api-reference/chat-streaming;
JetStream's server over its engine, https://github.com/AI-Hypercomputer/JetStream; vLLM's OpenAI
server (--api-key, its metrics), https://docs.vllm.ai/en/latest/serving/openai_compatible_server.html;
prometheus_client, https://prometheus.github.io/client_python/
"""
import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import re
import secrets
import threading
import time
import traceback

import prometheus_client
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from .engine import Engine, QueueFull
from .grammar import Grammars
from .protocol import (ChatBody, CompletionBody, api_error, chat_logprobs, chat_prompt, check_supported,
                       completion_logprobs, completion_prompts, encode, logit_bias_ids, requested_logprobs,
                       tool_calls)

LOG = logging.getLogger("uvicorn.error")  # the server's log (uvicorn sets it up)
MAX_BODY_BYTES = 4 << 20  # 4 MiB: a 128k-token prompt as ids is about 1 MB of JSON
LATENCY_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)  # histogram buckets, seconds
TOKEN_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)  # the same, per output token


# --- What the routes share ---------------------------------------------------------------------

METRICS = (  # engine.metrics() key, Prometheus type, help
    ("requests_total", "counter", "Requests accepted into the engine's queue."),
    ("tokens_total", "counter", "Tokens generated."),
    ("slots_busy", "gauge", "Requests in flight (each holds a slot)."),
    ("slots", "gauge", "Slots: requests in flight at most."),
    ("queue_length", "gauge", "Requests waiting for a slot or pages."),
    ("pages_used", "gauge", "KV cache pages requests hold."),
    ("pages_total", "gauge", "KV cache pages in the pool."),
    ("prefix_queries_total", "counter", "Prompt tokens looked up in the prefix cache."),
    ("prefix_hits_total", "counter", "Prompt tokens found in the prefix cache (not prefilled again)."),
    ("preemptions_total", "counter", "Requests preempted for pages (recomputed later)."),
    ("compiles_since_warmup", "gauge", "XLA compilations after warm-up; anything but 0 costs seconds per request."),
)
HISTOGRAMS = (  # name, help, buckets: over the requests that finished ("stop" or "length")
    ("request_queue_time_seconds", "Time from arrival to the first prompt tokens' step.", LATENCY_S),
    ("time_to_first_token_seconds", "Time from arrival to the first token.", LATENCY_S),
    ("time_per_output_token_seconds", "Time from the first token to the last, per later token.", TOKEN_S),
    ("e2e_request_latency_seconds", "Time from arrival to the last token.", LATENCY_S),
)


class EngineMetrics:
    """The engine's counters and gauges (`METRICS`) for a prometheus_client registry, read at each scrape."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        values = self.engine.metrics()
        for key, kind, help in METRICS:
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(f"llama_xla_{key}", help, value=values[key])


@dataclasses.dataclass
class Served:
    """What the routes share: the engine, its tokenizer and name, the metrics and the server's state."""
    engine: Engine
    tokenizer: object
    model_name: str
    thread: threading.Thread = None  # the engine loop, while the app runs
    fault: str = None  # the exception that stopped the engine loop
    requests: set = dataclasses.field(default_factory=set)  # the engine requests of the HTTP requests in flight
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)  # a submit against a fault
    registry: prometheus_client.CollectorRegistry = dataclasses.field(init=False)
    histograms: dict = dataclasses.field(init=False)  # HISTOGRAMS' names -> prometheus_client.Histogram
    grammars: Grammars = dataclasses.field(init=False)  # response_format's, compiled on first use

    def __post_init__(self):
        self.grammars = Grammars(self.tokenizer, self.engine.vocab_size, self.engine.eos_ids)
        prometheus_client.disable_created_metrics()  # for the whole process: no `_created` series
        self.registry = prometheus_client.CollectorRegistry()  # the app's own: two apps in a process work
        self.registry.register(EngineMetrics(self.engine))
        self.histograms = {name: prometheus_client.Histogram(f"llama_xla_{name}", help, buckets=buckets,
                                                             registry=self.registry)
                           for name, help, buckets in HISTOGRAMS}

    def running(self):
        return self.thread is not None and self.thread.is_alive()

    def observe(self, req):
        """A finished request's latencies, into the histograms."""
        if req.finish_reason not in ("stop", "length"):
            return
        h, n = self.histograms, len(req.tokens)
        h["request_queue_time_seconds"].observe(req.scheduled_at - req.submitted_at)
        h["time_to_first_token_seconds"].observe(req.first_token_at - req.submitted_at)
        h["e2e_request_latency_seconds"].observe(req.finished_at - req.submitted_at)
        if n > 1:
            h["time_per_output_token_seconds"].observe((req.finished_at - req.first_token_at) / (n - 1))

    def release(self, reqs):
        """An HTTP request has ended: cancel its engine requests that have not finished (their slots
        free at the next step)."""
        for req in reqs:
            self.requests.discard(req)
            if not req.done:
                self.engine.cancel(req)

    def cancel_all(self):
        """Cancel every request in flight (SIGTERM's drain timeout)."""
        for req in list(self.requests):
            self.engine.cancel(req)


# --- Errors and the guard in front of the routes -----------------------------------------------

async def http_error(request, exc):
    """Every HTTP error as OpenAI's {"error": {...}}: ours, unknown routes, wrong methods. A client's
    error (4xx) is logged with its reason at the server's default level (uvicorn's, warning)."""
    detail = exc.detail if isinstance(exc.detail, dict) else dict(
        message=str(exc.detail), type="invalid_request_error", param=None, code=None)
    if 400 <= exc.status_code < 500:
        LOG.warning("%d %s %s: %s", exc.status_code, request.method, request.url.path, detail["message"])
    return JSONResponse({"error": detail}, exc.status_code, headers=exc.headers)


async def bad_request(request, exc):
    """A body that does not validate: 400 as OpenAI answers (FastAPI's default is 422)."""
    first = exc.errors()[0]
    where = ".".join(map(str, first["loc"][1:]))  # loc: ("body", "max_tokens"), ("body", "prompt", "str")...
    message = f"{where}: {first['msg']}" if where else first["msg"]
    return await http_error(request, api_error(400, message, param=where.split(".")[0] or None))


async def server_error(request, exc):
    """A bug: a JSON 500 (Starlette then raises exc again, and uvicorn logs its traceback)."""
    return await http_error(request, api_error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))


class Guard:
    """ASGI middleware in front of every route: /v1 needs the API key, if there is one, and a body over
    MAX_BODY_BYTES is a 413 before anything parses it (at once by its Content-Length, else once that
    much of a chunked body has arrived)."""

    def __init__(self, app, api_key=None):
        self.app, self.authorization = app, api_key and f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.authorization and scope["path"].startswith("/v1") and not secrets.compare_digest(
                headers.get(b"authorization", b""), self.authorization):
            error = api_error(401, "a missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                              "authentication_error", code="invalid_api_key")
            return await JSONResponse({"error": error.detail}, 401)(scope, receive, send)
        length, received = int(headers.get(b"content-length", 0)), 0

        async def receive_at_most():
            nonlocal received
            message = await receive() if length <= MAX_BODY_BYTES else {}
            received += len(message.get("body", b""))
            if max(length, received) > MAX_BODY_BYTES:
                raise api_error(413, f"the request body holds more than this server's limit of {MAX_BODY_BYTES} "
                                     f"bytes; send a shorter prompt", code="body_too_large")
            return message
        await self.app(scope, receive_at_most, send)


# --- A completion: engine requests in, a response or its events out ----------------------------

Update = collections.namedtuple("Update", "index text count reason error")  # a choice after a step


def grammar_of(served, body):
    """The compiled grammar the body's answers must follow, or None: the call schema of a
    tool_choice that forces a call, else response_format's. 400 for a grammar that cannot be."""
    schema = body.tool_schema() if isinstance(body, ChatBody) else None  # a call the answer must be
    if schema and body.response_format not in (None, {"type": "text"}):
        raise api_error(400, "response_format with a tool_choice that forces a call: the call's grammar is the "
                             "answer's; send one of them", param="response_format")
    try:
        return served.grammars.json_schema(schema, "tools") if schema else \
            body.response_format and served.grammars.response_format(body.response_format)
    except ValueError as e:
        raise api_error(400, str(e), param="tools" if schema else "response_format") from None


def submit(served, body, prompts, grammar=None):
    """Queue body.n requests per prompt, each with its own matcher of `grammar` (`grammar_of`);
    returns (engine Requests, async iterator of their Updates). All or none: 400 for a value the
    engine rejects, 429 when the queue is full, 503 once the engine has failed."""
    loop, queue, reqs = asyncio.get_running_loop(), asyncio.Queue(), []

    def callback(index):  # runs in the engine's thread: hand over a snapshot, never block
        def put(req):
            if req.done:
                served.observe(req)
            update = Update(index, req.text, len(req.tokens), req.finish_reason, req.error)
            with contextlib.suppress(RuntimeError):  # the event loop has closed: nobody is waiting
                loop.call_soon_threadsafe(queue.put_nowait, update)
        return put

    logprobs, logit_bias = requested_logprobs(body), logit_bias_ids(body)
    try:
        with served.lock:  # not while the engine thread records a fault: see `run_engine`
            if served.fault:
                raise api_error(503, f"the engine failed ({served.fault}); the server is stopping", "server_error")
            for i, prompt in enumerate(prompts):
                for j in range(body.n):
                    max_tokens = body.max_tokens or 1  # 0 with echo: score the prompt, keep no token
                    reqs.append(served.engine.submit(
                        prompt, max_tokens, body.temperature, body.top_p, None if body.seed is None else body.seed + j,
                        body.stop or (), callback(i * body.n + j), max(body.top_k, 0), logprobs,
                        prompt_logprobs=getattr(body, "echo", False) and logprobs is not None,
                        ignore_eos=body.ignore_eos, min_tokens=body.min_tokens, logit_bias=logit_bias,
                        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                        grammar=grammar))
    except (QueueFull, ValueError) as e:
        served.release(reqs)
        if isinstance(e, QueueFull):
            raise api_error(429, str(e), "rate_limit_error", code="queue_full") from None
        name = re.match(r"(\w+)=", str(e))  # the engine names the value, e.g. "top_p=0.0 must be in (0, 1]"
        raise api_error(400, str(e), param=name[1] if name and name[1] in type(body).model_fields else None) from None
    served.requests.update(reqs)
    return reqs, updates(queue, len(reqs))


async def updates(queue, n):
    """The Updates of n requests as the engine makes them, until all have finished."""
    while n:
        update = await queue.get()
        n -= update.reason is not None
        yield update


def settled(text, stop):
    """The part of a running request's text that later tokens cannot change: without a trailing
    U+FFFD (an unfinished UTF-8 character decodes to it until its last byte arrives) and without
    a tail that may be the start of a stop string (which would be cut)."""
    text = text.rstrip("\ufffd")
    for k in range(min(len(text), max(map(len, stop), default=1) - 1), 0, -1):
        if any(s.startswith(text[-k:]) for s in stop):
            return text[:-k]
    return text


class Choices:
    """The choices of one response, as the engine's requests make them: text, tokens, logprobs."""

    def __init__(self, served, body, prompts, reqs, chat):
        self.tokenizer, self.body, self.prompts, self.reqs, self.chat = served.tokenizer, body, prompts, reqs, chat
        self.decode = served.engine.decode  # tokens -> text without special tokens (`decoder`)
        self.scoring = not chat and body.echo and body.max_tokens == 0  # the prompt only
        self.logprobs = reqs[0].logprobs is not None
        self.tools_on = chat and body.tools_on()  # an answer may be a tool call

    def ending(self, index):
        """(OpenAI's tool_calls of choice `index`'s answer or None (text; or no tools), its
        finish_reason: "tool_calls" for an answer that is a whole call)."""
        req = self.reqs[index]
        calls = tool_calls(req.text or "", self.body.tools) if self.tools_on else None
        return calls, "tool_calls" if calls and req.finish_reason == "stop" else req.finish_reason

    def may_call(self, text):
        """Whether a streamed answer that starts with `text` may still become a tool call (held back)."""
        return self.tools_on and text.lstrip()[:1] in ("", "{", "<")

    def prompt_part(self, index):
        """(echoed text, its logprobs entries, its tokens) of choice `index`'s prompt ("" unless echo)."""
        if self.chat or not self.body.echo:
            return "", [], []
        prompt = self.prompts[index // self.body.n]
        return self.decode(prompt), [None] + self.reqs[index].prompt_token_logprobs, prompt

    def logprobs_of(self, index, start, end, with_prompt=False):
        """The logprobs object of choice `index`'s tokens [start, end) (and its prompt's, first)."""
        if not self.logprobs:
            return None
        req = self.reqs[index]
        _, prompt_entries, prompt = self.prompt_part(index) if with_prompt else ("", [], [])
        entries, tokens = req.token_logprobs[start:end], req.tokens[start:end]
        if self.chat:
            return chat_logprobs(self.tokenizer, entries, tokens)
        return completion_logprobs(self.tokenizer, prompt_entries + entries, prompt + tokens)

    def final(self, index):
        """Choice `index` of a whole response."""
        req = self.reqs[index]
        if self.scoring:
            text, n = self.prompt_part(index)[0], 0
        else:
            text, n = self.prompt_part(index)[0] + (req.text or ""), len(req.tokens)
        logprobs = self.logprobs_of(index, 0, n, with_prompt=True)
        if self.chat:
            calls, reason = self.ending(index)
            message = dict(role="assistant", content=None, tool_calls=calls) if calls else \
                dict(role="assistant", content=text)
            return dict(index=index, message=message, logprobs=logprobs, finish_reason=reason)
        return dict(index=index, text=text, logprobs=logprobs, finish_reason="length" if self.scoring else req.finish_reason)

    def completion_tokens(self):
        return 0 if self.scoring else sum(len(r.tokens) for r in self.reqs)

    def usage(self, completion_tokens=None):
        """OpenAI's usage, with the prompt tokens found in the prefix cache (prompt_tokens_details.cached_tokens:
        per prompt, as its first choice found them). completion_tokens: those sent so far (a stream's
        chunk), else every choice's."""
        prompt_tokens = sum(map(len, self.prompts))
        cached = sum(r.cached_tokens for r in self.reqs[::self.body.n])
        done = self.completion_tokens() if completion_tokens is None else completion_tokens
        return dict(prompt_tokens=prompt_tokens, completion_tokens=done, total_tokens=prompt_tokens + done,
                    prompt_tokens_details=dict(cached_tokens=cached))


async def events(head, choices, stream):
    """Server-sent events of a streamed response: per choice, a chunk per piece of settled text
    (with the logprobs of its new tokens), the last with finish_reason; a usage chunk if asked for
    (include_usage), and the usage so far in every chunk (continuous_usage_stats); then [DONE]. If
    the engine failed, an error event instead of the rest, then [DONE]."""
    body, chat = choices.body, choices.chat
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    every = body.stream_options is not None and body.stream_options.continuous_usage_stats
    n = len(choices.reqs)
    sent, counted, first, error = [""] * n, [0] * n, [True] * n, None
    async for u in stream:
        if u.error:
            error = u.error
            continue
        i, count = u.index, 0 if choices.scoring else u.count
        text = "" if choices.scoring else (u.text if u.reason else settled(u.text, stop)) or ""
        if not u.reason and not sent[i] and choices.may_call(text):  # held back until it is clearly text
            text, count = "", counted[i]
        if u.reason or len(text) > len(sent[i]) or first[i]:
            echo = choices.prompt_part(i)[0] if first[i] else ""  # echo: the prompt, first
            delta = echo + text[len(sent[i]):]
            logprobs = choices.logprobs_of(i, counted[i], count, with_prompt=first[i])
            calls, reason = choices.ending(i) if u.reason else (None, None)  # a finished answer may be a call
            if calls:  # the whole call in one delta, as OpenAI's chunks add up
                message = ({"role": "assistant"} if first[i] else {}) | {
                    "tool_calls": [dict(index=k, **call) for k, call in enumerate(calls)]}
                chunk = dict(index=i, delta=message, logprobs=logprobs, finish_reason=reason)
            elif chat:
                message = ({"role": "assistant"} if first[i] else {}) | ({"content": delta} if delta or first[i] else {})
                chunk = dict(index=i, delta=message, logprobs=logprobs, finish_reason=u.reason)
            else:
                chunk = dict(index=i, text=delta, logprobs=logprobs, finish_reason=u.reason)
            sent[i], counted[i], first[i] = text, count, False
            usage = dict(usage=choices.usage(0 if choices.scoring else sum(counted))) if every else {}
            yield f"data: {json.dumps({**head, 'choices': [chunk], **usage})}\n\n"
    if error:
        yield f"data: {json.dumps({'error': api_error(500, error, 'server_error').detail})}\n\n"
    elif body.stream_options and body.stream_options.include_usage:
        yield f"data: {json.dumps({**head, 'choices': [], 'usage': choices.usage()})}\n\n"
    yield "data: [DONE]\n\n"


async def disconnected(request):
    """Returns once the client has closed the connection (after the body, receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request, coroutine):
    """coroutine's result, or None if the client disconnects first (the coroutine is then cancelled)."""
    work, left = asyncio.ensure_future(coroutine), asyncio.ensure_future(disconnected(request))
    try:
        done, _ = await asyncio.wait((work, left), return_when=asyncio.FIRST_COMPLETED)
    finally:
        work.cancel()
        left.cancel()
    return work.result() if work in done else None


async def errors_of(stream):
    """The errors of a stream's Updates, read to its end."""
    return [u.error async for u in stream if u.error]


async def respond(request, body, prompts, chat):
    """Run a completion (chat or not) and answer: one JSON body, or server-sent events."""
    served = request.app.state.served
    if body.model not in (None, served.model_name):
        raise api_error(404, f"the model {body.model!r} does not exist; this server serves {served.model_name!r}",
                        param="model", code="model_not_found")
    check_supported(body)
    grammar = await asyncio.to_thread(grammar_of, served, body)  # a first compile takes a while: not on the loop
    reqs, stream = submit(served, body, prompts, grammar)
    choices = Choices(served, body, prompts, reqs, chat)
    kind = ("chat.completion", "chatcmpl") if chat else ("text_completion", "cmpl")
    head = dict(id=f"{kind[1]}-{reqs[0].id}", object=kind[0], created=int(time.time()), model=served.model_name)
    if body.stream:  # once the stream ends (the client may have left), its unfinished requests are cancelled
        head["object"] += ".chunk" if chat else ""
        return StreamingResponse(events(head, choices, stream), media_type="text/event-stream",
                                 background=BackgroundTask(served.release, reqs))
    try:
        errors = await unless_disconnected(request, errors_of(stream))
    finally:
        served.release(reqs)
    if errors is None:
        raise api_error(499, "the client closed the connection")  # nobody reads this
    if errors:
        raise api_error(500, errors[0], "server_error")
    return {**head, "choices": [choices.final(i) for i in range(len(reqs))], "usage": choices.usage()}


# --- The routes and the app --------------------------------------------------------------------

async def completions(request: Request, body: CompletionBody):
    served = request.app.state.served
    if body.max_tokens is None:
        body.max_tokens = 16  # OpenAI's default for completions
    return await respond(request, body, completion_prompts(served.tokenizer, body.prompt, served.engine.vocab_size),
                         chat=False)


async def chat_completions(request: Request, body: ChatBody):
    served = request.app.state.served
    tools = body.tools and [t.model_dump(exclude_none=True) for t in body.tools]
    prompt = encode(served.tokenizer, chat_prompt(served.tokenizer, [m.for_template() for m in body.messages], tools))
    if body.max_completion_tokens is not None:
        body.max_tokens = body.max_completion_tokens
    if body.max_tokens is None:  # at least 1: a prompt too long gets the engine's message
        body.max_tokens = max(1, served.engine.room(len(prompt)))
    return await respond(request, body, [prompt], chat=True)


async def models(request: Request):
    name = request.app.state.served.model_name
    return dict(object="list", data=[dict(id=name, object="model", created=0, owned_by="llama-xla")])


async def health(request: Request):
    served = request.app.state.served
    if served.fault:
        return JSONResponse(dict(status="error", message=f"the engine failed: {served.fault}"), 503)
    if not served.running():
        return JSONResponse(dict(status="error", message="the engine loop is not running"), 503)
    return dict(status="ok")


async def metrics(request: Request):
    registry = request.app.state.served.registry
    return Response(prometheus_client.generate_latest(registry), media_type=prometheus_client.CONTENT_TYPE_LATEST)


def run_engine(served, stop):
    """The engine loop (`Engine.run`) in its thread. If a step raises, every request ends with the
    error, and the server stops (Faults, in the module docstring)."""
    try:
        served.engine.run(stop)
    except Exception as e:
        traceback.print_exc()
        with served.lock:  # from here on `submit` refuses: every request in the engine gets the error
            served.fault = f"{type(e).__name__}: {e}"
        served.engine.abort(f"the engine failed ({served.fault}); the server is stopping, see its log")


def app(engine, tokenizer, model_name, api_key=None):
    """The FastAPI app serving a warmed-up `engine` as `model_name`; with an `api_key`, /v1 needs it.
    While the app runs (its lifespan: from the server's start until its last request has
    finished), the engine loop steps in a background thread."""
    served = Served(engine, tokenizer, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        stop = threading.Event()
        served.thread = threading.Thread(target=run_engine, args=(served, stop), name="engine", daemon=True)
        served.thread.start()
        yield
        stop.set()  # uvicorn has finished every request: the loop returns once idle
        await asyncio.to_thread(served.thread.join)

    api = FastAPI(title="llama-xla", lifespan=lifespan)
    api.state.served = served
    api.add_exception_handler(HTTPException, http_error)
    api.add_exception_handler(RequestValidationError, bad_request)
    api.add_exception_handler(Exception, server_error)
    api.add_middleware(Guard, api_key=api_key)
    api.post("/v1/completions")(completions)
    api.post("/v1/chat/completions")(chat_completions)
    for path, endpoint in (("/v1/models", models), ("/health", health), ("/metrics", metrics)):
        api.get(path)(endpoint)
    return api
