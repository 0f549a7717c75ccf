"""Optimizers, learning-rate schedules and gradient clipping whose step XLA compiles once.

    schedule = Schedule("wsd", lr=3e-4, warmup_steps=100, total_steps=10_000, min_lr=3e-5)
    optimizer = AdamW(model.parameters(), weight_decay=0.1, schedule=schedule)
    loss.backward()
    norm = clip_grad_norm(model.parameters(), max_norm=1.0)  # a device tensor: log it, no host read
    optimizer.step()

Under torch_xla, what an optimizer computes on the host from the step costs every step: reading a
device value back (`.item()`, as torch's and Transformers' Adafactor do for each parameter) waits
for the device and cuts the step's graph; a Python float (a learning rate set by a scheduler on
the host) is uploaded with every step, and 0 and 1 are baked into the graph as constants, so a
warm-up from lr 0 compiles graphs of its own (measured on torch_xla 2.9; pytorch/xla issues
"How to use LR schedulers?", https://github.com/pytorch/xla/issues/797, and "hyperparameter
scheduling", https://github.com/pytorch/xla/issues/990). Here everything that depends on the
step is computed on the device from the counter each parameter keeps in its optimizer state
(`state["step"]`, an fp32 tensor). The training step then compiles twice however long it runs:
step 1, which also creates the optimizer state (inside the step, so the state's sharding follows
the parameter's), and one graph for every later step. Since the schedule reads that counter, a
checkpoint of the optimizer state (checkpoint.save / load) restores the schedule's position with it.

Sources:
- Adafactor: Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost",
  https://arxiv.org/abs/1804.04235
- AdamW: Kingma & Ba, "Adam: A Method for Stochastic Optimization", https://arxiv.org/abs/1412.6980;
  Loshchilov & Hutter, "Decoupled Weight Decay Regularization", https://arxiv.org/abs/1711.05101;
  the update as torch.optim.AdamW computes it (its docs give the algorithm),
  https://pytorch.org/docs/stable/generated/torch.optim.AdamW.html
- cosine decay: Loshchilov & Hutter, "SGDR: Stochastic Gradient Descent with Warm Restarts",
  https://arxiv.org/abs/1608.03983 (one cycle, warm-up first, as nanoGPT's `get_lr`)
- warm-up, stable, decay (WSD): Hu et al., "MiniCPM: Unveiling the Potential of Small Language Models
  with Scalable Training Strategies", https://arxiv.org/abs/2404.06395; the 1-sqrt decay over the
  last 20%: Hägele et al., "Scaling Laws and Compute-Optimal Training Beyond Fixed Training
  Durations", https://arxiv.org/abs/2405.18392
- clipping by the global norm: Pascanu et al., "On the difficulty of training recurrent neural
  networks", https://arxiv.org/abs/1211.5063; torch.nn.utils.clip_grad_norm_,
  https://pytorch.org/docs/stable/generated/torch.nn.utils.clip_grad_norm_.html
"""
import math

import torch

KINDS = ("cosine", "wsd", "constant")


