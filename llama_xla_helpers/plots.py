"""Every figure (and text table) the notebooks and benchmarks show.

Each plot function returns a matplotlib Figure (a notebook displays it once), labelled with its
name (`fig.get_label()`), and, when the environment variable LLAMA_XLA_FIGURES names a folder
(`make tour` sets it), saves it there as <name>.png.
"""
import os

import numpy as np
from matplotlib import rcParams
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

from .sharding import device_blocks


def _finish(fig, name):
    fig.set_label(name)  # fig.get_label(): which figure it is
    folder = os.environ.get("LLAMA_XLA_FIGURES")
    if folder:
        os.makedirs(folder, exist_ok=True)
        fig.savefig(os.path.join(folder, f"{name}.png"), dpi=110, bbox_inches="tight")
    return fig


def table(rows, columns=None):
    """Format a list of dicts as a fixed-width text table."""
    columns = columns or list(rows[0])
    cells = [[str(r[c]) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def plot_mesh(mesh, name="mesh", slices=1):
    """A 1D or 2D mesh as a grid of device ids, axes labelled with the mesh axis names.

    slices > 1 (a hybrid mesh, slice s holding the ids s*k ... s*k + k - 1): each slice's block
    is framed and labelled, so the slice boundary shows (rows when the DCN part is on the first
    axis, columns when it is on the second)."""
    grid = mesh.get_logical_mesh()
    grid = grid.reshape(1, -1) if grid.ndim == 1 else grid.reshape(grid.shape[0], -1)
    names = mesh.axis_names if len(mesh.axis_names) == 2 else ("", mesh.axis_names[0])
    fig = Figure(figsize=(0.7 * grid.shape[1] + 1.5, 0.7 * grid.shape[0] + 1))
    ax = fig.subplots()
    ax.imshow(grid, cmap="tab20", vmin=0, vmax=19)
    for (i, j), d in np.ndenumerate(grid):
        ax.text(j, i, str(d), ha="center", va="center", fontsize=12)
    ax.set_xticks([]), ax.set_yticks([])
    ax.set_ylabel(f"{names[0]} ({grid.shape[0]})" if names[0] else "")
    ax.set_xlabel(f"{names[1]} ({grid.shape[1]})")
    ax.set_title(f"mesh {tuple(mesh.mesh_shape)}" + (f", {slices} slices" if slices > 1 else ""))
    for s in range(slices if slices > 1 else 0):  # one frame per slice around its block of the grid
        rows, cols = np.nonzero(grid // (grid.size // slices) == s)
        top, left, height, width = rows.min(), cols.min(), np.ptp(rows) + 1, np.ptp(cols) + 1
        ax.add_patch(Rectangle((left - 0.45, top - 0.45), width - 0.1, height - 0.1, fill=False, lw=2.5))
        if width == grid.shape[1]:  # a block of rows: its label on the right
            ax.text(grid.shape[1] - 0.4, top + (height - 1) / 2, f" slice {s}", va="center", fontsize=11)
        else:  # a block of columns: below it
            ax.text(left + (width - 1) / 2, grid.shape[0] - 0.3, f"slice {s}", ha="center", va="top", fontsize=11)
    if slices > 1:  # room for the labels: on the right of row blocks, below column blocks
        rows_blocks = width == grid.shape[1]
        ax.set_xlim(-0.5, grid.shape[1] + (0.8 if rows_blocks else -0.5))
        ax.set_ylim(grid.shape[0] + (-0.5 if rows_blocks else 0.2), -0.5)
    return _finish(fig, name)


def plot_sharding(t, title="", name="sharding"):
    """A 2D XLA tensor cut into the blocks its devices hold, each block labelled with its devices."""
    rows, cols = t.shape
    holders = {}
    for device, (r, c) in device_blocks(t):
        holders.setdefault((r.start, r.stop, c.start, c.stop), []).append(device)
    fig = Figure(figsize=(4.5, 4.5 * rows / cols + 0.6))
    ax = fig.subplots()
    for k, ((r0, r1, c0, c1), devices) in enumerate(sorted(holders.items())):
        ax.add_patch(Rectangle(
            (c0, r0), c1 - c0, r1 - r0, facecolor=f"C{k % 10}", alpha=0.5, edgecolor="black"))
        ax.text((c0 + c1) / 2, (r0 + r1) / 2, ",".join(map(str, sorted(devices))), ha="center", va="center")
    ax.set_xlim(0, cols), ax.set_ylim(rows, 0)
    ax.set_xlabel(f"dim 1 ({cols})"), ax.set_ylabel(f"dim 0 ({rows})")
    ax.set_title(title or f"shape {tuple(t.shape)}: devices per block")
    return _finish(fig, name)


def plot_bars(groups, ylabel, title, name, log=False):
    """Grouped bars: groups = {group label: {series label: value}}; a group may be empty (all zero)."""
    series = list(dict.fromkeys(s for g in groups.values() for s in g)) or [""]
    fig = Figure(figsize=(1.2 * len(groups) * max(1, len(series) / 2) + 2, 3.5))
    ax = fig.subplots()
    width = 0.8 / len(series)
    for k, s in enumerate(series):
        xs = [i + k * width for i in range(len(groups))]
        ax.bar(xs, [g.get(s, 0) for g in groups.values()], width, label=s)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(groups))], list(groups))
    ax.set_ylabel(ylabel), ax.set_title(title)
    if log:
        ax.set_yscale("log")
    if len(series) > 1:  # beside the axes, so it covers no bar
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return _finish(fig, name)


