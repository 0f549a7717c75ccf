"""Quantized inference, side by side: quality, bytes, decode speed (issue: quantized inference).

    python benchmarks/quantize.py     # ~4 minutes; writes results/quantize.json and results/quantize_*.png

The model is the one notebook 03 trains (outputs/checkpoints/03_tiny_hf: byte-level, hidden 128,
4 layers, fp32). Schemes: fp32, bf16 (the whole model cast), int8 (per channel), int4 round to
nearest with groups of 32 and 128, and GPTQ int4 with groups of 128 calibrated on training chunks.

  quality   on the held-out split of the corpus (chunks of 128 bytes), teacher-forced, on the
            CPU (plain PyTorch; tests/test_quantize.py checks the XLA path gives the same
            logits to 1e-4): perplexity = exp(mean nats per byte), top-1 agreement with the
            fp32 model's greedy choice, and KL(fp32 || scheme) per position, in nats.
  bytes     every stored weight (codes, scales, zeros, and what stays unquantized), counted
            as served: the unquantized tensors, scales and zeros in bf16. For the tiny model and
            for Llama 2 7B's shapes built on the meta device, where the linears dominate.
  speed     per-token decode latency with `Generator` (32-token prompt, 128 new tokens,
            batch 1 and 8), one XLA CPU device, median of 3 calls after a warm-up call; and
            the same with 32 new tokens for the benchmarks' 56M-parameter random model
            (`get_config("bench")`, decode.py's and serve.py's) in fp32, int8 and int4 with groups
            of 32 (its MLP of 1376 is not a multiple of 128), the output layer quantized too, whose
            weights no longer fit in the CPU's caches; and the memory bandwidth, measured in the
            same run as decode.py measures it, for the weight-streaming bound.
"""
import copy
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from llama_xla_helpers import plots
from llama_xla_helpers.configs import get_config
from llama_xla_helpers.data import load_corpus, train_val_split
from llama_xla_helpers.generate import Generator
from llama_xla_helpers.model import Llama, ModelArgs
from llama_xla_helpers.quantize import Int4Linear, Int8Linear, quantize, weight_bytes
from llama_xla_helpers.runtime import init_runtime

from decode import memory_bandwidth  # benchmarks/decode.py, beside this file

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CHECKPOINT = ROOT / "outputs" / "checkpoints" / "03_tiny_hf"
SEQ_LEN, PROMPT, NEW, BATCHES, REPEATS = 128, 32, 128, (1, 8), 3
CALIBRATION = 128  # training chunks of 128 bytes for GPTQ
CHECK_CHUNKS = 16  # the first held-out chunks, for the notebook's check that the JSON fits its checkpoint
# name -> (scheme, group_size); None: no quantization (fp32 as trained, bf16 cast)
SCHEMES = {"fp32": None, "bf16": None, "int8": ("int8", None), "int4-g32": ("int4", 32),
           "int4-g128": ("int4", 128), "gptq-int4-g128": ("gptq-int4", 128)}
# A model large enough that decoding streams its weights from memory: the benchmarks' decode model.
LARGE = "bench"
LARGE_SCHEMES = ("fp32", "int8", "int4-g32")  # groups of 32: its MLP, 1376, is 43 x 32
LARGE_NEW = 32


def build(base, name, calibration=None, quantize_lm_head=False):
    """A copy of the fp32 model `base` in scheme `name` (on the CPU)."""
    model = copy.deepcopy(base)
    if name == "bf16":
        return model.to(torch.bfloat16)
    if SCHEMES[name] is None:
        return model
    scheme, group_size = SCHEMES[name]
    return quantize(model, scheme, group_size=group_size or 128, calibration=calibration,
                    quantize_lm_head=quantize_lm_head)


def served_bytes(model):
    """weight_bytes with floating tensors (unquantized weights, scales, zeros) in bf16."""
    return weight_bytes(copy.deepcopy(model).to(torch.bfloat16))


@torch.no_grad()
def log_probs(model, chunks, batch_size=8):
    """Next-byte log-probabilities (n, SEQ_LEN - 1, vocab) fp32, teacher-forced, on the CPU."""
    out = [model(b, torch.arange(b.shape[1]))[:, :-1].float().log_softmax(-1) for b in chunks.split(batch_size)]
    return torch.cat(out)


