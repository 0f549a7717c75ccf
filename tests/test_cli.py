"""The training CLI as a user runs it: a bad argument is one `error:` line and exit status 2,
a finished run says so, a corrupt checkpoint is skipped loudly, SIGTERM checkpoints and exits 0.

Most cases call the CLI's `main(argv)` in this process (the same code a real process runs, from
the parsed arguments to the exit status); the exit status and the single stderr line of a real
process, and SIGTERM, are checked with real processes."""
import argparse
import dataclasses
import importlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from llama_xla_helpers import checkpoint, parallel
from llama_xla_helpers import cli as cli_module
from llama_xla_helpers.train import TrainConfig, main, train

TRAIN = [sys.executable, "-m", "llama_xla_helpers.train"]
QUICK = ["--model", "micro", "--batch-size", "8", "--seq-len", "32", "--eval-batches", "1"]
ENV = {**os.environ, "CPU_NUM_DEVICES": "8"}


def run(*args, timeout=300):
    return subprocess.run(TRAIN + list(args), capture_output=True, text=True, timeout=timeout, env=ENV)


def cli(main_fn, argv, capsys):
    """Run a CLI's main(argv) here: (exit status, stdout, stderr); SystemExit gives the status."""
    try:
        main_fn(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def one_error_line(code, err, message):
    lines = [l for l in err.splitlines() if l.strip() and not l.startswith(("W0000", "WARNING", "I0000"))]
    return code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]


@pytest.mark.parametrize("args, message", [
    (["--seq-len", "0"], "seq_len=0: the tokens per sequence must be an int >= 1"),
    (["--lr", "-1"], "lr=-1.0 must be a finite number > 0"),
    (["--steps", "0"], "steps=0: the optimizer steps to run must be an int >= 1"),
    (["--steps", "-3"], "steps=-3"),
    (["--batch-size", "0"], "batch_size=0"),
    (["--checkpoint-every", "0"], "checkpoint_every=0"),
    (["--keep", "0"], "keep=0: the checkpoints kept must be an int >= 1"),
    (["--mesh", "0,2"], r"mesh=(0, 2) must be two ints >= 1"),
    (["--mesh=-4,2"], r"mesh=(-4, 2) must be two ints >= 1"),
    (["--mesh", "4,x"], "'4,x' is not a list of ints like 4,2"),
    (["--model", "llama-1b"], "unknown config 'llama-1b'; known names: tiny"),
    (["--dtype", "fp16"], "dtype='fp16' is not one of fp32, bf16"),
    (["--resume"], "resume=True needs checkpoint_dir"),
    (["--data", "/nonexistent/corpus.txt"], "data file '/nonexistent/corpus.txt' does not exist"),
])
def test_bad_argument_is_one_error_line(args, message, capsys):
    code, _, err = cli(main, args, capsys)
    assert one_error_line(code, err, message), (code, err[-2000:])


def test_a_bad_default_dtype_variable_is_one_error_line(monkeypatch, capsys):
    monkeypatch.setenv("LLAMA_XLA_DEFAULT_DTYPE", "half")
    code, _, err = cli(main, QUICK, capsys)
    assert one_error_line(code, err, "LLAMA_XLA_DEFAULT_DTYPE='half'"), (code, err[-2000:])
    monkeypatch.setenv("LLAMA_XLA_DEFAULT_DTYPE", "bf16")
    code, _, err = cli(main, QUICK + ["--dtype", "fp16"], capsys)  # an explicit --dtype is checked first
    assert one_error_line(code, err, "dtype='fp16' is not one of fp32, bf16"), (code, err[-2000:])


@pytest.mark.child_process
def test_a_real_process_exits_2_with_one_error_line():
    out = subprocess.run(TRAIN + ["--seq-len", "0"], capture_output=True, text=True, timeout=300, env=ENV)
    assert one_error_line(out.returncode, out.stderr, "seq_len=0"), out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def test_init_from_a_folder_that_is_not_a_llama(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2}')
    code, _, err = cli(main, ["--init-from", str(tmp_path), *QUICK], capsys)
    assert one_error_line(code, err, f"error: {tmp_path / 'config.json'} describes a 'gpt2' model, not a Llama"), err