def plot_loss(losses, val_losses, name="loss"):
    """Training loss per step and held-out loss at the steps it was measured (nats per byte)."""
    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    ax.plot(list(losses), list(losses.values()), lw=1, label="train")
    ax.plot(list(val_losses), list(val_losses.values()), "o-", label="held-out")
    ax.set_xlabel("step"), ax.set_ylabel("loss (nats / byte)"), ax.legend()
    return _finish(fig, name)


def plot_run(rows, name="run"):
    """A run's curves from its metrics.jsonl rows (`runlog.read(folder)`), against the step: the training
    loss (and the held-out loss where it was measured), the learning rate, the gradient norm."""
    fig = Figure(figsize=(11, 3))
    loss, lr, norm = fig.subplots(1, 3)
    steps = [r["step"] for r in rows]
    loss.plot(steps, [r["loss"] for r in rows], lw=1, label="train")
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    loss.plot([s for s, _ in val], [v for _, v in val], "o-", label="held-out")
    loss.set_ylabel("loss (nats / token)"), loss.legend()
    lr.plot(steps, [r["lr"] for r in rows], lw=1), lr.set_ylabel("learning rate")
    norm.plot(steps, [r["grad_norm"] for r in rows], lw=1), norm.set_ylabel("gradient norm (before clipping)")
    for ax in (loss, lr, norm):
        ax.set_xlabel("step")
    fig.tight_layout()
    return _finish(fig, name)


def plot_loss_mask(pieces, counted, name="loss_mask", per_line=12):
    """One SFT example's tokens in order, `per_line` to a row, each a box with its text: filled
    where the loss counts it (counted[i] True: the assistant's tokens), outlined where it is
    masked (labels IGNORE_INDEX: the prompt, the role headers, BOS)."""
    rows = (len(pieces) + per_line - 1) // per_line
    fig = Figure(figsize=(1.0 * per_line, 0.6 + 0.32 * rows))
    ax = fig.subplots()
    color = rcParams["axes.prop_cycle"].by_key()["color"][0]
    for i, (piece, c) in enumerate(zip(pieces, counted)):
        x, y = i % per_line, i // per_line
        ax.add_patch(Rectangle((x + 0.03, y + 0.08), 0.94, 0.84, color=color, fill=bool(c), alpha=0.8 if c else 0.4))
        ax.text(x + 0.5, y + 0.5, piece.replace("\n", "\\n")[:10], ha="center", va="center", fontsize=7,
                color="white" if c else "black")
    ax.set_xlim(0, per_line), ax.set_ylim(rows, 0), ax.axis("off")
    ax.set_title(f"filled: in the loss ({sum(map(bool, counted))} of {len(pieces)} tokens); outlined: masked")
    return _finish(fig, name)


def plot_lines(series, xlabel, ylabel, title, name, log=False, marks=(), integer_y=False):
    """One line per series: series = {label: {x: y}}. `marks`: x values to draw as dotted
    vertical lines (e.g. bucket boundaries); integer_y: only whole numbers on the y axis."""
    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    for label, points in series.items():
        ax.plot(list(points), list(points.values()), "o-", label=label)
    for x in marks:
        ax.axvline(x, color="gray", ls=":", lw=1)
    ax.set_xlabel(xlabel), ax.set_ylabel(ylabel), ax.set_title(title)
    if log:
        ax.set_yscale("log")
    if integer_y:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8)
    return _finish(fig, name)


def plot_pages(timeline, total=None, name="page_timeline", title="the KV cache pages each request holds"):
    """The engine's page timeline: timeline[step] = {request id: pages held} (`Engine.timeline`,
    `scheduler.replay`); each request a coloured band, stacked, labelled with its id where it is
    widest; `total`: the pool's pages, a dashed line."""
    timeline = list(timeline)  # Engine.timeline is a deque: indexing its middle walks it
    ids = sorted({rid for step in timeline for rid in step})
    held = np.array([[step.get(rid, 0) for step in timeline] for rid in ids])  # (requests, steps)
    fig = Figure(figsize=(7.5, 3.5))
    ax = fig.subplots()
    colors = [c["color"] for c in rcParams["axes.prop_cycle"]]
    steps = np.arange(len(timeline))
    ax.stackplot(steps, held, colors=[colors[rid % len(colors)] for rid in ids], step="post")
    below = np.cumsum(held, axis=0) - held / 2  # each band's middle
    for k, rid in enumerate(ids):
        widest = held[k].argmax()
        if held[k, widest] >= 2:
            ax.text(widest, below[k, widest], str(rid), ha="center", va="center", fontsize=8, color="white")
    if total is not None:
        ax.axhline(total, color="black", ls="--", lw=1, label=f"the pool: {total} pages")
        ax.legend(loc="upper right", fontsize=8)
    ax.set_xlim(0, len(timeline)), ax.set_xlabel("step"), ax.set_ylabel("pages held"), ax.set_title(title)
    return _finish(fig, name)


