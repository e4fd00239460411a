"""The real engine's learner and server with P learners in one process, for the quick loop.

P real `Learner` objects (engine/distributed/learner.py), each on a thread with its own copy of
the user's module, and the real `ParameterServer` + `ServerCore` + `CentralPayloads` on the
server's side (on the collective path `CollectivePayloads`, the learners all-reducing among
themselves as threads), joined by queues in place of the gloo endpoints (`QueueServerEndpoint`,
`QueueLearnerEndpoint`: the part of transport.py's `ServerEndpoint` and `LearnerEndpoint` that
the server and the learner use). Delays injected per learner make the slow learners slow, so
that staleness (async family) and cancellation (sync family) happen as in a multi-process run.

Everything that went through is recorded independently of the engine's own books: every push
as the server received it (learner, version, mini-batch, payload), every update the server
applied and the server's flat parameters and buffers at every version, so that a test can
recompute the method's update rule by hand (docs/method.md, "Setting").

All coupling to the engine's internals is here (the engine is being restructured: adapt here).
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from lightning_stale.engine.core import ServerCore, ServerLimits
from lightning_stale.engine.distributed.learner import Learner
from lightning_stale.engine.distributed.local_steps import LocalSteps
from lightning_stale.engine.distributed.messages import Flag, Kind, Message
from lightning_stale.engine.distributed.paths.central.path import CentralExchange, CentralPayloads
from lightning_stale.engine.distributed.paths.collective import path as collective_path
from lightning_stale.engine.distributed.paths.collective.local import CollectiveLocalExchange
from lightning_stale.engine.distributed.paths.collective.path import CollectivePayloads
from lightning_stale.engine.distributed.server import ParameterServer
from lightning_stale.engine.schedules import Schedules
from lightning_stale.engine.state import Contribution, ModelVectors, ServerState
from lightning_stale.method.adaptive import AdaptiveH, AdaptiveK
from lightning_stale.method.compensation import StalenessCompensation
from lightning_stale.method.variants import Variant
from lightning_stale.strategies.learner_rounds import handed_metrics
from lightning_stale.strategies.local_updates import outer_optimizer_factory, plain_averaging
from thread_ranks import ThreadRanks

LAST = (Kind.STOP, Kind.ABORT)  # nothing follows these to a learner
TIMEOUT_S = 30.0  # a learner or the server stuck this long fails the test instead of hanging it


@dataclass
class RecordedPush:
    """A push as the server received it; ``id`` is the rules' push id (arrival order)."""

    id: int
    learner: int
    version: int
    batch: int  # the learner's mini-batch index
    payload: torch.Tensor | None  # the gradient and buffers as pushed (None: unusable)
    masked: bool = False  # the payload ends with a presence mask (some gradient was missing)
    loss: float = float("nan")  # the push's loss (with local updates: its round's mean)
    local_steps: int = 1  # the H of the round it ends, as the push says


@dataclass
class RecordedUpdate:
    update: object  # method.rules.Update
    weights: tuple | None
    k_after: int = 0  # the server's K once the update was applied (AdaSync may raise it)


class QueueLearnerEndpoint:
    """A learner's side of the connection: pushes go straight into the server's event queue,
    the server's messages come into ``inbox``. In one process there is no connection to break
    and no silence to watch (``local``, as rank 0's learner beside its server)."""

    local = True

    def __init__(self, rank: int, run: InProcessRun) -> None:
        self.rank, self._run = rank, run
        self.inbox: queue.Queue = queue.Queue()
        self.last_heard = time.monotonic()
        self.failure: str | None = None
        self.interrupted: str | None = None
        self.server_aborted = False
        self.batch = -1  # the mini-batch of the push being made (set by the learner's thread)

    def push(self, message: Message) -> None:
        message.learner = self.rank
        message.received_at = time.monotonic()
        self._run.received(message, self.batch)

    def connection_broke(self, exc: BaseException) -> str:
        self.failure = self.failure or f"learner {self.rank}: {exc}"
        return self.failure

    def join(self, timeout: float) -> bool:
        return True


class QueueServerEndpoint:
    """The server's side: ``send`` puts a message into that learner's inbox."""

    def __init__(self, learners: list[QueueLearnerEndpoint]) -> None:
        self.learners = learners
        self.broken: dict[int, str] = {}
        self._closed: set[int] = set()
        self.sent: list[tuple[int, Kind, int]] = []  # (learner, kind, version)

    def send(self, learner: int, message: Message) -> None:
        if learner in self._closed:
            return
        if message.kind in LAST:
            self._closed.add(learner)
        message.learner = learner
        message.received_at = time.monotonic()
        self.sent.append((learner, message.kind, message.version))
        endpoint = self.learners[learner]
        endpoint.last_heard = message.received_at
        if message.kind == Kind.ABORT:
            endpoint.failure, endpoint.server_aborted = message.error, True
        endpoint.inbox.put(message)

    def heartbeat(self, interval: float) -> None:
        """Nothing to do: the learners here watch no silence."""

    def forget(self, learner: int) -> None:
        self._closed.add(learner)


