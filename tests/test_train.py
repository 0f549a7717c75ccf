import dataclasses
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaForCausalLM
from transformers.optimization import Adafactor as HFAdafactor

from llama_xla_helpers import checkpoint, train as train_module
from llama_xla_helpers.configs import get_config
from llama_xla_helpers.data import ByteTokenizer, StepSampler, load_corpus, small_tokenizer, train_val_split
from llama_xla_helpers.train import (Adafactor, TrainConfig, _parse_args, init_tile, init_weights, main,
                                     make_optimizer, optimizer_step, should_stop, stop_signals, train, train_step)
from util import N, sharded_runs

# Small and quick: the 2-layer model (half tiny's layers: what these tests check holds for any count); 2 steps
# compile, the rest reuse the graph. The mesh is picked for the devices there are.
SMALL = TrainConfig(model="micro", steps=4, batch_size=max(8, N), seq_len=32, eval_batches=2)
# For the tests whose point is equality with the fp32 CPU reference (cpu_losses): fp32 whatever
# LLAMA_XLA_DEFAULT_DTYPE says (check-variants runs every test with it set to bf16).
SMALL_FP32 = dataclasses.replace(SMALL, dtype="fp32")
# The options a real run adds, together: AdamW, warm-up then cosine, clipping that bites, 2 micro-batches
# (of max(8, N) rows: a micro-batch must split over 'data').
OPTIONS = dict(optimizer="adamw", schedule="cosine", warmup_steps=2, clip_norm=0.5, grad_accum=2,
               batch_size=2 * SMALL.batch_size)


def cpu_losses(cfg):
    """The same training, unsharded, in plain PyTorch on the CPU."""
    config = get_config(cfg.model)
    model = LlamaForCausalLM(config)
    init = init_weights(config, cfg.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init(name, tuple(p.shape))())  # read(): the whole tensor
    optimizer = make_optimizer(cfg, model.parameters())
    train_ids, _ = train_val_split(load_corpus(), cfg.seq_len)
    sampler = StepSampler(len(train_ids), cfg.batch_size, cfg.seed, 0, cfg.steps)
    loader = DataLoader(TensorDataset(train_ids), batch_size=cfg.batch_size, sampler=sampler, drop_last=True)
    return {step: optimizer_step(model, optimizer, ids, clip_norm=cfg.clip_norm)[0].item()  # the whole batch at once
            for step, (ids,) in enumerate(loader, 1)}


def test_random_init_draws_each_block_alone_from_keyed_tiles(monkeypatch):
    config = get_config("tiny")
    init = init_weights(config, seed=0)
    w = init("model.layers.0.mlp.gate_proj.weight", (384, 128))()  # (out, in): 6 x 2 tiles of 64 x 64
    assert w.shape == (384, 128) and abs(w.std().item() - config.initializer_range) < 0.1 * config.initializer_range
    drawn = []
    monkeypatch.setattr(train_module, "init_tile", lambda *a: drawn.append(a[-2:]) or init_tile(*a))
    rows_block = (slice(100, 150), slice(0, 128))  # a row block (a split on 'out'): rows in tiles 1 and 2
    assert torch.equal(init("model.layers.0.mlp.gate_proj.weight", (384, 128))(rows_block), w[rows_block])
    assert drawn == [(1, 0), (1, 1), (2, 0), (2, 1)]  # only the tiles its rows overlap
    drawn.clear()
    cols_block = (slice(0, 384), slice(32, 64))  # a column block (a split on 'in'): inside column tile 0
    assert torch.equal(init("model.layers.0.mlp.gate_proj.weight", (384, 128))(cols_block), w[cols_block])
    assert drawn == [(r, 0) for r in range(6)]  # not column tile 1: a column split draws only its share
    assert torch.equal(init("model.layers.0.mlp.gate_proj.weight", (384, 128))(), w)  # the same numbers every time
    assert not torch.equal(init("model.layers.0.mlp.up_proj.weight", (384, 128))(), w)  # keyed by name
    assert not torch.equal(init_weights(config, seed=1)("model.layers.0.mlp.gate_proj.weight", (384, 128))(), w)
    assert not torch.equal(w[:64, :64], w[:64, 64:])  # keyed by tile
    assert torch.equal(init("model.norm.weight", (128,))((slice(16, 32),)), torch.ones(16))
    bf16 = init_weights(config, seed=0, dtype=torch.bfloat16)("model.layers.0.mlp.gate_proj.weight", (384, 128))()
    assert torch.equal(bf16, w.bfloat16())
    with pytest.raises(ValueError, match=r"2-D weights.*\(2, 3, 4\)"):
        init("model.layers.0.extra.weight", (2, 3, 4))


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode("Grüße, λ!", bos=True, eos=True)
    assert ids[0] == 256 and ids[-1] == 257 and max(ids[1:-1]) < 256
    assert tok.decode(ids) == "Grüße, λ!"


