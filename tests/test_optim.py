import copy
import math

import pytest
import torch
import torch_xla
from util import N, hf_model, tp_size

from llama_xla_helpers.checkpoint import init_optimizer_state, load, save
from llama_xla_helpers.configs import get_config
from llama_xla_helpers.mesh import make_mesh
from llama_xla_helpers.metrics import count_compiles
from llama_xla_helpers.model import DTYPES
from llama_xla_helpers.optim import AdamW, Schedule, clip_grad_norm
from llama_xla_helpers.runtime import default_dtype
from llama_xla_helpers.sharding import shard_params
from llama_xla_helpers.train import Adafactor

spec = torch_xla._XLAC._get_xla_sharding_spec
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# Ours against torch's, both fp32: the bias corrections differ in rounding (fp32 tensors here,
# Python doubles in torch's eager path), a few ulps of the update. Tolerance fixed before measuring
# (measured since: at most 4e-7 relative, on the CPU and on XLA).
TIGHT = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def mesh(runtime):
    return make_mesh((N // tp_size(4), tp_size(4)))


def start_values(shapes=((6, 5), (5,)), seed=0):
    """Initial weights: a matrix and a vector (Adafactor factors the one, not the other)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in shapes]


def set_grads(step, *param_lists, dtype=torch.float32):
    """The same random gradients (seeded by `step`, values of `dtype`) into each list of parameters,
    on its device, in its dtype."""
    gen = torch.Generator().manual_seed(100 + step)
    for params in zip(*param_lists):
        g = torch.randn(params[0].shape, generator=gen).to(dtype)
        for p in params:
            p.grad = g.to(p.dtype).to(p.device)


def on(device, values, dtype=torch.float32):
    return [torch.nn.Parameter(v.to(device, dtype, copy=True)) for v in values]


@pytest.mark.parametrize("device", ["cpu", "xla"])
def test_adamw_equals_torch_adamw(device):
    start = start_values()
    ours, theirs = on(device, start), on("cpu", start)
    opt, ref = AdamW(ours, **HYPER), torch.optim.AdamW(theirs, **HYPER)
    for step in range(5):
        set_grads(step, ours, theirs)
        opt.step()
        ref.step()
        torch_xla.sync()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), **TIGHT)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][key].cpu(), ref.state[q][key], **TIGHT)
        assert opt.state[p]["step"].item() == ref.state[q]["step"].item() == 5
    assert all((p.detach().cpu() - s).abs().max() > 1e-2 for p, s in zip(ours, start))  # it moved


def test_bf16_master_weights_follow_fp32_adamw():
    """bf16 parameters: the fp32 master copy takes the updates as fp32 AdamW's weights do (lr 1e-4:
    most updates are below bf16's resolution), and the parameter is its rounding. Without master
    weights those updates are lost."""
    start = [v.to(torch.bfloat16).float() for v in start_values()]  # values bf16 can hold
    ours, plain, theirs = on("xla", start, torch.bfloat16), on("xla", start, torch.bfloat16), on("cpu", start)
    hyper = dict(HYPER, lr=1e-4)
    opt, plain_opt = AdamW(ours, **hyper), AdamW(plain, master_weights=False, **hyper)
    ref = torch.optim.AdamW(theirs, **hyper)
    for step in range(5):
        set_grads(step, ours, plain, theirs, dtype=torch.bfloat16)  # bf16 values, exact in the fp32 reference
        opt.step()
        plain_opt.step()
        ref.step()
        torch_xla.sync()
    for p, b, q, s in zip(ours, plain, theirs, start):
        state = opt.state[p]
        assert {state[k].dtype for k in ("master", "exp_avg", "exp_avg_sq")} == {torch.float32}
        assert p.dtype == torch.bfloat16 and torch.equal(p.cpu(), state["master"].cpu().to(torch.bfloat16))
        torch.testing.assert_close(state["master"].cpu(), q.detach(), **TIGHT)
        assert "master" not in plain_opt.state[b]
        change, plain_change = q.detach() - s, b.detach().cpu().float() - s
        assert (plain_change - change).norm() > 0.5 * change.norm()  # most of it lost


def by_hand(kind, step, lr=1e-3, warmup=10, total=100, min_lr=1e-4, fraction=0.2):
    """The schedules, written out with math: warm-up from 0, then the kind's shape, the floor after total."""
    if step < warmup:
        return lr * step / warmup
    if kind == "constant":
        return lr
    if step >= total:
        return min_lr
    if kind == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
    decay_start = total - fraction * total
    if step <= decay_start:
        return lr
    return min_lr + (lr - min_lr) * (1 - math.sqrt((step - decay_start) / (total - decay_start)))


@pytest.mark.parametrize("kind", ["cosine", "wsd", "constant"])
def test_schedules_equal_their_formulas(kind):
    schedule = Schedule(kind, lr=1e-3, warmup_steps=10, total_steps=100, min_lr=1e-4)
    steps = range(0, 131)  # warm-up, the decay or stable phase, and 30 steps past the end (the floor)
    want = [by_hand(kind, s) for s in steps]
    assert [float(schedule(s)) for s in steps] == pytest.approx(want, rel=1e-6, abs=1e-10)
    assert schedule(torch.arange(131)).tolist() == pytest.approx(want, rel=1e-6, abs=1e-10)  # a curve at once
    assert float(schedule(5)) == pytest.approx(5e-4) and float(schedule(10)) == pytest.approx(1e-3)
    floor = {"cosine": 1e-4, "wsd": 1e-4, "constant": 1e-3}[kind]
    assert float(schedule(100)) == float(schedule(130)) == pytest.approx(floor)
    if kind == "cosine":
        assert float(schedule(55)) == pytest.approx((1e-3 + 1e-4) / 2)  # half-way down the cosine
    if kind == "wsd":
        assert float(schedule(80)) == pytest.approx(1e-3)                # stable until the last 20%
        assert float(schedule(85)) == pytest.approx(1e-4 + 9e-4 * (1 - 0.5))  # 1-sqrt: a quarter in, half down
    xla_step = torch.tensor(55.0, device=torch_xla.device())
    assert schedule(xla_step).device.type == "xla" and schedule(xla_step).item() == pytest.approx(by_hand(kind, 55))


@pytest.mark.parametrize("make", [AdamW, Adafactor])
def test_a_scheduled_step_compiles_once_and_follows_the_schedule(make):
    """The lr changes every step (warm-up, stable, 1-sqrt decay) on the device: after step 2 nothing
    compiles. The weights equal the same optimizer given each step's lr as a Python float (on the CPU)."""
    schedule = Schedule("wsd", lr=1e-2, warmup_steps=2, total_steps=6, min_lr=1e-3, decay_fraction=0.5)
    start = start_values(((7, 3), (3,)), seed=1)  # shapes no other test compiles
    ours, theirs = on("xla", start), on("cpu", start)
    hyper = dict(HYPER) if make is AdamW else {}
    opt = make(ours, **dict(hyper, lr=1.0), schedule=schedule)  # lr is not used: the schedule's is
    ref = (torch.optim.AdamW if make is AdamW else Adafactor)(theirs, **hyper)
    compiles = []
    for step in range(1, 8):  # one past total_steps: the floor
        set_grads(step, ours, theirs)
        opt.step()
        ref.param_groups[0]["lr"] = float(schedule(step))
        ref.step()
        torch_xla.sync()
        compiles.append(count_compiles())
    assert compiles[1:] == [compiles[1]] * 6, compiles  # step 1 creates the state; then one graph
    assert opt.param_groups[0]["lr"] == 1e-2            # the groups record the schedule's peak
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), **TIGHT)
        assert opt.state[p]["step"].item() == 7


