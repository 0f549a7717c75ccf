"""Peak host memory while building a sharded Llama of >= 1 GB of weights (the post's host-OOM caveat).

    python benchmarks/meta_init.py        # prints a table, writes benchmarks/results/meta_init.json + .png

'meta' builds on the meta device and materializes one parameter at a time (train.build_model);
'host' builds the whole model on the CPU first, then shards it. Loading saved weights (a Hugging
Face folder, exported first into a temporary folder): 'stream' is train.build_model(init_from=...),
which reads each tensor's blocks of this host's devices from the safetensors file into the
shards; 'load_hf' loads the whole model on the host (checkpoint.load_hf), then shards it.
Each runs in its own process, so each peak (ru_maxrss) is its own. On this CPU the sharded
weights themselves live in host memory (the virtual devices' buffers), so 1.0x the weight bytes
is the floor for all. Each row also divides the peak by the bytes of this host's local shards:
the ratio a pod user cares about, as a host of a pod holds only its devices' share of the weights.

glibc's malloc keeps freed blocks for reuse (its mmap threshold grows with each large free),
so the per-parameter temporaries of the 'meta' build stay in RSS; MALLOC_MMAP_THRESHOLD_=65536
fixes the threshold and returns them to the OS. Both are measured.
"""
import json
import os
import resource
import subprocess
import sys
import tempfile

import psutil

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# Llama-shaped, ~580M parameters: 2.3 GB in fp32 (the embedding is 5.6% of it, as 2% in Llama 2 7B).
DIMS = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=40, num_attention_heads=16,
            num_key_value_heads=16, vocab_size=32000)


def export(folder):
    """The benchmark's model with random weights, as a Hugging Face folder (config.json + model.safetensors)."""
    from transformers import LlamaForCausalLM
    from llama_xla_helpers.configs import get_config
    LlamaForCausalLM(get_config("tiny", **DIMS)).save_pretrained(folder)


def measure(how, folder):
    from llama_xla_helpers.runtime import init_runtime
    init_runtime()
    import torch_xla
    import torch_xla.runtime as xr
    from transformers import LlamaForCausalLM
    from llama_xla_helpers import checkpoint
    from llama_xla_helpers.configs import get_config
    from llama_xla_helpers.mesh import make_mesh
    from llama_xla_helpers.sharding import shard_params, sharding_table
    from llama_xla_helpers.train import build_model

    config, mesh = get_config("tiny", **DIMS), make_mesh((4, 2))
    before = psutil.Process().memory_info().rss
    if how == "meta":
        model = build_model(config, mesh, "2d")
    elif how == "host":
        model = LlamaForCausalLM(config)
        shard_params(model, mesh, "2d")
    elif how == "stream":
        model = build_model(config, mesh, "2d", init_from=folder)
    else:  # load_hf
        model = checkpoint.load_hf(folder)
        shard_params(model, mesh, "2d")
    torch_xla.sync()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    local = sum(r["bytes_per_device"] for r in sharding_table(model)) * xr.addressable_runtime_device_count()
    return dict(how=how, weight_bytes=weights, local_shard_bytes=local, peak_increase_bytes=peak - before,
                ratio=round((peak - before) / weights, 3), local_ratio=round((peak - before) / local, 3))


def main():
    if len(sys.argv) > 1:  # child process: export, or one measurement printed as JSON
        if sys.argv[1] == "export":
            export(sys.argv[2])
        else:
            print(json.dumps(measure(*sys.argv[1:])))
        return
    fixed = {"MALLOC_MMAP_THRESHOLD_": "65536"}
    runs = [("meta", fixed), ("meta", {}), ("host", fixed), ("stream", fixed), ("load_hf", fixed)]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([sys.executable, __file__, "export", folder], capture_output=True, check=True)
        for how, env in runs:
            out = subprocess.run([sys.executable, __file__, how, folder], capture_output=True, text=True,
                                 check=True, env={**os.environ, **env}).stdout
            rows.append(dict(json.loads(out.strip().splitlines()[-1]),
                             malloc="fixed mmap threshold" if env else "glibc default"))
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "meta_init.json"), "w") as f:
        json.dump(rows, f, indent=2)
    os.environ.setdefault("LLAMA_XLA_FIGURES", RESULTS)
    from llama_xla_helpers import plots
    plots.plot_bars({f"{r['how']}\n{r['malloc']}": {"peak host memory / local shard bytes": r["local_ratio"]}
                     for r in rows},
                    "x this host's shard bytes", f"building a {rows[0]['weight_bytes'] / 1e9:.2f} GB model",
                    name="meta_init")
    for r in rows:
        print(f"{r['how']:7s} ({r['malloc']:20s}) weights {r['weight_bytes'] / 1e9:.2f} GB, peak host memory "
              f"+{r['peak_increase_bytes'] / 1e9:.2f} GB = {r['ratio']:.2f}x the weights, "
              f"{r['local_ratio']:.2f}x this host's shards ({r['local_shard_bytes'] / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
