"""Decode speed, side by side, in one run on one machine: KV-cache decoding against its baselines.

    python benchmarks/decode.py     # ~15 minutes; writes results/decode.json and results/decode_*.png

The benchmarks' ~56M-parameter Llama, `get_config("bench")` (hidden 512, 8 layers, 8 heads, 4 KV
heads, MLP 1376, vocab 32000), fp32, random weights, 32-token prompts, 256 new tokens, batch 1 / 8
/ 32, for:
  ours      Generator: bucketed prefill + one compiled decode step (XLA, one CPU device)
  hf-eager  Hugging Face generate, plain PyTorch on the same CPU
  hf-xla    Hugging Face generate on the XLA device out of the box (16 tokens: it recompiles
            every step, because every step has a new sequence length)
and the weight-streaming bound: a decode step must read every weight once, so it cannot be
faster than weight bytes / memory bandwidth (the bandwidth measured here, in this run).

Each hf-xla batch size runs in a child process (`--naive BATCH`): every step of it compiles new
graphs, and after a few hundred compilations one process failed ("LLVM compilation error:
Cannot allocate memory", then a crash) with 23 GB free; XLA's CPU backend keeps every compiled
program mapped, so the limit is most likely vm.max_map_count (65530 here).
"""
import json
import os
import subprocess
import sys
import time

from llama_xla_helpers import plots  # first: it picks the XLA device before torch_xla loads
import torch
import torch_xla
from transformers import LlamaForCausalLM

from llama_xla_helpers.configs import get_config
from llama_xla_helpers.generate import Generator
from llama_xla_helpers.metrics import count_compiles
from llama_xla_helpers.model import Llama
from llama_xla_helpers.runtime import init_runtime

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CONFIG = get_config("bench")  # the benchmarks' one decode model (configs.py)
PROMPT, NEW, NAIVE_NEW, BATCHES = 32, 256, 16, (1, 8, 32)
PROMPT_LENGTHS = (10, 100, 300, 600, 1000, 1500)


def memory_bandwidth():
    """Bytes per second of a large copy (read + write), best of 5."""
    src = torch.empty(256 * 2**20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best


def prompts(batch, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.vocab_size, (batch, length), generator=g)


def hf_generate(model, ids, new):
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                   do_sample=False, pad_token_id=0)
    torch_xla.sync()
    return time.perf_counter() - start


def row(name, batch, new, seconds, compiles=None):
    r = dict(name=name, batch=batch, new_tokens=new, latency_s=seconds, per_token_ms=1e3 * seconds / new,
             throughput=batch * new / seconds, compiles=compiles)
    print(f"{name:9s} batch {batch:2d}: {r['per_token_ms']:8.2f} ms/token", flush=True)  # progress
    return r


def naive(batch):
    """Hugging Face generate on the XLA device, out of the box: prints [seconds, compiles]."""
    init_runtime(cpu_devices=1)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(CONFIG).eval().to(torch_xla.device())
    before = count_compiles()
    with torch.no_grad():
        seconds = hf_generate(hf, prompts(batch, PROMPT).to(torch_xla.device()), NAIVE_NEW)
    print(json.dumps([seconds, count_compiles() - before]))


