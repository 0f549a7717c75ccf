"""Serving, side by side, in one run on one machine: continuous batching over a paged KV cache
against its baselines, with the targets it checks (below).

    python benchmarks/serve.py            # ~40 minutes; writes results/serve.json and results/serve_*.png
    python benchmarks/serve.py --quick    # ~3 minutes: 8 short requests, a 2-layer model, 1 repetition; a temp folder

Workload: the benchmarks' ~56M-parameter Llama, `get_config("bench")` (hidden 512, 8 layers, 8
heads, 4 KV heads, MLP 1376, vocab 32000), fp32, random weights (torch.manual_seed(0)), one XLA
CPU device. 32 requests with a fixed seed: prompt lengths uniform in [16, 400], output lengths
uniform in [16, 256], token ids uniform in the vocabulary. There is no EOS, so every request
makes exactly its output length, and every system is greedy. A request is at most 656 tokens;
the model's context is 768.

The cache: the same bytes as the fixed-slot engine's 8 slots x 768 positions. The paged engine's
pool is 8 x pages_for(768, 64) + 1 = 97 pages of 64 positions (kv_pages.page_size_for(768) = 64;
the extra page is page 0, which takes the padding's writes), and it may hold SLOTS_PAGED = 32
requests in flight (a slot is a row of per-request state, not a context), so every request of
the workload may run at once if their tokens fit. Its steps' token buckets are (4, 8, 16, 32,
256) (from 4, as the CPU's `engine.CPU_BUCKETS`): 4 to 32 for steps that only decode (up to 32
requests); 256 is a step's budget, which leaves >= 224 tokens for prompt chunks beside 32
decoding requests and keeps a step that carries a chunk short, so the decoding requests' TPOT
stays low (Sarathi-Serve's point; Hugging Face's batches below take 512). 64 and 128 are left out
so the warm-up compiles no more programs than the engine this one replaced (26): 15 (tokens,
pages) pairs, 6 argmax variants, 3 split steps of 256 tokens and the echo's.

Arrivals, in the request order, the same for every system:
  all-at-once  all 32 at time 0
  poisson-50%  Poisson arrivals at LOADS[0] x the compiled engine's all-at-once request throughput
  poisson-100% ... at LOADS[1] x that throughput
The rates are fractions of the capacity measured first (the compiled engine, all at once, in the
first repetition), so they make sense on any machine. The rates used are stored in the JSON.

Systems:
  engine-compiled  our `Engine` on the pool above, compile=True, its default on every device
               (one torch.compile'd program per step shape, the pages donated), warmed up first (not
               timed). The loop below submits each request when its arrival time has come and
               calls engine.step(); no threads. Prefix caching is on (the workload's random
               prompts share no page, so it changes nothing here but the look-ups).
  engine-lazy  the same with compile=False: each step traced again as lazy tensors.
  static       our `Generator`, batches of 8 in arrival order (all-at-once only), on its fixed-slot
               cache of 8 x 768 positions, prefill buckets (32, 64, 128): each batch runs for its
               longest output. A request's first token comes after the batch's prefill; it ends
               with its batch (generate returns at the end); only its own output counts.
  hf-cb        Hugging Face's continuous batching (`model.init_continuous_batching`), plain eager
               PyTorch on the same CPU, as before: at most 8 requests and 512 tokens per batch, a
               paged KV cache of the same bytes (8 x 768 positions in pages of 256), no prefix
               caching. Its per-token timestamps (record_timestamps=True) give each request's first token.
  http         the compiled engine behind our OpenAI-compatible server: a real `python -m
               llama_xla_helpers.serve --compile` process (the same slots, pages and buckets, one
               device) serving the same weights from a folder written here; 32 client threads send
               /v1/completions with stream=true (all-at-once, once, after the repetitions). The
               prompt is text in a word-level tokenizer ("t0" .. "t31999", one word per id, no BOS
               or EOS), so it encodes to exactly the workload's ids.

Per system and arrival pattern: output tokens/s (all output tokens / time from the first
arrival to the last completion), time to first token (TTFT, from the request's arrival) p50 and
p99, time per output token (TPOT, per request: (finish - first token) / (n - 1)) p50 and p99;
for the engines, the requests in flight per step (`Engine.timeline`): peak, median and mean over
the run's steps, against the 8 the fixed-slot engine held, and the preemptions. The workload runs
REPS times; each ratio is the median over the repetitions, with its range.

Decode steps, measured REPS times each (median): each engine path's step at batch 1 and 8 (every
request decoding, prefill done; contexts from 32 to `live` = 64 positions; token buckets (1, 8)),
in an engine whose pool is the workload's (N = 97 pages) and in one a tenth its size
(ceil(N / 10) = 10 pages, or the fewest that hold the batch); `Generator`'s step, lazy and
compiled, against Hugging Face eager generate at batch 1, 8 and 32 (32-token prompts, 64 new
tokens; HF's step is (time of 64 tokens - time of 1) / 63).

Host time per decode step, each engine path at batch 8 (the N-page pool): HOST_STEPS steady
steps under the profiler, each in `profile.marker`; a step's wall time (to the next step's start)
less the time its compiled programs ran (`profile.host_ms`), median over the steps; and the
Python thread's time in PjRt's "Wait for donation holds" per step, where it waits for the device.
Then the host's parts, timed in HOST_STEPS more steps (`host_parts`), and the step's inputs again
with no program between. `--host-only` runs this part alone and updates it in the saved JSON.

Structured output: the compiled engine on the workload all at once, every request
under a grammar (a JSON string of exactly its output length, so the token counts match), against
the same run unconstrained, alternating, REPS times (`constrained`). `--constrained-only` runs
this part alone and updates it in the saved JSON.

Prefix caching (one request at a time, an engine with a 2,048-token context: pages of 128, two
whole contexts, token buckets (32, 256)): the time to first token of a request of a 1,024-token
prefix and a distinct 32-token suffix when the prefix is cached (an earlier request had it)
against one whose 1,024-token prefix is fresh (nothing cached), PREFIX_REPS of each, alternating,
after one untimed run of each; medians; each engine path.

Compilations: every engine counts those after its warm-up (on_recompile="count"); a step of the
workload that compiled is listed in `compile_misses` with its profile (the system, pattern,
repetition, step, requests in it and the longest block table in pages: what sets its shape).

Targets (met or missed, as measured; never asserted), for the compiled engine unless said:
requests in flight on the workload all at once, median over repetitions of the peak, >= 2x the
fixed-slot engine's 8 (the mean over steps reported beside it); >= 1.5x hf-cb tokens/s all at
once and at 100% load; TPOT p50 <= 0.7x hf-cb's at 50% load; each path's
decode step at batch 1 and 8 in the N-page pool <= 1.2x the step in the tenth-size pool; TTFT
with the 1,024-token prefix cached <= 0.2x uncached (each path); 0 compilations after warm-up
(every engine, the server); the workload engine's warm-up at most as many programs as the
engine it replaced (BEFORE_PROGRAMS, which took BEFORE_WARMUP_S on this CPU); the batch-1
decode step <= `Generator`'s compiled step and <= 0.8x HF eager's; host time per batch-8 decode
step <= 1 ms; more tokens/s than the lazy path (else the lazy path is the default here); HTTP
overhead <= 10%. With grammars: tokens/s with every request constrained >= 0.85x unconstrained.

Dropped: engine / static tokens/s within 10% of the ceiling (static's decode steps / the
engine's): the ceiling counted steps of 8 fixed slots against static's batches of 8, each step
costing the same; the paged engine runs up to 32 requests and prompt chunks in a step whose cost
grows with its tokens and pages, so step counts no longer predict the ratio (static's tokens/s is
still measured beside the others). The 768- vs 128-position cache step: the paged engine has no
per-request cache length; the pool-size step above replaces it. Prefill of requests that arrive
together (prefill_rows): a ragged step puts every prompt chunk in one program, so there is no
row count left to compare.
"""
import argparse
import concurrent.futures
import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request

