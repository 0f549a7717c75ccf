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

The server is three modules, as vLLM and SGLang split theirs: `protocol.py`, the OpenAI request
models and their checks (the parameters, their defaults, the prompts); `api.py`, the handlers and
the FastAPI app (the endpoints, streaming, errors, /metrics, access, faults); and this one: loading
a model into an `Engine` (`load_engine`), running an app under uvicorn (`Server`,
`start_in_thread`) and the command line. `app` is `api.app`, importable from here too.

The command line: serving a host other than loopback without an API key (--api-key, default
$LLAMA_XLA_API_KEY) prints a warning. Once an engine step has raised (every request ends with an
error, see `api.py`), the server stops and the command line exits with status 1, for a supervisor
to restart it. SIGTERM or Ctrl+C (`Server.stop()` in a thread): uvicorn stops accepting
connections, and the requests in flight go on for at most --drain-timeout seconds (default 30);
those left then end with finish_reason "cancelled" (and [DONE]), and the process exits with status 0.

Sources: vLLM's OpenAI server (vllm/entrypoints/openai: protocol.py, api_server.py, cli_args.py),
https://docs.vllm.ai/en/latest/serving/openai_compatible_server.html; SGLang's
(python/sglang/srt/entrypoints/openai/protocol.py, python/sglang/srt/entrypoints/http_server.py),
https://github.com/sgl-project/sglang; uvicorn's graceful shutdown,
https://www.uvicorn.org/server-behavior/
"""
import argparse
import asyncio
import dataclasses
import functools
import ipaddress
import math
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import torch_xla.runtime as xr
import uvicorn
from transformers import GenerationConfig, LlamaConfig

from . import checkpoint, lora
from .api import app
from .cli import ArgumentParser, add_compile_cache_args, int_list, user_errors
from .engine import Engine, check_buckets, default_buckets
from .mesh import make_mesh, mesh_shape
from .model import Llama, ModelArgs
from .parallel import check_tensor_parallel, replicate_kv_heads, shard_for_inference
from .quantize import quantize as quantize_model
from .runtime import accelerator_type, default_dtype, init_runtime, multi_host_slice
from .tokenizer import TOKENIZER_FILES, ByteTokenizer, load_tokenizer
from .train import DTYPES, TOKENIZER_DIR, TrainConfig, build_model, lora_config, mesh_arg, model_config

MAX_SEQ_LEN = 2048  # the default cache length: max_position_embeddings, capped here
DRAIN_TIMEOUT = 30.0  # seconds that SIGTERM waits for the requests in flight
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


def check_lengths(config, max_seq_len, buckets, slots):
    """ValueError unless the longest request fits the model's positions and a step's budget (the
    largest bucket) holds a token of every request in flight."""
    if max_seq_len > config.max_position_embeddings:
        raise ValueError(f"max_seq_len={max_seq_len} > the model's max_position_embeddings="
                         f"{config.max_position_embeddings}; pass --max-seq-len {config.max_position_embeddings} or less")
    check_buckets(buckets, slots)


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
    adapters = lora_config(extra.get("train_config", {}))  # a LoRA run's checkpoint: its adapters, on its base
    base = extra["lora_base"]["folder"] if adapters else None
    if adapters and lora.folder_sha256(base) != extra["lora_base"]["sha256"]:
        raise ValueError(f"{step} holds LoRA adapters trained on the base model in {base!r}, whose weights have "
                         f"changed since; serve with that base restored, or a merged export (checkpoint.export_hf)")
    hf = build_model(config, make_mesh(mesh_shape(None, config)), dtype=DTYPES[dtype], init_from=base,
                     lora_config=adapters)
    checkpoint.load(step, lora.adapter_state(hf) if adapters else hf, verified=True)
    return Llama.from_state_dict(args, lora.merged_state(hf) if adapters else
                                 {name: t.cpu() for name, t in hf.state_dict().items()})


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
                quantize=None, compile=None, pages=None, prefix_caching=True):
    """(Engine, tokenizer) for the model at `path`, not yet warmed up. Every argument is checked
    against the model's config before a weight is read.

    slots: requests in flight at most, 4 by default (rounded up to a multiple of the mesh's 'data'
    axis); max_seq_len: the longest request, prompt and tokens (the config's max_position_embeddings
    capped at 2048); mesh: (data, model) devices (default: `mesh_shape_for`; on a CPU it sets the
    number of virtual devices, as train's --mesh does); buckets: a step's token counts
    (`engine.default_buckets()`); dtype: "bf16" or "fp32" (default: `runtime.default_dtype()`:
    LLAMA_XLA_DEFAULT_DTYPE, else bf16 on a TPU, fp32 on a CPU); quantize: None, "int8" or "int4"
    (weight-only, `quantize.quantize`); compile: `Engine`'s (None: compiled,
    `runner.default_compile`); pages: the KV cache pool's pages (default: `slots` whole contexts);
    prefix_caching: reuse cached prompt pages.
    """
    config, step = read_config(path)
    max_seq_len = max_seq_len or min(config.max_position_embeddings, MAX_SEQ_LEN)
    buckets = tuple(buckets or default_buckets())
    check_lengths(config, max_seq_len, buckets, slots or 4)
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
    engine = Engine(model, slots, buckets, max_queue, eos_ids, decode, on_recompile="count", compile=compile, pages=pages,
                    prefix_caching=prefix_caching)
    return engine, tokenizer


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


# --- Running it --------------------------------------------------------------------------------

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
    parser.add_argument("--slots", type=bounded(1), help="requests in flight at most (default: 4, rounded up to a "
                                                         "multiple of --mesh's data axis)")
    parser.add_argument("--max-seq-len", type=bounded(2), help="the longest request, prompt and tokens (default: the "
                                                               f"config's max_position_embeddings, at most {MAX_SEQ_LEN})")
    parser.add_argument("--pages", type=bounded(2), help="KV cache pages in the pool (default: --slots whole contexts)")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the cached pages of prompts that start alike (default: True)")
    parser.add_argument("--max-queue", type=bounded(1), default=64, help="requests waiting for a slot before 429")
    parser.add_argument("--mesh", type=mesh_arg, help="data,model devices, e.g. 1,8 (default: picked for the devices "
                                                      "and the model's heads)")
    parser.add_argument("--buckets", type=int_list("16,64,256"), help="a step's token counts, the largest its budget, "
                                                         "e.g. 16,64,256 (default: engine.default_buckets(): "
                                                         f"{','.join(map(str, default_buckets()))} here)")
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
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction,
                        help="torch.compile the engine's programs (default: yes, the faster path the engine's "
                             "docstring measures; --no-compile for a short run)")
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
                                        args.buckets, args.dtype, args.quantize, args.compile, args.pages,
                                        args.prefix_caching)
    a, mesh = engine.model.args, getattr(engine.model, "mesh", None)
    print(f"{args.dir}: {a.n_layers} layers, {a.n_kv_heads} KV heads, {engine.model.embed_tokens.weight.dtype}, "
          f"mesh {tuple(mesh.mesh_shape) if mesh else None}, {engine.slots} slots, requests up to {a.max_seq_len} "
          f"tokens, {engine.pool.num_pages - 1} pages of {engine.pool.page_size}, buckets {engine.buckets}, "
          f"compile {engine.compile}, tokenizer {type(tokenizer).__name__}", flush=True)
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
