"""ServerState and ModelVectors: the server's copy of the model, and its update arithmetic."""

import pytest
import torch
from torch import nn

from lightning_stale.engine.state import Contribution, ModelVectors, ServerState, clone_optimizer, named_state


def make(optimizer_cls=torch.optim.SGD, **kw):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    return module, ServerState(module, optimizer_cls(module.parameters(), **kw))


def flat(state):
    return state.vectors.state_vector()


def test_average_of_k_gradients_is_one_sgd_step():
    module, state = make(lr=0.5)
    before = flat(state)
    grads = [torch.randn(state.vectors.numel) for _ in range(3)]
    state.apply([Contribution(g) for g in grads])
    expected = before - 0.5 * torch.stack(grads).mean(0)
    assert torch.allclose(flat(state), expected, atol=1e-6)
    # the learner's module is a separate copy: untouched until parameters are sent
    assert torch.allclose(ModelVectors.of(module).state_vector(), before)


def test_weights_scale_each_gradient():
    _, state = make(lr=1.0)
    before = flat(state)
    g = torch.ones(state.vectors.numel)
    state.apply([Contribution(g), Contribution(g)], weights=[1.0, 0.5])
    assert torch.allclose(flat(state), before - 0.75 * g)


def test_adam_state_lives_with_the_server():
    _, state = make(torch.optim.Adam, lr=0.01)
    state.apply([Contribution(torch.randn(state.vectors.numel))])
    assert all("exp_avg" in s for s in state.optimizer.state.values())


def test_snapshot_is_cached_per_version():
    _, state = make(lr=0.1)
    assert not state.has_snapshot(0)
    a = state.snapshot(0)
    assert state.snapshot(0) is a and state.snapshot(0, torch.device("cpu")) is a
    assert state.has_snapshot(0) and not state.has_snapshot(1)
    state.apply([Contribution(torch.randn(state.vectors.numel))])
    assert not torch.equal(state.snapshot(1), a)


def test_vectors_reject_the_wrong_size():
    _, state = make(lr=0.1)
    with pytest.raises(ValueError, match="flat vector has 3 values"):
        state.vectors.load_state(torch.zeros(3))


