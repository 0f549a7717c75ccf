"""SFT with conversations packed into rows, against one conversation per row: tokens trained per second.

    python benchmarks/packing.py

Notebook 03b's SFT data (the conversations of `data.sft_conversations` that fit in 192 tokens,
from 800 asked for: the notebook asks for 400, and packed rows of 512 need more to hold out a
batch; the small tokenizer), the tiny model, batch 16, fp32, on mesh_shape's pick for 8 CPU
devices, in rows of 192 tokens (the notebook's) and of 512, three ways: one conversation per row with eager
attention (what SFT ran before packing), the same rows with blockwise attention, and packed rows
(`data.pack_next_fit`) with blockwise attention, which keeps the packed conversations apart by
their segment ids. A step costs the same whatever its rows hold, so what packing gains is the
share of each row that is conversation, not padding: conversation tokens per second = the step's
tokens per second x that share (from the SFT file's meta). Each is the median of REPEATS runs of
STEPS steps (train()'s steady state: the two steps that compile are left out). Writes
results/packing.json and results/packing.png.
"""
import json
import os
import statistics
import tempfile

from llama_xla_helpers.runtime import init_runtime

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CONVERSATIONS, LONGEST, SEQS, BATCH, STEPS, REPEATS = 800, 192, (192, 512), 16, 12, 3
WAYS = {"one per row, eager": ("eager", False), "one per row, blockwise": ("blockwise", False),
        "packed, blockwise": ("blockwise", True)}


def main():
    init_runtime(cpu_devices=8)
    from llama_xla_helpers import plots
    from llama_xla_helpers.data import file_meta, sft_conversations, sft_example, sft_file, small_tokenizer, write_jsonl
    from llama_xla_helpers.train import TrainConfig, train

    work = tempfile.mkdtemp(prefix="packing-")
    tok = small_tokenizer(512, path=os.path.join(work, "tok"))
    fits = [c for c in sft_conversations(CONVERSATIONS) if len(sft_example(tok, c["messages"])[0]) <= LONGEST]
    path = write_jsonl(os.path.join(work, "sft.jsonl"), fits)
    rows = []
    for seq in SEQS:
        for way, (attention, pack) in WAYS.items():
            meta = file_meta(sft_file(path, tok, seq, work, packed=pack))
            fill = meta["conversation_tokens"] / (meta["rows"] * seq)
            cfg = TrainConfig(steps=STEPS, batch_size=BATCH, seq_len=seq, dtype="fp32", optimizer="adamw", lr=3e-3,
                              sft=path, tokenizer=os.path.join(work, "tok"), eval_batches=1, attention=attention,
                              pack=pack)
            step_tps = statistics.median(train(cfg).tokens_per_sec_per_chip for _ in range(REPEATS))
            rows.append(dict(seq_len=seq, way=way, attention=attention, packed=pack, rows=meta["rows"], fill=fill,
                             tokens_per_sec_per_chip=step_tps, conversation_tokens_per_sec_per_chip=step_tps * fill))
            print(f"rows of {seq}, {way:24}: {meta['rows']} rows, {fill:.0%} conversation; {step_tps:,.0f} "
                  f"tokens/s/chip, {step_tps * fill:,.0f} of them conversation", flush=True)
    for r in rows:  # against one conversation per row in rows as long, eager and blockwise
        same = {q["way"]: q["conversation_tokens_per_sec_per_chip"] for q in rows if q["seq_len"] == r["seq_len"]}
        r["gain_over_eager_rows"] = r["conversation_tokens_per_sec_per_chip"] / same["one per row, eager"]
        r["gain_over_blockwise_rows"] = r["conversation_tokens_per_sec_per_chip"] / same["one per row, blockwise"]
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "packing.json"), "w") as f:
        json.dump(dict(conversations=len(fits), longest=LONGEST, batch_size=BATCH, steps=STEPS, repeats=REPEATS,
                       devices=8, rows=rows), f, indent=1)
    os.environ.setdefault("LLAMA_XLA_FIGURES", RESULTS)
    plots.plot_bars({f"rows of {seq} tokens": {r["way"]: r["conversation_tokens_per_sec_per_chip"]
                                               for r in rows if r["seq_len"] == seq} for seq in SEQS},
                    "conversation tokens/s per device", f"SFT, tiny model, batch {BATCH}, 8 CPU devices", name="packing")


if __name__ == "__main__":
    main()
