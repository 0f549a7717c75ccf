"""An OpenAI-compatible HTTP server over the continuous-batching `Engine`, and its command line.

    python -m llama_xla_helpers.serve DIR --port 8000    # DIR: a Hugging Face folder or a training checkpoint
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "DIR", "prompt": "Hello", "max_tokens": 16, "temperature": 0}'

The same server inside this process (on a TPU only one process can hold the chips, so a
notebook runs uvicorn in a thread of its kernel, not in a child process):

    engine, tokenizer = load_engine("tiny-llama", slots=4)
    engine.warmup()                                          # every graph compiles here, once
    server = start_in_thread(app(engine, tokenizer, "tiny-llama"), port=8000)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    server.stop()                                            # drains the requests in flight, as SIGTERM does

Two threads share the work. uvicorn's event loop answers HTTP; the engine loop (`Engine.run`)
steps in a thread of its own, which the app starts and stops with itself (its lifespan). A
request is submitted from the event loop; after each of its tokens the engine calls back in the
engine's thread, and the callback only hands a snapshot (text, token count, finish reason) to
the request's asyncio.Queue with `loop.call_soon_threadsafe`: the engine never waits for HTTP.

Endpoints, with OpenAI's names and defaults:

- POST /v1/completions: prompt (a string, a list of strings, a list of token ids, or a list of
  lists of ids), max_tokens (default 16), echo (the prompt before the completion; with logprobs,
  its tokens' log-probabilities too, and max_tokens 0 scores the prompt without generating),
  logprobs (0-20: each token's log-probability and that many alternatives).
- POST /v1/chat/completions: messages, max_tokens / max_completion_tokens (default: the room left
  in the context), logprobs (true) with top_logprobs (0-20).
- Both: model, temperature (default 1; 0 is greedy), top_p, top_k (vLLM's extension: at most
  engine.SAMPLE_TOP_K; 0 or -1 sets no limit of its own, so sampling keeps the engine's bound,
  the SAMPLE_TOP_K = 64 most likely tokens, as vLLM's and JetStream's TPU samplers do), seed
  (choice j of n uses seed + j), n (choices per prompt, up to MAX_N), stop (up to 4 non-empty
  strings), stream, stream_options.include_usage, user. Log-probabilities are the model's, before
  temperature and top-k/top-p; a token whose bytes are not UTF-8 on their own (a byte token) is
  written `bytes:\\xc3` as OpenAI does, never U+FFFD. Any other field is refused with a 400 that
  names it; presence_penalty, frequency_penalty, logit_bias, suffix,
  best_of, response_format, tools and tool_choice are refused unless they ask for nothing.
  Responses carry `usage` (summed over the choices) and `finish_reason` ("stop": an EOS id of the
  model (the tokenizer's and all of those in its config.json and generation_config.json) or a
  stop string; "length"; "cancelled", see Faults).
  `stream: true` sends server-sent events, one chunk per new piece of text (with its choice's
  `index` and its tokens' logprobs), then `data: [DONE]`. A streamed chunk holds back a tail that
  may be the start of a stop string, so the chunks add up to exactly the text a non-streamed
  request returns.
- GET /v1/models; GET /health ({"status": "ok"}, or 503 with the reason once the engine loop has
  stopped or failed); GET /metrics (Prometheus text by prometheus_client, one registry per app, no
  `_created` series): requests, tokens, busy slots, queue length, compilations since warm-up, and
  histograms of queue time, time to first token, time per output token and end-to-end latency
  of the requests that finished ("stop" or "length").

Access, as vLLM's --api-key: with a key (--api-key, default $LLAMA_XLA_API_KEY; `app(api_key=)`)
every /v1 request needs `Authorization: Bearer KEY`, else a 401; /health and /metrics stay open.
Serving a host other than loopback without a key prints a warning.

Errors are OpenAI's JSON, {"error": {"message", "type", "param", "code"}}, whatever goes wrong:
400 for a bad parameter (`param` names it) or a chat template that fails, 401 without the key,
404 for an unknown model or route, 413 for a body over MAX_BODY_BYTES = 4 MiB (before it is
parsed: at once by its Content-Length, or once that much of a chunked body has arrived; a
128k-token prompt of ids is about 1 MB of JSON), 429 when max_queue requests wait, 500 for
anything unexpected (its traceback goes to the log), 503 once the engine has failed.

Prompts: /v1/completions encodes the prompt as it is (with BOS). /v1/chat/completions uses the
tokenizer's chat template if it has one. Otherwise (the byte tokenizer of a training checkpoint,
or a tokenizer without a template) it writes a plain transcript: one "role: content" line per
message, then "assistant:".

Faults:
- A client that disconnects, streamed or not, cancels its requests: their slots free at the next
  step, and cancelled requests still waiting no longer count against max_queue.
- An exception in an engine step ends every running and waiting request with an error (a JSON 500,
  or a streamed `data: {"error": ...}` event then `data: [DONE]`); /health answers 503 with the
  reason, and the server stops: the command line exits with status 1, for a supervisor to restart
  it. Nothing tries to recover: after a failed step the state of the device (caches, slots) is unknown.
- SIGTERM or Ctrl+C (`Server.stop()` in a thread): uvicorn stops accepting connections, and the
  requests in flight go on for at most --drain-timeout seconds (default 30); those left then end
  with finish_reason "cancelled" (and [DONE]), and the process exits with status 0.

Sources: the OpenAI API reference, completions https://platform.openai.com/docs/api-reference/completions,
chat https://platform.openai.com/docs/api-reference/chat and streaming
https://platform.openai.com/docs/api-reference/chat-streaming; JetStream's server over its engine,
https://github.com/AI-Hypercomputer/JetStream; vLLM's OpenAI server (--api-key, its metrics),
https://docs.vllm.ai/en/latest/serving/openai_compatible_server.html; prometheus_client,
https://prometheus.github.io/client_python/; uvicorn's graceful shutdown,
https://www.uvicorn.org/server-behavior/
"""
import argparse
import asyncio
import collections
import contextlib
import dataclasses
import functools
import ipaddress
import itertools
import json
import math
import os
import re
import secrets
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