@pytest.mark.devices
def test_clip_grad_norm_equals_torchs_on_the_unsharded_model(mesh):
    """Gradients sharded over the mesh (in the run's default dtype): the global norm and the clipped
    gradients equal torch.nn.utils.clip_grad_norm_ on an unsharded CPU model holding the same
    gradients (in fp32), when it clips, when it does not, and when it only measures."""
    dtype = DTYPES[default_dtype()]
    model = hf_model(get_config("tiny", num_hidden_layers=2)).to(dtype)
    cpu = copy.deepcopy(model).float()
    shard_params(model, mesh, "2d")
    ids = torch.randint(0, 264, (8, 16), generator=torch.Generator().manual_seed(0)).to(torch_xla.device())
    close = TIGHT if dtype == torch.float32 else dict(rtol=2 ** -6, atol=1e-6)  # bf16: 8 bits, rounded twice
    for max_norm in (None, 1e3, 0.1):
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        torch_xla.sync()
        specs = [spec(p.grad) for p in model.parameters()]
        for p, q in zip(model.parameters(), cpu.parameters()):
            q.grad = p.grad.float().cpu()  # gathered: the unsharded gradient
        before = count_compiles()
        norm = clip_grad_norm(model.parameters(), max_norm)
        assert count_compiles() == before  # nothing ran: no host read inside
        torch_xla.sync()
        want = torch.nn.utils.clip_grad_norm_(cpu.parameters(), max_norm or math.inf)
        assert norm.item() == pytest.approx(want.item(), rel=1e-5)
        assert (want > 0.1) and (want < 1e3)  # 0.1 clips, 1e3 does not
        for p, q, s in zip(model.parameters(), cpu.parameters(), specs):
            torch.testing.assert_close(p.grad.float().cpu(), q.grad, **close)
            assert spec(p.grad) == s  # still sharded as before
    clipped = torch.stack([p.grad.float().square().sum() for p in model.parameters()]).sum().sqrt()
    assert clipped.item() == pytest.approx(0.1, rel=1e-2)