def plot_timeline(events, name="step_timeline", title="traced steps"):
    """A step timeline: events = [(name, start_ms, duration_ms), ...] (`profile.step_timeline`);
    one row per event name, in order of first appearance, each event a bar from its start."""
    rows = list(dict.fromkeys(e[0] for e in events))
    fig = Figure(figsize=(8, 0.6 + 0.4 * len(rows)))
    ax = fig.subplots()
    colors = [c["color"] for c in rcParams["axes.prop_cycle"]]
    for i, row in enumerate(rows):
        bars = [(start, duration) for label, start, duration in events if label == row]
        ax.broken_barh(bars, (i - 0.4, 0.8), color=colors[i % len(colors)])
    ax.set_yticks(range(len(rows)), [r.split("::")[-1] for r in rows])  # C++ scopes: the last part
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel("time (ms)"), ax.set_title(title)
    return _finish(fig, name)


def plot_roofline(chips, points, name="roofline", title="decode steps on the roofline"):
    """One roofline per chip, log-log: attainable FLOP/s = min(peak FLOP/s, intensity * HBM bytes/s)
    against arithmetic intensity (FLOPs per HBM byte); chips = {chip: (peak FLOP/s, HBM bytes/s)}.
    Each chip's ridge point (peak / bandwidth: left of it a step is memory-bound) is a dotted line.
    points = {label: (chip, intensity, FLOP/s)}: one marker each, in its chip's colour."""
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    colors = [c["color"] for c in rcParams["axes.prop_cycle"]]
    ridges = [peak / bandwidth for peak, bandwidth in chips.values()]
    lowest = min(intensity for _, intensity, _ in points.values())
    x = np.logspace(np.log10(lowest / 4), np.log10(max(ridges) * 4), 200)
    for k, (chip, (peak, bandwidth)) in enumerate(chips.items()):
        ax.plot(x, np.minimum(peak, x * bandwidth), color=colors[k % len(colors)],
                label=f"{chip} (ridge {peak / bandwidth:.0f})")
        ax.axvline(peak / bandwidth, color=colors[k % len(colors)], ls=":", lw=1)
    for m, (label, (chip, intensity, flops)) in enumerate(points.items()):
        ax.plot(intensity, flops, "osD^vPX*"[m % 8], color=colors[list(chips).index(chip) % len(colors)],
                mec="black", ls="", ms=8, label=label)
    ax.set_xscale("log"), ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOPs per HBM byte)"), ax.set_ylabel("FLOP/s per chip")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the axes, so it covers no line
    return _finish(fig, name)


def weight_blocks(t):
    """The blocks of a 2D XLA tensor and who holds them, from its shards (sharding.device_blocks):
    {(row start, row stop, column start, column stop): [device ids]}, in row-then-column order."""
    holders = {}
    for device, (r, c) in device_blocks(t):
        holders.setdefault((r.start, r.stop, c.start, c.stop), []).append(device)
    return {k: sorted(v) for k, v in sorted(holders.items())}


def plot_weight_splits(tensors, name="weight_splits"):
    """2D weights side by side, tensors = {title: an XLA tensor, or its blocks}: each drawn to scale as
    the blocks its devices hold (`weight_blocks`, or given as {(r0, r1, c0, c1): [ids]}, e.g. DTensor
    ranks'), each block labelled with the ids of the devices that hold it."""
    fig = Figure(figsize=(3.4 * len(tensors), 5))
    for ax, (title, t) in zip(np.atleast_1d(fig.subplots(1, len(tensors))), tensors.items()):
        blocks = dict(sorted(t.items())) if isinstance(t, dict) else weight_blocks(t)  # row-then-column order
        rows, cols = max(b[1] for b in blocks), max(b[3] for b in blocks)  # the blocks cover the tensor
        for k, ((r0, r1, c0, c1), devices) in enumerate(blocks.items()):
            ax.add_patch(Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor=f"C{k % 10}", alpha=0.5, edgecolor="black"))
            ax.text((c0 + c1) / 2, (r0 + r1) / 2, ",".join(map(str, devices)), ha="center", va="center")
        ax.set_xlim(0, cols), ax.set_ylim(rows, 0), ax.set_aspect("equal")
        ax.set_xlabel(f"in_features ({cols})"), ax.set_ylabel(f"out_features ({rows})"), ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return _finish(fig, name)
