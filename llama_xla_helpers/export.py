"""Export the inference Llama to StableHLO, and decode greedily from the saved graphs alone.

    python -m llama_xla_helpers.export export MODEL_DIR OUT_DIR --buckets 16,32 --max-seq-len 128
    python -m llama_xla_helpers.export run OUT_DIR --prompt-ids 1,2,3 --max-new-tokens 8   # [[...]] on stdout
    tokens, excerpt = export_in_subprocess(MODEL_DIR, OUT_DIR, [[1, 2, 3]], 8, buckets=(16, 32))  # both at once

OUT_DIR holds one prefill graph per prompt bucket (`prefill_16`, `prefill_32`), one decode graph
(`decode`), the weights (once, shared by all graphs) and `manifest.json` (buckets, cache shape,
max_seq_len, vocabulary). Every graph is the same pure function, at its own seqlen:

    step(tokens, input_pos, pad, k_0, v_0, ..., k_{L-1}, v_{L-1}) -> (next_token, k_0', v_0', ..., v_{L-1}')
    tokens (bsz, seqlen) int64, input_pos (seqlen,) cache slots, pad (bsz,) each row's left padding,
    k_i, v_i (bsz, max_seq_len, n_kv_heads, head_dim): layer i's cache in, and updated out,
    next_token (bsz, 1) int64: the greedy (argmax) pick, which is the next decode step's `tokens`.

The step returns the token, not the logits: a (bsz, 1) int per step instead of (bsz, vocab_size)
floats, ready to feed back. The prompts are left-padded into sections as `generate.Generator`
does (`prefill_sections`, pad = width - len), so the artifact's tokens equal Generator's.

Why the cache goes in and out: model.py writes it in place (`index_copy_` on KVCache buffers),
and torch_xla's StableHLO export drops in-place buffer mutations, so the graph would forget
every key and value it wrote. `Step` swaps each layer's KVCache for the engine's
`runner.SlotCache`, which writes out of place (`index_put`) into caches handed in as arguments,
and returns the results.

No SPMD: the artifact is exported and run in a process that never calls `xr.use_spmd()` (which
`runtime.init_runtime` does). Loaded under SPMD it fails with "Unknown device SPMD:0". Hence the
CLI, and `export_in_subprocess` for a notebook, whose kernel runs SPMD.

What it is for: serving without Python model code. StableHLO is "a portability layer between
different ML frameworks and ML compilers" (https://github.com/openxla/stablehlo): a runtime that
compiles StableHLO (XLA through PJRT or JAX, IREE) can run these graphs. torch_xla's docs up to
2.6 name TensorFlow Serving as the way to serve it
(https://github.com/pytorch/xla/blob/v2.6.0/docs/source/features/stablehlo.md); since 2.7 they
show torchax and `jax.export` instead
(https://github.com/pytorch/xla/blob/v2.9.0/docs/source/features/stablehlo.md).

The other serving routes the Llama 2 post names (its "Model Serving" section: "via Torch.Export,
StableHLO, and SavedModel", and "TorchServe to run their single-host workloads"; "High-Performance
Llama 2 Training and Inference with PyTorch/XLA on Cloud TPUs", PyTorch blog,
https://pytorch.org/blog/high-performance-llama-2/), today:
- TensorFlow SavedModel: torch_xla 2.9 still ships `torch_xla.tf_saved_model_integration` and its
  `stablehlo-to-saved-model` command, which wrap a bundle's first StableHLO function in a
  `tf.function` (`tfxla.call_module`) and need TensorFlow with XLA installed separately
  (`pip install tf-nightly`), but torch_xla's docs stopped describing this route in January 2025
  (https://github.com/pytorch/xla/blob/v2.9.0/torch_xla/tf_saved_model_integration.py,
  https://github.com/pytorch/xla/pull/8544).
- TorchServe: in "Limited Maintenance" since 28 February 2025, its README saying there are "no
  planned updates, bug fixes, new features, or security patches" (https://github.com/pytorch/serve,
  https://github.com/pytorch/serve/pull/3395).

Limits, as measured with torch_xla 2.9:
- `StableHLOGraphModule.evaluate` compiles its graph on every call (`ExecuteStablehlo` in
  torch_xla/csrc/xla_graph_executor.cpp keeps no compile cache), 1-4 s per token for the 2-layer
  tiny model on a 2-core CPU: `run` checks the artifact and is no server. A serving runtime
  compiles each graph once.
- Weights are fp32: the exporter saves them through numpy, which has no bfloat16.
- The `functions/*.meta` JSON is "in prototype stage and there are no backward compatibility
  guarantees" (torch_xla 2.6's docs, above).
"""
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch_xla
import torch_xla.runtime as xr
from torch_xla.stablehlo import (StableHLOExportOptions, StableHLOGraphModule, StableHLOModelBundle,
                                 exported_program_to_stablehlo)
