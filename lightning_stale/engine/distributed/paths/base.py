"""What a server path (`ServerPath`) is: a learner side (`LearnerSide`), a server side
(`ServerSide`), its part of a checkpoint (`CheckpointPart`) and a cost model for ``"auto"``
(`ServerPath.traffic`). `paths.registry` holds the paths by name; nothing else compares names."""

from __future__ import annotations

import datetime
import queue
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn
from torch.optim import Optimizer

from lightning_stale.engine.core import ServerCore
from lightning_stale.engine.distributed.messages import Message
from lightning_stale.engine.schedules import Schedules
from lightning_stale.engine.state import ModelVectors, ServerState
from lightning_stale.method.adaptive import AdaptiveH, AdaptiveK
from lightning_stale.method.compensation import StalenessCompensation
from lightning_stale.method.rules import Decision, Update
from lightning_stale.method.variants import Variant


@dataclass(kw_only=True)
class RankOptions:
    """What every rank needs to know besides the model (the strategy's options)."""

    path: str
    delay: Any = None
    delay_is_total: bool = False
    on_learner_failure: str = "stop"
    server_timeout: float = 30.0
    compensation: StalenessCompensation | None = None
    adaptive: AdaptiveK | None = None
    shared_memory: bool = True
    overlap: bool = False  # collective path: the all-reduce during backward (the strategy decides)
    shutdown_timeout: float = 60.0
    channels: str | None = None  # the backend of the device channels (`channels`), None for none
    # the strategy's ``timeout`` (None: torch's), for the overlap's group as for the default one:
    # on NCCL, the time after which torch's watchdog ends a collective left waiting
    timeout: datetime.timedelta | None = None
    observer: Any = None  # told of rank 0's core's pushes, updates, epochs (`replay.EventRecorder`)
    # local updates (central and collective paths): H inner steps per push, and what builds the outer optimizer
    local_steps: int = 1
    outer: Callable[[Sequence[Any]], Optimizer] | None = None
    adaptive_h: AdaptiveH | None = None  # AdaComm's schedule of H, run by rank 0's server (central path)


def spread_path_problem(name: str, on_learner_failure: str,
                        compensation: StalenessCompensation | None) -> str | None:
    """What a path whose every update needs every learner's process cannot run: surviving a dead
    learner, and the "norm" compensation (it needs the parameters in one place); None if neither."""
    if on_learner_failure != "stop":
        return (f"server={name!r} needs every learner's process (in each all-reduce, or holding a "
                "slice), so a dead learner ends the run: use server='central' with "
                "on_learner_failure='continue'")
    if compensation is not None and compensation.needs_parameters:
        return "the 'norm' staleness compensation needs the server's parameters in one place: use server='central'"
    return None


class LearnerSide(ABC):
    """How a learner meets the server on one path: per push `fill_push` after backward, `carry`
    over an epoch's end, `before_push` and `after_push` around its header's sending; `resolve`
    then `take` per message with parameters; `close` at the end. Hooks with a body do nothing."""

    # The LR schedulers this side steps (where every learner applies updates); None: elsewhere.
    schedules: Schedules | None = None
    overlapped_updates = 0  # updates whose all-reduce ran during backward (the collective path)

    @property
    def payloads_on_channels(self) -> int:
        """Payloads this side's own data routes sent or received on device channels so far."""
        return 0

    @abstractmethod
    def fill_push(self, message: Message) -> None:
        """Fill a push with the gradient, when the mini-batch's computation ends."""

    @abstractmethod
    def take(self, message: Message) -> None:
        """Load the parameters (or apply the update) a message brings."""

    def carry(self, message: Message) -> None:
        """The push waits over an epoch's end (Lightning zeroes the gradients before validation)."""

    def before_push(self, message: Message) -> None:
        """The push leaves now (not when cancelled work is thrown away)."""

    def after_push(self, message: Message) -> None:
        """The push's header has left; the answer has not been waited for yet."""

    def resolve(self, message: Message, check: Callable[[], None]) -> None:
        """Complete a message's parameters where they come in parts (``check`` raises on failure)."""

    def close(self, timeout: float, failed: bool = False) -> list[str]:
        """After the stop (or a failure): release what the side holds; the threads still running."""
        return []

    def release(self) -> None:
        """The module loses whatever this side hooked on it (at teardown, after a failure too)."""


class ServerSide(ABC):
    """What the server's messages carry on one path (hooks with a body do nothing)."""

    @abstractmethod
    def contribution(self, message: Message) -> Any:
        """What the core keeps of an accepted push (a gradient, or where to find it)."""

    @abstractmethod
    def fill(self, message: Message, core: ServerCore, decision: Decision | None) -> None:
        """Fill a message to a learner (parameters, an update, nothing)."""

    def on_update(self, update: Update, contributions: Sequence[Any], weights: Sequence[float] | None) -> None:
        """The core applied an update (where the state lives elsewhere, the update goes there)."""

    def on_schedule(self, epoch: int, metrics: dict, per_update: bool) -> None:
        """The LR schedulers are due (per epoch, or metrics for those stepped per update)."""

    def on_stop(self) -> None:
        """Training stopped: the last orders to wherever the state lives."""

    def attach(self, endpoint: Any) -> None:
        """The server's endpoint (`transport.ServerEndpoint`), once it exists."""

    def gather(self, request: int) -> None:
        """Collect the model's state to rank 0 where it is spread (for a checkpoint)."""
        raise RuntimeError("this path holds the model's state in one place: there is nothing to gather")