import jinja2
import prometheus_client
import torch_xla.runtime as xr
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from transformers import GenerationConfig, LlamaConfig

from . import checkpoint
from .cli import ArgumentParser, add_compile_cache_args, int_list, user_errors
from .detokenize import token_bytes, token_key
from .engine import SAMPLE_TOP_K, TOP_LOGPROBS, Engine, QueueFull
from .generate import check_buckets
from .mesh import make_mesh, mesh_shape
from .model import Llama, ModelArgs
from .parallel import check_tensor_parallel, replicate_kv_heads, shard_for_inference
from .quantize import quantize as quantize_model
from .runtime import accelerator_type, default_dtype, init_runtime, multi_host_slice
from .tokenizer import TOKENIZER_FILES, ByteTokenizer, load_tokenizer
from .train import DTYPES, TOKENIZER_DIR, TrainConfig, build_model, mesh_arg, model_config

MAX_SEQ_LEN = 2048  # the default cache length: max_position_embeddings, capped here
BUCKETS = (128, 256, 384, 512)  # default prefill buckets: those up to half the cache
MAX_N = 16  # choices per prompt
MAX_BODY_BYTES = 4 << 20  # 4 MiB: a 128k-token prompt as ids is about 1 MB of JSON
DRAIN_TIMEOUT = 30.0  # seconds that SIGTERM waits for the requests in flight
LATENCY_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)  # histogram buckets, seconds
TOKEN_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)  # the same, per output token
GENERATION_CONFIG = "generation_config.json"


# --- Loading a model into an engine ------------------------------------------------------------

def read_config(path):
    """(LlamaConfig, None) of a Hugging Face folder, or (LlamaConfig, step folder) of a training
    checkpoint: a step_XXXXXXXX folder, or a folder of them (the newest that verifies is taken).
    A checkpoint's files are verified here, once; its config is meta.json's extra["config"]."""
    path = Path(path)
    if (path / "config.json").is_file():
        return model_config(TrainConfig(init_from=str(path))), None
    if (path / checkpoint.META).is_file():
        step, meta = path, checkpoint.verify(path)
    else:
        step = checkpoint.latest(path)
        if step is None:
            raise FileNotFoundError(f"{str(path)!r} holds neither config.json (a Hugging Face folder) nor a "
                                    f"training checkpoint (step_XXXXXXXX/{checkpoint.META}); pass one of those")
        meta = checkpoint.read_meta(step)
    if "config" not in meta["extra"]:
        raise ValueError(f"{step / checkpoint.META} has no extra['config'] (the model's config); serve a "
                         f"checkpoint written by train, or export the model with checkpoint.export_hf")
    return LlamaConfig.from_dict(meta["extra"]["config"]), step