from transformers import LlamaConfig

from .cli import ArgumentParser, int_list, user_errors
from .generate import prefill_sections
from .model import Llama, ModelArgs
from .runner import SlotCache, attach

PROG = "python -m llama_xla_helpers.export"
MANIFEST = "manifest.json"
ARTIFACT_PARTS = (MANIFEST, "functions", "data", "constants")  # what export_artifact writes
DEFAULT_BUCKETS = (128, 256, 384, 512)  # Generator's
MAX_SEQ_LEN_CAP = 2048  # default max_seq_len: the config's max_position_embeddings, capped (as serving's)


# --- Export: the step as a pure function --------------------------------------------------

class Step(nn.Module):
    """A prefill section or decode step of `model` with the caches in and out (module docstring).

    It takes over `model`: each layer's KV cache becomes a `runner.SlotCache`, as in the engine's programs.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.views = [SlotCache() for _ in model.layers]
        for layer, view in zip(model.layers, self.views):
            layer.self_attn.kv_cache = view

    def forward(self, tokens, input_pos, pad, *caches):
        attach(self.views, zip(caches[0::2], caches[1::2]))
        logits = self.model(tokens, input_pos, pad, last_only=True)[:, -1]  # (bsz, vocab_size): the last position only
        next_token = logits.argmax(dim=-1, keepdim=True)  # (bsz, 1)
        return (next_token, *[c for view in self.views for c in (view.k, view.v)])


def cache_shape(args):
    return (args.max_batch_size, args.max_seq_len, args.n_kv_heads, args.head_dim)


def example_inputs(args, seqlen):
    """Zeros shaped like one step's inputs (tokens, input_pos, pad, *caches): torch.export traces with them."""
    bsz = args.max_batch_size
    caches = [torch.zeros(cache_shape(args)) for _ in range(2 * args.n_layers)]
    return (torch.zeros(bsz, seqlen, dtype=torch.long), torch.arange(seqlen), torch.zeros(bsz, dtype=torch.long),
            *caches)


def lower(step, seqlen, name, with_weights):
    """torch.export the step at this seqlen and lower it to StableHLO: a bundle with one function, `name`."""
    exported = torch.export.export(step, example_inputs(step.model.args, seqlen))
    # export_weights=False: the weights are the same for every graph; the first bundle keeps them.
    program = exported_program_to_stablehlo(exported, StableHLOExportOptions(export_weights=with_weights))
    bundle = program._bundle  # what torch_xla's own tf_saved_model_integration reads too
    if bundle.additional_constants:  # the default inline_all_constant=True leaves none
        raise RuntimeError(f"{name}: {len(bundle.additional_constants)} constants outside the graph")
    bundle.stablehlo_funcs[0].meta.name = name
    return bundle