class Head(nn.Module):
    """A backbone, and two heads of which training uses only one (as fine-tuning code does)."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Linear(3, 3)
        self.used = nn.Linear(3, 1)
        self.unused = nn.Linear(3, 1)
        self.norm = nn.BatchNorm1d(3)


def test_a_parameter_no_gradient_reached_is_left_alone_as_under_ddp():
    """AdamW with weight decay changes a parameter whose gradient is zero, but skips one whose
    gradient is None: the server must keep that difference."""
    torch.manual_seed(0)
    module = Head()
    module.backbone.requires_grad_(False)  # frozen, yet handed to the optimizer
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1, weight_decay=0.5)
    state = ServerState(module, optimizer)
    vectors = ModelVectors.of(module)
    trainable = [*module.used.parameters(), *module.unused.parameters(), *module.norm.parameters()]
    assert [id(p) for p in vectors.params] == [id(p) for p in trainable]
    module.used(module.backbone(torch.randn(4, 3))).sum().backward()
    payload, masked = vectors.push_vector()
    assert masked  # the unused head had no gradient
    unused_before = module.unused.weight.detach().clone()
    state.apply([vectors.split_push(payload, masked)])
    named = state.named_state(module)
    assert torch.equal(named["unused.weight"], unused_before)  # not decayed, not moved
    assert not torch.equal(named["used.weight"], module.used.weight)  # stepped
    assert "backbone.weight" not in named  # frozen: the module's own tensor stays the model's
    assert len(state.optimizer.state) == 2  # Adam moments only for the used head's two tensors


def test_a_gradient_present_in_one_push_is_averaged_with_zeros_for_the_others():
    module = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(module.weight)
    state = ServerState(module, torch.optim.SGD(module.parameters(), lr=1.0))
    state.apply([Contribution(torch.tensor([4.0])), Contribution(torch.tensor([0.0]), present=torch.tensor([False]))])
    assert state.params[0].item() == -2.0  # mean of 4 and a missing (zero) gradient


def test_buffers_travel_with_the_parameters_and_are_averaged():
    torch.manual_seed(0)
    module = Head()
    state = ServerState(module, torch.optim.SGD(module.parameters(), lr=0.0))
    vectors = ModelVectors.of(module)
    assert vectors.buffer_numel == 3 + 3 + 1  # running mean, var, num_batches_tracked
    pushes = []
    for batch in (torch.randn(8, 3) + 5.0, torch.randn(8, 3) - 5.0):
        module.zero_grad()
        module.norm.reset_running_stats()
        module.used(module.norm(batch)).sum().backward()
        pushes.append(vectors.split_push(*vectors.push_vector()))
    means = [c.buffers[:3] for c in pushes]
    state.apply(pushes)
    named = state.named_state(module)
    assert torch.allclose(named["norm.running_mean"], (means[0] + means[1]) / 2)
    assert named["norm.num_batches_tracked"].item() == 1
    # a learner loading the server's state gets its buffers too
    fresh = Head()
    ModelVectors.of(fresh).load_state(state.snapshot(1))
    assert torch.allclose(fresh.norm.running_mean, named["norm.running_mean"])
    assert fresh.norm.num_batches_tracked.dtype == torch.long


@pytest.mark.parametrize("name", sorted(
    n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
    and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
    and n not in ("Optimizer", "LBFGS", "SparseAdam")))
def test_every_torch_optimizer_is_rebuilt_with_its_options_and_state(name):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 3, bias=False), nn.Linear(3, 2, bias=False))  # 2-D: Muon too
    cls = getattr(torch.optim, name)
    kwargs = {"lr": 0.01} if "lr" in cls.__init__.__code__.co_varnames else {}
    optimizer = cls([{"params": [module[0].weight], "weight_decay": 0.1},
                     {"params": [module[1].weight]}], **kwargs)
    module(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    copies = {id(p): p.detach().clone().requires_grad_(True) for p in module.parameters()}
    clone = clone_optimizer(optimizer, copies)
    assert type(clone) is cls and len(clone.param_groups) == 2
    assert clone.param_groups[0]["weight_decay"] == 0.1
    assert clone.param_groups[0]["params"][0] is copies[id(module[0].weight)]
    assert clone.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()
    for p in clone.param_groups[0]["params"] + clone.param_groups[1]["params"]:
        p.grad = torch.ones_like(p)
    clone.step()  # the rebuilt optimizer works


def test_an_optimizer_with_its_own_constructor_is_copied_when_it_cannot_be_rebuilt():
    class Custom(torch.optim.SGD):
        def __init__(self, params, schedule, lr=0.1):
            super().__init__(params, lr=lr)
            self.schedule = schedule  # a constructor argument its defaults do not hold

    module = nn.Linear(2, 1)
    optimizer = Custom(module.parameters(), schedule=[1, 2])
    copies = {id(p): p.detach().clone().requires_grad_(True) for p in module.parameters()}
    clone = clone_optimizer(optimizer, copies)
    assert type(clone) is Custom and clone.param_groups[0]["params"][0] is copies[id(module.weight)]


def test_lbfgs_is_refused_with_the_reason():
    module = nn.Linear(2, 1)
    with pytest.raises(ValueError, match="LBFGS re-evaluates the loss"):
        ServerState(module, torch.optim.LBFGS(module.parameters()))


def test_sparse_adam_gets_sparse_gradients():
    torch.manual_seed(0)
    module = nn.Embedding(10, 2, sparse=True)
    state = ServerState(module, torch.optim.SparseAdam(module.parameters(), lr=0.1))
    vectors = ModelVectors.of(module)
    module(torch.tensor([1, 3])).sum().backward()
    state.apply([vectors.split_push(*vectors.push_vector())])
    moved = (state.params[0] != module.weight).any(dim=1)
    assert moved.tolist() == [i in (1, 3) for i in range(10)]  # only the rows looked up


def test_a_trainable_tensor_outside_the_module_is_refused():
    module = nn.Linear(2, 1)
    stray = nn.Parameter(torch.zeros(1))
    with pytest.raises(ValueError, match="not parameters of the LightningModule"):
        ServerState(module, torch.optim.SGD([*module.parameters(), stray], lr=0.1))


def test_plateau_scheduler_steps_with_its_monitored_value():
    module = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)

    class Config:
        interval, frequency, reduce_on_plateau, monitor, strict = "epoch", 1, True, "val/loss", True

    config = Config()
    config.scheduler = scheduler
    state = ServerState(module, optimizer, [config])
    for epoch, loss in enumerate([1.0, 2.0, 3.0]):
        state.schedules.end_epoch(epoch, {"val/loss": loss})
    assert state.optimizer.param_groups[0]["lr"] == 0.25  # two epochs without improvement
    with pytest.raises(ValueError, match="monitors 'val/loss'"):
        state.schedules.end_epoch(3, {"train/loss": 1.0})


def test_vectors_are_written_into_a_given_place_that_fits_and_made_anew_otherwise():
    """A push or state vector goes straight into a recycled vector or a shared-memory slot of its
    size (no second pass), with the same values as a fresh one."""
    module = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    module(torch.randn(4, 3)).sum().backward()
    vectors = ModelVectors.of(module)
    fresh, masked = vectors.push_vector()
    place = torch.full((fresh.numel(),), float("nan"))
    written, _ = vectors.push_vector(out=place)
    assert written.data_ptr() == place.data_ptr() and torch.equal(written, fresh) and not masked
    slot = vectors.push_vector(out=lambda numel: torch.empty(numel))[0]
    assert torch.equal(slot, fresh)
    assert torch.equal(vectors.push_vector(out=torch.empty(2))[0], fresh)  # (the wrong size: a new one)
    state = vectors.state_vector()
    into = torch.empty(vectors.state_numel)
    assert vectors.state_vector(out=into).data_ptr() == into.data_ptr() and torch.equal(into, state)


def test_own_copies_a_borrowed_push_out_of_its_slot():
    slot = torch.arange(8, dtype=torch.float32)  # a shared-memory slot the push still views
    borrowed = Contribution(slot[:5], buffers=slot[5:7], present=torch.tensor([True, False]))
    mask = borrowed.present
    borrowed.own()
    slot.fill_(-1.0)  # the slot is reused for the next push
    mask.fill_(True)
    assert borrowed.gradient.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert borrowed.buffers.tolist() == [5.0, 6.0] and borrowed.present.tolist() == [True, False]
    bare = Contribution(slot[:2].clone())
    bare.own()
    assert bare.buffers is None and bare.present is None


def test_the_largest_push_holds_gradients_buffers_and_one_presence_flag_per_parameter():
    module = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))  # 4 parameter tensors, 5 buffer values
    vectors = ModelVectors.of(module)
    assert (vectors.numel, vectors.buffer_numel) == (12, 5)
    assert vectors.max_push_numel() == 12 + 5 + 4


class Holed(nn.Module):
    """Parameters of 3, 0 and 2 values, then a buffer of 2: an empty tensor between two."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(3))
        self.empty = nn.Parameter(torch.zeros(0))
        self.b = nn.Parameter(torch.zeros(2))
        self.register_buffer("running", torch.zeros(2))


