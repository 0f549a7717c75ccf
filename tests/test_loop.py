"""The training loop's options beyond the step itself: resuming a scheduled run and its metrics.jsonl,
gradient accumulation (equal to the whole batch; its collectives, measured), the training clock, and
what logging costs. (Apart from test_train.py and test_train_bf16.py: XLA:CPU keeps every compiled
program mapped, and one process compiling all of them aborts.)"""
import dataclasses
import json

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met
from transformers import LlamaForCausalLM

from llama_xla_helpers import checkpoint, runlog, serve, train as train_module
from llama_xla_helpers.data import IGNORE_INDEX, small_tokenizer, sft_conversations, write_jsonl
from llama_xla_helpers.configs import get_config
from llama_xla_helpers.train import Clock, build_model, first_batch, optimizer_step, profile_step, setup, train
import test_train
import test_train_bf16
from test_train import OPTIONS, SMALL, SMALL_FP32
from util import preempted

# test_train.py's tests, with the options a real run adds (AdamW, warm-up then cosine, clipping, 2 micro-batches)
@pytest.mark.devices
def test_training_with_the_options_compiles_two_graphs():
    test_train.test_training_compiles_two_graphs_however_many_steps("2d", None, OPTIONS)


@pytest.mark.devices
def test_sharded_training_with_the_options_matches_unsharded_whole_batches():
    test_train.test_sharded_training_matches_unsharded("2d", None, OPTIONS)


def test_a_bf16_run_with_the_options_resumes_as_if_never_interrupted(tmp_path, monkeypatch):
    test_train_bf16.test_a_bf16_run_resumes_as_if_never_interrupted(tmp_path, monkeypatch, OPTIONS)


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_resume_gives_the_losses_of_an_uninterrupted_run(tmp_path, monkeypatch, background):
    """fp32, with AdamW, a schedule, clipping and accumulation: the schedule's position is in the
    optimizer state, so it resumes too. metrics.jsonl holds every step once, the resumed ones after.
    In the background too: the stop signal's save commits before the run returns."""
    run = dataclasses.replace(SMALL_FP32, steps=6, checkpoint_every=3, checkpoint_dir=str(tmp_path / "ck"),
                              log_every=2, eval_every=3, async_checkpoint=background, **OPTIONS)
    whole = train(dataclasses.replace(run, checkpoint_dir=str(tmp_path / "whole")))
    preempted(run, 3, monkeypatch)
    with open(tmp_path / "ck" / "metrics.jsonl", "a") as f:          # a step the crash lost after the checkpoint
        f.write(json.dumps(dict(step=4, loss=0.0)) + "\n")
    resumed = train(dataclasses.replace(run, resume=True))
    assert resumed.losses == {step: whole.losses[step] for step in (4, 5, 6)}  # bit for bit
    rows, want = runlog.read(tmp_path / "ck"), runlog.read(tmp_path / "whole")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in rows] == [r["loss"] for r in want] == [whole.losses[s] for s in range(1, 7)]
    assert [r["grad_norm"] for r in rows] == [r["grad_norm"] for r in want]
    schedule = resumed.optimizer.schedule
    assert [r["lr"] for r in rows] == pytest.approx([schedule(s).item() for s in range(1, 7)], rel=1e-6)
    assert rows[1]["lr"] == pytest.approx(1e-3) and rows[5]["lr"] == pytest.approx(1e-4)  # peak at warm-up's end; floor
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6]  # evaluated at step 3 and at the end
    assert rows[5]["val_loss"] == resumed.val_losses[6] and rows[5]["compiles"] == resumed.train_compiles
    assert all(r["step_time"] > 0 and r["tokens_per_sec"] > 0 for r in rows)
    with pytest.raises(ValueError, match="trained with seq_len=32 but this run has seq_len=40"):
        train(dataclasses.replace(run, seq_len=40, resume=True))