class Schedule:
    """The learning rate at an optimizer step, a tensor computed with torch ops from the step.

    kind: "cosine": linear warm-up to `lr`, then half a cosine down to `min_lr` at `total_steps`.
          "wsd": warm-up, stable at `lr`, then a 1-sqrt decay to `min_lr` over the last
          `decay_fraction` of `total_steps` (default 20%). MiniCPM decays exponentially over about
          the last 10%; Hägele et al. find that a cool-down over the last 20% matches cosine and
          that 1-sqrt beats a linear one, hence these defaults. Unlike cosine, the rate before the
          decay does not depend on `total_steps`: a checkpoint from the stable phase can go on into
          a longer run (resume with a larger total_steps; the step is saved, the schedule is not).
          "constant": warm-up, then `lr`.
    Steps count from 1 (the first update): warm-up gives lr * step / warmup_steps, so step
    `warmup_steps` is the first at the full `lr`; after `total_steps` the rate stays at the
    floor (`min_lr` for cosine and wsd).

    `schedule(step)` takes the optimizer's step tensor (on the device: no recompile, no host
    read), a Python number or a tensor of steps (a curve to plot) and returns a float32 tensor
    of the same shape on the same device.
    """

    def __init__(self, kind, lr, warmup_steps, total_steps, min_lr=0.0, decay_fraction=0.2):
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} is not one of {', '.join(KINDS)}")
        if not _number(lr) or not 0 < lr < math.inf:
            raise ValueError(f"lr={lr!r} must be a finite number > 0, the peak learning rate (e.g. 3e-4)")
        if not _int(total_steps) or total_steps < 1:
            raise ValueError(f"total_steps={total_steps!r} must be an int >= 1, the run's optimizer steps")
        if not _int(warmup_steps) or not 0 <= warmup_steps <= total_steps:
            raise ValueError(f"warmup_steps={warmup_steps!r} must be an int from 0 to total_steps={total_steps}; "
                             f"shorten the warm-up or lengthen the run")
        if not _number(min_lr) or not 0 <= min_lr <= lr:
            raise ValueError(f"min_lr={min_lr!r} must be from 0 to lr={lr}, the floor the rate decays to "
                             f"(e.g. lr / 10)")
        if not _number(decay_fraction) or not 0 < decay_fraction <= 1:
            raise ValueError(f"decay_fraction={decay_fraction!r} must be in (0, 1], the share of total_steps "
                             f"the wsd decay takes (e.g. 0.2)")
        self.decay_steps = decay_fraction * total_steps  # wsd: the decay runs from total_steps - decay_steps on
        if kind == "wsd" and warmup_steps > total_steps - self.decay_steps:
            raise ValueError(f"warmup_steps={warmup_steps} overlaps the wsd decay, which starts at step "
                             f"{total_steps - self.decay_steps:g} (the last decay_fraction={decay_fraction} "
                             f"of total_steps={total_steps}); shorten the warm-up or lower decay_fraction")
        self.kind, self.lr, self.min_lr = kind, lr, min_lr
        self.warmup_steps, self.total_steps, self.decay_fraction = warmup_steps, total_steps, decay_fraction

    def __call__(self, step):
        step = torch.as_tensor(step, dtype=torch.float32)  # the step's shape and device
        warm = (step / self.warmup_steps).clamp(0, 1) if self.warmup_steps else torch.ones_like(step)
        if self.kind == "constant":
            return self.lr * warm
        if self.kind == "cosine":
            t = ((step - self.warmup_steps) / max(self.total_steps - self.warmup_steps, 1)).clamp(0, 1)
            shape = (1 + torch.cos(math.pi * t)) / 2                 # 1 -> 0 along the decay
        else:
            t = ((step - (self.total_steps - self.decay_steps)) / self.decay_steps).clamp(0, 1)
            shape = 1 - t.sqrt()
        return warm * (self.min_lr + (self.lr - self.min_lr) * shape)

    def __repr__(self):
        return (f"Schedule({self.kind!r}, lr={self.lr}, warmup_steps={self.warmup_steps}, total_steps="
                f"{self.total_steps}, min_lr={self.min_lr}, decay_fraction={self.decay_fraction})")


def _number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def _lr(schedule, group, step):
    """This step's learning rate: the schedule's at `step` (a device tensor), or the group's constant."""
    return group["lr"] if schedule is None else schedule(step)