@pytest.mark.parametrize("cuts", [[3], [3, 3], [5], [3, 5], [0, 3, 5, 5, 7]])
def test_load_parts_loads_chunks_cut_at_tensor_boundaries(cuts):
    module = Holed()
    vectors = ModelVectors.of(module)
    state = torch.arange(1.0, 8.0)
    bounds = [0, *cuts, 7]
    vectors.load_parts([state[lo:hi] for lo, hi in zip(bounds, bounds[1:])])
    assert module.a.tolist() == [1.0, 2.0, 3.0] and module.b.tolist() == [4.0, 5.0]
    assert module.running.tolist() == [6.0, 7.0] and module.empty.numel() == 0
    assert torch.equal(vectors.state_vector(), state)


def test_load_parts_refuses_chunks_of_another_size_or_cut_inside_a_tensor():
    module = Holed()
    vectors = ModelVectors.of(module)
    state = torch.arange(1.0, 8.0)
    with pytest.raises(ValueError, match=r"^chunks of 6 values, the module has 7$"):
        vectors.load_parts([state[:3], state[3:6]])
    with pytest.raises(ValueError, match=r"^chunks of 8 values, the module has 7$"):
        vectors.load_parts([state, state[:1]])
    for cut in (1, 2, 4, 6):
        with pytest.raises(ValueError, match=r"^a tensor straddles two chunks$"):
            vectors.load_parts([state[:cut], state[cut:]])
    assert module.a.tolist() == [0.0, 0.0, 0.0]  # nothing loaded from a refused split


@pytest.mark.parametrize("keep", [True, False])
def test_load_into_and_named_state_carry_buffers_only_where_the_state_keeps_them(keep):
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    source[1].running_mean.fill_(5.0)
    state = ServerState(source, torch.optim.SGD(source.parameters(), lr=0.1), buffers=keep)
    learner = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    state.load_into(learner)
    assert torch.equal(learner[0].weight, source[0].weight) and torch.equal(learner[1].bias, source[1].bias)
    assert learner[1].running_mean.tolist() == ([5.0, 5.0] if keep else [0.0, 0.0])  # else the learner's own
    named = state.named_state(learner)
    assert torch.equal(named["0.weight"], source[0].weight)
    assert ("1.running_mean" in named) is keep and ("1.num_batches_tracked" in named) is keep