from llama_xla_helpers import plots  # first: it picks the XLA device before torch_xla loads
from llama_xla_helpers import profile
import numpy as np
import torch
import torch_xla.core.xla_model as xm
import torch_xla.debug.profiler as xp
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils.logging import disable_progress_bar

from llama_xla_helpers.configs import get_config
from llama_xla_helpers.engine import Engine
from llama_xla_helpers.generate import Generator
from llama_xla_helpers.grammar import Grammars
from llama_xla_helpers.kv_pages import page_size_for, pages_for
from llama_xla_helpers.metrics import count_compiles
from llama_xla_helpers.model import Llama
from llama_xla_helpers.runner import default_compile
from llama_xla_helpers.runtime import init_runtime
from llama_xla_helpers.tokenizer import ByteTokenizer

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SLOTS = 8  # the fixed-slot engine's rows: the cache's bytes (SLOTS contexts), static's and HF's batches
ENGINES = {"engine-lazy": False, "engine-compiled": True}  # system name: Engine's compile=
HOST_STEPS = 16  # decode steps traced for the host time
MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"  # Linux: memory regions a process may map
MAPS_NEEDED = 262144  # XLA:CPU maps ~400 regions per compiled program (measured); the full run reached 87,441
LOADS = (0.5, 1.0)  # Poisson rates, as fractions of the engine's all-at-once requests/s
DECODE_PROMPT = 32
STEP_BUCKETS = (1, SLOTS)  # the decode-step engines' token buckets: a decode step of 1 request, of SLOTS
PREFIX_REPS = 5  # cached and uncached requests timed in the prefix-caching part, each
HF_BATCH_TOKENS = 512  # Hugging Face continuous batching's tokens per step
BEFORE_PROGRAMS, BEFORE_WARMUP_S = 26, 106  # the workload engine's warm-up with token buckets (16, 32, 64, 128, 256)


@dataclasses.dataclass
class Setup:
    layers: int = 8
    requests: int = 32
    prompt_lens: tuple = (16, 400)
    output_lens: tuple = (16, 256)
    slots: int = 32  # the paged engine's requests in flight at most
    buckets: tuple = (4, 8, 16, 32, 256)  # the paged engine's step token counts (module docstring)
    prompt_buckets: tuple = (32, 64, 128)  # static's (Generator's) prefill buckets
    max_seq_len: int = 768
    decode_batches: tuple = (1, 8, 32)
    decode_new: int = 64
    live: int = 64  # the engine's decode step: contexts up to this many positions
    prefix: int = 1024  # the prefix-caching part: a prefix of this many tokens,
    suffix: int = 32  # then this many of the request's own,
    prefix_seq_len: int = 2048  # in an engine of this context
    prefix_buckets: tuple = (32, 256)  # and these token buckets
    reps: int = 3

    @property
    def config(self):
        return get_config("bench", num_hidden_layers=self.layers)  # the benchmarks' decode model


FULL = Setup()
QUICK = Setup(layers=2, requests=8, prompt_lens=(8, 40), output_lens=(4, 16), slots=16, buckets=(4, 16, 64),
              prompt_buckets=(16, 32), max_seq_len=64, decode_batches=(1, 8), decode_new=8, live=48, prefix=64,
              suffix=16, prefix_seq_len=128, prefix_buckets=(64,), reps=1)  # short contexts: few page buckets to compile


def pool_pages(max_seq_len, contexts=SLOTS):
    """The pool of `contexts` whole contexts of max_seq_len positions (the fixed-slot engine's
    bytes at SLOTS), plus page 0, the padding's."""
    return contexts * pages_for(max_seq_len, page_size_for(max_seq_len)) + 1


def workload(setup, seed=0):
    """[(prompt token ids, output length)] for every request."""
    g = random.Random(seed)
    prompt = lambda: [g.randrange(setup.config.vocab_size) for _ in range(g.randint(*setup.prompt_lens))]
    return [(prompt(), g.randint(*setup.output_lens)) for _ in range(setup.requests)]


def poisson(n, rate, seed=1):
    """n arrival times (s) of a Poisson process at `rate` per second, the first at 0."""
    g = random.Random(seed)
    return np.cumsum([0.0] + [g.expovariate(rate) for _ in range(n - 1)]).tolist()


