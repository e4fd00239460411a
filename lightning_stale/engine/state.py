"""The parameter server's authoritative state: parameters, optimizer, schedulers.

The server core (`engine.core`) owns one `ServerState` where the server applies updates. It is built from the learner's module and optimizer, so any
torch optimizer works (momentum and Adam moments live here, next to the server's parameters),
and it applies docs/method.md's update

    w_{j+1} = w_j - (eta / K) * sum_{l=1..K} g(w_{tau(l,j)}, xi_{l,j})

as "average the K gradients, then one optimizer step", which is exactly that rule for plain SGD
and its natural extension for other optimizers.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor, nn
from torch.optim import Optimizer


class FlatView:
    """Copies between a module's parameters (or their gradients) and one flat vector."""

    def __init__(self, params: Sequence[Tensor]) -> None:
        self.params = list(params)
        self.numel = sum(p.numel() for p in self.params)
        self.dtype = torch.float32
        for p in self.params:
            self.dtype = torch.promote_types(self.dtype, p.dtype)

    def flatten(self, tensors: Sequence[Tensor | None]) -> Tensor:
        """One contiguous CPU vector; a missing gradient (unused parameter) is zeros."""
        parts = [torch.zeros(p.numel(), dtype=self.dtype, device=p.device) if t is None
                 else t.detach().reshape(-1).to(self.dtype) for p, t in zip(self.params, tensors)]
        return torch.cat(parts).cpu() if parts else torch.zeros(0, dtype=self.dtype)

    def params_vector(self) -> Tensor:
        return self.flatten(self.params)

    def grads_vector(self) -> Tensor:
        return self.flatten([p.grad for p in self.params])

    def load_params(self, flat: Tensor) -> None:
        with torch.no_grad():
            for p, part in zip(self.params, self._split(flat)):
                p.copy_(part.view_as(p), non_blocking=True)

    def load_grads(self, flat: Tensor) -> None:
        for p, part in zip(self.params, self._split(flat)):
            part = part.view_as(p).to(device=p.device, dtype=p.dtype)
            if p.grad is None:
                p.grad = part.clone()
            else:
                p.grad.copy_(part)

    def _split(self, flat: Tensor) -> list[Tensor]:
        if flat.numel() != self.numel:
            raise ValueError(f"flat vector has {flat.numel()} values, the parameters have {self.numel}")
        return list(torch.split(flat, [p.numel() for p in self.params]))


def trainable_parameters(module: nn.Module) -> list[Tensor]:
    return [p for p in module.parameters() if p.requires_grad]


def _clone_optimizer(optimizer: Optimizer, mapping: dict[int, Tensor]) -> Optimizer:
    """The same optimizer class and hyperparameters over the server's copies of the parameters."""
    groups = []
    for group in optimizer.param_groups:
        clone = {k: v for k, v in group.items() if k != "params"}
        clone["params"] = [mapping[id(p)] for p in group["params"]]
        groups.append(clone)
    server_optimizer = type(optimizer)(groups, **optimizer.defaults)
    server_optimizer.load_state_dict(optimizer.state_dict())  # momentum etc. after a resume
    return server_optimizer


def _mark_steps_for_schedulers(optimizer: Optimizer) -> None:
    # torch's schedulers warn unless optimizer.step was wrapped by them; ours moved here.
    step = optimizer.step

    def tracked_step(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    tracked_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked_step  # type: ignore[method-assign]


class ServerState:
    """Authoritative parameters, optimizer and LR schedulers of a parameter server.

    Args:
        module: the learner's module; its trainable parameters are copied (never shared).
        optimizer: the optimizer Lightning built for ``module``; rebuilt over the copies.
        schedulers: Lightning ``LRSchedulerConfig``s of that optimizer: the server steps them
            (``interval="step"`` after every ``frequency`` updates, ``"epoch"`` at epoch ends),
            so schedules follow server updates rather than any one learner's steps.
    """

    def __init__(self, module: nn.Module, optimizer: Optimizer, schedulers: Sequence[Any] = ()) -> None:
        learner_params = trainable_parameters(module)
        self.params = [p.detach().clone() for p in learner_params]
        for p in self.params:
            p.requires_grad_(True)
        mapping = {id(lp): sp for lp, sp in zip(learner_params, self.params)}
        missing = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in mapping]
        if missing:
            raise ValueError("the optimizer holds tensors that are not trainable parameters of the "
                             "module; the parameter server can only update the module's parameters")
        self.optimizer = _clone_optimizer(optimizer, mapping)
        _mark_steps_for_schedulers(self.optimizer)
        self.schedulers = list(schedulers)
        for config in self.schedulers:
            config.scheduler.optimizer = self.optimizer
        self.view = FlatView(self.params)
        self._snapshot: tuple[int, Tensor] | None = None

    def apply(self, gradients: Sequence[Tensor], weights: Sequence[float] | None = None,
              update_index: int = 0) -> None:
        """Average the flat gradients (weighted, e.g. for staleness compensation), take one
        optimizer step, and step the schedulers due after update ``update_index``."""
        if weights is None:
            average = torch.stack(list(gradients)).mean(dim=0)
        else:
            w = torch.tensor(weights, dtype=gradients[0].dtype)
            average = (torch.stack(list(gradients)) * w[:, None]).sum(dim=0) / len(gradients)
        self.view.load_grads(average)
        self.optimizer.step()
        self._snapshot = None
        for config in self.schedulers:
            if config.interval == "step" and update_index % config.frequency == 0:
                config.scheduler.step()

    def end_epoch(self, epoch: int) -> None:
        """Epoch ``epoch`` (from 0) ended: step the epoch-interval schedulers that are due."""
        for config in self.schedulers:
            if config.interval == "epoch" and (epoch + 1) % config.frequency == 0:
                config.scheduler.step()

    def snapshot(self, version: int) -> Tensor:
        """The current parameters, which are those of ``version``, as one flat CPU vector; made
        once per version."""
        if self._snapshot is None or self._snapshot[0] != version:
            self._snapshot = (version, self.view.params_vector())
        return self._snapshot[1]

    def load_into(self, module_params: Sequence[Tensor]) -> None:
        with torch.no_grad():
            for dst, src in zip(module_params, self.params):
                dst.copy_(src)

    def scheduler_states(self) -> list[dict]:
        return [c.scheduler.state_dict() for c in self.schedulers]

    def load_scheduler_states(self, states: Sequence[dict]) -> None:
        for config, s in zip(self.schedulers, states):
            config.scheduler.load_state_dict(s)