def test_a_snapshot_is_made_on_the_device_asked_for():
    # (the meta device stands in for a GPU: a learner's snapshot is sent from where it is asked)
    module, state = make(lr=0.1)
    on_meta = state.snapshot(0, torch.device("meta"))
    assert on_meta.device.type == "meta" and on_meta.numel() == state.vectors.state_numel
    assert state.has_snapshot(0, torch.device("meta")) and not state.has_snapshot(0, torch.device("cpu"))
    assert state.snapshot(0).device.type == "cpu"


def test_the_clip_acts_on_the_servers_optimizer_before_its_step():
    torch.manual_seed(0)
    module = nn.Linear(3, 2)
    seen = []

    def clip(optimizer):  # as the Trainer's gradient clipping: on the averaged gradient
        seen.append(optimizer)
        torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 0.1)

    state = ServerState(module, torch.optim.SGD(module.parameters(), lr=1.0), clip=clip)
    before = state.vectors.state_vector()
    state.apply([Contribution(torch.full((state.vectors.numel,), 10.0))])
    assert seen == [state.optimizer]
    assert float((state.vectors.state_vector() - before).norm()) == pytest.approx(0.1, rel=1e-4)


def test_pushed_buffers_average_and_integer_counters_take_the_largest():
    module = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    state = ServerState(module, torch.optim.SGD(module.parameters(), lr=0.1))
    numel = state.vectors.numel
    # buffers: running_mean (2), running_var (2), num_batches_tracked (1)
    first = torch.tensor([1.0, 2.0, 1.0, 1.0, 3.0])
    second = torch.tensor([3.0, 4.0, 3.0, 5.0, 6.0])
    state.apply([Contribution(torch.zeros(numel), buffers=first), Contribution(torch.zeros(numel), buffers=second)])
    named = state.named_state(module)
    assert named["1.running_mean"].tolist() == [2.0, 3.0] and named["1.running_var"].tolist() == [2.0, 3.0]
    assert named["1.num_batches_tracked"].item() == 6  # the learner that counted most, not a mean


def test_a_shards_state_holds_and_steps_only_its_own_tensors():
    module, _ = make()  # parameters: weight 4x3, bias 4, weight 2x4, bias 2
    learner_params = list(module.parameters())
    before = [p.detach().clone() for p in learner_params]
    state = ServerState(module, torch.optim.SGD(module.parameters(), lr=0.5), tensors=[0, 2])
    assert [p.shape for p in state.params] == [torch.Size([4, 3]), torch.Size([2, 4])]
    assert all(p.requires_grad for p in state.params)
    # its optimizer holds the shard's copies and nothing of the learner's
    assert [id(p) for g in state.optimizer.param_groups for p in g["params"]] == [id(p) for p in state.params]
    state.apply([Contribution(torch.ones(12 + 8))])
    assert torch.equal(state.params[0], before[0] - 0.5) and torch.equal(state.params[1], before[2] - 0.5)
    assert all(torch.equal(p, b) for p, b in zip(learner_params, before))  # the learner's own untouched


def test_joined_gathers_parts_on_the_device_asked_for_into_out_where_it_fits():
    from lightning_stale.engine.state import _joined

    meta, cpu = torch.device("meta"), torch.device("cpu")  # (meta stands in for a GPU)
    host = [torch.ones(2), torch.ones(3)]
    gathered = _joined(host, meta)  # parts on one other device: joined there, moved once
    assert gathered.device == meta and gathered.numel() == 5
    out = torch.empty(5, device="meta")
    assert _joined(host, meta, out) is out
    assert _joined([torch.ones(2), torch.ones(3, device="meta")], meta).device == meta  # mixed parts
    with_room = torch.empty(5)
    assert _joined(host, cpu, with_room) is with_room and with_room.tolist() == [1.0] * 5
    for wrong in (torch.empty(4), torch.empty(5, device="meta")):  # the wrong size, or elsewhere
        joined = _joined(host, cpu, wrong)
        assert joined is not wrong and joined.device == cpu and joined.tolist() == [1.0] * 5
    assert _joined(host, meta, torch.empty(4, device="meta")).shape == (5,)  # no room: a new vector


def test_load_gradients_gives_dense_gradients_unless_asked_for_sparse_ones():
    from lightning_stale.engine.state import load_gradients

    params = [nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(3))]
    load_gradients(params, torch.arange(7.0))
    assert not params[0].grad.is_sparse and params[1].grad.tolist() == [4.0, 5.0, 6.0]
    load_gradients(params, torch.arange(7.0), sparse=True)
    assert params[0].grad.is_sparse


