"""Gradient checkpointing and bf16: time per training step and scratch memory per device.

    python benchmarks/remat.py

The tiny model at sequence length 512 (where activations outweigh the weights), on mesh_shape's
pick for 8 CPU devices, with Table 2's eager attention (as measured; benchmarks/attention.py
measures the blockwise attention train() runs on a CPU by default), in one process: fp32 and
bf16, each without and with gradient checkpointing (fp32 without is the baseline). Time per step is train()'s steady-state
throughput over 12 steps (the two that compile are left out). Scratch memory is the compiled
step's "preallocated-temp" in XLA's buffer assignment (`train.profile_step`), with XLA:CPU's
memory-minimizing scheduler: its default schedules for concurrency and keeps every layer's
buffers live with or without checkpointing (measured: 132.8 and 134.3 MiB at 8 layers), while
a TPU's compiler schedules to fit in HBM. Writes results/remat.json and results/remat.png.
"""
import json
import os

from llama_xla_helpers.runtime import init_runtime

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
STEPS, BATCH, SEQ = 12, 8, 512
MEMORY_SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def main():
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {MEMORY_SCHEDULER}".strip()
    init_runtime(cpu_devices=8, hlo_dump_dir=True)
    import dataclasses

    from llama_xla_helpers import plots
    from llama_xla_helpers.train import TrainConfig, profile_step, train

    base = TrainConfig(model="tiny", steps=STEPS, batch_size=BATCH, seq_len=SEQ, eval_every=0, attention="eager")
    rows = []
    for dtype in ("fp32", "bf16"):
        for remat in (False, True):
            cfg = dataclasses.replace(base, dtype=dtype, gradient_checkpointing=remat)
            profile = profile_step(cfg)  # compiles the step graphs that train() then takes from the cache
            result = train(cfg)
            step_ms = 1e3 * BATCH * SEQ / (result.tokens_per_sec_per_chip * 8)
            rows.append(dict(dtype=dtype, gradient_checkpointing=remat, step_ms=step_ms,
                             temp_mib=profile["temp_bytes"] / 2**20, matmuls=profile["matmuls"]))
            print(f"{dtype} checkpointing={remat!s:5}: {step_ms:6.1f} ms/step; the step's scratch memory "
                  f"{rows[-1]['temp_mib']:.1f} MiB per device, {profile['matmuls']} matmuls",
                  flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "remat.json"), "w") as f:
        json.dump(dict(steps=STEPS, batch_size=BATCH, seq_len=SEQ, devices=8, xla_flags=MEMORY_SCHEDULER, rows=rows),
                  f, indent=1)
    os.environ.setdefault("LLAMA_XLA_FIGURES", RESULTS)
    plots.plot_bars({dtype: {("with" if r["gradient_checkpointing"] else "without") + " checkpointing": r["step_ms"]
                             for r in rows if r["dtype"] == dtype} for dtype in ("fp32", "bf16")},
                    "ms per step", f"tiny model, batch {BATCH} x {SEQ}, 8 CPU devices", name="remat")


if __name__ == "__main__":
    main()