def read_tokenizer(path, step, config):
    """The folder's Hugging Face tokenizer if it has one (a training checkpoint's: the one train saved
    beside its step folders, checkpoint_dir/tokenizer), else the byte tokenizer (training's)."""
    folder = Path(path) if step is None else Path(str(step)).parent / TOKENIZER_DIR
    if any((folder / f).is_file() for f in TOKENIZER_FILES):
        return load_tokenizer(folder)
    if config.vocab_size < ByteTokenizer.vocab_size:
        raise ValueError(f"{path} has no tokenizer, and its vocab_size={config.vocab_size} is smaller than the byte "
                         f"tokenizer's {ByteTokenizer.vocab_size}; add the model's tokenizer files to the folder")
    return ByteTokenizer()


def check_lengths(config, max_seq_len, buckets):
    """ValueError unless the cache fits the model's positions and the buckets fit the cache (with
    the 2 tokens the engine's warm-up generates after the largest)."""
    if max_seq_len > config.max_position_embeddings:
        raise ValueError(f"max_seq_len={max_seq_len} > the model's max_position_embeddings="
                         f"{config.max_position_embeddings}; pass --max-seq-len {config.max_position_embeddings} or less")
    check_buckets(buckets, max_seq_len, room=2)


def mesh_shape_for(n, config):
    """The default (data, model) mesh shape for n devices: 'model' is the widest axis that divides n,
    the query heads, the MLP and the vocabulary, and that divides n_kv_heads or is a multiple of it
    (then the KV heads are copied, see `serving_mesh`); the devices left over form 'data'."""
    def fits(tp):
        kv = config.num_key_value_heads % tp == 0 or tp % config.num_key_value_heads == 0
        split = (config.num_attention_heads, config.intermediate_size, config.vocab_size)
        return n % tp == 0 and kv and all(v % tp == 0 for v in split)
    tp = max(filter(fits, range(1, n + 1)))
    return n // tp, tp


def serving_mesh(args, shape):
    """(the mesh, copies of each KV head) for a (data, model) shape, or (None, 1) for one device.

    A 'model' axis wider than n_kv_heads needs each KV head copied 'model' / n_kv_heads times
    (`replicate_kv_heads`) so the cache still splits on heads; 'data' splits the slots. ValueError,
    naming the fix, if the model (args, with the slots as max_batch_size) does not split evenly.
    """
    data, tp = shape
    if data * tp == 1:
        return None, 1
    mesh = make_mesh(shape)
    factor = tp // args.n_kv_heads if tp > args.n_kv_heads and tp % args.n_kv_heads == 0 else 1
    if args.max_batch_size % data:
        raise ValueError(f"slots={args.max_batch_size} is not divisible by the mesh's 'data' axis of size {data}, "
                         f"which splits the slots; pass --slots {data * -(-args.max_batch_size // data)} or another --mesh")
    check_tensor_parallel(dataclasses.replace(args, n_kv_heads=args.n_kv_heads * factor), mesh)
    return mesh, factor


def read_weights(path, step, config, args):
    """The inference Llama, on the CPU, of a Hugging Face folder, or of a training checkpoint: the
    sharded training model is rebuilt as train does, filled by `checkpoint.load` (already
    verified by `read_config`) and gathered to the host."""
    if step is None:
        return Llama.from_pretrained(path, args.max_batch_size, args.max_seq_len)
    extra = checkpoint.read_meta(step)["extra"]  # the parameters' dtype (older checkpoints: train_config's)
    dtype = extra.get("dtypes", {}).get("parameters") or extra.get("train_config", {}).get("dtype") or "fp32"
    hf = build_model(config, make_mesh(mesh_shape(None, config)), dtype=DTYPES[dtype])
    checkpoint.load(step, hf, verified=True)
    return Llama.from_state_dict(args, {name: t.cpu() for name, t in hf.state_dict().items()})


def check_one_host():
    """ValueError, before the runtime starts, on one host of a multi-host TPU slice (known from its type:
    `runtime.multi_host_slice`). There the runtime's start waits for every host's process, forever when
    only this one serves; after the start, `load_engine` also refuses a job of several processes."""
    hosts = multi_host_slice()
    if hosts:
        raise ValueError(f"{accelerator_type()} is a slice of {hosts} hosts and serve runs on one host: started here "
                         f"alone, the TPU runtime would wait for the other hosts forever. Serve from a single-host "
                         f"slice (v4-8, v5p-8, v5litepod-8, v6e-8)")