def main():
    # Out-of-the-box XLA first, a fresh process per batch (see the module docstring), while this
    # process has not opened the device: on a TPU only one process can hold the chips.
    naive_rows = []
    for batch in BATCHES:
        child = subprocess.run([sys.executable, __file__, "--naive", str(batch)], check=True,
                               stdout=subprocess.PIPE, text=True)
        naive_rows.append(row("hf-xla", batch, NAIVE_NEW, *json.loads(child.stdout.splitlines()[-1])))
    init_runtime(cpu_devices=1)  # one device: on 8 virtual devices an unsharded program runs 8 times
    torch.manual_seed(0)
    hf = LlamaForCausalLM(CONFIG).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    bandwidth = memory_bandwidth()
    bound_ms = 1e3 * weight_bytes / bandwidth
    rows = []
    gen = Generator(Llama.from_hf(hf, max_batch_size=max(BATCHES), max_seq_len=PROMPT + NEW),
                    buckets=(32,), eos_check_interval=10)
    for batch in BATCHES:
        ids = prompts(batch, PROMPT).tolist()
        _, cold = gen.generate(ids, NEW)                                 # first call: compiles
        _, stats = gen.generate(ids, NEW)
        rows.append(row("ours", batch, NEW, stats.latency_s, cold.compiles))
        with torch.no_grad():
            hf_generate(hf, prompts(batch, PROMPT), 4)                   # warm-up
            rows.append(row("hf-eager", batch, NEW, hf_generate(hf, prompts(batch, PROMPT), NEW)))
    rows += naive_rows

    long = Generator(Llama.from_hf(hf, max_batch_size=1, max_seq_len=2048), eos_check_interval=10)
    by_length = []
    for n in PROMPT_LENGTHS:
        ids = prompts(1, n).tolist()
        long.generate(ids, 32)
        _, stats = long.generate(ids, 32)
        by_length.append(dict(prompt=n, prefill_runs=stats.prefill_runs, prefill_s=stats.prefill_s,
                              latency_s=stats.latency_s, per_token_ms=1e3 * stats.per_token_latency_s))

    result = dict(config=CONFIG.to_diff_dict(), weight_bytes=weight_bytes, bandwidth_bytes_per_s=bandwidth,
                  bound_per_token_ms=bound_ms, rows=rows, by_prompt_length=by_length)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "decode.json"), "w") as f:
        json.dump(result, f, indent=2)
    report(result)


def bucket_boundaries(result):
    """Prompt lengths where prefill changes graph: the default buckets, then each 512-token section."""
    longest = max(r["prompt"] for r in result["by_prompt_length"])
    return [b for b in (128, 256, 384, *range(512, longest, 512)) if b < longest]


def report(result):
    """Print the table and return the figures (the notebook calls this on the saved JSON too)."""
    rows, bound = result["rows"], result["bound_per_token_ms"]
    print(plots.table([dict(r, per_token_ms=round(r["per_token_ms"], 2), throughput=round(r["throughput"]),
                            latency_s=round(r["latency_s"], 2)) for r in rows],
                      ["name", "batch", "new_tokens", "per_token_ms", "throughput", "latency_s", "compiles"]))
    get = {(r["name"], r["batch"]): r for r in rows}
    ours1, eager1, naive1 = get["ours", 1], get["hf-eager", 1], get["hf-xla", 1]
    print(f"weight-streaming bound: {result['weight_bytes'] / 1e6:.0f} MB / "
          f"{result['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s = {bound:.2f} ms per token")
    print(f"batch 1: ours {ours1['per_token_ms']:.2f} ms/token = {eager1['per_token_ms'] / ours1['per_token_ms']:.2f}x "
          f"the speed of HF eager, {ours1['per_token_ms'] / bound:.1f}x the bound; out-of-the-box XLA generate "
          f"{naive1['per_token_ms'] / ours1['per_token_ms']:.0f}x slower per token ({naive1['compiles']} compiles "
          f"for {naive1['new_tokens']} tokens)")
    return [plots.plot_lines({name: {r["batch"]: r["per_token_ms"] for r in rows if r["name"] == name}
                      for name in ("ours", "hf-eager", "hf-xla")} | {"bound": {b: bound for b in (1, 8, 32)}},
                     "batch size", "ms per token", "decode latency vs batch size", name="decode_latency_vs_batch",
                     log=True),
            plots.plot_lines({"ours": {r["prompt"]: r["latency_s"] for r in result["by_prompt_length"]}},
                     "prompt length (tokens)", "seconds for prompt + 32 tokens",
                     "latency vs prompt length (dotted: bucket and section boundaries)",
                     name="decode_latency_vs_prompt", marks=bucket_boundaries(result)),
            plots.plot_bars({f"batch {b}": {"hf-xla (16 tokens)": get["hf-xla", b]["compiles"],
                                    "ours (256 tokens)": get["ours", b]["compiles"]} for b in (1, 8, 32)},
                    "XLA compilations", "compilations per generate call", name="decode_compiles")]


if __name__ == "__main__":
    os.environ.setdefault("LLAMA_XLA_FIGURES", RESULTS)
    naive(int(sys.argv[2])) if sys.argv[1:2] == ["--naive"] else main()