def export_artifact(model, out_dir, buckets):
    """Save `model` (an fp32 Llama) as StableHLO in out_dir: prefill_<n> per bucket, decode, the
    weights and manifest.json. The shapes are model.args': max_batch_size rows, max_seq_len slots.

    Needs a process without SPMD, and takes over `model` (see Step). Returns the manifest.
    """
    device_without_spmd()  # lowering runs on the XLA device, in a process without SPMD
    if model.lm_head.weight.dtype != torch.float32:
        raise ValueError(f"the model is {model.lm_head.weight.dtype}; export needs fp32 (numpy, which saves "
                         "the weights, has no bfloat16): call model.float() and model.init_buffers()")
    manifest = make_manifest(model.args, buckets)
    step = Step(model).eval()
    seqlens = [*buckets, 1]  # decode feeds one token per row
    bundles = [lower(step, n, name, i == 0) for i, (n, name) in enumerate(zip(seqlens, manifest["functions"]))]
    funcs = [b.stablehlo_funcs[0] for b in bundles]
    program = StableHLOGraphModule(StableHLOModelBundle(state_dict=bundles[0].state_dict,
                                                        additional_constants=[], stablehlo_funcs=funcs))
    program.save(out_dir)
    (Path(out_dir) / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def make_manifest(args, buckets):
    """What a runtime needs to know to call the graphs (module docstring), from ModelArgs."""
    return dict(
        functions=[f"prefill_{n}" for n in buckets] + ["decode"],
        buckets=list(buckets), batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
        vocab_size=args.vocab_size, n_layers=args.n_layers,
        cache_shape=list(cache_shape(args)), cache_dtype="float32",
        inputs="tokens (batch_size, seqlen) int64, input_pos (seqlen,) int64, pad (batch_size,) int64, "
               "then k_0, v_0, ..., k_{n_layers-1}, v_{n_layers-1} (cache_shape, cache_dtype)",
        outputs="next_token (batch_size, 1) int64 (greedy), then the updated k_0, v_0, ..., v_{n_layers-1}",
    )


def device_without_spmd():
    """The XLA device, in a process without SPMD: `runtime.init_runtime`'s variant for export.

    Importing the package picks PJRT_DEVICE (the TPU if there is one, else the CPU).
    """
    if xr.is_spmd():
        raise RuntimeError("SPMD is on in this process (init_runtime turns it on), and a StableHLO artifact "
                           "does not load under SPMD ('Unknown device SPMD:0'): export and run it in a process "
                           f"of its own, with export_in_subprocess(...) or `{PROG}`")
    return torch_xla.device()


# --- Run: greedy decoding from the artifact alone -----------------------------------------

class Artifact:
    """An exported directory, loaded to decode: it needs torch_xla and out_dir, no model code."""

    def __init__(self, out_dir):
        self.device = device_without_spmd()
        self.manifest = read_manifest(out_dir)
        self.program = StableHLOGraphModule.load(out_dir)
        # The weights load as numpy arrays, which evaluate() would copy to the device on every
        # call; put them there once.
        weights = self.program._bundle.state_dict
        for name, w in weights.items():
            weights[name] = torch.from_numpy(w).to(self.device)

    def generate(self, prompts, max_new_tokens):
        """Greedy tokens (bsz, max_new_tokens) as lists, for prompts (bsz lists of token ids)."""
        sections = check_request(self.manifest, prompts, max_new_tokens)
        width = sum(sections)
        tokens = left_pad(prompts, width)  # (bsz, width), on the host
        pad = torch.tensor([width - len(p) for p in prompts]).to(self.device)  # (bsz,)
        caches = [torch.zeros(self.manifest["cache_shape"]).to(self.device)
                  for _ in range(2 * self.manifest["n_layers"])]
        pos = 0
        for n in sections:  # each section picks a token; the last one's is the first new token
            next_token, *caches = self.call(f"prefill_{n}", tokens[:, pos:pos + n], torch.arange(pos, pos + n),
                                            pad, caches)
            pos += n
        out = [next_token]  # (bsz, 1) each, on the device
        for _ in range(max_new_tokens - 1):
            next_token, *caches = self.call("decode", next_token, torch.tensor([pos]), pad, caches)
            out.append(next_token)
            pos += 1
        return torch.cat(out, dim=1).tolist()

    def call(self, name, tokens, input_pos, pad, caches):
        """Run one graph: (next_token (bsz, 1), *new caches), all on the device."""
        tokens, input_pos = tokens.to(self.device), input_pos.to(self.device)
        return self.program.evaluate(name, (tokens, input_pos, pad, *caches))


def left_pad(prompts, width):
    """(bsz, width) int64: each prompt at the right end of its row, as Generator.prefill lays them out."""
    padded = torch.zeros(len(prompts), width, dtype=torch.long)  # the padding's token id never matters
    for b, p in enumerate(prompts):
        padded[b, width - len(p):] = torch.tensor(p)
    return padded


def read_manifest(out_dir):
    file = Path(out_dir) / MANIFEST
    if not file.is_file():
        raise FileNotFoundError(f"{out_dir} has no {MANIFEST}: expected a directory written by `{PROG} export`")
    return json.loads(file.read_text())


def check_request(manifest, prompts, max_new_tokens):
    """ValueError for prompts the artifact cannot take, before any device work; returns the prefill sections."""
    if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, (list, tuple)) for p in prompts):
        raise TypeError("prompts must be a list of prompts, each a list of token ids")
    if len(prompts) != manifest["batch_size"]:
        raise ValueError(f"{len(prompts)} prompts, but the artifact takes batches of exactly "
                         f"batch_size={manifest['batch_size']}; export it with --batch-size {len(prompts)}")
    vocab = manifest["vocab_size"]
    for b, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {b} is empty; every prompt needs at least one token (e.g. BOS)")
        bad = [t for t in p if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt {b} has token id {bad[0]!r}, not an int in the vocabulary [0, {vocab})")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1")
    longest = max(len(p) for p in prompts)
    sections = prefill_sections(longest, manifest["buckets"])
    need = sum(sections) + max_new_tokens
    if need > manifest["max_seq_len"]:
        raise ValueError(f"the longest prompt ({longest} tokens, padded to {sum(sections)} for buckets "
                         f"{tuple(manifest['buckets'])}) + max_new_tokens={max_new_tokens} = {need} cache slots > "
                         f"max_seq_len={manifest['max_seq_len']}; ask for fewer tokens or export with "
                         f"--max-seq-len {need}")
    return sections


