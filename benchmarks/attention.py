"""Eager against blockwise attention: a training step's scratch memory and time against sequence length.

    python benchmarks/attention.py [--quick]

The tiny model (max_position_embeddings 2,048: training does not check it and RoPE computes any
position, so it runs past it unchanged), batch 8 on mesh (8, 1) of 8 CPU devices (one row per
device), fp32, at 512 ... 4,096 tokens, with `TrainConfig(attention="eager")` (Table 2's (bsz,
heads, s, s) scores) and "blockwise" (`attention.BLOCK`-token blocks), in one process.

- Scratch memory: the compiled steady step's "preallocated-temp" in XLA's buffer assignment
  (`train.profile_step`), with XLA:CPU's memory-minimizing scheduler (benchmarks/remat.py: its
  default keeps buffers live for concurrency, while a TPU's compiler schedules to fit in HBM).
  A step predicted too big to run here (below) is compiled and not run (`compiled_temp`).
- Time: the median of REPEATS steps of a second copy of the model, after the one that creates
  the optimizer state (both graphs come from the cache `profile_step` filled). With it the step's
  matmuls, its HLO instructions and the seconds spent compiling: what explains a difference. At
  2,048 tokens blockwise also runs with the blocks of OTHER_BLOCKS.
- Longest sequence: each way doubles the length (past 4,096 too) while the scratch predicted from
  its measured points (`predict`) keeps all 8 devices' steps (8 x (scratch + weights + optimizer
  state)) under RAM_SHARE of MemAvailable (the machine is shared), and, past 4,096, four times
  the last compile + step under MAX_SECONDS (attention's work grows with the square of the
  length, blockwise's unrolled loop with its (query block, key block) pairs). The first length
  predicted over RAM is compiled, not run, at the end: its scratch checks the prediction.
- The SPMD partitioner's warnings for the blockwise step on the 2D mesh (4, 2).

Writes results/attention.json and results/attention_memory.png, attention_step_time.png.
--quick: 256 and 512 tokens, no search, and a check of `compiled_temp` against `profile_step`
at 1,024; writes to QUICK_RESULTS.
"""
import argparse
import gc
import json
import math
import os
import statistics
import time

import numpy as np

from llama_xla_helpers.runtime import init_runtime

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
LENGTHS, QUICK_LENGTHS = (512, 1024, 2048, 4096), (256, 512)
QUICK_RESULTS = "/tmp/attention_quick"
BATCH, DEVICES, REPEATS = 8, 8, 3
OTHER_BLOCKS = (256, 1024)  # blockwise also runs with these blocks at the second-longest length
RAM_SHARE, MAX_SECONDS = 0.35, 480
MEMORY_SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def mem_available():
    """Bytes the kernel says can be allocated now without swapping (MemAvailable)."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def pairs(seq_len, block):
    """(query block, key block) pairs a causal blockwise pass computes per layer: n(n + 1) / 2 of n blocks."""
    n = math.ceil(seq_len / block)
    return n * (n + 1) // 2


def hlo_instructions(modules):
    """Instructions of the largest compiled module (the training step's)."""
    return max(sum(" = " in line for line in m.splitlines()) for m in modules)


def model_and_optimizer(cfg):
    """(cfg as setup fills it, mesh, the sharded model in training mode, its optimizer), as profile_step builds them."""
    from llama_xla_helpers.train import DTYPES, build_model, make_optimizer, prepare_layers, setup

    cfg, mesh, config = setup(cfg)
    model = build_model(config, mesh, cfg.strategy, cfg.seed, dtype=DTYPES[cfg.dtype], attention=cfg.attention)
    prepare_layers(model, cfg)
    model.train()
    return cfg, mesh, model, make_optimizer(cfg, model.parameters())


def step_ms(cfg):
    """Median ms of REPEATS training steps of a fresh model after the step that creates the optimizer state."""
    import torch_xla

    from llama_xla_helpers.train import first_batch, optimizer_step

    cfg, mesh, model, optimizer = model_and_optimizer(cfg)
    ids = first_batch(cfg, mesh)
    times = []
    for _ in range(1 + REPEATS):
        start = time.perf_counter()
        loss, _ = optimizer_step(model, optimizer, ids, clip_norm=None)
        torch_xla.sync()
        loss.item()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times[1:])