def test_load_gradients_skips_absent_tensors_and_matches_each_parameters_device_and_dtype():
    from lightning_stale.engine.state import load_gradients

    params = [nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2, dtype=torch.float64)),
              nn.Parameter(torch.ones(1, device="meta"))]  # (meta stands in for a GPU)
    params[0].grad = torch.ones(2)
    load_gradients(params, torch.arange(5.0), present=torch.tensor([False, True, True]))
    assert params[0].grad is None  # absent from every push: the optimizer skips it
    assert params[1].grad.dtype == torch.float64 and params[1].grad.tolist() == [2.0, 3.0]
    assert params[2].grad.device.type == "meta"


# ---------------------------------------------------------------- the learner's side of the vectors
class Mixed(nn.Module):
    """A frozen tensor, two trainable ones, a float buffer, an integer counter and a buffer that
    state_dict leaves out (non-persistent)."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.frozen = nn.Parameter(torch.zeros(2, dtype=dtype), requires_grad=False)
        self.w = nn.Parameter(torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=dtype))
        self.b = nn.Parameter(torch.tensor([5.0], dtype=dtype))
        self.register_buffer("mean", torch.tensor([6.0, 7.0], dtype=dtype))
        self.register_buffer("count", torch.tensor(8))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)


def test_vectors_hold_the_trainable_parameters_then_the_persistent_buffers():
    module = Mixed()
    vectors = ModelVectors.of(module)
    assert [id(t) for t in vectors.params] == [id(module.w), id(module.b)]
    assert [id(t) for t in vectors.buffers] == [id(module.mean), id(module.count)]
    assert vectors.state_vector().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    assert ModelVectors.of(module, buffers=False).buffers == []
    assert ModelVectors.of(module, buffers=False).state_vector().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize("params,buffer,expected", [
    (torch.float64, torch.float32, torch.float64),   # the widest parameter
    (torch.float16, torch.float16, torch.float32),   # never narrower than float32
    (torch.float32, torch.float64, torch.float64),   # a float buffer counts too
])
def test_the_vectors_dtype_is_the_widest_floating_one(params, buffer, expected):
    module = Mixed(params)
    module.mean.data = module.mean.to(buffer)
    vectors = ModelVectors.of(module)
    assert vectors.dtype == expected and vectors.state_vector().dtype == expected
    module.w.grad = torch.ones_like(module.w)
    module.b.grad = torch.ones_like(module.b)
    assert vectors.push_vector()[0].dtype == expected


def test_a_push_with_a_mask_asked_for_or_a_missing_gradient():
    module = Mixed()
    vectors = ModelVectors.of(module)
    module.w.grad = torch.full((2, 2), 0.5)
    # b has no gradient: zeros in its place, and the mask says so
    payload, masked = vectors.push_vector()
    assert masked and payload.tolist() == [0.5] * 4 + [0.0] + [6.0, 7.0, 8.0] + [1.0, 0.0]
    part = vectors.split_push(payload, masked)
    assert part.gradient.tolist() == [0.5] * 4 + [0.0] and part.buffers.tolist() == [6.0, 7.0, 8.0]
    assert part.present.dtype == torch.bool and part.present.tolist() == [True, False]
    module.b.grad = torch.tensor([2.0])
    payload, masked = vectors.push_vector()
    assert not masked and payload.tolist() == [0.5] * 4 + [2.0, 6.0, 7.0, 8.0]
    assert vectors.split_push(payload, masked).present is None
    payload, masked = vectors.push_vector(mask=True)  # asked for: every flag set
    assert masked and payload.tolist()[-2:] == [1.0, 1.0]
    with pytest.raises(ValueError, match="a push of 10 values, expected 8"):
        vectors.split_push(payload, False)
    with pytest.raises(ValueError, match="a push of 8 values, expected 10"):
        vectors.split_push(payload[:8], True)
    bare = ModelVectors.of(module, buffers=False)
    assert bare.split_push(*bare.push_vector()).buffers is None


def test_a_sparse_gradient_is_pushed_dense():
    module = nn.Embedding(4, 2, sparse=True)
    module(torch.tensor([1, 1, 3])).sum().backward()
    assert module.weight.grad.is_sparse
    payload, masked = ModelVectors.of(module).push_vector()
    assert not masked and payload.view(4, 2).tolist() == [[0.0, 0.0], [2.0, 2.0], [0.0, 0.0], [1.0, 1.0]]


def test_vectors_go_to_the_device_asked_for_and_a_model_without_tensors_gives_empty_ones():
    meta = torch.device("meta")  # (meta stands in for a GPU)
    module = Mixed()
    module.w.grad, module.b.grad = torch.ones(2, 2), torch.ones(1)
    vectors = ModelVectors.of(module)
    assert vectors.device == torch.device("cpu")
    assert vectors.push_vector(device=meta)[0].device == meta
    assert vectors.state_vector(device=meta).device == meta
    into = torch.empty(vectors.state_numel, device=meta)  # a place elsewhere: written there
    assert vectors.state_vector(out=into) is into
    assert ModelVectors.of(Mixed().to(meta)).device.type == "meta"
    empty = ModelVectors([])
    assert empty.device == torch.device("cpu")
    payload, masked = empty.push_vector(device=meta)
    assert payload.numel() == 0 and payload.device == meta and payload.dtype == torch.float32 and not masked
    assert empty.state_vector(device=meta).device == meta and empty.state_vector().numel() == 0
    out = torch.empty(0, dtype=torch.float64)
    assert empty.state_vector(out=out) is out
    payload, masked = empty.push_vector(mask=True)  # a mask of no flags is still of the vectors' dtype
    assert masked and payload.numel() == 0 and payload.dtype == torch.float32


def test_vectors_are_on_the_cpu_by_default_whatever_torchs_default_device():
    empty = ModelVectors([])
    default = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        state, push = empty.state_vector(), empty.push_vector()[0]
    finally:
        torch.set_default_device(default)
    assert state.device.type == "cpu" and push.device.type == "cpu"


def test_loading_a_state_rounds_integer_buffers_and_keeps_floats():
    module = Mixed()
    vectors = ModelVectors.of(module)
    vectors.load_state(torch.tensor([0.5, 1.5, 2.5, 3.25, 4.75, 5.5, 6.5, 8.6]))
    assert module.w.tolist() == [[0.5, 1.5], [2.5, 3.25]] and module.b.tolist() == [4.75]
    assert module.mean.tolist() == [5.5, 6.5] and module.count.item() == 9  # 8.6 rounded, not cut
    with pytest.raises(ValueError, match="flat vector has 7 values, the module has 8"):
        vectors.load_state(torch.zeros(7))


def test_named_state_names_copies_in_each_tensors_dtype():
    module = Mixed(torch.float64)
    vector = torch.arange(1.0, 9.0, dtype=torch.float64)
    named = named_state(module, vector)
    assert list(named) == ["w", "b", "mean", "count"]  # state_dict's order; no frozen, no scratch
    assert named["w"].tolist() == [[1.0, 2.0], [3.0, 4.0]] and named["w"].dtype == torch.float64
    assert named["count"].dtype == torch.long and named["count"].item() == 8
    vector.fill_(0.0)
    assert named["b"].item() == 5.0  # copies, not views of the vector
    assert list(named_state(module, torch.arange(1.0, 6.0), buffers=False)) == ["w", "b"]


# ---------------------------------------------------------------- clone_optimizer
def _copies(module):
    return {id(p): p.detach().clone().requires_grad_(True) for p in module.parameters()}


def test_a_shard_of_the_optimizer_keeps_every_group_but_only_its_tensors():
    module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    optimizer = torch.optim.SGD([{"params": module[0].parameters(), "lr": 0.5},
                                 {"params": module[1].parameters()}], lr=0.1, momentum=0.9)
    mapping = {id(module[1].weight): module[1].weight.detach().clone().requires_grad_(True)}
    shard = clone_optimizer(optimizer, mapping, only_mapped=True)
    assert [len(g["params"]) for g in shard.param_groups] == [0, 1]
    assert shard.param_groups[1]["params"][0] is mapping[id(module[1].weight)]
    assert [g["lr"] for g in shard.param_groups] == [0.5, 0.1] and shard.defaults["momentum"] == 0.9
    whole = clone_optimizer(optimizer, mapping)  # unmapped tensors kept as they are
    assert whole.param_groups[0]["params"][0] is module[0].weight


def test_the_clones_state_is_its_own_copy_of_the_learners():
    torch.manual_seed(0)
    module = nn.Linear(2, 1)
    optimizer = torch.optim.Adam(module.parameters(), lr=0.1)
    module(torch.randn(3, 2)).sum().backward()
    optimizer.step()
    copies = _copies(module)
    clone = clone_optimizer(optimizer, copies)
    server_state = clone.state[copies[id(module.weight)]]
    learner_state = optimizer.state[module.weight]
    assert torch.equal(server_state["exp_avg"], learner_state["exp_avg"])
    server_state["exp_avg"].add_(1.0)
    server_state["step"].add_(1.0)
    assert not torch.equal(server_state["exp_avg"], learner_state["exp_avg"])
    assert learner_state["step"].item() == 1.0
    assert module.weight not in clone.state  # keyed by the server's copies only


def test_the_clone_steps_the_servers_tensors_even_under_a_learners_scheduler():
    """A scheduler wraps the learner's ``optimizer.step``; the clone must not carry that wrapper
    (it would step the learner's optimizer), nor torch's bookkeeping of the learner's."""
    module = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    before = [p.detach().clone() for p in module.parameters()]
    copies = _copies(module)
    clone = clone_optimizer(optimizer, copies)
    for p in copies.values():
        p.grad = torch.ones_like(p)
    clone.step()
    assert all(torch.equal(p, b) for p, b in zip(module.parameters(), before))
    assert all(torch.equal(copies[id(p)], b - 1.0) for p, b in zip(module.parameters(), before))
    assert not getattr(optimizer, "_opt_called", False)


def test_a_copied_optimizer_keeps_its_own_attributes_and_the_learners_state():
    class Custom(torch.optim.SGD):
        def __init__(self, params, schedule, lr=0.1):
            super().__init__(params, lr=lr, momentum=0.5)
            self.schedule = schedule  # a constructor argument its defaults do not hold
            self.me = self  # what points at the optimizer points at the clone
            self.watched = self.param_groups[0]["params"][0]  # and at a parameter, at its copy

    torch.manual_seed(0)
    module = nn.Linear(2, 1)
    optimizer = Custom(module.parameters(), schedule=[1, 2])
    module(torch.randn(3, 2)).sum().backward()
    optimizer.step()
    copies = _copies(module)
    clone = clone_optimizer(optimizer, copies)
    assert clone.schedule == [1, 2] and clone.schedule is not optimizer.schedule
    assert clone.me is clone and clone.watched is copies[id(module.weight)]
    assert [p is copies[id(q)] for p, q in zip(clone.param_groups[0]["params"], module.parameters())] == [True, True]
    assert set(map(id, clone.state)) == {id(c) for c in copies.values()}
    assert torch.equal(clone.state[copies[id(module.weight)]]["momentum_buffer"],
                       optimizer.state[module.weight]["momentum_buffer"])


def test_a_rebuilt_optimizer_keeps_what_was_set_on_it_and_state_that_is_not_a_tensor():
    module = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    optimizer.warmup = {"steps": 10}  # set by a user's code after construction
    optimizer.state[module.weight]["history"] = [[1.0], [2.0]]
    copies = _copies(module)
    clone = clone_optimizer(optimizer, copies)
    assert clone.warmup == {"steps": 10} and clone.warmup is not optimizer.warmup
    history = clone.state[copies[id(module.weight)]]["history"]
    assert history == [[1.0], [2.0]] and history[0] is not optimizer.state[module.weight]["history"][0]


def test_the_rebuilt_optimizer_runs_none_of_the_learners_step_hooks():
    """Hooks registered on the learner's optimizer act on the learner's objects: the server's
    optimizer is built anew, without them."""
    module = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    calls = []
    optimizer.register_step_pre_hook(lambda *args: calls.append("pre"))
    optimizer.register_step_post_hook(lambda *args: calls.append("post"))
    copies = _copies(module)
    clone = clone_optimizer(optimizer, copies)
    for p in copies.values():
        p.grad = torch.ones_like(p)
    clone.step()
    assert calls == []


def test_a_copied_shard_holds_no_state_of_the_tensors_outside_it():
    class Custom(torch.optim.SGD):
        def __init__(self, params, schedule, lr=0.1):
            super().__init__(params, lr=lr, momentum=0.5)
            self.schedule = schedule
            self.watched = self.param_groups[0]["params"][1]  # the bias, outside the shard

    torch.manual_seed(0)
    module = nn.Linear(2, 1)
    optimizer = Custom(module.parameters(), schedule=[1])
    module(torch.randn(3, 2)).sum().backward()
    optimizer.step()
    mapping = {id(module.weight): module.weight.detach().clone().requires_grad_(True)}
    shard = clone_optimizer(optimizer, mapping, only_mapped=True)
    assert shard.param_groups[0]["params"] == [mapping[id(module.weight)]]
    assert list(shard.state) == [mapping[id(module.weight)]]
    assert shard.watched is module.bias  # a tensor the shard does not hold stays the learner's


def test_a_missing_gradients_zeros_take_the_vectors_dtype_not_torchs_default():
    """Under ``torch.set_default_dtype(torch.float64)`` (as code made for 64-bit precision sets
    it) a float32 model still pushes float32 vectors, zeros included."""
    module = Mixed()
    module.w.grad = torch.ones(2, 2)  # b has none
    vectors = ModelVectors.of(module)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        payload, masked = vectors.push_vector()
        empty = ModelVectors([]).push_vector()[0]
        empty_masked = ModelVectors([]).push_vector(mask=True)[0]
        empty_state = ModelVectors([]).state_vector()
    finally:
        torch.set_default_dtype(default)
    assert masked and payload.dtype == torch.float32
    assert empty.dtype == empty_masked.dtype == empty_state.dtype == torch.float32


def test_pushes_of_a_half_precision_model_are_float32_without_a_float32_part():
    """Never narrower than float32, even where no part of the push (no float32 buffer, no
    zeros, no mask) would make the concatenation float32 by itself."""
    module = Mixed(torch.float16)
    module.w.grad, module.b.grad = torch.ones(2, 2, dtype=torch.float16), torch.ones(1, dtype=torch.float16)
    payload, masked = ModelVectors.of(module, buffers=False).push_vector()
    assert not masked and payload.dtype == torch.float32
    module.requires_grad_(False)  # only the buffers travel: a half-precision mean and a counter
    module.count.data = module.count.to(torch.float16)
    payload, _ = ModelVectors.of(module).push_vector()
    assert payload.dtype == torch.float32 and payload.tolist() == [6.0, 7.0, 8.0]


def test_the_learning_rates_recorded_for_a_step_are_those_it_takes():
    """`step_lrs`: without an outer optimizer, the learner optimizer's (where Lightning's
    schedulers move them, copied into the server's copy only at its step); with one, its own."""
    torch.manual_seed(0)
    module = nn.Linear(2, 1, bias=False)
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    state = ServerState(module, optimizer)
    optimizer.param_groups[0]["lr"] = 0.25  # a scheduler's step, not copied yet
    assert state.optimizer.param_groups[0]["lr"] == 1.0
    assert state.step_lrs() == (0.25,)
    before, gradient = flat(state), torch.ones(2)
    state.apply([Contribution(gradient)])
    assert torch.allclose(flat(state), before - 0.25 * gradient)  # the step took that rate

    outer = ServerState(module, optimizer, outer=lambda params: torch.optim.SGD(params, lr=0.7))
    assert outer.step_lrs() == (0.7,)  # the outer optimizer's, not the inner one's 0.25


def test_loading_the_buffers_part_leaves_the_parameters_alone():
    """`ModelVectors.load_buffers` (the collective path's settled buffers) writes the buffers
    only, rounding integer counters; the parameters keep their values."""
    module = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    vectors = ModelVectors.of(module)
    params = [p.detach().clone() for p in module.parameters()]
    vectors.load_buffers(torch.tensor([1.0, 2.0, 3.0, 4.0, 6.6]))  # mean (2), var (2), count
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), params))
    assert module[1].running_mean.tolist() == [1.0, 2.0] and module[1].running_var.tolist() == [3.0, 4.0]
    assert module[1].num_batches_tracked.item() == 7