def quality(logp, targets, ref=None):
    """Mean nats per byte, perplexity, and (given the fp32 log-probs) top-1 agreement and KL."""
    nats = -logp.gather(-1, targets[..., None]).mean().item()
    row = dict(nats_per_byte=nats, perplexity=math.exp(nats))
    if ref is not None:
        row["top1_agreement"] = (logp.argmax(-1) == ref.argmax(-1)).float().mean().item()
        row["kl_from_fp32"] = F.kl_div(logp, ref, log_target=True, reduction="none").sum(-1).mean().item()
    return row


def meta_bytes(name, schemes):
    """weight_bytes of a bf16 `name` model built on the meta device, for each (label, scheme, group)."""
    rows = []
    for label, scheme, group_size in schemes:
        with torch.device("meta"):
            model = Llama(ModelArgs.from_hf_config(get_config(name), max_batch_size=1, max_seq_len=16))
        model = model.to(torch.bfloat16)
        if scheme:
            model = quantize(model, scheme, group_size=group_size or 128)
        rows.append(dict(model=name, scheme=label, weight_bytes=weight_bytes(model)))
    for r in rows:
        r["ratio_to_bf16"] = r["weight_bytes"] / rows[0]["weight_bytes"]
    return rows


def decode_latency(model, prompts, batch_sizes, new):
    """Per-token latency (ms) at each batch size: warm-up call (compiles), then median of REPEATS."""
    gen = Generator(model, buckets=(PROMPT,), eos_check_interval=10)
    rows = []
    for batch in batch_sizes:
        ids = prompts[:batch]
        _, cold = gen.generate(ids, new)
        runs = [gen.generate(ids, new)[1] for _ in range(REPEATS)]
        ms = statistics.median(1e3 * s.per_token_latency_s for s in runs)
        step_ms = statistics.median(1e3 * s.decode_step_s for s in runs)
        rows.append(dict(batch=batch, new_tokens=new, per_token_ms=ms, decode_step_ms=step_ms,
                         compiles=cold.compiles, warm_compiles=sum(s.compiles for s in runs)))
    return rows


def main():
    init_runtime(cpu_devices=1)  # one device: on 8 virtual devices an unsharded program runs 8 times
    if not (CHECKPOINT / "config.json").is_file():
        sys.exit(f"{CHECKPOINT} is missing: run notebooks/03 (or python -m llama_xla_helpers.train) first")
    start = time.perf_counter()
    torch.manual_seed(0)
    train, val = train_val_split(load_corpus(), SEQ_LEN)
    calibration = train[torch.randperm(len(train), generator=torch.Generator().manual_seed(0))[:CALIBRATION]]
    base = Llama.from_pretrained(CHECKPOINT, max_batch_size=max(BATCHES), max_seq_len=PROMPT + NEW)
    ref = log_probs(base, val)
    targets = val[:, 1:]
    prompts = val[:max(BATCHES), :PROMPT].tolist()  # held-out text

    schemes = []
    for name in SCHEMES:
        model = build(base, name, calibration if name.startswith("gptq") else None)
        row = dict(name=name, weight_bytes=served_bytes(model))
        logp = log_probs(model, val)
        row.update(quality(logp, targets, None if name == "fp32" else ref))
        # a cheap fingerprint the notebook recomputes, to tell that the JSON is about its checkpoint
        row["check_nats_per_byte"] = quality(logp[:CHECK_CHUNKS], targets[:CHECK_CHUNKS])["nats_per_byte"]
        row["decode"] = decode_latency(model, prompts, BATCHES, NEW)  # moves the model to the XLA device
        schemes.append(row)
        print(name, row, f"{time.perf_counter() - start:.0f} s", flush=True)

    torch.manual_seed(0)
    large_base = Llama.from_hf(LlamaForCausalLM(get_config(LARGE)).eval(),
                               max_batch_size=max(BATCHES), max_seq_len=PROMPT + LARGE_NEW)
    large_prompts = torch.randint(0, 256, (max(BATCHES), PROMPT), generator=torch.Generator().manual_seed(0))
    bandwidth = memory_bandwidth()
    large = []
    for name in LARGE_SCHEMES:
        model = build(large_base, name, quantize_lm_head=True)  # the output layer is 16M of the weights
        large.append(dict(name=name, weight_bytes=weight_bytes(model),
                          decode=decode_latency(model, large_prompts.tolist(), BATCHES, LARGE_NEW)))
        print("large", name, large[-1], f"{time.perf_counter() - start:.0f} s", flush=True)

    sizes = meta_bytes("llama2-7b", [("bf16", None, None), ("int8", "int8", None),
                                     ("int4-g32", "int4", 32), ("int4-g128", "int4", 128)])
    result = dict(checkpoint=str(CHECKPOINT.relative_to(ROOT)), seq_len=SEQ_LEN, val_chunks=len(val),
                  check_chunks=CHECK_CHUNKS,
                  calibration_chunks=CALIBRATION, prompt=PROMPT, new_tokens=NEW, repeats=REPEATS,
                  xla_path={"int8": Int8Linear.xla_path, "int4": Int4Linear.xla_path},
                  schemes=schemes,
                  large=dict(config=get_config(LARGE).to_diff_dict(), new_tokens=LARGE_NEW, schemes=large),
                  bandwidth_bytes_per_s=bandwidth, llama2_7b_bytes=sizes)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "quantize.json").write_text(json.dumps(result, indent=2) + "\n")
    report(result)