def test_corpus_from_a_local_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("Grüße aus der Datei.\n" * 100, encoding="utf-8")
    assert load_corpus(path) == "Grüße aus der Datei.\n" * 100
    train_ids, _ = train_val_split(load_corpus(path), 16)
    assert ByteTokenizer().decode(train_ids[0].tolist()).startswith("Grüße")
    path.write_bytes(b"ok \xc3")  # a UTF-8 sequence cut short
    with pytest.raises(ValueError, match=r"is not UTF-8 text: byte 3 is 0xc3"):
        load_corpus(path)


def test_corpus_split_and_chunks():
    text = load_corpus()
    assert len(text) > 400_000 and "def" in text
    train_ids, val_ids = train_val_split(text, 64)
    assert train_ids.shape[1] == val_ids.shape[1] == 64
    assert 8 < len(train_ids) / len(val_ids) < 10  # 90% / 10%
    assert ByteTokenizer().decode(val_ids[1].tolist()) in text[int(len(text) * 0.9):]


def test_step_sampler_resumes_exactly_and_reshuffles():
    whole = list(StepSampler(20, 4, seed=3, start=0, steps=12))
    resumed = list(StepSampler(20, 4, seed=3, start=7, steps=5))
    assert resumed == whole[7 * 4:]
    assert sorted(whole[:20]) == sorted(whole[20:40]) == list(range(20))  # each epoch covers every chunk once
    assert whole[:20] != whole[20:40]                      # in another order
    with pytest.raises(ValueError, match="3 training chunks cannot fill one batch of 4"):
        StepSampler(3, 4, seed=0, start=0, steps=1)


def test_step_sampler_shuffles_once_per_epoch(monkeypatch):
    draws = []
    monkeypatch.setattr(torch, "randperm", lambda n, generator: draws.append(n) or torch.arange(n))
    assert len(list(StepSampler(20, 4, seed=3, start=2, steps=12))) == 48  # steps 2-13: epochs 0, 1 and 2
    assert draws == [20, 20, 20]


def test_adafactor_matches_transformers_adafactor():
    torch.manual_seed(0)
    ours_p = [torch.nn.Parameter(torch.randn(6, 5)), torch.nn.Parameter(torch.randn(5))]
    theirs_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    ours = Adafactor(ours_p, lr=1e-2)
    theirs = HFAdafactor(theirs_p, lr=1e-2, relative_step=False, scale_parameter=True, warmup_init=False)
    for _ in range(5):
        grads = [torch.randn_like(p) for p in ours_p]
        for p, q, g in zip(ours_p, theirs_p, grads):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    for p, q in zip(ours_p, theirs_p):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


@pytest.mark.devices
@pytest.mark.parametrize("strategy, mesh, options", [pytest.param("2d", None, {}, marks=pytest.mark.variants),
                                                     ("fsdp", (N, 1), {})])
def test_training_compiles_two_graphs_however_many_steps(strategy, mesh, options):
    """(test_loop.py runs it under 2D with OPTIONS, so make test leaves out 2D without them: check-variants.)"""
    # A shape no other test uses, so the graphs are compiled here and not taken from the cache.
    result = train(dataclasses.replace(SMALL, steps=8, seq_len=40, log_every=3, strategy=strategy, mesh=mesh,
                                       **options))
    assert result.train_compiles == 2   # step 1 (creates optimizer state) and every later step: nothing read mid-step
    assert sorted(result.losses) == list(range(1, 9))  # every step's loss, read every 3 steps
    assert all(isinstance(v, float) for v in result.losses.values())
    assert result.mfu is None           # not a TPU