def load_engine(path, slots=None, max_seq_len=None, max_queue=64, mesh=None, buckets=None, dtype=None,
                quantize=None):
    """(Engine, tokenizer) for the model at `path`, not yet warmed up. Every argument is checked
    against the model's config before a weight is read.

    slots: 4 by default (rounded up to a multiple of the mesh's 'data' axis); max_seq_len: the
    config's max_position_embeddings capped at 2048; mesh: (data, model) devices (default:
    `mesh_shape_for`; on a CPU it sets the number of virtual devices, as train's --mesh does);
    buckets: those of 128, 256, 384, 512 up to half the cache; dtype: "bf16" or "fp32" (default:
    `runtime.default_dtype()`: LLAMA_XLA_DEFAULT_DTYPE, else bf16 on a TPU, fp32 on a CPU); quantize:
    None, "int8" or "int4" (weight-only, `quantize.quantize`).
    """
    config, step = read_config(path)
    max_seq_len = max_seq_len or min(config.max_position_embeddings, MAX_SEQ_LEN)
    buckets = tuple(buckets or [b for b in BUCKETS if 2 * b <= max_seq_len] or [max_seq_len // 2])
    check_lengths(config, max_seq_len, buckets)
    tokenizer = read_tokenizer(path, step, config)
    check_one_host()
    init_runtime(cpu_devices=math.prod(mesh) if mesh else None)
    if xr.process_count() > 1:  # a slice whose type gives no host count (GKE's names)
        raise ValueError(f"this is one of {xr.process_count()} hosts: the engine steps only on the host that got "
                         f"the request, and the others would wait in its collectives forever. Serve from a "
                         f"single-host TPU VM, or on a pod call Generator.generate with the same prompts on "
                         f"every host at once (README, 'On a TPU VM / pod')")
    shape = tuple(mesh) if mesh else mesh_shape_for(xr.global_runtime_device_count(), config)
    slots = slots or shape[0] * -(-4 // shape[0])  # 4, or the next multiple of 'data'
    args = ModelArgs.from_hf_config(config, slots, max_seq_len)
    mesh, factor = serving_mesh(args, shape)
    dtype = dtype or default_dtype()
    model = read_weights(path, step, config, args).to(DTYPES[dtype])
    if factor > 1:
        model = replicate_kv_heads(model, factor)
    if quantize:
        model = quantize_model(model, quantize)
    if mesh is not None:
        model = shard_for_inference(model, mesh)
    decode, eos_ids = decoder(tokenizer, config, path)
    return Engine(model, slots, buckets, max_queue, eos_ids, decode, on_recompile="count"), tokenizer


# --- Text in, text out -------------------------------------------------------------------------

def decoder(tokenizer, config=None, path=None):
    """(tokens -> text without special tokens, the EOS ids) for the Engine: the tokenizer's EOS and
    those of the model's config.json and generation_config.json (Llama 3 lists several)."""
    byte = isinstance(tokenizer, ByteTokenizer)
    ids = {tokenizer.eos_id if byte else tokenizer.eos_token_id} - {None}
    sources = [config] + ([GenerationConfig.from_pretrained(path)] if path and (Path(path) / GENERATION_CONFIG).is_file()
                          else [])
    for source in sources:
        eos = getattr(source, "eos_token_id", None)
        ids |= set([eos] if isinstance(eos, int) else eos or [])
    return (tokenizer.decode if byte else functools.partial(tokenizer.decode, skip_special_tokens=True)), ids


def encode(tokenizer, text):
    """Token ids of a prompt, with BOS (once: a chat template may have written it already)."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode(text)
    bos = tokenizer.bos_token
    return tokenizer.encode(text, add_special_tokens=not (bos and text.startswith(bos)))


def chat_prompt(tokenizer, messages):
    """The prompt of a chat: the tokenizer's template, else one "role: content" line per message.
    A template that fails is the request's fault: a 400 naming the template's message."""
    if not getattr(tokenizer, "chat_template", None):
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except jinja2.TemplateError as e:
        raise api_error(400, f"the model's chat template rejected these messages: {e}", param="messages") from None


def settled(text, stop):
    """The part of a running request's text that later tokens cannot change: without a trailing
    U+FFFD (an unfinished UTF-8 character decodes to it until its last byte arrives) and without
    a tail that may be the start of a stop string (which would be cut)."""
    text = text.rstrip("\ufffd")
    for k in range(min(len(text), max(map(len, stop), default=1) - 1), 0, -1):
        if any(s.startswith(text[-k:]) for s in stop):
            return text[:-k]
    return text


# --- The HTTP API ------------------------------------------------------------------------------

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class Sampling(BaseModel):
    """What both endpoints take, with OpenAI's names and defaults. A field that is not here is
    refused (400 naming it); those in UNSUPPORTED are refused unless they ask for nothing."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = Field(0, ge=-1, le=SAMPLE_TOP_K, description=(  # vLLM's extension
        f"sample from the top_k most likely tokens; 0 or -1: no limit of the request's own, so the engine's: "
        f"the {SAMPLE_TOP_K} most likely (engine.SAMPLE_TOP_K)"))
    seed: int | None = None
    stop: str | list[str] | None = None  # up to 4 (`check_supported`), non-empty (the engine checks)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None


class CompletionBody(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str
    content: str


class ChatBody(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None  # chat's newer name for max_tokens; wins if given
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None


UNSUPPORTED = dict(presence_penalty=0.0, frequency_penalty=0.0, logit_bias=(None, {}), suffix=(None, ""),
                   response_format=(None, {"type": "text"}), tools=(None, []), tool_choice=(None, "none"))


def check_supported(body):
    """400 naming a parameter this server does not implement, unless it has its no-op value, and
    for what the types leave open: max_tokens 0 without echo, over 4 stop strings, stream_options
    without stream."""
    for name, noop in UNSUPPORTED.items():
        value = getattr(body, name, noop if not isinstance(noop, tuple) else noop[0])
        if value not in (noop if isinstance(noop, tuple) else (noop,)):
            raise api_error(400, f"{name}={value!r} is not supported by this server; leave it out", param=name)
    if getattr(body, "best_of", None) not in (None, body.n):
        raise api_error(400, f"best_of={body.best_of} is not supported (only best_of == n); leave it out", param="best_of")
    if body.max_tokens == 0 and not getattr(body, "echo", False):
        raise api_error(400, "max_tokens=0 must be an int >= 1 (0 only with echo, to score the prompt)",
                        param="max_tokens")
    if isinstance(body.stop, list) and len(body.stop) > 4:
        raise api_error(400, f"stop={body.stop!r} holds more than 4 stop strings (OpenAI's limit)", param="stop")
    if body.stream_options and not body.stream:
        raise api_error(400, "stream_options is only allowed with stream: true", param="stream_options")


METRICS = (  # engine.metrics() key, Prometheus type, help
    ("requests_total", "counter", "Requests accepted into the engine's queue."),
    ("tokens_total", "counter", "Tokens generated."),
    ("slots_busy", "gauge", "Slots holding a request."),
    ("slots", "gauge", "Slots: rows of the decode batch."),
    ("queue_length", "gauge", "Requests waiting for a slot."),
    ("compiles_since_warmup", "gauge", "XLA compilations after warm-up; anything but 0 costs seconds per request."),
)
HISTOGRAMS = (  # name, help, buckets: over the requests that finished ("stop" or "length")
    ("request_queue_time_seconds", "Time from arrival to the first prompt section.", LATENCY_S),
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

    def __post_init__(self):
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


Update = collections.namedtuple("Update", "index text count reason error")  # a choice after a step


def api_error(status, message, type="invalid_request_error", param=None, code=None):
    """An HTTPException whose detail is OpenAI's error object (see `http_error`)."""
    return HTTPException(status, dict(message=message, type=type, param=param, code=code))


async def http_error(request, exc):
    """Every HTTP error as OpenAI's {"error": {...}}: ours, unknown routes, wrong methods."""
    detail = exc.detail if isinstance(exc.detail, dict) else dict(
        message=str(exc.detail), type="invalid_request_error", param=None, code=None)
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


def submit(served, body, prompts):
    """Queue body.n requests per prompt; returns (engine Requests, async iterator of their Updates).
    All or none: 400 for a value the engine rejects, 429 when the queue is full, 503 once the
    engine has failed."""
    loop, queue, reqs = asyncio.get_running_loop(), asyncio.Queue(), []

    def callback(index):  # runs in the engine's thread: hand over a snapshot, never block
        def put(req):
            if req.done:
                served.observe(req)
            update = Update(index, req.text, len(req.tokens), req.finish_reason, req.error)
            with contextlib.suppress(RuntimeError):  # the event loop has closed: nobody is waiting
                loop.call_soon_threadsafe(queue.put_nowait, update)
        return put

    if isinstance(body, ChatBody):
        if body.top_logprobs is not None and not body.logprobs:
            raise api_error(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        logprobs = body.logprobs
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
                        prompt_logprobs=getattr(body, "echo", False) and logprobs is not None))
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


def completion_logprobs(tokenizer, entries, tokens, offset=0):
    """OpenAI's completions `logprobs` of tokens with their engine entries (None for a prompt's
    first). A token that is not UTF-8 alone is written `bytes:\\xNN` (`detokenize.token_key`)."""
    lengths = [len(tokenizer.decode([t])) for t in tokens[:-1]]
    return dict(tokens=[token_key(tokenizer, t) for t in tokens], token_logprobs=[e and e[0] for e in entries],
                top_logprobs=[e and {token_key(tokenizer, i): v for i, v in e[1]} for e in entries],
                text_offset=list(itertools.accumulate(lengths, initial=offset)))


def chat_logprobs(tokenizer, entries, tokens):
    """OpenAI's chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}, `bytes` the
    token's own (`detokenize.token_bytes`)."""
    def item(token, value):
        return dict(token=token_key(tokenizer, token), logprob=value, bytes=list(token_bytes(tokenizer, token)))
    return dict(content=[item(t, v) | dict(top_logprobs=[item(i, w) for i, w in top])
                         for t, (v, top) in zip(tokens, entries)])


class Choices:
    """The choices of one response, as the engine's requests make them: text, tokens, logprobs."""

    def __init__(self, served, body, prompts, reqs, chat):
        self.tokenizer, self.body, self.prompts, self.reqs, self.chat = served.tokenizer, body, prompts, reqs, chat
        self.decode = served.engine.decode  # tokens -> text without special tokens (`decoder`)
        self.scoring = not chat and body.echo and body.max_tokens == 0  # the prompt only
        self.logprobs = reqs[0].logprobs is not None

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
            return dict(index=index, message=dict(role="assistant", content=text), logprobs=logprobs,
                        finish_reason=req.finish_reason)
        return dict(index=index, text=text, logprobs=logprobs, finish_reason="length" if self.scoring else req.finish_reason)

    def completion_tokens(self):
        return 0 if self.scoring else sum(len(r.tokens) for r in self.reqs)

    def usage(self):
        prompt_tokens = sum(map(len, self.prompts))
        return dict(prompt_tokens=prompt_tokens, completion_tokens=self.completion_tokens(),
                    total_tokens=prompt_tokens + self.completion_tokens())


async def events(head, choices, stream):
    """Server-sent events of a streamed response: per choice, a chunk per piece of settled text
    (with the logprobs of its new tokens), the last with finish_reason; a usage chunk if asked for;
    then [DONE]. If the engine failed, an error event instead of the rest, then [DONE]."""
    body, chat = choices.body, choices.chat
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    n = len(choices.reqs)
    sent, counted, first, error = [""] * n, [0] * n, [True] * n, None
    async for u in stream:
        if u.error:
            error = u.error
            continue
        i, count = u.index, 0 if choices.scoring else u.count
        text = "" if choices.scoring else (u.text if u.reason else settled(u.text, stop)) or ""
        if u.reason or len(text) > len(sent[i]) or first[i]:
            echo = choices.prompt_part(i)[0] if first[i] else ""  # echo: the prompt, first
            delta = echo + text[len(sent[i]):]
            logprobs = choices.logprobs_of(i, counted[i], count, with_prompt=first[i])
            if chat:
                message = ({"role": "assistant"} if first[i] else {}) | ({"content": delta} if delta or first[i] else {})
                chunk = dict(index=i, delta=message, logprobs=logprobs, finish_reason=u.reason)
            else:
                chunk = dict(index=i, text=delta, logprobs=logprobs, finish_reason=u.reason)
            yield f"data: {json.dumps({**head, 'choices': [chunk]})}\n\n"
            sent[i], counted[i], first[i] = text, count, False
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
    reqs, stream = submit(served, body, prompts)
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


def completion_prompts(tokenizer, prompt, vocab_size):
    """The token ids of each prompt: a string, a list of strings, a list of ids or a list of lists of ids."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise api_error(400, "prompt is empty; send a string, a list of strings or token ids", param="prompt")
    ids = [encode(tokenizer, p) if isinstance(p, str) else p for p in prompt]
    for p in ids:
        bad = [t for t in p if not 0 <= t < vocab_size]
        if not p or bad:
            raise api_error(400, f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})" if bad else
                            "a prompt is empty; every prompt needs at least one token", param="prompt")
    return ids


async def completions(request: Request, body: CompletionBody):
    served = request.app.state.served
    if body.max_tokens is None:
        body.max_tokens = 16  # OpenAI's default for completions
    return await respond(request, body, completion_prompts(served.tokenizer, body.prompt, served.engine.vocab_size),
                         chat=False)


async def chat_completions(request: Request, body: ChatBody):
    served = request.app.state.served
    prompt = encode(served.tokenizer, chat_prompt(served.tokenizer, [m.model_dump() for m in body.messages]))
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


# --- Running it -------------------------------------------------------------------------------

def listen(host, port):
    """A socket bound to (host, port), so a busy port fails at once, before any model is loaded
    (port 0: a free one). uvicorn listens on it."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}; pass another --port (0: any free "
                         f"one) or --host") from None
    return sock


class Server(uvicorn.Server):
    """uvicorn's server for an `app`, on a bound socket: prints `ready on URL` once it listens, stops
    once the engine has failed, and when it stops, cancels the requests still running after
    drain_timeout seconds."""

    def __init__(self, app, sock, debug=False, drain_timeout=DRAIN_TIMEOUT):
        # uvicorn's own limit comes later, for requests that a cancel cannot end (a stuck engine)
        super().__init__(uvicorn.Config(app, log_level="info" if debug else "warning", access_log=debug,
                                        timeout_graceful_shutdown=drain_timeout + 10))
        host, port = sock.getsockname()[:2]
        self.sock, self.url = sock, f"http://{f'[{host}]' if ':' in host else host}:{port}"
        self.served, self.drain_timeout = app.state.served, drain_timeout
        self.ready, self.thread = threading.Event(), None

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started:
            print(f"ready on {self.url}", flush=True)
            self.ready.set()

    async def on_tick(self, counter):
        return await super().on_tick(counter) or self.served.fault is not None

    async def shutdown(self, sockets=None):
        drain = asyncio.get_running_loop().call_later(self.drain_timeout, self.drain_expired)
        try:
            await super().shutdown(sockets)
        finally:
            drain.cancel()

    def drain_expired(self):
        print(f"drain timeout ({self.drain_timeout:g} s): cancelling {len(self.served.requests)} request(s) still "
              "running", flush=True)
        self.served.cancel_all()

    def run(self):
        super().run(sockets=[self.sock])

    def stop(self):
        """Stop a server started by `start_in_thread`: the requests in flight finish first (or are
        cancelled after drain_timeout seconds)."""
        self.should_exit = True
        self.thread.join()


def start_in_thread(app, host="127.0.0.1", port=8000, debug=False, drain_timeout=DRAIN_TIMEOUT):
    """Serve `app` from a background thread of this process; returns the `Server` (its .url, .stop())
    once it listens. For a notebook on a TPU, whose chips a child process could not open."""
    server = Server(app, listen(host, port), debug, drain_timeout)
    server.thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    server.thread.start()
    while not server.ready.wait(0.1):
        if not server.thread.is_alive():
            raise RuntimeError("the server stopped while starting; see its messages above")
    return server


def loopback(host):
    """Whether host is a loopback address (or "localhost")."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def bounded(low, high=math.inf, kind=int):
    """An argparse type: an int (kind=int) or a finite number (kind=float) in [low, high]."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or not low <= value <= high:
            bounds = f">= {low}" if high == math.inf else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an int' if kind is int else 'a number'} {bounds}")
        return value
    return parse


def parse_args(argv=None):
    parser = ArgumentParser(prog="python -m llama_xla_helpers.serve", description=__doc__.split("\n")[0])
    parser.add_argument("dir", help="a local Hugging Face folder (config.json + *.safetensors), or a training "
                                    "checkpoint (a step_XXXXXXXX folder or the folder holding them)")
    parser.add_argument("--slots", type=bounded(1), help="requests decoded together (default: 4, rounded up to a "
                                                         "multiple of --mesh's data axis)")
    parser.add_argument("--max-seq-len", type=bounded(2), help="KV cache length per slot (default: the config's "
                                                               f"max_position_embeddings, at most {MAX_SEQ_LEN})")
    parser.add_argument("--max-queue", type=bounded(1), default=64, help="requests waiting for a slot before 429")
    parser.add_argument("--mesh", type=mesh_arg, help="data,model devices, e.g. 1,8 (default: picked for the devices "
                                                      "and the model's heads)")
    parser.add_argument("--buckets", type=int_list("128,256,512"), help="prefill lengths, e.g. 128,256,512 (default: "
                                                         f"{','.join(map(str, BUCKETS))}, those up to half the cache)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on; 0.0.0.0: every interface (then pass --api-key)")
    parser.add_argument("--port", type=bounded(0, 65535), default=8000, help="port to listen on; 0: any free port")
    parser.add_argument("--api-key", default=os.environ.get("LLAMA_XLA_API_KEY"),
                        help="every /v1 request must send 'Authorization: Bearer KEY' (default: $LLAMA_XLA_API_KEY)")
    parser.add_argument("--drain-timeout", type=bounded(0, kind=float), default=DRAIN_TIMEOUT, metavar="SECONDS",
                        help="on SIGTERM, how long the requests in flight may go on before they are cancelled")
    parser.add_argument("--dtype", choices=tuple(DTYPES),
                        help="the weights' dtype (default: LLAMA_XLA_DEFAULT_DTYPE, else bf16 on a TPU, fp32 on a CPU)")
    parser.add_argument("--quantize", choices=("int8", "int4"), help="weight-only quantization (default: none)")
    add_compile_cache_args(parser)
    parser.add_argument("--debug", action="store_true", help="tracebacks of input errors, uvicorn's request log")
    args = parser.parse_args(argv)
    if args.mesh and (len(args.mesh) != 2 or min(args.mesh) < 1):
        parser.error(f"argument --mesh: {args.mesh} must be two ints >= 1, data,model devices, e.g. 1,8")
    return args


def main(argv=None):
    args = parse_args(argv)
    if not args.api_key and not loopback(args.host):
        print(f"warning: serving on {args.host} without an API key, for anyone who reaches the port; pass "
              f"--api-key KEY or set LLAMA_XLA_API_KEY", file=sys.stderr, flush=True)
    with user_errors(args.debug):
        check_one_host()
        init_runtime(math.prod(args.mesh) if args.mesh else None, cache_dir=args.compile_cache,
                     cache_readonly=args.compile_cache_readonly)  # the cache before anything compiles
        sock = listen(args.host, args.port)
        engine, tokenizer = load_engine(args.dir, args.slots, args.max_seq_len, args.max_queue, args.mesh,
                                        args.buckets, args.dtype, args.quantize)
    a, mesh = engine.model.args, getattr(engine.model, "mesh", None)
    print(f"{args.dir}: {a.n_layers} layers, {a.n_kv_heads} KV heads, {engine.model.embed_tokens.weight.dtype}, "
          f"mesh {tuple(mesh.mesh_shape) if mesh else None}, {engine.slots} slots of {a.max_seq_len} tokens, "
          f"buckets {engine.buckets}, tokenizer {type(tokenizer).__name__}", flush=True)
    start = time.perf_counter()
    compiles = engine.warmup()
    print(f"warm-up: {compiles} graphs compiled in {time.perf_counter() - start:.1f} s", flush=True)
    server = Server(app(engine, tokenizer, Path(args.dir).resolve().name, args.api_key), sock, args.debug,
                    args.drain_timeout)
    for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn handles them while it runs, then raises the one
        signal.signal(sig, signal.SIG_IGN)        # it caught again: ignored, so the process exits with 0
    server.run()
    m, fault = engine.metrics(), server.served.fault
    print(f"stopped: {m['requests_total']} requests, {m['tokens_total']} tokens"
          + (f"; the engine failed: {fault}" if fault else ""), flush=True)
    if fault:
        raise SystemExit(1)  # for a supervisor to restart the server


if __name__ == "__main__":
    main()
