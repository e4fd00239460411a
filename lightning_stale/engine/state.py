"""The parameter server's state, and the flat vectors learners exchange with it.

`ModelVectors` lays a module out flat: trainable parameters, persistent buffers, and a presence
mask when some parameter got no gradient. `ServerState` applies docs/method.md's update rule
(Dutta et al., 2018): the mean of the K gradients, one step of the module's own optimizer (a
parameter no gradient touched keeps ``grad = None``, as under DDP), the mean of the pushed
buffers (integer buffers: the largest; docs/concepts/server.md)."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_stale.engine.schedules import Schedules


@dataclass
class Contribution:
    """One pushed mini-batch as the server keeps it: gradient, buffers, which parameters had one."""

    gradient: Tensor
    buffers: Tensor | None = None
    present: Tensor | None = None  # bool, one per parameter tensor

    def own(self) -> None:
        """Copy what views a borrowed payload (a push still in its shared-memory slot)."""
        self.gradient = self.gradient.clone()
        self.buffers = None if self.buffers is None else self.buffers.clone()
        self.present = None if self.present is None else self.present.clone()


class ModelVectors:
    """Copies between a module and flat vectors (see the module docstring)."""

    def __init__(self, params: Sequence[Tensor], buffers: Sequence[Tensor] = ()) -> None:
        self.params, self.buffers = list(params), list(buffers)
        self.numel = sum(p.numel() for p in self.params)
        self.buffer_numel = sum(b.numel() for b in self.buffers)
        self.dtype = torch.float32
        for t in self.params + [b for b in self.buffers if b.is_floating_point()]:
            self.dtype = torch.promote_types(self.dtype, t.dtype)
        self._param_sizes = [p.numel() for p in self.params]
        self._buffer_sizes = [b.numel() for b in self.buffers]

    @classmethod
    def of(cls, module: nn.Module, buffers: bool = True) -> ModelVectors:
        """The trainable parameters of ``module`` and, with ``buffers``, its persistent buffers."""
        persistent = module.state_dict(keep_vars=True)
        chosen = [b for name, b in module.named_buffers() if name in persistent] if buffers else []
        return cls([p for p in module.parameters() if p.requires_grad], chosen)

    @property
    def device(self) -> torch.device:  # (CPU for a model with no parameters)
        return self.params[0].device if self.params else torch.device("cpu")

    @property
    def state_numel(self) -> int:  # a parameters-and-buffers vector's (what the server sends)
        return self.numel + self.buffer_numel

    def max_push_numel(self) -> int:  # gradients, buffers and a presence mask
        return self.state_numel + len(self.params)

    # ------------------------------------------------------------------ learner side
    def state_vector(self, out: Tensor | None = None, device: torch.device | None = None) -> Tensor:
        """Parameters then buffers, one vector on ``device`` (default CPU), into ``out`` if given."""
        device = torch.device("cpu") if device is None else device
        parts = [t.detach().reshape(-1).to(dtype=self.dtype) for t in self.params + self.buffers]
        if not parts:
            return out if out is not None else torch.zeros(0, dtype=self.dtype, device=device)
        return _joined(parts, device if out is None else out.device, out)

    def load_state(self, flat: Tensor) -> None:
        """Load a `state_vector` into the module's parameters and buffers."""
        if flat.numel() != self.state_numel:
            raise ValueError(f"flat vector has {flat.numel()} values, the module has {self.state_numel}")
        self._load(torch.split(flat, self._param_sizes + self._buffer_sizes))

    def load_parts(self, chunks: Sequence[Tensor]) -> None:
        """`load_state` of the concatenation of ``chunks``, without concatenating them."""
        sizes, parts = self._param_sizes + self._buffer_sizes, []
        chunks = [c for c in chunks if c.numel()]
        if sum(c.numel() for c in chunks) != self.state_numel:
            raise ValueError(f"chunks of {sum(c.numel() for c in chunks)} values, the module has {self.state_numel}")
        chunk, offset = 0, 0
        for size in sizes:
            if size and offset == chunks[chunk].numel():
                chunk, offset = chunk + 1, 0
            if offset + size > chunks[chunk].numel():
                raise ValueError("a tensor straddles two chunks")
            parts.append(chunks[chunk][offset:offset + size] if size else torch.zeros(0, dtype=self.dtype))
            offset += size
        self._load(parts)

    def load_buffers(self, flat: Tensor) -> None:
        """Load the buffers' part of a `state_vector` (integer buffers rounded)."""
        self._load(torch.split(flat, self._buffer_sizes), self.buffers)

    def _load(self, parts: Sequence[Tensor], into: Sequence[Tensor] | None = None) -> None:
        with torch.no_grad():
            for dst, part in zip(self.params + self.buffers if into is None else into, parts):
                src = part.view_as(dst)
                dst.copy_(src.round() if not dst.is_floating_point() else src, non_blocking=True)

    def push_vector(self, mask: bool = False, device: torch.device | None = None,
                    out: Tensor | Callable[[int], Tensor | None] | None = None) -> tuple[Tensor, bool]:
        """Gradients (zeros where missing), buffers and a presence mask where needed; its presence."""
        device = torch.device("cpu") if device is None else device
        grads = [None if p.grad is None else (p.grad.to_dense() if p.grad.is_sparse else p.grad)
                 for p in self.params]
        masked = mask or any(g is None for g in grads)
        # (the parts where the parameters are: `_joined` copies them to ``device`` at once)
        parts: list[Tensor] = [torch.zeros(p.numel(), dtype=self.dtype, device=p.device) if g is None
                               else g.detach().reshape(-1).to(dtype=self.dtype) for p, g in zip(self.params, grads)]
        parts += [b.detach().reshape(-1).to(dtype=self.dtype) for b in self.buffers]
        if masked:
            parts.append(torch.tensor([g is not None for g in grads], dtype=self.dtype, device=self.device))
        if not parts:
            return torch.zeros(0, dtype=self.dtype, device=device), masked
        total = sum(t.numel() for t in parts)
        return _joined(parts, device, out(total) if callable(out) else out), masked

    def split_push(self, flat: Tensor, masked: bool) -> Contribution:
        """A `push_vector` back into its parts (views of ``flat``)."""
        size = self.state_numel + (len(self.params) if masked else 0)
        if flat.numel() != size:
            raise ValueError(f"a push of {flat.numel()} values, expected {size}")
        gradient = flat[:self.numel]
        buffers = flat[self.numel:self.state_numel] if self.buffers else None
        present = flat[self.state_numel:].bool() if masked else None
        return Contribution(gradient, buffers, present)