@dataclass
class CheckpointView:
    """What a path's part of a checkpoint may read on rank 0 (the strategy gives it)."""

    server: Any  # the parameter server
    module: nn.Module  # the LightningModule
    optimizer: Callable[[], Any] = lambda: None  # rank 0's own (Lightning's) optimizer
    learner: Callable[[], Any] = lambda: None  # rank 0's learner, None once it has left
    finished: Callable[[], bool] = lambda: False  # the fit ended: the module holds the final state
    check_server: Callable[[], None] = lambda: None  # raises if the server failed
    learner_side: LearnerSide | None = None  # rank 0's


class CheckpointPart:
    """A path's part of a checkpoint on rank 0: the module's and optimizer's state as the server
    has it, and its books (``"stale_server"``), in one format on every path, so a run resumes on
    any path. `read` takes the three at one instant: Lightning reads the parts one after the
    other while the server steps on. By default (None) the module and optimizer hold them."""

    def __init__(self, view: CheckpointView) -> None:
        self.view = view
        self._held: tuple[dict, dict, dict] | None = None

    @property
    def live(self) -> bool:
        """Training has not finished: the server's state is not the module's yet."""
        return not self.view.finished()

    def read(self) -> tuple[dict, dict, dict] | None:
        """The server's named state, optimizer state and books at one instant, copied; None: nothing."""
        return None

    def _instant(self) -> tuple[dict, dict, dict] | None:
        if not self.live:
            return None
        if self._held is None:
            self._held = self.read()
        return self._held

    def module_state(self, state_dict: dict) -> dict:
        """``state_dict`` (the module's own) with the server's parameters and buffers."""
        self._held = None  # a checkpoint begins here: its instant is now
        instant = self._instant()
        if instant is not None:
            state_dict.update(instant[0])
        return state_dict

    def optimizer_state(self, own: dict) -> dict:
        """The optimizer's state as the server has it (``own``: rank 0's optimizer's)."""
        instant = self._instant()
        return own if instant is None else instant[1]

    def engine_state(self) -> dict:
        """The server's books, matching the parameters saved beside them."""
        saved, instant = self.view.server.state_dict(), self._instant()
        self._held = None  # the next checkpoint reads anew
        if instant is not None:
            saved.update(instant[2])
        return saved

    def finish(self) -> None:
        """After the stop: rank 0's optimizer takes the server's final state."""


@dataclass
class RankContext:
    """What a path builds one rank from (`ranks.build_rank`)."""

    rank: int
    group: Any
    module: nn.Module
    optimizer: Optimizer
    schedulers: list
    variant: Variant
    vectors: ModelVectors
    options: RankOptions
    resume: dict | None = None
    clip: Callable[[Optimizer], None] | None = None
    channels: dict = field(default_factory=dict)  # this rank's device channels
    server: Callable[[], Any] = lambda: None  # rank 0's server, once it exists


@dataclass
class RankParts:
    """What a path built for one rank."""

    learner_side: Callable[[Any], LearnerSide]  # made once this rank's learner endpoint exists
    server_side: ServerSide | None = None  # on rank 0
    state: ServerState | None = None  # on rank 0, where the server core holds the model
    orders: queue.Queue | None = None  # for this rank's part of the server (a shard owner), if any
    start: Callable[[Any, Any], None] | None = None  # starts that part (learner endpoint, server)


class ServerPath(ABC):
    """One way the server applies updates (see the module docstring)."""

    name: ClassVar[str]
    # pushes and answers carry the model through the server's endpoints (on lanes, channels)
    payloads_through_server: ClassVar[bool] = False
    broadcasts_start: ClassVar[bool] = True  # every learner starts from rank 0's parameters, as DDP
    # every learner steps on every update: rank 0's optimizer holds the server's state after the fit
    learners_step_optimizer: ClassVar[bool] = False

    @abstractmethod
    def problem(self, variant_name: str, on_learner_failure: str, compensation: StalenessCompensation | None,
                clips: bool = False) -> str | None:
        """Why this path cannot run these options, naming what to use instead; None if it can."""

    @abstractmethod
    def traffic(self, numel: int, p: int, k: int) -> float:
        """Values the busiest rank moves per update, for N = ``numel``, P learners, K gradients."""

    @abstractmethod
    def channel_pairs(self, p: int) -> list[tuple[int, int]]:
        """The (sender, receiver) directions this path's payloads take (for device channels)."""

    @abstractmethod
    def build(self, ctx: RankContext) -> RankParts:
        """This rank's part of the path (`RankParts`); collective where the path needs it."""

    def overlaps(self, variant: Variant, adaptive: AdaptiveK | None) -> bool:
        """Whether the learners can reduce their gradients during backward."""
        return False

    def checkpoint(self, view: CheckpointView) -> CheckpointPart:
        """This path's part of a checkpoint on rank 0."""
        return CheckpointPart(view)