def summary(system, pattern, rows, work, rep):
    """The metrics of one run; rows: (arrival, first token, finish, tokens) per request, in seconds."""
    if [row[3] for row in rows] != [n for _, n in work]:
        raise RuntimeError(f"{system} ({pattern}) did not make exactly each request's output length")
    arrival, first, finish, n = (np.array(c) for c in zip(*rows))
    seconds = finish.max() - arrival.min()
    ttft, tpot = first - arrival, (finish - first)[n > 1] / (n - 1)[n > 1]
    r = dict(system=system, pattern=pattern, rep=rep, requests=len(rows), output_tokens=int(n.sum()), seconds=seconds,
             tokens_per_s=n.sum() / seconds, requests_per_s=len(rows) / seconds,
             ttft_p50_s=np.percentile(ttft, 50), ttft_p99_s=np.percentile(ttft, 99),
             tpot_p50_ms=1e3 * np.percentile(tpot, 50), tpot_p99_ms=1e3 * np.percentile(tpot, 99))
    r = {k: float(v) if isinstance(v, np.floating) else v for k, v in r.items()}
    print(f"{system:8s} {pattern:12s} {r['tokens_per_s']:7.1f} tokens/s  TTFT p50 {r['ttft_p50_s']:6.2f} s "
          f"p99 {r['ttft_p99_s']:6.2f} s  TPOT p50 {r['tpot_p50_ms']:6.1f} ms p99 {r['tpot_p99_ms']:6.1f} ms  "
          f"({r['seconds']:.0f} s)", flush=True)  # progress
    return r


def wait_until(t):
    time.sleep(max(0.0, t - time.perf_counter()))


# --- The systems: each runs the workload with arrival times (s from its start) and returns rows ---

def run_engine(engine, work, arrivals, grammars=None):
    """Rows; and the steps that compiled after warm-up, each with its profile (the step's index,
    requests and longest block table in pages, which set its shape). grammars: a compiled grammar
    per request (`constrained`), or None."""
    engine.timeline.clear()
    pending = list(zip(arrivals, work, grammars or [None] * len(work)))
    t0, reqs, misses = time.perf_counter(), [], []
    while pending or not all(r.done for r in reqs):
        while pending and t0 + pending[0][0] <= time.perf_counter():
            _, (prompt, n), grammar = pending.pop(0)
            reqs.append(engine.submit(prompt, n, grammar=grammar))
        compiles = engine.compiles_since_warmup
        if not engine.step() and pending:  # idle: sleep until the next arrival
            wait_until(t0 + pending[0][0])
        if engine.compiles_since_warmup > compiles:
            last = engine.timeline[-1]
            misses.append(dict(step=len(engine.timeline) - 1, compiles=engine.compiles_since_warmup - compiles,
                               requests=len(last), longest_table_pages=max(last.values())))
    return [(t0 + a, r.first_token_at, r.finished_at, len(r.tokens)) for a, r in zip(arrivals, reqs)], misses


def in_flight(engine, preemptions):
    """Requests in flight per step of the engine's last run (`Engine.timeline`): peak, median, mean;
    the most pages held in a step, the steps, the preemptions since `preemptions`."""
    n = [len(step) for step in engine.timeline]
    return dict(in_flight_peak=float(max(n)), in_flight_median=float(np.median(n)), in_flight_mean=float(np.mean(n)),
                pages_held_peak=float(max(sum(step.values()) for step in engine.timeline)), steps=float(len(n)),
                preemptions=float(engine.scheduler.preemptions - preemptions))


def run_static(gen, work, arrivals):
    t0, free, rows = time.perf_counter(), time.perf_counter(), []
    for k in range(0, len(work), SLOTS):
        batch, arrived = work[k:k + SLOTS], [t0 + a for a in arrivals[k:k + SLOTS]]
        wait_until(max(arrived[-1], free))  # its last request has arrived, the previous batch is done
        start = time.perf_counter()
        _, stats = gen.generate([p for p, _ in batch], max(n for _, n in batch))
        free = time.perf_counter()
        rows += [(a, start + stats.prefill_s, free, n) for a, (_, n) in zip(arrived, batch)]
    return rows


def run_hf_cb(manager, work, arrivals):
    t0, ids = time.perf_counter(), []
    for a, (prompt, n) in zip(arrivals, work):
        wait_until(t0 + a)
        ids.append(manager.add_request(prompt, max_new_tokens=n, record_timestamps=True))
    out = {}
    while len(out) < len(ids):
        r = manager.get_result(timeout=1)
        if r is None and not manager.is_running():
            raise RuntimeError("Hugging Face's continuous batching loop stopped; see its log above")
        if r is not None and r.is_finished():
            out[r.request_id] = r
    return [(t0 + a, out[i].timestamps[0], out[i].timestamps[-1], len(out[i].generated_tokens))
            for a, i in zip(arrivals, ids)]


def complete(url, prompt, n):
    """One streamed /v1/completions request: (first text, finish, completion tokens)."""
    body = dict(prompt=" ".join(f"t{i}" for i in prompt), max_tokens=n, temperature=0, stream=True,
                stream_options=dict(include_usage=True))
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    first = usage = None
    with urllib.request.urlopen(request) as response:
        for line in response:  # server-sent events: "data: {chunk}" lines, then "data: [DONE]"
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    return first, time.perf_counter(), usage["completion_tokens"]


def run_http(url, work):
    """All requests arrive at once; a client thread per request sends it."""
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(work)) as pool:
        return [(t0, *r) for r in pool.map(lambda w: complete(url, *w), work)]


# --- Building and warming up each system ---------------------------------------------------------

def build_engine(hf, setup, compile):
    """The workload's engine: setup.slots requests in flight, the pool of SLOTS contexts."""
    return warm_engine(hf, setup.max_seq_len, setup.slots, setup.buckets, compile, pool_pages(setup.max_seq_len),
                       max_queue=setup.requests)


def warm_engine(hf, max_seq_len, slots, buckets, compile, pages, max_queue=64):
    """A warmed-up Engine on a pool of `pages` pages; its warm-up's seconds in engine.warmup_s."""
    engine = Engine(Llama.from_hf(hf, max_batch_size=1, max_seq_len=max_seq_len), slots, buckets,
                    max_queue=max_queue, on_recompile="count", compile=compile, pages=pages)
    start = time.perf_counter()
    n = engine.warmup()
    engine.warmup_s = time.perf_counter() - start
    print(f"engine warm-up ({slots} slots, {pages} pages of {engine.pool.page_size}, {max_seq_len} positions, "
          f"buckets {buckets}, compile={compile}): {n} compilations in {engine.warmup_s:.0f} s", flush=True)
    return engine