def test_binary_data_names_the_offset(tmp_path, capsys):
    binary_file = tmp_path / "weights.bin"
    binary_file.write_bytes(b"plain text, then \xff\xfe not UTF-8")
    code, _, err = cli(main, ["--data", str(binary_file), *QUICK], capsys)
    assert one_error_line(code, err, f"error: {binary_file} is not UTF-8 text: byte 17 is 0xff"), err
    with pytest.raises(ValueError, match="is not UTF-8 text"):  # --debug: the exception and its traceback
        main(["--data", str(binary_file), "--debug", *QUICK])


def test_a_finished_run_says_so_and_exits_0(tmp_path, capsys):
    code, out, err = cli(main, ["--steps", "2", "--checkpoint-dir", str(tmp_path), *QUICK], capsys)
    assert code == 0, err[-2000:]
    assert "tokens/s/chip: not enough steps to measure" in out  # not "nan tokens/s/chip"
    code, out, err = cli(main, ["--steps", "2", "--checkpoint-dir", str(tmp_path), "--resume", *QUICK], capsys)
    assert code == 0, err[-2000:]
    assert "the run is already complete: the newest checkpoint is at step 2 (--steps 2); held-out loss" in out


def test_resume_skips_a_truncated_newest_checkpoint_loudly(tmp_path, capsys):
    args = ["--checkpoint-every", "2", "--checkpoint-dir", str(tmp_path), *QUICK]
    assert cli(main, ["--steps", "4", *args], capsys)[0] == 0
    shard = tmp_path / "step_00000004" / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)
    with pytest.warns(UserWarning, match="step_00000004 is corrupt: __0_0.distcp has .* using step_00000002"):
        code, out, err = cli(main, ["--steps", "6", "--resume", *args], capsys)
    assert code == 0, err[-2000:]
    assert "resuming from step_00000002: step 3 next" in out
    for step in (2, 4):  # every checkpoint of everything it lost
        os.truncate(tmp_path / f"step_0000000{step}" / "__0_0.distcp", 10)
    os.remove(tmp_path / "step_00000006" / "meta.json")
    code, _, err = cli(main, ["--steps", "8", "--resume", *args], capsys)
    assert one_error_line(code, err, f"error: no checkpoint in '{tmp_path}' verifies (step_00000004 is corrupt"), err


@pytest.mark.child_process
def test_sigterm_saves_the_current_step_and_a_resume_matches_an_uninterrupted_run(tmp_path):
    """A spot / preemptible VM's notice: checkpoint at the end of the current step, exit 0."""
    cmd = TRAIN + ["--steps", "400", "--checkpoint-every", "10", "--checkpoint-dir", str(tmp_path), *QUICK]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV)
    deadline = time.time() + 300
    while checkpoint.latest(tmp_path) is None:  # training is under way
        assert proc.poll() is None and time.time() < deadline, "training ended or stalled before step 10"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0
    step = checkpoint.read_meta(checkpoint.latest(tmp_path))["step"]
    assert 10 <= step < 400 and f"stop signal (SIGTERM or SIGHUP): saved a checkpoint at step {step}" in stdout

    cfg = TrainConfig(model="micro", steps=step + 3, batch_size=8, seq_len=32, eval_batches=1,
                      checkpoint_dir=str(tmp_path), resume=True)  # QUICK's
    resumed = train(cfg).losses
    whole = train(dataclasses.replace(cfg, resume=False, checkpoint_dir=None)).losses
    assert resumed == {s: whole[s] for s in range(step + 1, step + 4)}  # bit for bit