class StepSchedule:
    """A Lightning scheduler config stepped every optimizer step."""

    interval, frequency, reduce_on_plateau, monitor, strict = "step", 1, False, None, True

    def __init__(self, scheduler):
        self.scheduler = scheduler


def test_with_an_outer_optimizer_the_inner_schedules_step_h_times_per_update():
    """Local updates: the outer optimizer steps the server's parameters with its own options,
    while the inner optimizer's step schedulers advance once per inner step, H per update (one
    where H is not given)."""
    for steps_per_update, expected in ((None, 0.5), (3, 0.125)):
        torch.manual_seed(0)
        module = nn.Linear(2, 1, bias=False)
        inner = torch.optim.SGD(module.parameters(), lr=1.0)
        schedule = StepSchedule(torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5))
        h = {} if steps_per_update is None else {"steps_per_update": steps_per_update}
        state = ServerState(module, inner, [schedule], outer=lambda params: torch.optim.SGD(params, lr=2.0), **h)
        before = flat(state)
        state.apply([Contribution(torch.ones(2))], update_index=1)
        assert inner.param_groups[0]["lr"] == expected
        assert state.optimizer.param_groups[0]["lr"] == 2.0  # the outer optimizer's own
        assert torch.allclose(flat(state), before - 2.0)  # the pseudo-gradient stepped at its lr
