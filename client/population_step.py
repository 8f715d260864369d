"""The vectorised step of ``population_round`` (``client/population.py``): every local
DP-SGD step of a chunk of clients at once, their weights stacked in one ``(clients, d)``
tensor.

A step computes each client's sum of masked, clipped per-sample gradients with one
``torch.func.vmap`` over clients of ``vmap(grad(loss_i))`` over examples
(``_clipped_step``). When no client of the chunk clips (the ``noisy`` mechanism, and FedAvg
without DP), a client's sum is its batch gradient, one ``vmap(grad(batch loss))`` over
clients (``_summed_step``), with no per-sample gradients held; a step whose masked sum is not
finite is recomputed per sample, so that its non-finite examples contribute exactly 0 as in
``client_round``. One case differs: a finite per-sample gradient whose float32 norm
overflows (entries near 1e19) is dropped by ``client_round`` and summed here while the sum
stays finite; no clipping bounds such a step in either. The recomputation costs time only
where a gradient is not finite: a simulation's timing, which no server observes (a deployed
node runs ``client_round``, branch-free: ``common/dp/optimizer.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from fedsparse.common.dp.optimizer import zero_non_finite
from fedsparse.common.finite import all_finite
from fedsparse.common.layout import ParamLayout
from fedsparse.common.training.local import DUMMY_LABEL

if TYPE_CHECKING:
    from fedsparse.client.population import _Client

__all__ = ["train_chunk"]


def train_chunk(clients: list[_Client], model: nn.Module, layout: ParamLayout) -> torch.Tensor:
    """Every local step of ``clients``, vectorised across them: their trained weights, one row
    each (``(clients, d)``, on the CPU)."""
    slices = list(layout.slices())
    device = clients[0].device  # one per chunk (_chunks)
    sample_shape = clients[0].x.shape[1:]
    if device.type != "cpu":  # the module's own tensors (not its weights) on the device too
        model = copy.deepcopy(model).to(device)

    def example_loss(
        theta: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = functional_call(model, theta, (xi.unsqueeze(0),))
        loss = nn.functional.cross_entropy(
            out, yi.unsqueeze(0), reduction="none", ignore_index=DUMMY_LABEL
        ).sum()
        return loss, loss.detach()

    def batch_loss(
        theta: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = functional_call(model, theta, (xb,))
        losses = nn.functional.cross_entropy(out, yb, reduction="none", ignore_index=DUMMY_LABEL)
        return losses.sum(), losses.detach()

    def column(values: Sequence[float | bool], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).unsqueeze(1).to(device)

    # Weights batched (one row a client: False), or one model every client starts from (True):
    # a step from shared weights is one batched convolution over every client's examples
    # where stacked weights take one per client (on the digits CNN at 1,000 clients of 1-2
    # examples, about 1.5-2x faster); the same sums to float32 rounding.
    per_client = {
        one: vmap(
            vmap(grad(example_loss, has_aux=True), in_dims=(None, 0, 0)),
            in_dims=(None if one else 0, 0, 0),
        )
        for one in (False, True)
    }
    # no client clips ("noisy"): a client's batch gradient, the sum of its per-sample ones
    summed = (
        None
        if any(c.clips for c in clients)
        else {
            one: vmap(grad(batch_loss, has_aux=True), in_dims=(None if one else 0, 0, 0))
            for one in (False, True)
        }
    )
    # the round's first step: every client from one downlinked model (``apply_downlink``
    # hands the nodes of a process one tensor), so its weights need not be stacked
    shared = clients[0].initial
    starts_shared = all(c.initial is shared for c in clients)
    flat = shared.detach().to(device=device, dtype=torch.float32)
    # every client's examples in one pool (a batch is one gather), their first row's offset
    pool_x = torch.cat([c.x for c in clients]).to(device)
    pool_y = torch.cat([c.y for c in clients]).to(device)
    offsets = torch.tensor([0, *(len(c.x) for c in clients)]).cumsum(0)[:-1].tolist()
    weights: torch.Tensor | None = None  # stacked when a step needs them (``stacked``)

    def stacked() -> torch.Tensor:
        nonlocal weights
        if weights is None:
            rows = [c.initial.detach().to(torch.float32) for c in clients]
            weights = torch.stack(rows).to(device)
        return weights

    if not starts_shared:
        stacked()
    keep_all = None
    if any(c.mask is not None for c in clients):
        ones = torch.ones(layout.numel, dtype=torch.bool)
        keep_all = torch.stack([c.mask if c.mask is not None else ones for c in clients])
        keep_all = keep_all.to(device)
    bound_all = column([c.max_grad_norm for c in clients], torch.float32)
    clips_all = column([c.clips for c in clients], torch.bool)
    scale_all = column([float(c.expected_batch) for c in clients], torch.float32)
    lr_all = column([c.lr for c in clients], torch.float32)
    momentum_all = column([c.momentum for c in clients], torch.float32)
    velocity = None
    if any(c.momentum for c in clients):
        velocity = torch.zeros((len(clients), layout.numel), dtype=torch.float32, device=device)
    for step in range(max(c.steps for c in clients)):
        rows = [k for k, c in enumerate(clients) if step < c.steps]
        active = [clients[k] for k in rows]
        index = torch.tensor(rows, device=device) if len(rows) < len(clients) else None

        def pick(values: torch.Tensor, index: torch.Tensor | None = index) -> torch.Tensor:
            return values if index is None else values.index_select(0, index)

        for c in active:
            if step % c.steps_per_epoch == 0:  # iter(loader): the DataLoader's base seed
                torch.empty((), dtype=torch.int64).random_(generator=c.data_gen)
                c.epoch_loss.append(0.0)
                c.epoch_examples.append(0)
        chosen = [c.sample() for c in active]
        sizes = [len(idx) for idx in chosen]
        width = max(1, max(sizes))
        xb = torch.zeros((len(active), width, *sample_shape), dtype=pool_x.dtype, device=device)
        yb = torch.full((len(active), width), DUMMY_LABEL, dtype=pool_y.dtype, device=device)
        if sum(sizes):
            source = torch.cat([idx + offsets[k] for k, idx in zip(rows, chosen, strict=True)])
            row = torch.repeat_interleave(torch.arange(len(active)), torch.tensor(sizes))
            col = torch.cat([torch.arange(n) for n in sizes])
            source, row, col = source.to(device), row.to(device), col.to(device)
            xb[row, col] = pool_x[source]
            yb[row, col] = pool_y[source]
        one = step == 0 and starts_shared
        if one:
            theta = {name: flat[part].view(shape) for name, part, shape in slices}
        else:
            current = pick(stacked())
            rows_ = len(active)
            theta = {name: current[:, part].view(rows_, *shape) for name, part, shape in slices}
            del current
        keep = None if keep_all is None else pick(keep_all)
        sums = _summed_step(summed[one], theta, xb, yb, keep, slices) if summed else None
        if sums is None:  # per-sample gradients: clipped, or a non-finite batch sum
            sums = _clipped_step(
                per_client[one], theta, xb, yb, keep, slices, pick(bound_all), pick(clips_all)
            )
        step_grad, losses = sums
        del theta, sums
        noisy = [k for k, c in enumerate(active) if c.std != 0]
        if noisy:
            noise = torch.stack([active[k].noise(layout) for k in noisy])
            if keep is not None:
                noise.mul_(keep[noisy] if len(noisy) < len(active) else keep)
            if len(noisy) == len(active):
                step_grad += noise
            else:
                step_grad.index_add_(0, torch.tensor(noisy, device=device), noise)
        step_grad /= pick(scale_all)
        if velocity is not None:  # torch's SGD: the first step's buffer is the gradient
            if step > 0:
                step_grad = pick(velocity).mul_(pick(momentum_all)).add_(step_grad)
            if index is None:
                velocity.copy_(step_grad)
            else:
                velocity.index_copy_(0, index, step_grad)
        # w - lr g; without momentum the product in place (the gradient is not kept, and
        # -(lr g) + w is the same float32 sum): no second (clients, d) tensor a step
        lr_step = step_grad.mul_(pick(lr_all)) if velocity is None else pick(lr_all) * step_grad
        if weights is None and index is None:  # the first step from the shared model
            weights = lr_step.neg_().add_(flat)
        elif index is None:
            stacked().sub_(lr_step)
        else:
            stacked().index_add_(0, index, lr_step, alpha=-1)
        real = (yb != DUMMY_LABEL).sum(dim=1).tolist()
        loss_sums = losses.sum(dim=1).tolist()
        for k, c in enumerate(active):
            if sizes[k]:
                c.epoch_loss[-1] += loss_sums[k]
                c.epoch_examples[-1] += int(real[k])
    return stacked().cpu()


def _summed_step(
    summed: Callable[..., tuple[dict[str, torch.Tensor], torch.Tensor]],
    theta: dict[str, torch.Tensor],
    xb: torch.Tensor,
    yb: torch.Tensor,
    keep: torch.Tensor | None,
    slices: list[tuple[str, slice, tuple[int, ...]]],
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A step without clipping: each client's masked batch gradient (``(clients, d)``) and
    its per-example losses, from one gradient a client (no per-sample gradients held); None
    when a sum is not finite, for ``_clipped_step`` to drop the examples that made it so.

    Exact: a sum of finite terms is finite or overflows, and a NaN or infinite term makes the
    sum NaN or infinite (``common/finite.py``), so a finite masked sum is the per-sample path's
    sum, every example kept, up to the order of float32 additions.
    """
    grads, losses = summed(theta, xb, yb)
    rows = len(xb)
    step_grad = torch.cat([grads[name].reshape(rows, -1) for name, _, _ in slices], dim=1)
    if keep is not None:  # a select: an inf off the mask is not summed on it
        step_grad.masked_fill_(~keep, 0.0)
    if not all_finite(step_grad):
        return None
    return step_grad, losses