BAD = [
    (lambda p: Schedule("linear", 1e-3, 10, 100), r"kind='linear' is not one of cosine, wsd, constant"),
    (lambda p: Schedule("cosine", 0, 10, 100), r"lr=0 must be a finite number > 0"),
    (lambda p: Schedule("cosine", 1e-3, 10, 0), r"total_steps=0 must be an int >= 1"),
    (lambda p: Schedule("cosine", 1e-3, 200, 100), r"warmup_steps=200 must be an int from 0 to total_steps=100"),
    (lambda p: Schedule("cosine", 1e-3, 10, 100, min_lr=1e-2), r"min_lr=0.01 must be from 0 to lr=0.001"),
    (lambda p: Schedule("wsd", 1e-3, 10, 100, decay_fraction=0), r"decay_fraction=0 must be in \(0, 1\]"),
    (lambda p: Schedule("wsd", 1e-3, 90, 100), r"warmup_steps=90 overlaps the wsd decay, which starts at step 80"),
    (lambda p: AdamW(p, lr=-1), r"lr=-1 must be a finite number > 0"),
    (lambda p: AdamW(p, betas=(0.9, 1.0)), r"betas=\(0.9, 1.0\) must be two numbers in \[0, 1\)"),
    (lambda p: AdamW(p, eps=0), r"eps=0 must be a finite number > 0"),
    (lambda p: AdamW(p, weight_decay=-0.1), r"weight_decay=-0.1 must be a finite number >= 0"),
    (lambda p: clip_grad_norm(p, -1.0), r"max_norm=-1.0 must be a finite number >= 0"),
]


@pytest.mark.parametrize("make, message", BAD)
def test_bad_arguments_name_the_value_and_the_limit(make, message):
    with pytest.raises(ValueError, match=message):
        make([torch.nn.Parameter(torch.zeros(2))])


@pytest.mark.parametrize("make", [AdamW, Adafactor])
def test_a_loaded_state_dict_continues_exactly_schedule_included(make):
    """After 3 of 6 steps the state dict holds the schedule's position (the step tensor): a fresh
    optimizer that loads it takes steps 4-6 at the same learning rates, bit for bit (eager CPU)."""
    schedule = Schedule("cosine", lr=1e-2, warmup_steps=2, total_steps=6, min_lr=1e-3)
    params = on("cpu", start_values())
    opt = make(params, schedule=schedule)

    def run(opt, params, steps):
        for step in steps:
            set_grads(step, params)
            opt.step()

    run(opt, params, range(3))
    saved, saved_params = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params]
    run(opt, params, range(3, 6))
    fresh_params = on("cpu", saved_params)
    fresh = make(fresh_params, schedule=schedule)
    fresh.load_state_dict(saved)
    run(fresh, fresh_params, range(3, 6))
    for p, q in zip(params, fresh_params):
        assert torch.equal(p, q)
        assert fresh.state[q]["step"].item() == 6


def test_a_checkpoint_resumes_adamw_and_its_schedule(mesh, tmp_path):
    """checkpoint.save / init_optimizer_state / load, unchanged, with AdamW, a wsd schedule and
    clipping on the sharded model (in the run's default dtype; bf16 keeps fp32 moments and master
    weights): the resumed run's steps 4-5 match the uninterrupted run's."""
    dtype = DTYPES[default_dtype()]
    schedule = Schedule("wsd", lr=1e-3, warmup_steps=2, total_steps=5, decay_fraction=0.4)

    def build(seed):
        model = hf_model(get_config("tiny", num_hidden_layers=2), seed).to(dtype)
        shard_params(model, mesh, "2d")
        return model, AdamW(model.parameters(), schedule=schedule)

    def step(model, opt, seed):
        ids = torch.randint(0, 264, (8, 16), generator=torch.Generator().manual_seed(seed)).to(torch_xla.device())
        model(ids, labels=ids).loss.backward()
        clip_grad_norm(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch_xla.sync()

    model, opt = build(0)
    for seed in (1, 2, 3):
        step(model, opt, seed)
    save(tmp_path, 3, model, opt)
    fresh, fresh_opt = build(1)
    load(tmp_path, fresh, init_optimizer_state(fresh_opt))
    assert {fresh_opt.state[p]["step"].item() for p in fresh.parameters()} == {3.0}
    for seed in (4, 5):
        step(model, opt, seed)
        step(fresh, fresh_opt, seed)
    keys = {"step", "exp_avg", "exp_avg_sq"} | ({"master"} if dtype != torch.float32 else set())
    for p, q in zip(model.parameters(), fresh.parameters()):
        want, got = opt.state[p], fresh_opt.state[q]
        assert want.keys() == got.keys() == keys
        for key in want:  # the primed state's layout may differ: float sums in another order
            torch.testing.assert_close(got[key].cpu(), want[key].cpu(), rtol=1e-5, atol=1e-7, msg=key)
        torch.testing.assert_close(q.detach().cpu(), p.detach().cpu(), rtol=1e-5 if dtype == torch.float32 else 2 ** -7,
                                   atol=1e-7)