def clone_optimizer(optimizer: Optimizer, mapping: Mapping[int, Tensor], only_mapped: bool = False) -> Optimizer:
    """The same optimizer over the server's copies (``mapping``: id of a learner parameter -> its copy;
    others, e.g. frozen ones, kept, or left out with ``only_mapped``: a shard); every group is kept,
    even emptied, so that per-group schedules still line up."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("LBFGS re-evaluates the loss several times per step, which a parameter "
                         "server cannot do: it applies gradients computed elsewhere. Use a "
                         "first-order optimizer (SGD, Adam, AdamW, ...)")

    def kept(group: dict) -> list[Tensor]:
        return [mapping.get(id(p), p) for p in group["params"] if not only_mapped or id(p) in mapping]

    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": kept(g)}
              for g in optimizer.param_groups]
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    memo = {id(p): mapping.get(id(p), p) for g in optimizer.param_groups for p in g["params"]}
    try:
        clone = cls(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
    except Exception:  # noqa: BLE001 - any constructor that cannot be called this way
        clone = copy.deepcopy(optimizer, dict(memo))
        for group, original in zip(clone.param_groups, optimizer.param_groups):
            group["params"] = kept(original)
        clone.state.clear()
    memo[id(optimizer)] = clone
    for name, value in vars(optimizer).items():
        if name not in _REBUILT and not getattr(value, "_wrapped_by_lr_sched", False):
            setattr(clone, name, copy.deepcopy(value, memo))
    for learner_param, state in optimizer.state.items():
        server_param = mapping.get(id(learner_param))
        if server_param is not None:  # momentum etc. after a resume
            clone.state[server_param] = {k: v.detach().clone() if isinstance(v, Tensor) else copy.deepcopy(v)
                                         for k, v in state.items()}
    return clone


# What `clone_optimizer` builds itself: the groups, the state, the defaults, torch's hooks and
# bookkeeping (an LR scheduler's ``step`` wrapper is left out too: it calls the learner's).
_REBUILT = frozenset((
    "param_groups", "state", "defaults", "_opt_called", "_zero_grad_profile_name",
    "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks"))


class ServerState:
    """A parameter server's parameters, buffers, optimizer and LR schedulers. With local updates
    (docs/how-to/local-updates.md) ``outer`` builds the outer optimizer, the contributions are
    pseudo-gradients and the inner optimizer's schedulers step ``steps_per_update`` times."""

    def __init__(self, module: nn.Module, optimizer: Optimizer, schedulers: Sequence[Any] = (),
                 buffers: bool = True, clip: Callable[[Optimizer], None] | None = None,
                 tensors: Sequence[int] | None = None,
                 outer: Callable[[Sequence[Tensor]], Optimizer] | None = None,
                 steps_per_update: int = 1) -> None:
        learner = ModelVectors.of(module, buffers)
        owned = learner.params if tensors is None else [learner.params[i] for i in tensors]
        self.params = [p.detach().clone().requires_grad_(True) for p in owned]
        self.buffers = [b.detach().clone() for b in learner.buffers]
        module_params = {id(p) for p in module.parameters()}
        foreign = [p for g in optimizer.param_groups for p in g["params"]
                   if p.requires_grad and id(p) not in module_params]
        if foreign:
            raise ValueError(f"the optimizer holds {len(foreign)} trainable tensor(s) that are not "
                             "parameters of the LightningModule; learners push the module's "
                             "gradients only: register them as module parameters (nn.Parameter)")
        self.outer = outer is not None  # the contributions are pseudo-gradients
        if outer is not None:
            # The inner optimizer's schedules are its own: not copied into the outer optimizer.
            self.optimizer = outer(self.params)
            self.schedules = Schedules(schedulers, optimizer, steps_per_update=steps_per_update)
        else:
            self.optimizer = clone_optimizer(optimizer, {id(lp): sp for lp, sp in zip(owned, self.params)},
                                             only_mapped=tensors is not None)
            self.schedules = Schedules(schedulers, optimizer, stepped=self.optimizer)
        self._sparse = isinstance(self.optimizer, torch.optim.SparseAdam)
        self.clip = clip
        self.vectors = ModelVectors(self.params, self.buffers)
        self._snapshot: tuple[int, dict[torch.device, Tensor]] | None = None  # version, per device

    def apply(self, contributions: Sequence[Contribution], weights: Sequence[float] | None = None,
              update_index: int = 0) -> None:
        """Average the gradients (weighted; a missing one: zero), step optimizer and schedulers, combine buffers."""
        k = len(contributions)
        scales = [1.0 / k] * k if weights is None else [float(w) / k for w in weights]
        if scales == [1.0]:  # one gradient as it is (K = 1): no copy, the parameters' grads view it
            average = contributions[0].gradient
        else:  # (no zero-filled start: a pass over N values fewer)
            # Summed where the parameters live (on a GPU, rank 0 pushes a CUDA vector, others host ones).
            device = self.vectors.device
            average = torch.mul(contributions[0].gradient.to(device), scales[0])
            for scale, c in zip(scales[1:], contributions[1:]):
                average.add_(c.gradient.to(device), alpha=scale)
        present = None
        if any(c.present is not None for c in contributions):
            present = torch.zeros(len(self.params), dtype=torch.bool)
            for c in contributions:
                present |= torch.ones_like(present) if c.present is None else c.present.cpu()
        load_gradients(self.params, average, present, sparse=self._sparse)
        if self.clip is not None:
            self.clip(self.optimizer)
        self.schedules.before_step()
        self.optimizer.step()
        self._combine_buffers(contributions)
        self._snapshot = None
        self.schedules.after_update(update_index)

    def step_lrs(self) -> tuple[float, ...]:
        """The learning rates the next `apply` steps with (read where `Schedules.before_step` will
        copy them from, not copied twice; with an outer optimizer, its own)."""
        copied = self.schedules.stepped is self.optimizer
        groups = (self.schedules.learner_optimizer if copied else self.optimizer).param_groups
        return tuple(float(g["lr"]) for g in groups)

    def has_snapshot(self, version: int, device: torch.device | None = None) -> bool:
        """Whether `snapshot` of ``version`` on ``device`` is made already."""
        return self._snapshot is not None and self._snapshot[0] == version and \
            torch.device(device or "cpu") in self._snapshot[1]

    def snapshot(self, version: int, device: torch.device | None = None) -> Tensor:
        """The parameters and buffers of ``version`` on ``device`` (CPU), once per version and device."""
        device = torch.device(device or "cpu")
        if self._snapshot is None or self._snapshot[0] != version:
            self._snapshot = (version, {})
        made = self._snapshot[1]
        if device not in made:
            made[device] = self.vectors.state_vector(device=device)
        return made[device]

    def load_into(self, module: nn.Module) -> None:
        """Put the server's parameters and buffers into ``module`` (a learner)."""
        ModelVectors.of(module, bool(self.buffers)).load_state(self.vectors.state_vector())

    def named_state(self, module: nn.Module) -> dict[str, Tensor]:
        """The server's parameters and buffers under the names ``module.state_dict`` uses."""
        return named_state(module, self.vectors.state_vector(), bool(self.buffers))

    # ------------------------------------------------------------------ internals
    def _combine_buffers(self, contributions: Sequence[Contribution]) -> None:
        if not self.buffers:
            return
        pushed = [c.buffers.to(self.buffers[0].device) for c in contributions if c.buffers is not None]
        if not pushed:
            return
        stacked = torch.stack(pushed)
        sizes = [b.numel() for b in self.buffers]
        for b, mean, largest in zip(self.buffers, torch.split(stacked.mean(0), sizes),
                                    torch.split(stacked.max(0).values, sizes)):
            b.copy_((mean if b.is_floating_point() else largest.round()).view_as(b))