class RecordingPayloads(CentralPayloads):
    """`CentralPayloads` that also keep the server's parameters and buffers at every version."""

    def __init__(self, vectors: ModelVectors, run: InProcessRun) -> None:
        super().__init__(vectors, on_device=frozenset())
        self._run = run

    def on_update(self, update, contributions, weights) -> None:
        super().on_update(update, contributions, weights)
        run = self._run
        run.updates.append(RecordedUpdate(update, weights, run.core.rules.k))
        run.versions[update.version] = run.core.state.snapshot(update.version).clone()


class RecordingCollectivePayloads(CollectivePayloads):
    """The collective path's server side (pushes are headers, updates say whose to take), recording
    every update; the parameters of each version are recorded by the learners, which hold them."""

    def __init__(self, run: InProcessRun) -> None:
        super().__init__()
        self._run = run

    def on_update(self, update, contributions, weights) -> None:
        super().on_update(update, contributions, weights)
        self._run.updates.append(RecordedUpdate(update, weights, self._run.core.rules.k))


class RecordingLocalExchange(CollectiveLocalExchange):
    """A learner's side of the collective path with local updates, recording its pushed
    pseudo-gradients (which stay with it: only headers travel) and its copy of the server's
    parameters and buffers at every version it takes."""

    def __init__(self, run: InProcessRun, rank: int, *args) -> None:
        super().__init__(*args)
        self._run, self._rank = run, rank
        self.versions: dict[int, torch.Tensor] = {0: self.pulled.clone()}

    def after_push(self, message: Message) -> None:
        super().after_push(message)
        if not message.flags & Flag.UNUSABLE:  # its push is this learner's latest received one
            with self._run._lock:
                push = [p for p in self._run.pushes if p.learner == self._rank][-1]
                push.payload, push.masked = self._pending[-1].clone(), True

    def take(self, message: Message) -> None:
        super().take(message)
        if message.payload is not None:
            self.versions[message.version] = self.pulled.clone()


class Delays:
    """A fixed injected delay (seconds) per learner: ``seconds[learner]``."""

    def __init__(self, seconds: dict[int, float]) -> None:
        self.seconds = seconds

    def sample(self, learner: int) -> float:
        return self.seconds.get(learner, 0.0)


def optimizer_and_schedulers(module) -> tuple[torch.optim.Optimizer, list]:
    """The module's ``configure_optimizers``, an optimizer alone or Lightning's dict with one
    ``lr_scheduler``, as an optimizer and Lightning's scheduler configs."""
    from pytorch_lightning.utilities.types import LRSchedulerConfig

    configured = module.configure_optimizers()
    if not isinstance(configured, dict):
        return configured, []
    spec = configured.get("lr_scheduler")
    if spec is None:
        return configured["optimizer"], []
    spec = spec if isinstance(spec, dict) else {"scheduler": spec}
    plateau = isinstance(spec["scheduler"], torch.optim.lr_scheduler.ReduceLROnPlateau)  # (as Lightning marks it)
    return configured["optimizer"], [LRSchedulerConfig(**spec, reduce_on_plateau=plateau)]