def build_static(hf, setup):
    gen = Generator(Llama.from_hf(hf, max_batch_size=SLOTS, max_seq_len=setup.max_seq_len), setup.prompt_buckets)
    for b in setup.prompt_buckets * 2:  # every bucket's prefill and the decode step, twice
        gen.generate([[0] * b] * SLOTS, 3)
    return gen


def build_hf_cb(hf, setup):
    """A started manager, run once on a few requests (not timed)."""
    # It asks torch for the default accelerator's module, which fails here once torch_xla has run
    # (it names its device PrivateUse1 without that backend's hooks). Its model runs on the CPU.
    default = torch.get_device_module
    torch.get_device_module = lambda device=None: torch.cpu if device is None else default(device)
    pages = SLOTS * math.ceil(setup.max_seq_len / 256)  # 256-token pages: the engine's 8 x max_seq_len
    cb = ContinuousBatchingConfig(page_size=256, num_blocks=pages, max_batch_tokens=HF_BATCH_TOKENS,
                                  max_requests_per_batch=SLOTS, allow_block_sharing=False)
    manager = hf.init_continuous_batching(GenerationConfig(do_sample=False, eos_token_id=-1), cb)
    manager.warmup()
    manager.start()
    run_hf_cb(manager, workload(setup, seed=2)[:SLOTS], [0.0] * SLOTS)
    return manager


def model_dir(hf, folder):
    """The model for the server: weights, config and a word-level tokenizer ("t<id>" per id)."""
    disable_progress_bar()
    hf.save_pretrained(folder)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(hf.config.vocab_size)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(folder)


def start_server(folder, setup):
    """A `serve` process on a free port, warmed up; returns (process, url)."""
    cmd = [sys.executable, "-m", "llama_xla_helpers.serve", folder, "--slots", str(setup.slots), "--mesh", "1,1",
           "--compile", "--max-seq-len", str(setup.max_seq_len), "--pages", str(pool_pages(setup.max_seq_len)),
           "--buckets", ",".join(map(str, setup.buckets)),
           "--max-queue", str(setup.requests), "--host", "127.0.0.1", "--port", "0"]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    for line in server.stdout:
        print(f"  server: {line.rstrip()}", flush=True)
        if line.startswith("ready on "):
            return server, line.split()[-1]
    raise RuntimeError(f"the server exited with status {server.wait()} before it was ready; see its messages above")


def server_compiles(url):
    text = urllib.request.urlopen(f"{url}/metrics").read().decode()
    return int(float(next(line.split()[-1] for line in text.splitlines()
                          if line.startswith("llama_xla_compiles_since"))))  # prometheus_client writes 0.0


# --- Decode speed -----------------------------------------------------------------------------------

def hf_seconds(hf, ids, new):
    start = time.perf_counter()
    hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def decode_speed(hf, setup):
    """Per batch size: a decode step of Generator (lazy and compiled) and of HF eager generate, ms
    (medians of setup.reps)."""
    new = setup.decode_new
    gens = {path: Generator(Llama.from_hf(hf, max_batch_size=max(setup.decode_batches),
                                          max_seq_len=DECODE_PROMPT + new), (DECODE_PROMPT,), compile=compile)
            for path, compile in (("lazy", False), ("compiled", True))}
    rows = []
    for batch in setup.decode_batches:
        ids = torch.randint(0, hf.config.vocab_size, (batch, DECODE_PROMPT), generator=torch.Generator().manual_seed(0))
        row = dict(batch=batch, compiles=0)
        for path, gen in gens.items():
            gen.generate(ids.tolist(), new)  # compiles
            ours = [gen.generate(ids.tolist(), new)[1] for _ in range(setup.reps)]
            row[f"{path}_ms"] = 1e3 * np.median([s.decode_step_s for s in ours])
            row["compiles"] += sum(s.compiles for s in ours)
        hf_seconds(hf, ids, 4)  # warm-up
        hf_steps = [(hf_seconds(hf, ids, new) - hf_seconds(hf, ids, 1)) / (new - 1) for _ in range(setup.reps)]
        rows.append(row | dict(hf_eager_ms=1e3 * np.median(hf_steps)))
        print(f"decode step, batch {batch:2d}: Generator lazy {row['lazy_ms']:6.2f} ms, compiled "
              f"{row['compiled_ms']:6.2f} ms, HF eager {rows[-1]['hf_eager_ms']:6.2f} ms", flush=True)  # progress
    return rows


def engine_step_ms(engine, batch, live):
    """The engine's step (ms) with `batch` requests decoding from 32-token prompts, prefill done,
    until their contexts reach `live` positions."""
    reqs = [engine.submit([1 + b] * DECODE_PROMPT, live - DECODE_PROMPT) for b in range(batch)]
    while not all(r.tokens for r in reqs):  # prefilled, first tokens read
        engine.step()
    start, steps = time.perf_counter(), 0
    while not all(r.done for r in reqs):
        engine.step()
        steps += 1
    return 1e3 * (time.perf_counter() - start) / steps


def host_ms(engine):
    """A decode step with every slot busy, HOST_STEPS steps under the profiler, each in a profile.marker
    (module docstring): {host_ms, profiled_step_ms: medians; donation_wait_ms: the Python thread's
    mean time per step in PjRt's "Wait for donation holds", where it waits for the previous
    program to release the buffers it donates}, and the host's parts alone (`host_parts`)."""
    reqs = decoding(engine)
    with tempfile.TemporaryDirectory() as logdir:
        xp.start_trace(logdir)
        try:
            for _ in range(HOST_STEPS):
                with profile.marker("engine step"):
                    engine.step()
            xm.wait_device_ops()
        finally:
            xp.stop_trace()
        wall, device = np.array(profile.host_ms(logdir, "engine step")).T
        waits = sum(e.duration_ms for e in profile.read_events(logdir)
                    if e.name == "Wait for donation holds" and e.thread == "python")
    finish(engine, reqs)
    return dict(host_ms=float(np.median(wall - device)), profiled_step_ms=float(np.median(wall)),
                donation_wait_ms=waits / HOST_STEPS) | host_parts(engine)