def _joined(parts: Sequence[Tensor], device: torch.device, out: Tensor | None = None) -> Tensor:
    """Flat ``parts`` as one vector on ``device`` (in ``out`` where it fits); parts on one other
    device are joined there and copied once (a copy per tensor from a GPU waits each time)."""
    total = sum(t.numel() for t in parts)
    fits = out is not None and out.numel() == total and out.device == device
    sources = {t.device for t in parts}
    if sources != {device} and len(sources) == 1:
        flat = torch.cat(list(parts))
        return out.copy_(flat) if fits and out is not None else flat.to(device)
    moved = [t.to(device) for t in parts]
    return torch.cat(moved, out=out) if fits else torch.cat(moved)


def named_state(module: nn.Module, vector: Tensor, buffers: bool = True) -> dict[str, Tensor]:
    """A parameters-and-buffers vector of ``module`` by the names of ``module.state_dict``."""
    layout = ModelVectors.of(module, buffers)
    tensors = layout.params + layout.buffers
    parts = torch.split(vector, [t.numel() for t in tensors])
    by_id = {id(t): part.view_as(t).to(t.dtype).clone() for t, part in zip(tensors, parts)}
    return {name: by_id[id(t)] for name, t in module.state_dict(keep_vars=True).items() if id(t) in by_id}


def load_gradients(params: Sequence[Tensor], flat: Tensor, present: Tensor | None = None,
                   sparse: bool = False) -> None:
    """Each parameter's ``grad`` from its part of ``flat`` (a view where it can: ``flat`` must not
    be reused); one not ``present`` gets ``grad = None``: the optimizer skips it, as under DDP."""
    flags = None if present is None else present.tolist()  # (one read of a CUDA mask, not one per tensor)
    for i, (p, part) in enumerate(zip(params, torch.split(flat, [p.numel() for p in params]))):
        if flags is not None and not flags[i]:
            p.grad = None
            continue
        grad = part.view_as(p).to(device=p.device, dtype=p.dtype)
        p.grad = grad.to_sparse() if sparse else grad