def _clipped_step(
    per_client: Callable[..., tuple[dict[str, torch.Tensor], torch.Tensor]],
    theta: dict[str, torch.Tensor],
    xb: torch.Tensor,
    yb: torch.Tensor,
    keep: torch.Tensor | None,
    slices: list[tuple[str, slice, tuple[int, ...]]],
    bound: torch.Tensor,
    clips: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's sums of masked, clipped per-sample gradients (``(clients, d)``; non-finite
    examples contribute exactly 0) and the per-example losses."""
    grads, losses = per_client(theta, xb, yb)
    rows, width = xb.shape[:2]
    per_sample = torch.cat([grads[name].reshape(rows, width, -1) for name, _, _ in slices], dim=2)
    del grads
    if keep is not None:
        # a select, not a product: an inf off the mask must not become a NaN on it (the
        # optimizer takes the kept coordinates, ``index_select``)
        per_sample.masked_fill_(~keep.unsqueeze(1), 0.0)
    norms = per_sample.norm(2, dim=2)
    clipped = (bound / (norms + 1e-6)).clamp(max=1.0)
    factor = torch.where(clips, clipped, torch.ones_like(clipped))
    factor = torch.where(torch.isfinite(norms), factor, 0.0)
    per_sample = zero_non_finite(per_sample, in_place=True)
    return torch.bmm(factor.unsqueeze(1), per_sample).squeeze(1), losses