def report(result):
    """Print the tables and return the figures (the notebook calls this on the saved JSON too)."""
    rows = result["schemes"]
    s = {r["name"]: r for r in rows}
    bf16, fp32 = s["bf16"]["weight_bytes"], s["fp32"]["perplexity"]
    print(f"quality on {result['val_chunks']} held-out chunks of {result['seq_len']} bytes; "
          f"bytes as served (bf16 unquantized tensors and scales)")
    print(plots.table([dict(scheme=r["name"], weight_kB=round(r["weight_bytes"] / 1e3, 1),
                            x_bf16=round(r["weight_bytes"] / bf16, 3), perplexity=round(r["perplexity"], 4),
                            vs_fp32=f"{100 * (r['perplexity'] / fp32 - 1):+.2f}%",
                            top1_agree=round(r.get("top1_agreement", 1.0), 4),
                            kl_fp32=f"{r.get('kl_from_fp32', 0.0):.2e}") for r in rows]))
    print("\nweight bytes, Llama 2 7B shapes (meta device, bf16):")
    print(plots.table([dict(scheme=r["scheme"], GB=round(r["weight_bytes"] / 1e9, 3),
                            x_bf16=round(r["ratio_to_bf16"], 3)) for r in result["llama2_7b_bytes"]]))
    print(f"\nper-token decode latency (ms), {result['prompt']}-token prompt + {result['new_tokens']} new tokens, "
          f"one XLA CPU device, median of {result['repeats']}:")
    large = result["large"]
    print(plots.table([dict(model="tiny (trained)", scheme=r["name"], weight_MB=round(r["weight_bytes"] / 1e6, 2),
                            **{f"batch {d['batch']}": round(d["per_token_ms"], 2) for d in r["decode"]})
                       for r in rows] +
                      [dict(model=f"56M random ({large['new_tokens']} new)", scheme=r["name"],
                            weight_MB=round(r["weight_bytes"] / 1e6, 1),
                            **{f"batch {d['batch']}": round(d["per_token_ms"], 2) for d in r["decode"]})
                       for r in large["schemes"]]))
    names = [r["name"] for r in rows]
    return [
        plots.plot_bars({n: {"KL(fp32 || scheme)": s[n]["kl_from_fp32"]} for n in names[1:]},
                        "nats per byte", "distance from the fp32 model (held-out text)",
                        name="quantize_kl", log=True),
        plots.plot_bars({"tiny (trained)": {n: s[n]["weight_bytes"] / bf16 for n in names if n != "fp32"},
                         "Llama 2 7B shapes": {r["scheme"]: r["ratio_to_bf16"] for r in result["llama2_7b_bytes"]}},
                        "weight bytes / bf16", "weight bytes as served", name="quantize_bytes"),
        plots.plot_bars({f"{label}, batch {b}": {r["name"]: next(d["per_token_ms"] for d in r["decode"]
                                                                   if d["batch"] == b) for r in group}
                         for label, group in (("tiny", rows), ("56M", large["schemes"])) for b in (1, 8)},
                        "ms per token", "decode latency per scheme (one CPU device)",
                        name="quantize_latency", log=True),
    ]


if __name__ == "__main__":
    os.environ.setdefault("LLAMA_XLA_FIGURES", str(RESULTS))
    main()