def stablehlo_excerpt(out_dir, name="decode"):
    """Three lines of a graph's StableHLO text: its signature (weights, tokens, positions, pad and
    caches in; next token and caches out), the first cache write (a scatter), the return."""
    lines = (Path(out_dir) / "functions" / f"{name}.mlir").read_text().splitlines()
    signature = next(line for line in lines if "func.func @main" in line)
    cache_write = next(line for line in lines if "stablehlo.scatter" in line)
    result = next(line for line in lines if line.strip().startswith("return "))
    return "\n    ...\n".join([signature, cache_write, result])


def export_in_subprocess(model_dir, out_dir, prompts, max_new_tokens, buckets, max_seq_len=None, timeout=900):
    """Export model_dir to out_dir, then decode prompts (a list of token-id lists: the batch)
    greedily from the artifact, in a child process without SPMD; returns (tokens, decode excerpt).

    A bad argument raises ValueError with the child's `error:` message.
    """
    argv = [sys.executable, "-m", "llama_xla_helpers.export", "export", str(model_dir), str(out_dir),
            "--buckets", ",".join(map(str, buckets)), "--max-new-tokens", str(max_new_tokens)]
    argv += [arg for p in prompts for arg in ("--prompt-ids", ",".join(map(str, p)))]
    if max_seq_len is not None:
        argv += ["--max-seq-len", str(max_seq_len)]
    child = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=child_env())
    errors = [line for line in child.stderr.splitlines() if line.startswith("error: ")]
    if child.returncode == 2 and errors:
        raise ValueError(errors[-1].removeprefix("error: "))
    if child.returncode:
        raise RuntimeError(f"{' '.join(argv[1:4])} exited with {child.returncode}:\n{child.stderr[-3000:]}")
    return json.loads(child.stdout.splitlines()[-1]), stablehlo_excerpt(out_dir)


def child_env():
    """This process's environment for a child on the CPU without SPMD.

    The CPU: a TPU that this process holds cannot be opened by another one. Without SPMD:
    `xr.use_spmd()` sets XLA_USE_SPMD=1, which a child inherits. And without `init_runtime`'s
    HLO dump flags, which would make the child write into this process's dump folder.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_USE_SPMD", "XLA_AUTO_SPMD")}
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_dump"))
    env["PJRT_DEVICE"] = "CPU"
    return env


# --- Command line ---------------------------------------------------------------------------

def model_args(model_dir, batch_size, max_seq_len):
    """ModelArgs of model_dir's config.json; max_seq_len None: max_position_embeddings, at most 2048."""
    default = max_seq_len is None
    args = ModelArgs.from_pretrained(model_dir, batch_size, MAX_SEQ_LEN_CAP if default else max_seq_len)
    if default:
        config = LlamaConfig.from_json_file(Path(model_dir) / "config.json")
        args = dataclasses.replace(args, max_seq_len=min(config.max_position_embeddings, MAX_SEQ_LEN_CAP))
    return args