def test_a_micro_batch_is_its_share_of_the_whole_batch_mean():
    """SFT-like labels, masked unevenly: 4 micro-batches with different token counts give the loss and
    gradients of the whole batch at once (each weighs by its tokens, not by 1/4)."""
    cfg, mesh, config = setup(dataclasses.replace(SMALL_FP32, batch_size=4 * SMALL.batch_size))
    ids = first_batch(cfg, mesh)
    labels = ids.clone()
    labels[: ids.shape[0] // 2, : 3 * ids.shape[1] // 4] = IGNORE_INDEX  # the first rows lose most tokens

    class Capture:  # an optimizer that keeps the gradients it is given
        def __init__(self, params):
            self.params = list(params)

        def step(self):
            self.grads = [p.grad for p in self.params]  # read after the step's one graph has run

        def zero_grad(self, set_to_none=True):
            for p in self.params:
                p.grad = None

    runs = []
    for k in (1, 4):
        model = build_model(config, mesh, dtype=torch.float32)
        optimizer = Capture(model.parameters())
        loss, norm = optimizer_step(model, optimizer, ids, labels, k)
        torch_xla.sync()
        runs.append((loss.item(), norm.item(), [g.cpu() for g in optimizer.grads]))
    (loss1, norm1, grads1), (loss4, norm4, grads4) = runs
    assert loss4 == pytest.approx(loss1, rel=1e-6) and norm4 == pytest.approx(norm1, rel=1e-5)
    for g1, g4 in zip(grads1, grads4):
        torch.testing.assert_close(g4, g1, rtol=1e-4, atol=1e-7)


def test_gradient_reductions_run_once_per_micro_batch():
    """The formula in train.optimizer_step's docstring, from the compiled step's HLO: the all-reduce
    bytes grow by one reduction of the gradients per micro-batch (each device reduces its 'model'
    shard of every gradient over 'data'); XLA does not fold the K reductions into one."""
    cfg = dataclasses.replace(SMALL_FP32, seq_len=24, batch_size=4 * SMALL.batch_size)
    data, model = setup(cfg)[0].mesh
    if data == 1:
        pytest.skip("no 'data' axis to reduce over")
    grads = sum(p.numel() * 4 for p in LlamaForCausalLM(get_config(cfg.model)).parameters())  # fp32 bytes
    reduced = {k: profile_step(dataclasses.replace(cfg, grad_accum=k))["collectives"][1] for k in (1, 2, 4)}
    per_micro_batch = [(reduced[2]["all-reduce"] - reduced[1]["all-reduce"]),
                       (reduced[4]["all-reduce"] - reduced[2]["all-reduce"]) / 2]
    print({k: round(r["all-reduce"] / 2**20, 2) for k, r in reduced.items()}, "MiB all-reduced;",
          [round(b / 2**20, 2) for b in per_micro_batch], "MiB per micro-batch; gradients / model:",
          round(grads / model / 2**20, 2))
    assert per_micro_batch[1] == pytest.approx(per_micro_batch[0], rel=0.1)  # linear in K
    assert per_micro_batch[0] == pytest.approx(grads / model, rel=0.15)
    assert reduced[4]["all-gather"] <= reduced[1]["all-gather"]  # the weights are gathered no more often


def test_the_training_clock_stops_for_saves_and_evaluations(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(train_module.time, "perf_counter", lambda: now[0])
    clock = Clock()
    start = clock.now()
    now[0] += 2
    with clock.stopped():
        now[0] += 30  # a checkpoint save
    now[0] += 1
    assert clock.now() - start == 3


def test_logging_adds_no_host_read():
    """Each step's loss and gradient norm come back in one transfer, a step or more late, as the loss
    alone did: a run's reads from the device are one per step plus the evaluation's one."""
    count = lambda: (met.metric_data("TransferFromDeviceTime") or (0,))[0]
    cfg = dataclasses.replace(SMALL, steps=5, log_every=2, eval_batches=1, seq_len=36, **OPTIONS)  # a new shape
    before = count()
    result = train(cfg)
    assert count() - before == cfg.steps + 1  # the held-out loss at the end: one more
    assert result.train_compiles == 2 and sorted(result.losses) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("attention", ["eager", "blockwise"])
def test_a_tokenizer_sizes_the_model_and_sft_trains_on_the_assistant_tokens(tmp_path, attention):
    """--tokenizer: a random-init model gets the tokenizer's vocabulary (rounded up to 64) and the
    tokenizer is saved beside the checkpoints, where serve finds it. --sft: chat conversations
    through the tokenizer's template; the run compiles its 2 graphs and the loss falls. With
    blockwise attention the conversations are packed into rows (pack's default), with eager not."""
    tokenizer = small_tokenizer(vocab_size=500, path=tmp_path / "tok")
    write_jsonl(tmp_path / "chats.jsonl", sft_conversations(192))  # packed: 8 held-out rows or more
    run = dataclasses.replace(SMALL_FP32, steps=6, seq_len=256, tokenizer=str(tmp_path / "tok"), sft=str(tmp_path / "chats.jsonl"),
                              checkpoint_dir=str(tmp_path / "ck"), optimizer="adamw", lr=3e-3, attention=attention)
    packed = attention != "eager"
    assert len(train_module.datasets(setup(run)[0], tokenizer)[0]) == (4 if packed else 2)  # the rows' columns
    result = train(run)
    assert result.model.config.vocab_size == 512 and result.train_compiles == 2
    assert result.losses[6] < result.losses[1]
    step = checkpoint.latest(run.checkpoint_dir)
    served = serve.read_tokenizer(run.checkpoint_dir, step, result.model.config)
    assert served.get_vocab() == tokenizer.get_vocab()
    # A profiled step (first_batch) reads the same rows as the run: the tokenizer's ids, not bytes.
    _, mesh, _ = setup(run)
    (ids, _), _ = train_module.datasets(run, tokenizer)
    assert torch.equal(first_batch(run, mesh).cpu(), ids[:run.batch_size])


def test_a_held_out_split_smaller_than_a_batch_is_an_error_before_any_work(tmp_path):
    small_tokenizer(vocab_size=500, path=tmp_path / "tok")
    write_jsonl(tmp_path / "chats.jsonl", sft_conversations(40))  # 4 held-out rows at most
    run = dataclasses.replace(SMALL_FP32, seq_len=256, tokenizer=str(tmp_path / "tok"), sft=str(tmp_path / "chats.jsonl"))
    with pytest.raises(ValueError, match=r"held-out split has \d+ rows .* fewer than batch_size="):
        train(run)


def test_a_model_and_a_tokenizer_that_do_not_fit_are_an_error_before_any_work(tmp_path):
    """The old silent case: init_from a model with another vocabulary and no tokenizer of its own
    trained it on byte ids. Now an error, as is a tokenizer longer than the model's vocabulary."""
    other = LlamaForCausalLM(get_config("tiny", vocab_size=512, bos_token_id=1, eos_token_id=2))
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="not trained with the byte tokenizer"):
        train(dataclasses.replace(SMALL, init_from=str(tmp_path / "other")))
    small_tokenizer(vocab_size=600, path=tmp_path / "tok")
    with pytest.raises(ValueError, match="vocab_size is 512"):
        train(dataclasses.replace(SMALL, init_from=str(tmp_path / "other"), tokenizer=str(tmp_path / "tok")))