def classification_loss(module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(module(x), y)


@dataclass
class InProcessRun:
    """One fit of ``p`` real learners and the real server in this process (see the module
    docstring). ``batches(rank, i)`` gives learner ``rank``'s i-th mini-batch."""

    module: torch.nn.Module
    batches: object
    variant: str
    p: int
    k: int | None = None
    delays: dict[int, float] = field(default_factory=dict)
    max_updates: int = 8
    max_batches: int = 200  # per learner: leaves (a BYE ends training) if no stop came first
    compensation: str | None = None
    loss: object = classification_loss
    # local updates: H inner steps of the module's optimizer per push, and the outer optimizer
    # (`strategies.local_updates.outer_optimizer_factory`'s spec; None: plain averaging)
    local_steps: int = 1
    outer_optimizer: object = None
    # "collective": the learners all-reduce the pushes of each update among themselves (threads
    # as ranks, `thread_ranks.ThreadRanks`) and every one applies it; local updates only
    path: str = "central"
    # AdaSync's schedule of K (`AdaptiveK.create`'s spec), and what a dead learner does to the run
    adaptive_k: object = None
    adaptive_h: object = None  # AdaComm's schedule of H (`AdaptiveH.create`'s spec), run by the server
    on_learner_failure: str = "stop"
    # learner -> the mini-batch before whose forward it dies (its process gone: no goodbye, its
    # round in progress lost), the server hearing of it as from a broken connection
    die_at: dict[int, int] = field(default_factory=dict)
    # epochs: the server ends one every ``pushes_per_epoch`` pushes (0: never); at its end each
    # learner "validates" and logs ``logged(rank, epoch)`` (a dict), and rank 0 resumes the server
    # with its metrics as `StaleStrategy` does, handing the learners their plateau schedulers' share
    pushes_per_epoch: int = 0
    logged: object = None

    def __post_init__(self) -> None:
        self.pushes: list[RecordedPush] = []
        self.updates: list[RecordedUpdate] = []
        self.versions: dict[int, torch.Tensor] = {}
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._received = 0
        # per learner: (first mini-batch, version) of each round of local updates it started
        self.round_starts: dict[int, list[tuple[int, int]]] = {r: [] for r in range(self.p)}
        # per learner: (version of the round, learning rates of the groups) of every inner step
        self.inner_lrs: dict[int, list[tuple[int, list[float]]]] = {r: [] for r in range(self.p)}

    # ------------------------------------------------------------------ wiring
    def received(self, message: Message, batch: int) -> None:
        """A learner's message reaches the server: pushes are recorded in the order the server
        will take them (the rules number pushes in that order)."""
        with self._lock:
            if message.kind == Kind.PUSH:
                usable = not message.flags & Flag.UNUSABLE
                payload = message.payload.detach().clone() if usable and message.payload is not None else None
                self.pushes.append(RecordedPush(self._received, message.learner, message.version, batch,
                                                payload, bool(message.flags & Flag.MASKED), float(message.loss),
                                                message.local_steps))
                self._received += 1
            self.server.events.put(message)

    def fit(self) -> InProcessRun:
        variant = Variant.create(self.variant, self.p, self.k)
        server_module = copy.deepcopy(self.module)
        optimizer, _ = optimizer_and_schedulers(server_module)  # (the inner schedules are the learners')
        self.local = self.local_steps > 1 or self.outer_optimizer is not None
        outer = None
        if self.local:
            outer = outer_optimizer_factory(self.outer_optimizer) or plain_averaging()
        state = ServerState(server_module, optimizer, outer=outer, steps_per_update=self.local_steps)
        compensation = StalenessCompensation.create(self.compensation)
        collective = self.path == "collective"
        assert not collective or (self.local and variant.synchronous), "the collective path's local updates"
        adaptive = AdaptiveK.create(self.adaptive_k, k0=variant.k)
        if adaptive is not None:
            adaptive.limit(self.p)
            variant = Variant.create(self.variant, self.p, adaptive.k0)
        self.core = ServerCore(variant, None if collective else state,
                               ServerLimits(max_updates=self.max_updates, pushes_per_epoch=self.pushes_per_epoch),
                               adaptive=adaptive, compensation=compensation, clock=time.monotonic(),
                               adaptive_h=AdaptiveH.create(self.adaptive_h, h0=self.local_steps))
        self.versions[0] = state.snapshot(0).clone()
        self.server_vectors = ModelVectors.of(server_module)
        payloads = RecordingCollectivePayloads(self) if collective else RecordingPayloads(self.server_vectors, self)
        self.server = ParameterServer(self.core, payloads, on_learner_failure=self.on_learner_failure,
                                      heartbeat_s=0.05)
        self.endpoints = [QueueLearnerEndpoint(r, self) for r in range(self.p)]
        self.modules = [copy.deepcopy(self.module) for _ in range(self.p)]
        delays = Delays(self.delays)
        vectors = [ModelVectors.of(m) for m in self.modules]
        configured = [optimizer_and_schedulers(m) for m in self.modules]
        self.inner_optimizers = [opt for opt, _ in configured]
        self.inner_schedulers = [configs for _, configs in configured]
        self.ranks = ThreadRanks(self.p)
        exchanges = [RecordingLocalExchange(self, r, v, o, Schedules([], o), r, torch.device("cpu"), m, outer,
                                            self.local_steps) if collective else CentralExchange(v, local=self.local)
                     for r, (v, o, m) in enumerate(zip(vectors, self.inner_optimizers, self.modules))]
        self.learners = [Learner(e, v, delays, exchange=x, waits_for_answer=variant.pusher_needs_answer)
                         for e, v, x in zip(self.endpoints, vectors, exchanges)]
        self.rounds = [LocalSteps(learner, opt, self.local_steps, configs, self.adaptive_h is not None)
                       if self.local else None
                       for learner, (opt, configs) in zip(self.learners, configured)]
        self.server_endpoint = QueueServerEndpoint(self.endpoints)
        self.server.start(self.server_endpoint)
        threads = [threading.Thread(target=self._learn, args=(r,), daemon=True, name=f"inprocess-learner-{r}")
                   for r in range(self.p)]
        patched = collective_path.dist
        collective_path.dist = self.ranks if collective else patched  # (the path's all-reduces)
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(TIMEOUT_S)
        finally:
            collective_path.dist = patched
        stuck = [t.name for t in threads if t.is_alive()]
        if not self.server.join(TIMEOUT_S):
            stuck.append("stale-server")
        if self.errors:
            raise self.errors[0]
        if stuck or self.server.error:
            raise RuntimeError(f"the in-process run did not end cleanly: {stuck or self.server.error}")
        self.stats, _ = self.server.final_report()
        if collective:  # every learner's copy of the server's parameters (learner 0's recorded)
            self.versions.update(self.learners[0].exchange.versions)
        return self

    def _learn(self, rank: int) -> None:
        module, endpoint, learner = self.modules[rank], self.endpoints[rank], self.learners[rank]
        self.ranks.local.rank = rank  # (this thread is the rank in the collective path's all-reduces)
        try:
            module.train()
            learner.wait_for_parameters()
            rounds = self.rounds[rank]
            for i in range(self.max_batches):
                if learner.stopped:
                    break
                if self.die_at.get(rank) == i:
                    self.server.events.put(Message(Kind.FAILED, rank, error=f"receiving from learner {rank} failed"))
                    return  # (gone: no goodbye)
                if rounds is not None:
                    rounds.begin()
                    if rounds.round is not None and rounds.round.done == 0:
                        self.round_starts[rank].append((i, learner.version))
                module.zero_grad()
                batch = self.batches(rank, i)
                loss = self.loss(module, batch)
                loss.backward()
                endpoint.batch = i
                if rounds is not None:
                    lrs = [float(g["lr"]) for g in self.inner_optimizers[rank].param_groups]
                    self.inner_lrs[rank].append((rounds.version, lrs))
                    rounds.step(loss.item(), len(batch[1]))
                else:
                    learner.step(loss.item(), len(batch[1]), time.monotonic())
                if learner.paused and not learner.stopped:
                    self._end_epoch(rank)
            learner.close(TIMEOUT_S)
        except BaseException as exc:  # noqa: BLE001 - raised again on the test's thread
            self.errors.append(exc)
            self.server.events.put(Message(Kind.ABORT, rank, error=f"learner {rank}: {exc!r}"))

    def _end_epoch(self, rank: int) -> None:
        """Where Lightning's loader stops at the server's epoch's end: validation, then the next
        epoch's first batch (`StaleStrategy.on_train_batch_start`)."""
        learner = self.learners[rank]
        metrics = self.logged(rank, learner.server_epochs - 1) if self.logged is not None else {}
        if rank == 0:
            self.server.resume(metrics, handed_metrics(self.inner_schedulers[0], metrics) if self.local else None)
        learner.resume()

    # ------------------------------------------------------------------ what the method says
    def pushed(self, push_id: int) -> Contribution:
        """Push ``push_id``'s gradient and buffers, as the server splits them."""
        push = self.pushes[push_id]
        return self.server_vectors.split_push(push.payload.clone(), push.masked)

    def gradient_at(self, version: int, learner: int, batch: int) -> torch.Tensor:
        """By hand: the gradient of ``learner``'s mini-batch ``batch`` at the server's
        parameters of ``version`` (buffers as the learner held them do not enter the gradient
        of a module without BatchNorm)."""
        module = copy.deepcopy(self.module)
        vectors = ModelVectors.of(module)
        vectors.load_state(self.versions[version])
        module.zero_grad()
        self.loss(module, self.batches(learner, batch)).backward()
        return torch.cat([p.grad.reshape(-1) for p in module.parameters() if p.requires_grad])

    def parameters(self, version: int) -> torch.Tensor:
        return self.versions[version][: self.server_vectors.numel]

    def buffers(self, version: int) -> torch.Tensor:
        return self.versions[version][self.server_vectors.numel:]


def blob_batches(batch_size: int = 8, features: int = 8, seed: int = 0, image: bool = False):
    """``batches(rank, i)``: disjoint mini-batches of 3-class blobs per learner (a rank's i-th
    batch is the same every time it is asked for)."""
    from user_modules import blobs

    x, y = blobs(192, features, seed=seed)
    if image:
        x = x.view(-1, 1, 4, features // 4)
    count = len(y) // batch_size

    def batches(rank: int, i: int):
        j = (7 * rank + i) % count
        return x[j * batch_size:(j + 1) * batch_size], y[j * batch_size:(j + 1) * batch_size]

    return batches


def isclose(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)