def compiled_temp(cfg):
    """`profile_step(cfg)`'s figures for a step compiled but never run: the optimizer state comes
    from an optimizer step on zero gradients (no forward), then the training step is traced and
    compiled (`_xla_warm_up_cache`, as torch_xla's dynamo bridge does) and its graph dropped."""
    import torch
    import torch_xla

    from llama_xla_helpers.hlo import BUFFER_ASSIGNMENT, compiled_hlo, op_count, temp_bytes
    from llama_xla_helpers.train import first_batch, optimizer_step

    cfg, mesh, model, optimizer = model_and_optimizer(cfg)
    for p in model.parameters():
        p.grad = p.detach() * 0  # sharded as p
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch_xla.sync()
    loss, _ = optimizer_step(model, optimizer, first_batch(cfg, mesh), clip_norm=None)
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    with compiled_hlo() as modules, compiled_hlo(BUFFER_ASSIGNMENT) as buffers:
        torch_xla._XLAC._xla_warm_up_cache([loss, *model.parameters(), *state], [])
    torch_xla._XLAC._clear_pending_irs(str(torch_xla.device()))  # nothing of this step may run later
    hlo = "".join(modules)
    return dict(temp_bytes=sum(map(temp_bytes, buffers)), matmuls=op_count(hlo, "dot"),
                hlo_instructions=hlo_instructions(modules))


def measure(cfg, run=True, timed=True):
    """One row: the step's scratch MiB per device, matmuls, HLO instructions, compile seconds and,
    if timed, ms per step; run=False compiles it without running it (`compiled_temp`)."""
    from llama_xla_helpers.hlo import compiled_hlo
    from llama_xla_helpers.metrics import compile_seconds
    from llama_xla_helpers.train import profile_step

    compiled, start = compile_seconds(), time.perf_counter()
    if run:
        with compiled_hlo() as modules:
            profile = dict(profile_step(cfg), hlo_instructions=None)
        profile["hlo_instructions"] = hlo_instructions(modules)
    else:
        profile = compiled_temp(cfg)
    gc.collect()
    row = dict(seq_len=cfg.seq_len, attention=cfg.attention, ran=run, temp_mib=profile["temp_bytes"] / 2**20,
               fixed_mib=(profile.get("param_bytes", 0) + profile.get("optimizer_bytes", 0)) / 2**20,
               matmuls=profile["matmuls"], hlo_instructions=profile["hlo_instructions"],
               compile_s=compile_seconds() - compiled, profile_s=time.perf_counter() - start,
               step_ms=step_ms(cfg) if run and timed else None)
    print(row, flush=True)
    return row


def predict(rows, attention, seq_len):
    """MiB per device predicted at seq_len from `attention`'s measured scratch: the larger of a
    quadratic fit and the power law through the last two points (one point: quadratic from it).
    Not linear for blockwise: on XLA:CPU its scratch grows faster (2.4x from 2,048 to 4,096 tokens)."""
    points = dict(sorted((r["seq_len"], r["temp_mib"]) for r in rows
                         if r["attention"] == attention and r["block"] is None))
    xs, ys = list(points), list(points.values())
    if len(xs) == 1:
        return ys[0] * (seq_len / xs[0]) ** 2
    power = ys[-1] * (seq_len / xs[-1]) ** (math.log(ys[-1] / ys[-2]) / math.log(xs[-1] / xs[-2]))
    fit = float(np.polyval(np.polyfit(xs, ys, 2), seq_len)) if len(xs) > 2 else 0.0
    return max(power, fit)


def limit(rows, attention, budget_mib):
    """The longest length (a multiple of 512) whose predicted 8-device total fits in budget_mib."""
    fixed = max(r["fixed_mib"] for r in rows if r["attention"] == attention)
    seq_len = 512
    while DEVICES * (predict(rows, attention, seq_len + 512) + fixed) <= budget_mib and seq_len < 2**20:
        seq_len += 512
    return seq_len