def load_model(model_dir, args):
    """The fp32 Llama of a local Hugging Face directory, with args' cache size."""
    model = Llama.from_pretrained(model_dir, args.max_batch_size, args.max_seq_len)
    if model.lm_head.weight.dtype != torch.float32:
        model = model.float()
        model.init_buffers()  # RoPE tables computed in fp32, not cast from bf16
    return model


def check_buckets(buckets, max_seq_len):
    if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
        raise ValueError(f"buckets={buckets} must be increasing positive ints, e.g. 128,256,384,512")
    if buckets[-1] > max_seq_len:
        raise ValueError(f"largest bucket {buckets[-1]} > max_seq_len={max_seq_len}; drop it or pass a "
                         f"larger --max-seq-len")


def prepare_out_dir(out_dir):
    """Create out_dir, or empty it of an earlier artifact; refuse a directory that holds anything else."""
    out = Path(out_dir)
    if out.exists():
        if not out.is_dir():
            raise ValueError(f"OUT_DIR {out} is a file; pass a new or empty directory")
        names = {p.name for p in out.iterdir()}
        if names and (MANIFEST not in names or names - set(ARTIFACT_PARTS)):
            raise ValueError(f"OUT_DIR {out} holds files that are not an artifact of this command "
                             f"({', '.join(sorted(names)[:3])}); pass a new or empty directory")
    for part in ARTIFACT_PARTS:
        path = out / part
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)


def export_command(args):
    """Check everything, then load MODEL_DIR, export, and with --prompt-ids decode from OUT_DIR."""
    shapes = model_args(args.model_dir, args.batch_size or len(args.prompt_ids or [[]]), args.max_seq_len)
    check_buckets(args.buckets, shapes.max_seq_len)
    if args.prompt_ids:
        check_request(make_manifest(shapes, args.buckets), args.prompt_ids, args.max_new_tokens)
    prepare_out_dir(args.out_dir)
    manifest = export_artifact(load_model(args.model_dir, shapes), args.out_dir, args.buckets)
    print(f"exported {', '.join(manifest['functions'])} to {args.out_dir}", file=sys.stderr)
    if args.prompt_ids:
        print(json.dumps(Artifact(args.out_dir).generate(args.prompt_ids, args.max_new_tokens)))


def run_command(args):
    check_request(read_manifest(args.out_dir), args.prompt_ids, args.max_new_tokens)
    print(json.dumps(Artifact(args.out_dir).generate(args.prompt_ids, args.max_new_tokens)))


def parse_args(argv=None):
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="export a Hugging Face Llama directory to StableHLO")
    export.add_argument("model_dir", help="local Hugging Face directory: config.json + *.safetensors")
    export.add_argument("out_dir", help="new or empty directory (or an earlier artifact, replaced)")
    export.add_argument("--buckets", type=int_list("16,32"), default=DEFAULT_BUCKETS,
                        help="prompt bucket lengths, one prefill graph each (default: 128,256,384,512)")
    export.add_argument("--max-seq-len", type=int,
                        help="cache slots (default: the config's max_position_embeddings, at most 2048)")
    export.add_argument("--batch-size", type=int,
                        help="rows per call (default: the number of --prompt-ids, else 1)")
    add_decode_args(export, required=False)  # given, export then decodes them from the artifact
    run = commands.add_parser("run", help="decode greedily from an exported directory; prints the tokens as JSON")
    run.add_argument("out_dir", help="a directory written by `export`")
    add_decode_args(run, required=True)
    return parser.parse_args(argv)


def add_decode_args(parser, required):
    parser.add_argument("--prompt-ids", type=int_list("1,2,3"), action="append", required=required,
                        help="a prompt's token ids, e.g. 1,2,3; once per row of the batch (the tokens: JSON on stdout)"
                             + ("" if required else "; default: none, export only"))
    parser.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate per row (default: 16)")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an input error")


def main(argv=None):
    args = parse_args(argv)
    with user_errors(args.debug):
        if args.command == "export":
            export_command(args)
        else:
            run_command(args)


if __name__ == "__main__":
    main()