@pytest.mark.parametrize("args, message", [
    (["reshard", "/nonexistent", "{dst}", "--factor", "2"], "/nonexistent has no config.json"),
    (["reshard", "{src}", "{dst}", "--factor", "3"], "factor=3 gives 12 KV heads, which do not divide n_heads=8"),
    (["reshard", "{src}", "{dst}", "--factor", "two"], "argument --factor: invalid int value: 'two'"),
    (["reshard", "{src}"], "the following arguments are required: dst"),
])
def test_reshard_cli_bad_arguments(tmp_path, args, message, capsys):
    from llama_xla_helpers.configs import get_config
    from util import hf_model
    src = tmp_path / "src"
    hf_model(get_config("tiny", num_hidden_layers=1)).save_pretrained(src)
    capsys.readouterr()  # save_pretrained's progress bar
    argv = [a.format(src=src, dst=tmp_path / "dst") for a in args]
    code, _, err = cli(parallel.main, argv, capsys)
    assert one_error_line(code, err, message), err
    assert not (tmp_path / "dst").exists()


def help_entries(text):
    """{an argument or subcommand of a --help text (its first spelling: "--max-queue", "dir", "run"): its help},
    read from the argument sections; a help may start on the next line and wrap over several."""
    entries, name, section, commands = {}, None, False, ()
    for line in text.splitlines():
        if line in ("positional arguments:", "options:", "optional arguments:"):
            section = True
        elif not line.strip():
            section = False
        elif section:
            indent, (first, *rest) = len(line) - len(line.lstrip()), re.split(r"\s{2,}", line.strip(), maxsplit=1)
            if indent == 2 or first in commands:  # a new argument, or a subcommand of the {a,b} line above it
                name = first.split(", ")[-1].split()[0]  # "-h, --help" -> "--help"; "--slots SLOTS" -> "--slots"
                commands = name.strip("{}").split(",") if name.startswith("{") else commands
                entries[name] = " ".join(rest)
            else:
                entries[name] = f"{entries[name]} {line.strip()}".strip()
    return entries


def cli_help(main_fn, argv, capsys, monkeypatch):
    """(the --help text main_fn(argv) prints, its parser): in this process, which `--help` leaves before any work."""
    parsers = []
    monkeypatch.setattr(cli_module.ArgumentParser, "format_help",
                        lambda self: parsers.append(self) or argparse.ArgumentParser.format_help(self))
    code, out, err = cli(main_fn, argv, capsys)
    assert code == 0 and len(parsers) == 1, (code, err[-2000:])
    return out, parsers[0]


@pytest.mark.parametrize("module, argv", [
    ("train", ["--help"]), ("serve", ["--help"]), ("doctor", ["--help"]),
    ("export", ["--help"]), ("export", ["export", "--help"]), ("export", ["run", "--help"]),
    ("parallel", ["--help"]), ("parallel", ["reshard", "--help"]),
])
def test_help_has_a_line_with_its_default_for_every_option(module, argv, capsys, monkeypatch):
    """`--help` of every CLI: each argument, option and subcommand has a help line, and each option with a
    default to show (not None: the help says what leaving it out does; not a flag's False) names it."""
    monkeypatch.setenv("COLUMNS", "100")  # help lines wrap, as in a terminal
    monkeypatch.delenv("LLAMA_XLA_API_KEY", raising=False)  # serve's --api-key default; its help names the variable
    text, parser = cli_help(importlib.import_module(f"llama_xla_helpers.{module}").main, argv, capsys, monkeypatch)
    entries = help_entries(text)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            names = [choice.dest for choice in action._choices_actions]
        else:
            names = [action.option_strings[-1] if action.option_strings else action.metavar or action.dest]
        for name in names:
            assert entries.get(name), f"{module} {' '.join(argv)}: {name} has no help line:\n{text}"
        if not any(action.default is v for v in (None, False, argparse.SUPPRESS)):
            shown = ",".join(map(str, action.default)) if isinstance(action.default, (tuple, list)) \
                else str(action.default)
            assert re.search(rf"default:? {re.escape(shown)}(?![\w.])", entries[names[0]]), \
                f"{module} {' '.join(argv)}: {names[0]}'s help does not give its default {shown}: {entries[names[0]]!r}"