def test_same_seed_same_losses():
    a, b = train(SMALL), train(SMALL)
    assert a.losses == b.losses and a.val_losses == b.val_losses
    seed1 = dataclasses.replace(SMALL_FP32, seed=1)  # another init and another batch order
    c, want = train(seed1).losses, cpu_losses(seed1)
    assert all(c[s] == pytest.approx(want[s], abs=2e-4) for s in want)  # follows the seed's own reference
    assert all(abs(c[s] - a.losses[s]) > 1e-3 for s in want)


@pytest.mark.devices
@pytest.mark.parametrize("strategy, mesh", sharded_runs())
def test_sharded_training_matches_unsharded(strategy, mesh, options=None):
    """(test_loop.py runs it with OPTIONS: there the CPU reference runs each step's batch whole, the
    sharded run in 2 micro-batches.)"""
    cfg = dataclasses.replace(SMALL_FP32, strategy=strategy, mesh=mesh, **(options or {}))
    want = cpu_losses(cfg)
    got = train(cfg).losses
    assert list(got) == list(want)
    for step in want:
        assert got[step] == pytest.approx(want[step], abs=2e-4), step
    assert want[4] < want[1]  # and it learns


@pytest.mark.devices
def test_two_slices_train_like_one_device():
    """--slices 2: a leading 'dcn' axis; weights sharded inside each slice, the batch across slices."""
    if N % 2:
        pytest.skip("two slices need an even device count")
    cfg = dataclasses.replace(SMALL_FP32, slices=2)
    result = train(cfg)
    assert result.model.model.embed_tokens.weight.device.type == "xla"
    want = cpu_losses(cfg)
    assert all(result.losses[s] == pytest.approx(want[s], abs=2e-4) for s in want)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_both_ask_to_stop_and_the_handlers_are_put_back(sig):
    before = signal.getsignal(sig)
    with stop_signals() as got:
        assert not should_stop(1, got, every=10)
        os.kill(os.getpid(), sig)
        assert got and should_stop(2, got, every=10)  # one process: at once, not at a multiple of 10
    assert signal.getsignal(sig) == before


# Two hosts over gloo. In each case (signalled, at), host `signalled` gets its signal after step `at`;
# each host prints the step it stops at, or "none" after 12 steps.
CASES = [(1, 3, "5"), (0, 7, "10"), (0, 5, "5"), (1, 11, "none")]
HOSTS = """
import json, sys
import torch.distributed as dist
from llama_xla_helpers.train import should_stop
rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
stops = []
for signalled, at, _ in json.loads(sys.argv[3]):
    got = []
    for step in range(1, 13):
        if rank == signalled and step == at:
            got.append(True)
        if should_stop(step, got, 5, dist.group.WORLD):
            stops.append(str(step))
            break
    else:
        stops.append("none")
print(json.dumps(stops))
dist.destroy_process_group()
"""