def sweep(base, attention, lengths, search, rows):
    """Rows of one way at `lengths`, then (search) at doubling lengths until RAM or time says stop
    (see the module docstring); returns why it stopped and the length predicted over RAM, if any,
    to compile without running once nothing is left to run."""
    budget_mib = RAM_SHARE * mem_available() / 2**20
    seq_len = lengths[0]
    while True:
        done = [r for r in rows if r["attention"] == attention and r["block"] is None]
        last = done[-1] if done else None
        in_table = seq_len <= lengths[-1]
        if last is not None:
            total = DEVICES * (predict(rows, attention, seq_len) + last["fixed_mib"])
            seconds = 4 * (last["compile_s"] + (last["step_ms"] or 1e3 * last["profile_s"] / 2) / 1e3)
            if total > budget_mib:
                return (f"{seq_len} tokens: predicted {total:.0f} MiB for 8 devices > {RAM_SHARE} x MemAvailable "
                        f"= {budget_mib:.0f} MiB; compiled, not run"), seq_len
            if not in_table and seconds > MAX_SECONDS:
                return f"{seq_len} tokens: predicted compile + step {seconds:.0f} s > {MAX_SECONDS} s", None
        if not in_table and not search:
            return "not searched", None
        rows.append(dict(measure(base(seq_len, attention), timed=in_table), block=None))
        seq_len *= 2


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_LENGTHS} tokens, no search, to {QUICK_RESULTS}")
    quick = parser.parse_args().quick
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {MEMORY_SCHEDULER}".strip()
    init_runtime(cpu_devices=DEVICES, hlo_dump_dir=True, partitioner_warnings=True)
    from llama_xla_helpers import attention, plots
    from llama_xla_helpers.hlo import partitioner_warnings
    from llama_xla_helpers.train import TrainConfig

    base = lambda seq_len, way, mesh=(DEVICES, 1): TrainConfig(
        model="tiny", batch_size=BATCH, seq_len=seq_len, mesh=mesh, dtype="fp32", attention=way)
    lengths, results, blocks = (QUICK_LENGTHS, QUICK_RESULTS, (128,)) if quick else (LENGTHS, RESULTS, OTHER_BLOCKS)
    short, long = lengths[-2:]
    rows, stops, too_big = [], {}, {}
    ram = mem_available()
    for way in ("eager", "blockwise"):
        stops[way], too_big[way] = sweep(base, way, lengths, not quick, rows)
    default = attention.BLOCK  # other blocks compute a part of eager's scores, whose step ran at `short`:
    ran = any(r["ran"] for r in rows if (r["attention"], r["seq_len"]) == ("eager", short))
    for block in blocks if ran else ():
        attention.BLOCK = block  # what attention.use reads when build_model gives no block
        rows.append(dict(measure(base(short, "blockwise")), block=block))
    attention.BLOCK = default
    with partitioner_warnings() as warned:
        measure(base(lengths[0], "blockwise", (4, 2)), timed=False)
    print(f"partitioner warnings, blockwise on mesh (4, 2): {len(warned)}", flush=True)
    if quick:  # check compiled_temp against profile_step (running a step after it: small here)
        too_big["blockwise"] = 2 * long
    # last: the steps too big to run, compiled only (their graphs are dropped; nothing runs after them)
    for way, seq_len in too_big.items():
        if seq_len:
            rows.append(dict(measure(base(seq_len, way), run=False), block=None))
    if quick:
        rows.append(dict(measure(base(2 * long, "blockwise"), timed=False), block=None))
    for r in rows:
        r["pairs_per_layer"] = (pairs(r["seq_len"], r["block"] or attention.BLOCK) if r["attention"] == "blockwise"
                                else None)
    print(plots.table(rows, ["seq_len", "attention", "block", "ran", "temp_mib", "step_ms", "compile_s", "matmuls",
                             "hlo_instructions", "pairs_per_layer"]))
    print(stops, flush=True)
    at = {(r["attention"], r["seq_len"]): r for r in rows if r["block"] is None}
    longest = {way: dict(longest_run=max(r["seq_len"] for r in rows if r["attention"] == way and r["ran"]),
                         stopped_at=stops[way],
                         predicted_limit_35pct=limit(rows, way, RAM_SHARE * ram / 2**20),
                         predicted_limit_all_ram=limit(rows, way, ram / 2**20))
               for way in ("eager", "blockwise")}
    ratio = lambda key, a, b: None if None in (a[key], b[key]) else b[key] / a[key]
    growth = lambda way: ratio("temp_mib", at[(way, short)], at[(way, long)])
    targets = {
        f"temp_{long}_vs_eager": dict(value=ratio("temp_mib", at[("eager", long)], at[("blockwise", long)]),
                                      limit=0.25),
        f"temp_growth_{short}_to_{long}": dict(value=growth("blockwise"), limit=2.5, eager=growth("eager")),
        f"step_time_{short}_vs_eager": dict(value=ratio("step_ms", at[("eager", short)], at[("blockwise", short)]),
                                            limit=1.3)}
    for t in targets.values():
        t["met"] = t["value"] is not None and t["value"] <= t["limit"]
    print(targets, longest, flush=True)
    os.makedirs(results, exist_ok=True)
    with open(os.path.join(results, "attention.json"), "w") as f:
        json.dump(dict(batch_size=BATCH, devices=DEVICES, mesh=[DEVICES, 1], dtype="fp32", xla_flags=MEMORY_SCHEDULER,
                       block=attention.BLOCK, mem_available_mib=ram / 2**20, ram_share=RAM_SHARE,
                       partitioner_warnings_2d=len(warned), rows=rows, targets=targets, longest=longest), f, indent=1)
    os.environ.setdefault("LLAMA_XLA_FIGURES", results)
    series = lambda key: {way: {r["seq_len"]: r[key] for r in rows if r["attention"] == way and r["block"] is None
                                and r[key] is not None} for way in ("eager", "blockwise")}
    title = f"tiny model, batch {BATCH}, {DEVICES} CPU devices, fp32"
    plots.plot_lines(series("temp_mib"), "sequence length (tokens)", "scratch MiB per device", title,
                     name="attention_memory", log=True)
    plots.plot_lines(series("step_ms"), "sequence length (tokens)", "ms per training step", title,
                     name="attention_step_time", log=True)


if __name__ == "__main__":
    main()
