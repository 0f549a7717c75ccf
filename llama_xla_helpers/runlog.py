"""A training run's metrics: `metrics.jsonl` next to its checkpoints, and TensorBoard event files.

One JSON object per line, one line per step, in the order the steps ran:

    {"step": 12, "loss": 3.91, "lr": 0.0009, "grad_norm": 1.7, "step_time": 0.21, "tokens_per_sec": 9753,
     "compiles": 2}
    {"step": 20, ..., "val_loss": 3.85}     # the steps that evaluated also carry the held-out loss

`step_time` is the host's time between two steps' dispatches (in steady state the host waits for the
device, so it is the device's step time); checkpoint saves and evaluations are not in it. `compiles`
counts the graphs compiled since the run started. The loop writes a step's line a step or more
late, when it reads the loss back anyway (`TrainConfig.log_every`), so logging adds no host sync.

Only process 0 writes. A resumed run first cuts the file back to the step it resumes from, so the
file always describes one run (the steps after that checkpoint, lost in the crash, are gone). A
local file gets its lines appended as they come; on an object store (gs://), where appending is not
possible, the whole file is rewritten at each checkpoint (`flush`).

TensorBoard: with the `log` extra installed (pip install -e '.[log]'), the same values go to event
files in `<checkpoint_dir>/tensorboard` (`tensorboard --logdir <checkpoint_dir>`), for a local folder
(TensorBoard writes to gs:// only through TensorFlow). Without it, nothing else changes: the JSONL
file needs nothing beyond the standard library and fsspec.

Sources: the JSON Lines format, https://jsonlines.org; torch.utils.tensorboard,
https://pytorch.org/docs/stable/tensorboard.html.
"""
import json

import fsspec

FILE = "metrics.jsonl"
SCALARS = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_sec", "step_time")  # TensorBoard's charts


def read(folder):
    """The rows of `folder`'s metrics.jsonl (a list of dicts; [] if there is none)."""
    fs, path = fsspec.core.url_to_fs(f"{str(folder).rstrip('/')}/{FILE}")
    if not fs.exists(path):
        return []
    with fs.open(path, "r") as f:
        return [json.loads(line) for line in f if line.strip()]


class RunLog:
    """The metrics of the run checkpointed in `folder`, from step `start` on (0: a new run)."""

    def __init__(self, folder, start=0):
        self.folder, self.remote = str(folder).rstrip("/"), "://" in str(folder)
        self.rows = [row for row in read(folder) if row["step"] <= start]  # a resumed run's past
        self.fs, self.path = fsspec.core.url_to_fs(f"{self.folder}/{FILE}")
        self.fs.makedirs(self.fs._parent(self.path), exist_ok=True)
        self.board = tensorboard_writer(self.folder)
        self.flush()  # cut back to `start` now, not at the first checkpoint

    def write(self, rows):
        """Add the rows of some steps (dicts with at least "step")."""
        self.rows += rows
        if not self.remote:
            with self.fs.open(self.path, "a") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
        for row in rows if self.board else ():
            for key in SCALARS:
                if row.get(key) is not None:
                    self.board.add_scalar(key, row[key], row["step"])

    def flush(self):
        """Write the whole file (an object store's only way to add lines; a checkpoint calls it)."""
        with self.fs.open(self.path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in self.rows)
        if self.board:
            self.board.flush()

    def close(self):
        self.flush()
        if self.board:
            self.board.close()


def tensorboard_writer(folder):
    """A SummaryWriter into folder/tensorboard, or None without the `log` extra (tensorboard) or for a URL."""
    if "://" in folder:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch's module imports tensorboard
        return None
    return SummaryWriter(f"{folder}/tensorboard")