def test_the_hosts_of_a_pod_agree_on_the_step_to_stop_at(tmp_path):
    """Without agreement, the signalled host would stop at once and the other would block in its next
    collective. With it, both stop at the next multiple of `every` (5), or both run on."""
    hosts = [subprocess.Popen([sys.executable, "-c", HOSTS, str(rank), str(tmp_path / "store"), json.dumps(CASES)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outs = [host.communicate(timeout=300) for host in hosts]
    assert [host.returncode for host in hosts] == [0, 0], [err[-2000:] for _, err in outs]
    want = [stop for _, _, stop in CASES]
    assert [json.loads(out.splitlines()[-1]) for out, _ in outs] == [want, want]  # (gloo prints its peers first)


# A pod's host, faked where it differs (process index and count), over gloo: train.datasets with the
# host's own --data, which on host 1 does not exist. Prints its first rows and the files it hashed.
DATA_HOSTS = """
import json, sys
import torch.distributed as dist
import torch_xla.runtime as xr
rank, store, data, shared, tok = int(sys.argv[1]), *sys.argv[2:]
xr.process_index, xr.process_count = (lambda: rank), (lambda: 2)
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
from llama_xla_helpers import data as data_module, train
hashed, sha = [], data_module._data_sha
data_module._data_sha = lambda path: hashed.append(str(path)) or sha(path)
cfg = train.TrainConfig(seq_len=16, tokenizer=tok, data=data, checkpoint_dir=shared)
try:
    (ids,), _ = train.datasets(cfg, train.hf_tokenizer(cfg))
    print(json.dumps(dict(path=ids.path, rows=ids[:3].tolist(), n=len(ids), hashed=hashed)))
except Exception as e:
    print(json.dumps(dict(error=f"{type(e).__name__}: {e}", hashed=hashed)))
dist.destroy_process_group()
"""


def test_only_process_0_reads_the_data_and_every_host_reads_its_token_file(tmp_path):
    """The review's L3: every host hashed its own copy of --data to name the token file. Now process 0
    names it (and tokenizes); host 1's --data is a path that does not exist."""
    small_tokenizer().save_pretrained(tmp_path / "tok")
    (tmp_path / "corpus.txt").write_text(load_corpus()[:20_000], encoding="utf-8")

    def hosts(case, data0):
        procs = [subprocess.Popen([sys.executable, "-c", DATA_HOSTS, str(rank), str(tmp_path / f"store-{case}"),
                                   str(data0 if rank == 0 else tmp_path / "not-on-host-1.txt"),
                                   str(tmp_path / "shared"), str(tmp_path / "tok")],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
        outs = [p.communicate(timeout=300) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
        return [json.loads(out.splitlines()[-1]) for out, _ in outs]

    lead, other = hosts("ok", tmp_path / "corpus.txt")
    assert lead["hashed"] == [str(tmp_path / "corpus.txt")] and other["hashed"] == []
    assert lead["path"] == other["path"] and lead["path"].startswith(str(tmp_path / "shared"))
    assert lead["rows"] == other["rows"] and lead["n"] == other["n"] > 3
    # process 0's error (its --data is missing) reaches the other host at once, not after its 30-minute wait
    lead, other = hosts("missing", tmp_path / "missing.txt")
    assert lead["error"].startswith(f"FileNotFoundError: data file {str(tmp_path / 'missing.txt')!r} does not exist")
    assert other["error"] == f"RuntimeError: process 0 could not name the token file: {lead['error']}"


@pytest.mark.child_process
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_crash_mid_save_resumes_exactly_from_the_previous_checkpoint(tmp_path, capsys, mode):
    """In async mode (the default) the crash comes on the saving thread while the steps go on."""
    def argv(directory):
        return ["--model", "micro", "--steps", "8", "--batch-size", "8", "--seq-len", "32", "--eval-batches", "1",
                "--checkpoint-every", "2", "--checkpoint-dir", str(directory), f"--{'' if mode == 'async' else 'no-'}"
                "async-checkpoint"]

    # SIGKILL at the worst moment, in a real process: step 6's shards written, its meta.json not
    crashed = subprocess.run([sys.executable, "-m", "llama_xla_helpers.train", *argv(tmp_path / "run")],
                             capture_output=True, text=True, timeout=600,
                             env=dict(os.environ, LLAMA_XLA_CRASH_IN_SAVE="6"))
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    assert checkpoint.latest(tmp_path / "run").name == "step_00000004"
    assert not (tmp_path / "run" / "step_00000006").exists()
    main([*argv(tmp_path / "run"), "--resume"])  # the CLI's main, in this process
    resumed = capsys.readouterr().out
    assert "resuming from step_00000004: step 5 next" in resumed
    main(argv(tmp_path / "whole"))
    # "step 8: train loss ..., held-out loss ... nats/byte; (compiles, which the cache changes)"
    final = [[line.split(";")[0] for line in out.splitlines() if line.startswith("step 8:")]
             for out in (resumed, capsys.readouterr().out)]
    assert final[0] and final[0] == final[1]
    # the final weights and optimizer state, byte for byte: the same shard files
    sums = [{name: entry for name, entry in checkpoint.read_meta(d / "step_00000008")["files"].items()
             if name.endswith(".distcp")} for d in (tmp_path / "run", tmp_path / "whole")]
    assert len(sums[0]) == checkpoint.THREADS and sums[0] == sums[1]


def test_gradient_checkpointing_gives_the_same_losses():
    cfg = dataclasses.replace(SMALL_FP32, steps=3)
    assert train(dataclasses.replace(cfg, gradient_checkpointing=True)).losses == pytest.approx(train(cfg).losses, abs=1e-5)


def test_cli_flags_mirror_the_config():
    cfg, debug = _parse_args(["--mesh", "2,4", "--strategy", "fsdp", "--steps", "7", "--lr", "0.003", "--resume",
                       "--checkpoint-dir", "ck", "--data", "corpus.txt", "--gradient-checkpointing", "--scan-layers"])
    assert cfg == dataclasses.replace(TrainConfig(), mesh=(2, 4), strategy="fsdp", steps=7, lr=0.003, resume=True,
                                      checkpoint_dir="ck", data="corpus.txt", gradient_checkpointing=True,
                                      scan_layers=True)
    assert _parse_args([])[0].pack is None  # decided by setup: packed SFT rows unless the attention is eager
    assert _parse_args(["--no-pack"])[0].pack is False and _parse_args(["--pack"])[0].pack is True


def test_bad_training_input():
    with pytest.raises(ValueError, match="resume=True needs checkpoint_dir"):
        train(dataclasses.replace(SMALL, resume=True))
    if N > 1:
        with pytest.raises(ValueError, match=f"batch_size {N + 1} is not divisible by the 'data' axis of size {N}"):
            train(dataclasses.replace(SMALL, mesh=(N, 1), batch_size=N + 1))
    with pytest.raises(ValueError, match="dtype='fp16' is not one of fp32, bf16"):
        train(dataclasses.replace(SMALL, dtype="fp16"))
    with pytest.raises(ValueError, match="unknown config 'llama-1b'"):
        train(dataclasses.replace(SMALL, model="llama-1b"))
    with pytest.raises(ValueError, match="pack=True .* needs sft"):
        train(dataclasses.replace(SMALL, pack=True))
    with pytest.raises(ValueError, match=r"prefetch=-1 must be an int >= 0 \(batches read ahead; 0: none\)"):
        train(dataclasses.replace(SMALL, prefetch=-1))
    for bad, why in (({"attention": "eager"}, "attention='eager' cannot keep them apart"),
                     ({"attention": "blockwise", "scan_layers": True}, "scan_layers' layer step takes no segment")):
        with pytest.raises(ValueError, match=f"pack=True puts several conversations in a row, and {why}.*--no-pack"):
            train(dataclasses.replace(SMALL, sft="chats.jsonl", pack=True, **bad))


def test_init_from_a_local_folder_starts_from_its_weights(tmp_path):
    trained = train(dataclasses.replace(SMALL_FP32, steps=3))
    checkpoint.export_hf(trained.model, tmp_path)
    tuned = train(dataclasses.replace(SMALL_FP32, steps=2, init_from=str(tmp_path)))
    cpu = checkpoint.load_hf(tmp_path)  # the exported weights, on the CPU: step 1's loss before any update
    train_ids, _ = train_val_split(load_corpus(), SMALL.seq_len)
    [first] = DataLoader(TensorDataset(train_ids), batch_size=SMALL.batch_size, drop_last=True,
                         sampler=StepSampler(len(train_ids), SMALL.batch_size, SMALL.seed, 0, 1))
    want = train_step(cpu, Adafactor(cpu.parameters()), first[0]).item()
    assert tuned.losses[1] == pytest.approx(want, abs=2e-4)
    assert tuned.losses[1] < trained.losses[1] - 0.05  # not a fresh init