def decoding(engine):
    """A request in every slot, each with HOST_STEPS + 8 tokens to make, prefilled and decoding."""
    reqs = [engine.submit([1 + b] * DECODE_PROMPT, HOST_STEPS + 8) for b in range(engine.slots)]
    while not all(len(r.tokens) > 2 for r in reqs):
        engine.step()
    xm.wait_device_ops()
    return reqs


def finish(engine, reqs):
    while not all(r.done for r in reqs):
        engine.step()


def host_parts(engine):
    """The host's parts of HOST_STEPS decode steps (after those `host_ms` profiles), medians, ms:
    inputs_ms (`runner.inputs`: the step's layout and its two transfers), call_ms (the program's
    call: compiled, Dynamo's guards, torch_xla's bridge and the launch; lazy, tracing the step, its
    sync not included), read_ms (`Engine.collect`: reading the step before's tokens, which waits
    for its program if it still runs), and inputs_alone_ms (the last step's `runner.inputs` again,
    HOST_STEPS times back to back once every program has finished: the same host work with no
    program between; its requests' newest tokens now come from the host, not the device)."""
    runner, times, args = engine.runner, {"inputs": [], "call": [], "read": []}, []

    def timed(name, fn):
        def run(*a):
            start = time.perf_counter()
            out = fn(*a)
            times[name].append(time.perf_counter() - start)
            if name == "inputs":
                args[:] = a
            return out
        return run

    reqs, program = decoding(engine), runner.program
    runner.inputs, runner.program, engine.collect = \
        timed("inputs", runner.inputs), timed("call", program), timed("read", engine.collect)
    try:
        for _ in range(HOST_STEPS):
            engine.step()
    finally:
        del runner.inputs, engine.collect  # the methods again
        runner.program = program
    inputs, alone = runner.inputs, []
    xm.wait_device_ops()
    for _ in range(HOST_STEPS):
        start = time.perf_counter()
        inputs(*args)
        alone.append(time.perf_counter() - start)
    finish(engine, reqs)
    return {f"{name}_ms": 1e3 * float(np.median(t)) for name, t in (*times.items(), ("inputs_alone", alone))}