class Adafactor(torch.optim.Optimizer):
    """Adafactor (Shazeer & Stern, 2018): factored second moments, update clipping, no momentum.

    torch.optim.Adafactor and the Transformers one read step-dependent values back to the host
    (`.item()`, then `math.pow(step, ...)`): two reads per parameter per step, each a wait for the
    device that cuts the step's graph (measured on torch_xla 2.9: they do not recompile, but they
    stall). Here every such value is a device tensor, so the step is one graph, compiled once.
    State is created inside the first step, so its sharding is propagated from the parameters
    (the post's reason for two graphs: the first step, then every other step).

    Mixed precision (master_weights, on by default): a parameter that is not fp32 (bf16) gets an
    fp32 copy in its state, `state["master"]`. The update is applied to that copy, and the
    parameter is its rounding: bf16 keeps 8 bits of mantissa, so an update smaller than about
    2^-9 (0.2%) of a weight, which fine-tuning learning rates make most of them, would round back
    to the old value and be lost; the fp32 copy adds them up until they show. The forward and
    backward still run in bf16 (bf16 matmuls); the copy costs 4 bytes per parameter, saved and
    restored with the optimizer state. master_weights=False updates bf16 parameters directly.

    schedule: a Schedule giving the (relative) lr of each step; the param groups' lr is then
    its peak, `schedule.lr`, and `lr` is not used.
    """

    def __init__(self, params, lr=1e-2, eps=(1e-30, 1e-3), clip=1.0, decay_rate=-0.8, scale_parameter=True,
                 master_weights=True, schedule=None):
        self.schedule = schedule
        super().__init__(params, dict(lr=lr if schedule is None else schedule.lr, eps=eps, clip=clip,
                                      decay_rate=decay_rate, scale_parameter=scale_parameter,
                                      master_weights=master_weights))

    @staticmethod
    def _rms(t):
        return t.square().mean().sqrt()

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            eps1, eps2 = group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, state = p.grad.float(), self.state[p]
                if not state:
                    start_state(state, p, group["master_weights"])
                    if p.dim() >= 2:  # factored: one value per row and per column
                        state["row"] = torch.zeros(p.shape[:-1], device=p.device)
                        state["col"] = torch.zeros(p.shape[:-2] + p.shape[-1:], device=p.device)
                    else:
                        state["sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                weight = state["step"] ** group["decay_rate"]  # 1 - beta2_t, a tensor
                sq = g * g + eps1
                if p.dim() >= 2:
                    row, col = state["row"], state["col"]
                    row.lerp_(sq.mean(-1), weight)
                    col.lerp_(sq.mean(-2), weight)
                    v = (row / row.mean(-1, keepdim=True)).unsqueeze(-1) * col.unsqueeze(-2)
                else:
                    v = state["sq"].lerp_(sq, weight)
                update = g * v.rsqrt()
                update = update / (self._rms(update) / group["clip"]).clamp(min=1.0)
                w = state.get("master", p)  # the weight the update goes to: fp32 master, or p itself
                lr = _lr(self.schedule, group, state["step"])
                lr = lr * (self._rms(w.float()).clamp(min=eps2) if group["scale_parameter"] else 1.0)
                w.sub_((lr * update).to(w.dtype))
                round_to(p, w)


class AdamW(torch.optim.Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter), computing what torch.optim.AdamW does:

        m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2
        w = w (1 - lr wd) - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

    but with the bias corrections (and a scheduled lr) computed on the device from the step
    tensor t, which lives in the state beside the moments (a checkpoint saves it with them).
    torch.optim.AdamW keeps the step on the host and uploads its Python powers every step; and it
    keeps the moments in the parameter's dtype, bf16 for bf16 parameters, with no fp32 master
    copy. Here the moments are fp32 whatever the parameter's dtype; state is created in the first
    step, so its sharding follows the parameter's.

    master_weights: a parameter that is not fp32 (bf16) gets an fp32 copy, `state["master"]`, which
    takes the update and the decay; the parameter is its rounding (see Adafactor for why).

    Weight decay applies to every parameter of a group; give norms and biases a group with
    weight_decay=0 to exempt them, as nanoGPT does.

    schedule: a Schedule giving each step's lr; the param groups' lr is then its peak,
    `schedule.lr`, and `lr` is not used.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, master_weights=True,
                 schedule=None):
        if schedule is None and (not _number(lr) or not 0 < lr < math.inf):
            raise ValueError(f"lr={lr!r} must be a finite number > 0 (e.g. 3e-4), or pass schedule=")
        if len(betas) != 2 or not all(_number(b) and 0 <= b < 1 for b in betas):
            raise ValueError(f"betas={betas!r} must be two numbers in [0, 1), e.g. (0.9, 0.95)")
        if not _number(eps) or not 0 < eps < math.inf:
            raise ValueError(f"eps={eps!r} must be a finite number > 0 (e.g. 1e-8)")
        if not _number(weight_decay) or not 0 <= weight_decay < math.inf:
            raise ValueError(f"weight_decay={weight_decay!r} must be a finite number >= 0 (e.g. 0.1; 0: none)")
        self.schedule = schedule
        super().__init__(params, dict(lr=lr if schedule is None else schedule.lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, master_weights=master_weights))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, state = p.grad.float(), self.state[p]  # g: p's shape, fp32
                if not state:
                    start_state(state, p, group["master_weights"])
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)     # m, p's shape and sharding
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)  # v
                state["step"] += 1
                t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                lr = _lr(self.schedule, group, t)
                denom = (v.sqrt() / (1 - beta2 ** t).sqrt()).add_(group["eps"])  # beta ** t: a tensor
                w = state.get("master", p)  # the weight the update goes to: fp32 master, or p itself
                w.mul_(1 - lr * group["weight_decay"])
                w.sub_((lr / (1 - beta1 ** t) * m / denom).to(w.dtype))
                round_to(p, w)


def start_state(state, p, master_weights):
    """What both optimizers keep for every parameter: the step count (a 0-d fp32 tensor, so the
    schedule and bias corrections are computed on the device) and, with master_weights, an fp32
    copy of a parameter that is not fp32, `state["master"]` (same shape and sharding as p)."""
    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
    if master_weights and p.dtype != torch.float32:
        state["master"] = p.float()


def round_to(p, w):
    """After an update to w: if w is p's fp32 master copy, p becomes its rounding to p's dtype."""
    if w is not p:
        p.copy_(w)


@torch.no_grad()
def clip_grad_norm(parameters, max_norm=None):
    """The global L2 norm of the gradients of `parameters` (a device tensor, before clipping); with
    max_norm, the gradients are scaled in place by min(1, max_norm / (norm + 1e-6)), as
    torch.nn.utils.clip_grad_norm_ does.

    No host read: the scale is a tensor, so a step that clips still compiles once, and the norm
    can be logged with the loss. Under SPMD each gradient is sharded; the sum of its squares is
    the global one (XLA adds the all-reduce), so this is the unsharded model's norm. Squares are
    summed in fp32 whatever the gradients' dtype (torch's takes bf16 gradients' norm in bf16).
    max_norm None or 0: only the norm, for logging.
    """
    if max_norm is not None and (not _number(max_norm) or not 0 <= max_norm < math.inf):
        raise ValueError(f"max_norm={max_norm!r} must be a finite number >= 0 (e.g. 1.0; 0 or None: "
                         f"no clipping, only the norm)")
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.stack([g.float().square().sum() for g in grads]).sum().sqrt()  # (), replicated
    if max_norm:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))
    return norm