def engine_steps(hf, setup):
    """Each engine path's decode step at batch 1 and SLOTS (medians of setup.reps, ms), contexts up to
    setup.live positions, in an engine whose pool is the workload's (N pages) and in one of a tenth
    (or the fewest pages that hold the batch); at batch SLOTS in the N-page pool, its host time
    (`host_ms`); each path's first engine's warm-up, s."""
    big = pool_pages(setup.max_seq_len)
    small = max(-(-big // 10), SLOTS * pages_for(setup.live, page_size_for(setup.max_seq_len)) + 1)
    rows = []
    for system, compile in ENGINES.items():
        engines = {pages: warm_engine(hf, setup.max_seq_len, SLOTS, STEP_BUCKETS, compile, pages)
                   for pages in (big, small)}
        for batch in (1, SLOTS):
            row = dict(system=system, batch=batch, pool_pages=big, small_pool_pages=small, host_ms=None,
                       profiled_step_ms=None, donation_wait_ms=None, inputs_ms=None, call_ms=None, read_ms=None,
                       inputs_alone_ms=None,
                       first_warmup_s=engines[big].warmup_s if batch == 1 else None)
            before = sum(e.compiles_since_warmup for e in engines.values())
            for key, engine in zip(("pool_ms", "small_pool_ms"), engines.values()):
                row[key] = float(np.median([engine_step_ms(engine, batch, setup.live) for _ in range(setup.reps)]))
            if batch == SLOTS:
                row |= host_ms(engines[big])
            row["compiles"] = sum(e.compiles_since_warmup for e in engines.values()) - before
            rows.append(row)
            print(f"engine step: {row}", flush=True)  # progress
    return rows


def ttft_s(engine, prompt):
    """Time to first token (s) of one request of `prompt` (two tokens), run alone; its cached prompt tokens."""
    req = engine.submit(prompt, 2)
    while not req.done:
        engine.step()
    return req.first_token_at - req.submitted_at, req.cached_tokens


def prefix_ttft(hf, setup):
    """Per engine path, the time to first token of a request whose setup.prefix-token prefix is
    cached (an earlier request had it) and of one whose prefix is fresh, each followed by its own
    setup.suffix tokens: medians of PREFIX_REPS, alternating, after one untimed run of each, ms."""
    g = random.Random(3)
    ids = lambda n: [g.randrange(setup.config.vocab_size) for _ in range(n)]
    prefix, rows = ids(setup.prefix), []
    for system, compile in ENGINES.items():
        engine = warm_engine(hf, setup.prefix_seq_len, 1, setup.prefix_buckets, compile,
                             pool_pages(setup.prefix_seq_len, contexts=2))  # room for the cached prefix and a fresh one
        runs = {"cached": [], "uncached": []}
        for rep in range(1 + PREFIX_REPS):
            for kind, first in (("cached", prefix), ("uncached", ids(setup.prefix))):
                if rep:
                    runs[kind].append(ttft_s(engine, first + ids(setup.suffix)))
                else:  # untimed: the first puts the prefix in the cache
                    ttft_s(engine, first + ids(setup.suffix))
        row = dict(system=system, prefix=setup.prefix, suffix=setup.suffix, page_size=engine.pool.page_size)
        for kind, got in runs.items():
            row[f"{kind}_ttft_ms"] = 1e3 * float(np.median([t for t, _ in got]))
            row[f"{kind}_tokens"] = min(n for _, n in got)  # prompt tokens found in the cache
        row["compiles"] = engine.compiles_since_warmup
        rows.append(row)
        print(f"prefix caching: {row}", flush=True)  # progress
    return rows


# --- The run --------------------------------------------------------------------------------------

def constrained(hf, setup, engine=None):
    """The compiled engine on the workload all at once, unconstrained and with every request under
    a grammar, alternating, setup.reps times each: summary rows. A request of n tokens gets the
    JSON schema of a string of n - 3 lowercase letters ({"type": "string", "pattern": ...}), over
    the byte tokenizer's ids (the model's 32,000 ids past them are never allowed), so its answer
    is the quote, n - 3 letters, the quote and EOS: n tokens, as unconstrained. The grammars
    compile before the clock starts (the server compiles a request's before submitting it)."""
    engine = engine or build_engine(hf, setup, True)
    grammars = Grammars(ByteTokenizer(), setup.config.vocab_size, [ByteTokenizer.eos_id])
    work = workload(setup)
    letters = lambda n: "".join(f"[a-z]{{{min(100, n - k)}}}" for k in range(0, n, 100))  # xgrammar: {128} at most
    compiled = [grammars.json_schema({"type": "string", "pattern": f"^{letters(n - 3)}$"}) for _, n in work]
    rows = []
    for rep in range(setup.reps):
        for system, each in (("engine-compiled", None), ("engine-compiled-constrained", compiled)):
            out, missed = run_engine(engine, work, [0.0] * len(work), each)
            compiles = sum(m["compiles"] for m in missed)
            rows.append(summary(system, "all-at-once", out, work, rep) | dict(compiles=compiles))
            print(f"constrained part, {system}, repetition {rep}: {rows[-1]['tokens_per_s']:.1f} tokens/s", flush=True)
    return rows


def patterns(n, engine_requests_per_s):
    rates = {f"poisson-{load:.0%}": load * engine_requests_per_s for load in LOADS}
    return {"all-at-once": [0.0] * n} | {name: poisson(n, rate) for name, rate in rates.items()}, rates


def seeded_model(setup):
    """The runtime on one device (on 8 virtual devices an unsharded program runs 8 times) and the
    benchmark's model, the same random weights at every run."""
    init_runtime(cpu_devices=1)
    torch.manual_seed(0)
    return LlamaForCausalLM(setup.config).eval()


def memory_maps():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def check_map_count():
    """Exit with one error line if the kernel's limit on memory maps is below what the full run
    needs: past it, XLA:CPU fails to compile ('LLVM compilation error: Cannot allocate memory')."""
    if os.path.exists(MAX_MAP_COUNT):
        with open(MAX_MAP_COUNT) as f:
            limit = int(f.read())
        if limit < MAPS_NEEDED:
            print(f"error: vm.max_map_count is {limit}, below the {MAPS_NEEDED} this run needs (XLA:CPU maps about 400 "
                  f"memory regions per compiled program and nothing here frees them); raise it with "
                  f"`sudo sysctl -w vm.max_map_count={MAPS_NEEDED}`, or run --quick", file=sys.stderr)
            sys.exit(2)


def run_all(setup, folder):
    """Every system on every pattern it runs, setup.reps times; returns the result dict."""
    hf = seeded_model(setup)
    work, runs, misses = workload(setup), [], []
    with torch.no_grad():
        decode = decode_speed(hf, setup)  # first: HF's continuous batching starts only after a generate call
    engine_decode = engine_steps(hf, setup)
    prefix = prefix_ttft(hf, setup)
    engines = {system: build_engine(hf, setup, compile) for system, compile in reversed(ENGINES.items())}
    gen = build_static(hf, setup)
    with torch.no_grad():
        manager = build_hf_cb(hf, setup)
    arrivals = rates = timeline = None

    def run(system, engine, name, times, rep):
        preemptions = engine.scheduler.preemptions
        rows, missed = run_engine(engine, work, times)
        misses.extend(dict(system=system, pattern=name, rep=rep, **m) for m in missed)
        return summary(system, name, rows, work, rep) | in_flight(engine, preemptions)

    before = count_compiles()
    for rep in range(setup.reps):
        for system, engine in engines.items():  # the compiled engine first
            runs.append(run(system, engine, "all-at-once", [0.0] * len(work), rep))
            if system == "engine-compiled":
                timeline = list(engine.timeline)  # the last repetition's, for the figure
            if arrivals is None:  # the rates: fractions of the compiled engine's capacity, measured once
                arrivals, rates = patterns(len(work), runs[0]["requests_per_s"])
            for name in list(arrivals)[1:]:
                runs.append(run(system, engine, name, arrivals[name], rep))
        runs.append(summary("static", "all-at-once", run_static(gen, work, arrivals["all-at-once"]), work, rep))
        with torch.no_grad():
            runs += [summary("hf-cb", name, run_hf_cb(manager, work, a), work, rep) for name, a in arrivals.items()]
    manager.stop()
    grammar_runs = constrained(hf, setup, engines["engine-compiled"])
    compiles = {system: engine.compiles_since_warmup for system, engine in engines.items()}
    compiles["all"] = count_compiles() - before
    compiles["engine_steps"] = sum(r["compiles"] for r in engine_decode)
    compiles["prefix"] = sum(r["compiles"] for r in prefix)
    model_dir(hf, folder)
    server, url = start_server(folder, setup)
    try:
        complete(url, [1, 2, 3], 2)  # the first request through HTTP (not timed)
        runs.append(summary("http", "all-at-once", run_http(url, work), work, 0))
        compiles["server"] = server_compiles(url)
    finally:
        server.terminate()
        print(f"  server: {server.communicate(timeout=120)[0].strip()}")
    engine = engines["engine-compiled"]
    return dict(quick=setup is QUICK, config=setup.config.to_diff_dict(), setup=dataclasses.asdict(setup),
                slots=SLOTS, pages=engine.pool.num_pages, page_size=engine.pool.page_size,
                warmup=dict(seconds=engine.warmup_s, programs=len(engine.runner.shapes())),
                default_compile=default_compile(), loads=LOADS, rates_per_s=rates, compiles_after_warmup=compiles,
                compile_misses=misses, memory_maps=memory_maps(), runs=runs, timeline=timeline, decode=decode,
                engine_decode=engine_decode, prefix_caching=prefix, constrained=grammar_runs)


def ratios(result, num, den, key="tokens_per_s"):
    """[num / den of `key`, per repetition]; num and den are (system, pattern)."""
    get = {(r["system"], r["pattern"], r["rep"]): r[key] for r in result["runs"]}
    return [get[(*num, k)] / get[(*den, k)] for k in range(result["setup"]["reps"])]


def spread(xs, unit="x"):
    return f"{np.median(xs):.2f}{unit}" + (f" (range {min(xs):.2f}-{max(xs):.2f})" if len(xs) > 1 else "")


def targets(result):
    """(target, measured, met) for each target (module docstring); ratios are medians over the repetitions."""
    rows, runs = [], result["runs"]
    flight = [r for r in runs if (r["system"], r["pattern"]) == ("engine-compiled", "all-at-once")]
    peak = np.median([r["in_flight_peak"] for r in flight])
    rows.append((f"compiled engine requests in flight (all-at-once), same cache bytes as {SLOTS} x "
                 f"{result['setup']['max_seq_len']} positions ({result['pages']} pages of {result['page_size']}): "
                 f"peak >= 2x the fixed-slot engine's {SLOTS}",
                 f"peak {spread([r['in_flight_peak'] for r in flight], '')}, per step median "
                 f"{np.median([r['in_flight_median'] for r in flight]):.1f}, mean "
                 f"{np.median([r['in_flight_mean'] for r in flight]):.1f}", peak >= 2 * SLOTS))
    for pattern in ("all-at-once", "poisson-100%"):
        x = ratios(result, ("engine-compiled", pattern), ("hf-cb", pattern))
        rows.append((f"compiled engine >= 1.5x HF continuous batching tokens/s ({pattern})", spread(x), np.median(x) >= 1.5))
    x = ratios(result, ("engine-compiled", "poisson-50%"), ("hf-cb", "poisson-50%"), "tpot_p50_ms")
    rows.append(("compiled engine TPOT p50 <= 0.7x HF continuous batching's (poisson-50%)", spread(x),
                 np.median(x) <= 0.7))
    warm = result["warmup"]
    rows.append((f"compiled engine warm-up: at most {BEFORE_PROGRAMS} programs, as many as the engine it "
                 f"replaced (which compiled them in {BEFORE_WARMUP_S} s on this CPU)",
                 f"{warm['programs']} programs in {warm['seconds']:.0f} s", warm["programs"] <= BEFORE_PROGRAMS))
    live, step = result["setup"]["live"], {(r["system"], r["batch"]): r for r in result["engine_decode"]}
    for (system, batch), r in step.items():
        x = r["pool_ms"] / r["small_pool_ms"]
        rows.append((f"{system} step, batch {batch}, contexts <= {live}: a {r['pool_pages']}-page pool <= 1.2x a "
                     f"{r['small_pool_pages']}-page one", f"{x:.2f}x ({r['pool_ms']:.1f} vs {r['small_pool_ms']:.1f} ms)",
                     x <= 1.2))
    for r in result["prefix_caching"]:
        x = r["cached_ttft_ms"] / r["uncached_ttft_ms"]
        rows.append((f"{r['system']} TTFT with a cached {r['prefix']}-token prefix <= 0.2x uncached",
                     f"{x:.2f}x ({r['cached_ttft_ms']:.0f} vs {r['uncached_ttft_ms']:.0f} ms)", x <= 0.2))
    compiles = result["compiles_after_warmup"]
    counts = {k: compiles[k] for k in (*ENGINES, "engine_steps", "prefix", "server")}
    misses = result["compile_misses"]
    missed = f"; {len(misses)} steps compiled, the first (compile_misses): {misses[:3]}" if misses else ""
    rows.append(("0 compilations after warm-up", ", ".join(f"{k} {n}" for k, n in counts.items()) + missed,
                 not any(counts.values())))
    b1, hf1, gen1 = step["engine-compiled", 1]["pool_ms"], result["decode"][0]["hf_eager_ms"], \
        result["decode"][0]["compiled_ms"]
    rows.append(("compiled engine step at batch 1 <= 0.8x HF eager's", f"{b1:.1f} ms vs {hf1:.1f} ms", b1 <= 0.8 * hf1))
    rows.append(("compiled engine step at batch 1 <= Generator's compiled step", f"{b1:.1f} ms vs {gen1:.1f} ms",
                 b1 <= gen1))
    host = {system: step[system, SLOTS]["host_ms"] for system in ENGINES}
    rows.append((f"compiled engine host time per decode step at batch {SLOTS} <= 1 ms",
                 ", ".join(f"{system} {ms:.1f} ms" for system, ms in host.items()), host["engine-compiled"] <= 1))
    parts = step["engine-compiled", SLOTS]
    if parts.get("inputs_ms") is not None:  # the host's parts (older results have none)
        work = parts["inputs_ms"] + parts["call_ms"] + parts["read_ms"]
        rows.append((f"compiled engine host work per decode step at batch {SLOTS} (inputs, call, read) <= 1 ms",
                     f"{work:.2f} ms (inputs {parts['inputs_ms']:.2f}, call {parts['call_ms']:.2f}, read "
                     f"{parts['read_ms']:.2f}; the inputs alone {parts['inputs_alone_ms']:.2f})", work <= 1))
    x = ratios(result, ("engine-compiled", "all-at-once"), ("engine-lazy", "all-at-once"))
    default = "engine-compiled" if result["default_compile"] else "engine-lazy"  # Engine's compile=None here
    rows.append((f"compiled engine faster than the lazy one, or the lazy one is the default here (default: {default})",
                 spread(x), np.median(x) > 1 or default == "engine-lazy"))
    if "constrained" in result:  # the structured-output part (older results have none)
        by = {(r["system"], r["rep"]): r["tokens_per_s"] for r in result["constrained"]}
        x = [by["engine-compiled-constrained", k] / by["engine-compiled", k] for k in range(result["setup"]["reps"])]
        rows.append(("compiled engine tokens/s with every request constrained by a grammar >= 0.85x unconstrained "
                     "(all-at-once)", spread(x), np.median(x) >= 0.85))
    http = np.median([r["tokens_per_s"] for r in runs if r["system"] == "http"])
    overhead = 1 - http / np.median([r["tokens_per_s"] for r in flight])
    rows.append(("HTTP overhead <= 10% (all-at-once, against engine-compiled)", f"{overhead:.1%}", overhead <= 0.10))
    return [dict(target=t, measured=m, met=bool(ok)) for t, m, ok in rows]


def medians(runs):
    """One row per (system, pattern): the median of each measure over the repetitions."""
    groups = {}
    for r in runs:
        groups.setdefault((r["system"], r["pattern"]), []).append(r)
    return [{k: float(np.median([r[k] for r in rs])) if isinstance(v, float) else v for k, v in rs[0].items()}
            for rs in groups.values()]


def latencies(runs, key, unit):
    """{system: {"p50 pattern": value, "p99 pattern": value, ...}} of ttft or tpot, for plot_bars."""
    groups = {}
    for r in runs:
        for p in ("p50", "p99"):
            groups.setdefault(r["system"], {})[f"{p} {r['pattern']}"] = r[f"{key}_{p}_{unit}"]
    return groups


def runs_table(result):
    """The workload runs' medians over the repetitions, a row per system and pattern, as text."""
    columns = ["system", "pattern", "tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms", "seconds",
               "in_flight_peak", "in_flight_mean", "preemptions"]
    return plots.table([{k: round(r[k], 2) if isinstance(r.get(k), float) else r.get(k, "") for k in columns}
                        for r in medians(result["runs"])], columns)


def report(result):
    """Print the tables and targets and return the figures (a notebook may call this on the saved
    JSON, or `runs_table` and `figures` alone)."""
    print(f"medians of {result['setup']['reps']} repetitions")
    print(runs_table(result))
    for rows in (result["decode"], result["engine_decode"], result["prefix_caching"], *(
            [result["constrained"]] if "constrained" in result else [])):
        print(plots.table([{k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()} for r in rows]))
    for t in result["targets"]:
        print(f"{'met   ' if t['met'] else 'missed'}  {t['target']}: {t['measured']}")
    return figures(result)


def figures(result):
    """The saved result's figures, each labelled with its name (`Figure.get_label()`, `plots`)."""
    runs = medians(result["runs"])
    live = result["setup"]["live"]
    flight = {r["system"]: r for r in runs if r["pattern"] == "all-at-once" and "in_flight_peak" in r}
    timeline = [{int(k): v for k, v in step.items()} for step in result["timeline"]]  # JSON's keys are strings
    return [plots.plot_bars({p: {r["system"]: r["tokens_per_s"] for r in runs if r["pattern"] == p}
                             for p in dict.fromkeys(r["pattern"] for r in runs)},
                            "output tokens/s", "serving throughput per arrival pattern", name="serve_throughput"),
            plots.plot_bars(latencies(runs, "ttft", "s"), "seconds", "time to first token (p50, p99)",
                            name="serve_ttft", log=True),
            plots.plot_bars(latencies(runs, "tpot", "ms"), "ms", "time per output token (p50, p99)",
                            name="serve_tpot", log=True),
            plots.plot_lines({name: {r["batch"]: r[key] for r in result["decode"]}
                              for name, key in (("Generator lazy", "lazy_ms"), ("Generator compiled", "compiled_ms"),
                                                ("hf-eager", "hf_eager_ms"))},
                             "batch size", "ms per decode step", "decode step vs batch size (prefill excluded)",
                             name="serve_decode_step", log=True),
            plots.plot_bars({f"{r['system']}, batch {r['batch']}": {f"{r[f'{k}pages']}-page pool": r[f"{k}ms"]
                                                                     for k in ("pool_", "small_pool_")}
                             for r in result["engine_decode"]}, "ms per step",
                            f"engine decode step, contexts <= {live} positions", name="serve_engine_step"),
            plots.plot_bars({system: {stat: r[f"in_flight_{stat}"] for stat in ("peak", "median", "mean")}
                             for system, r in flight.items()} | {"fixed-slot engine": {"peak": SLOTS}},
                            "requests in flight per step", f"all at once, the cache of {SLOTS} x "
                            f"{result['setup']['max_seq_len']} positions", name="serve_in_flight"),
            plots.plot_pages(timeline, result["pages"] - 1, name="serve_pages",
                             title="engine-compiled, all at once: the pages each request holds"),
            plots.plot_bars({r["system"]: {kind: r[f"{kind}_ttft_ms"] for kind in ("cached", "uncached")}
                             for r in result["prefix_caching"]}, "ms",
                            f"time to first token, a {result['setup']['prefix']}-token prefix cached or not",
                            name="serve_prefix_ttft", log=True)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 short requests, a 2-layer model; a temp folder")
    parser.add_argument("--host-only", action="store_true",
                        help="only the host time per batch-8 decode step, updated in the saved results/serve.json")
    parser.add_argument("--constrained-only", action="store_true",
                        help="only the constrained part (grammars or none), updated in the saved results/serve.json")
    args = parser.parse_args()
    if args.quick and (args.host_only or args.constrained_only):
        parser.error("--host-only and --constrained-only update the full run's results/serve.json: run without --quick")
    setup, start = QUICK if args.quick else FULL, time.perf_counter()
    if not args.quick:
        check_map_count()
    out = tempfile.mkdtemp(prefix="serve-quick-") if args.quick else RESULTS
    os.environ["LLAMA_XLA_FIGURES"] = out  # the figures go beside the JSON
    if args.host_only or args.constrained_only:
        path = os.path.join(RESULTS, "serve.json")
        with open(path) as f:
            result = json.load(f)
        hf = seeded_model(setup)
        for row in result["engine_decode"] if args.host_only else []:
            if row["batch"] == SLOTS:
                row |= host_ms(warm_engine(hf, setup.max_seq_len, SLOTS, STEP_BUCKETS, ENGINES[row["system"]],
                                           row["pool_pages"]))
                print(f"engine step: {row}", flush=True)  # progress
        if args.constrained_only:
            result["constrained"] = constrained(hf, setup)
        result["targets"] = targets(result)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        report(result)
        return
    with tempfile.TemporaryDirectory() as folder:
        result = run_all(setup, folder)
    result["targets"] = targets(result)
    result["seconds"] = time.perf_counter() - start
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "serve.json"), "w") as f:
        json.dump(result, f, indent=2)
    report(result)
    print(f"{result['seconds']:.0f} s; results in {out}")


if __name__ == "__main__":
    main()
