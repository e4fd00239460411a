"""Which server path ``server="auto"`` picks, and the refusals of a forced path: the rule of
`engine.distributed.paths.registry.choose_path`, measured by benchmarks/scaling.py (docs/benchmarks/scaling.md),
and `settle_path`, which asks every rank's shared memory first where the answer decides."""

import pytest
from torch import nn

from lightning_stale.engine.distributed import lanes
from lightning_stale.engine.distributed.paths import registry as ranks
from lightning_stale.engine.distributed.paths.registry import (CROWDED_HOST_COLLECTIVE_MIN_NUMEL, ONE_HOST_COLLECTIVE_MIN_NUMEL,
                                                      ONE_HOST_SHARDED_MIN_P, SCALE_MIN_NUMEL, SHARDED_MIN_TRAFFIC,
                                                      central_if_memory_is_shared, choose_path, settle_path)
from lightning_stale.method.compensation import StalenessCompensation
from lightning_stale.method.variants import Variant
from thread_ranks import ThreadRanks


def auto(name, p, numel, k=None, failure="stop", compensation=None, clips=False, nodes=2, cores=None,
         shared=False):
    return choose_path("auto", Variant.create(name, p, k), numel, failure, compensation, clips, nodes, cores,
                       memory_shared=shared)


@pytest.mark.parametrize("name", ["sync", "k_sync", "k_batch_sync", "async", "k_async", "k_batch_async"])
def test_small_models_and_one_learner_stay_central(name):
    k = None if name in ("sync", "async") else 1
    assert auto(name, 4, SCALE_MIN_NUMEL - 1, k) == "central"
    assert auto(name, 1, 100 * SHARDED_MIN_TRAFFIC, 1 if k else None) == "central"


def test_the_sync_family_goes_collective_at_scale():
    assert auto("sync", 2, SCALE_MIN_NUMEL) == "collective"
    assert auto("k_batch_sync", 4, SCALE_MIN_NUMEL, k=2) == "collective"


def test_on_one_cpu_host_with_shared_memory_the_sync_family_stays_central_longer():
    medium = ONE_HOST_COLLECTIVE_MIN_NUMEL - 1  # e.g. 1M parameters
    assert SCALE_MIN_NUMEL < medium
    for name, k in (("sync", None), ("k_sync", 4), ("k_batch_sync", 2)):
        assert auto(name, 4, medium, k, nodes=1, cores=8, shared=True) == "central"
        assert auto(name, 4, ONE_HOST_COLLECTIVE_MIN_NUMEL, k, nodes=1, cores=8, shared=True) == "collective"
        # a learner without shared memory (its payloads over gloo), GPUs (NCCL device to device),
        # or several hosts: collective
        assert auto(name, 4, medium, k, nodes=1, cores=8, shared=False) == "collective"
        assert auto(name, 4, medium, k, nodes=1, cores=None, shared=True) == "collective"
        assert auto(name, 4, medium, k, nodes=2, cores=8, shared=True) == "collective"
    # the async family's rule is its own
    assert auto("k_async", 4, medium, 2, nodes=1, cores=8, shared=True) == "central"


def test_where_cpu_learners_outnumber_the_cores_the_sync_family_stays_central_longer_still():
    crowded, roomy = 2, 4  # cores for 4 learners
    assert ONE_HOST_COLLECTIVE_MIN_NUMEL < 3_500_000 < CROWDED_HOST_COLLECTIVE_MIN_NUMEL < 13_800_000
    for numel in (ONE_HOST_COLLECTIVE_MIN_NUMEL, 3_500_000, CROWDED_HOST_COLLECTIVE_MIN_NUMEL - 1):
        assert auto("sync", 4, numel, nodes=1, cores=crowded, shared=True) == "central"
        assert auto("sync", 4, numel, nodes=1, cores=roomy, shared=True) == "collective"
        assert auto("sync", 4, numel, nodes=1, cores=crowded, shared=False) == "collective"
    assert auto("sync", 4, CROWDED_HOST_COLLECTIVE_MIN_NUMEL, nodes=1, cores=crowded, shared=True) == "collective"


@pytest.mark.parametrize("name, p, numel, nodes, cores, asks", [
    ("sync", 4, 3_500_000, 1, 2, True),  # the strategy opens the lanes to decide
    ("k_batch_sync", 4, 1_000_000, 1, 8, True),
    ("sync", 4, SCALE_MIN_NUMEL - 1, 1, 2, False),  # central anyway
    ("sync", 4, 3_500_000, 1, 4, False),  # collective: the learners have a core each
    ("sync", 4, 3_500_000, 2, 2, False),  # two hosts
    ("sync", 4, 3_500_000, 1, None, False),  # GPUs
    ("k_async", 4, 3_500_000, 1, 2, False),  # the async family's rule needs no lanes
    ("sync", 1, 3_500_000, 1, 2, False),  # no remote learner
])
def test_the_question_of_shared_memory_is_asked_only_where_its_answer_decides(name, p, numel, nodes, cores, asks):
    variant = Variant.create(name, p, p // 2 if name.startswith("k_") else None)
    assert central_if_memory_is_shared(variant, numel, nodes, cores) is asks
    if asks:  # and the answer then decides
        paths = {choose_path("auto", variant, numel, "stop", None, False, nodes, cores, memory_shared=shared)
                 for shared in (True, False)}
        assert paths == {"central", "collective"}


def test_the_async_family_shards_once_rank_0_would_carry_too_much():
    # 4M parameters: central on 2 and 4 learners (where it kept up), sharded on 8
    assert auto("k_async", 2, 4_000_000, k=1) == "central"
    assert auto("k_async", 4, 4_000_000, k=2) == "central"
    assert auto("k_async", 8, 4_000_000, k=4) == "sharded"
    # 16M parameters: sharded from 2 learners on
    assert auto("async", 2, SHARDED_MIN_TRAFFIC) == "sharded"
    assert auto("k_batch_async", 4, 16_000_000, k=2) == "sharded"


def test_on_one_host_the_async_family_shards_only_from_many_learners():
    big = 100 * SHARDED_MIN_TRAFFIC
    few, many = ONE_HOST_SHARDED_MIN_P - 1, ONE_HOST_SHARDED_MIN_P
    assert auto("k_batch_async", 4, 16_000_000, k=2, nodes=1) == "central"  # sharded on two hosts
    assert auto("async", few, big, nodes=1) == "central"
    assert auto("async", many, big, nodes=1) == "sharded"
    assert auto("k_async", many, 4_000_000, k=4, nodes=1) == "sharded"
    assert auto("k_async", many, SHARDED_MIN_TRAFFIC // (2 * many), k=4, nodes=1) == "central"  # little traffic
    assert auto("sync", 2, big, nodes=1) == "collective"  # the sync family does not depend on it


def test_options_that_need_the_whole_model_keep_auto_central():
    big = 100 * SHARDED_MIN_TRAFFIC
    assert auto("k_async", 4, big, k=2, failure="continue") == "central"
    assert auto("k_sync", 4, big, k=2, failure="continue") == "central"
    assert auto("async", 4, big, compensation=StalenessCompensation.create({"mode": "norm", "c": 1.0})) == "central"
    assert auto("async", 4, big, clips=True) == "central"  # clipping needs the whole gradient
    assert auto("sync", 4, big, clips=True) == "collective"  # every learner holds it


@pytest.mark.parametrize("path, name, failure, match", [
    ("collective", "k_async", "stop", "serves the sync family"),
    ("sharded", "k_async", "continue", "use server='central' with on_learner_failure='continue'"),
    ("collective", "sync", "continue", "a dead learner ends the run"),
])
def test_a_forced_path_that_cannot_run_the_options_is_refused_naming_the_alternative(path, name, failure, match):
    variant = Variant.create(name, 4, 2 if name.startswith("k_") else None)
    with pytest.raises(ValueError, match=match):
        choose_path(path, variant, 10, failure, None)


@pytest.mark.parametrize("cores, width, learner_without_memory, expected", [
    (8, 600, None, "central"),  # 0.36M values: central where every learner shares memory
    (8, 600, 2, "collective"),  # learner 2 cannot (a full /dev/shm): collective, on every rank
    (2, 1600, None, "central"),  # 2.6M values, 3 learners on 2 cores
    (8, 1600, None, "collective"),  # the same with a core each: nothing to ask
    (None, 600, None, "collective"),  # GPUs: nothing to ask
])
def test_every_rank_settles_on_the_same_path_and_the_central_one_takes_the_lanes_opened_to_decide(
        monkeypatch, cores, width, learner_without_memory, expected):
    world = ThreadRanks(3)
    monkeypatch.setattr(lanes, "dist", world)
    monkeypatch.setattr(ranks.os, "cpu_count", lambda: cores)
    create = lanes.LaneFile.create.__func__

    def create_unless_without(cls, directory, slot_bytes):
        if world.local.rank == learner_without_memory:
            raise OSError(28, "No space left on device")
        return create(cls, directory, slot_bytes)

    monkeypatch.setattr(lanes.LaneFile, "create", classmethod(create_unless_without))
    variant = Variant.create("sync", 3)
    settled = world.run(lambda rank: settle_path("auto", variant, nn.Linear(width, width), None, rank, "stop",
                                                 None, nodes=1, shared_memory=True, cpu=cores is not None))
    assert [path for path, _ in settled] == [expected] * 3
    asked = cores == 2 or width == 600 and cores is not None
    assert world.calls == [2 if asked else 0] * 3  # the lanes' all-gather and broadcast, or nothing
    if expected == "central":  # rank 0 holds a lane pair to each learner, each learner one to it
        assert sorted(settled[0][1]) == [1, 2] and [sorted(settled[r][1]) for r in (1, 2)] == [[0], [0]]
    else:
        assert all(held is None for _, held in settled)


LARGE = ranks.INLINE_PAYLOAD_BYTES + 4  # a push larger than a header's frame


@pytest.mark.parametrize("wanted,path,world,backend,device,failure,push_bytes,expected", [
    (False, "central", 4, "nccl", "cuda", "stop", LARGE, None),  # the default: through host memory
    (False, "sharded", 8, "nccl", "cuda", "stop", LARGE, None),
    (True, "central", 4, "nccl", "cuda", "stop", LARGE, "nccl"),  # asked for: GPU to GPU
    (True, "sharded", 8, "nccl", "cuda", "stop", LARGE, "nccl"),
    (True, "central", 4, "nccl", "cuda", "stop", LARGE - 4, None),  # every payload fits a frame
    (True, "central", 4, "gloo", "cpu", "stop", LARGE - 4, None),
    (False, "central", 4, "gloo", "cpu", "stop", LARGE, None),  # on CPU gloo carries payloads already
    (True, "collective", 4, "nccl", "cuda", "stop", LARGE, None),  # its payloads meet in all-reduces
    (True, "central", 1, None, "cuda", "stop", LARGE, None),  # no peer
    (True, "sharded", 4, "gloo", "cpu", "stop", LARGE, "gloo"),
])
def test_payloads_take_device_channels_only_where_asked(wanted, path, world, backend, device,
                                                        failure, push_bytes, expected):
    """Device channels have not run on several GPUs: they are never a default (payloads go
    through host memory, which has), and open where asked for."""
    import torch

    assert ranks.channel_backend(wanted, path, world, backend, torch.device(device), failure,
                                 push_bytes) == expected


def test_channels_asked_for_on_gpus_without_nccl_are_refused_naming_the_backend():
    import torch

    with pytest.raises(ValueError, match=r"needs NCCL for payloads on cuda devices.*runs on 'gloo'"):
        ranks.channel_backend(True, "central", 2, "gloo", torch.device("cuda"), "stop", LARGE)


def test_nccl_channels_are_refused_where_their_streams_would_share_a_pool():
    """Up to MAX_CHANNEL_WORLD processes every channel keeps a stream of its own (32 per pool,
    PyTorch's); beyond, and where a device offers too few priority levels, asking for channels
    is refused, saying why."""
    import torch

    gpu, top = torch.device("cuda"), ranks.MAX_CHANNEL_WORLD
    assert ranks.streams.engine_streams_needed(2 * (top - 1)) <= ranks.streams.STREAMS_PER_POOL
    assert ranks.streams.engine_streams_needed(2 * top) > ranks.streams.STREAMS_PER_POOL
    for path in ("central", "sharded"):
        assert ranks.channel_backend(True, path, top, "nccl", gpu, "stop", LARGE) == "nccl"
    with pytest.raises(ValueError, match=rf"payload_channels=True: {top + 1} processes .*at most {top} processes"):
        ranks.channel_backend(True, "central", top + 1, "nccl", gpu, "stop", LARGE)
    with pytest.raises(ValueError, match=r"fewer than three stream priority levels"):
        ranks.channel_backend(True, "sharded", 4, "nccl", gpu, "stop", LARGE, separate_levels=False)


@pytest.mark.parametrize("setting,backend,expected", [
    (None, "gloo", True), (None, None, True),  # the default: where the default group is gloo
    (None, "nccl", False),  # a second NCCL communicator beside the default one: never run on GPUs
    (True, "nccl", True), (False, "gloo", False),  # as given
])
def test_the_overlap_is_no_default_on_nccl(setting, backend, expected):
    assert ranks.overlap_wanted(setting, backend) is expected


@pytest.mark.parametrize("path,p,pairs", [
    ("central", 3, [(1, 0), (0, 1), (2, 0), (0, 2)]),
    ("sharded", 3, [(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)]),
    ("collective", 3, []),
])
def test_every_direction_a_paths_payloads_take_gets_a_channel(path, p, pairs):
    from lightning_stale.engine.distributed.paths.registry import channel_pairs

    assert channel_pairs(path, p) == pairs


def test_an_unknown_path_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="unknown server path 'ring'; choose one of auto, central, collective, sharded"):
        ranks.check_path("ring", "k_async", "stop", None)
    with pytest.raises(ValueError, match="unknown server path 'ring'"):
        ranks.channel_pairs("ring", 2)


def test_a_path_is_a_plug_in_that_the_registry_consults(monkeypatch):
    """A dummy path, known to the registry only: its refusals, channels and overlap are its own."""
    from lightning_stale.engine.distributed.paths.base import ServerPath

    class Ring(ServerPath):
        name = "ring"

        def problem(self, variant_name, on_learner_failure, compensation, clips=False):
            return None if variant_name == "sync" else "server='ring' runs 'sync' only: use server='central'"

        def traffic(self, numel, p, k):
            return 2 * numel * (p - 1) / p

        def channel_pairs(self, p):
            return [(r, (r + 1) % p) for r in range(p)]

        def build(self, ctx):
            raise NotImplementedError

    monkeypatch.setitem(ranks.PATHS, "ring", Ring())
    ranks.check_path("ring", "sync", "stop", None)
    with pytest.raises(ValueError, match="runs 'sync' only"):
        choose_path("ring", Variant.create("k_async", 4, 2), 10, "stop", None)
    assert ranks.channel_pairs("ring", 3) == [(0, 1), (1, 2), (2, 0)]
    assert ranks.channel_backend(True, "ring", 3, "gloo", __import__("torch").device("cpu"), "stop", LARGE) == "gloo"
    assert not ranks.overlap_allreduce(None, "gloo", "ring", Variant.create("sync", 4), None, plain_steps=True)
    assert ranks.overlap_allreduce(None, "gloo", "collective", Variant.create("sync", 4), None, plain_steps=True)


def test_the_cost_models_follow_their_derivations():
    """Central's rank 0 moves 2N(P - 1) values per P gradients, P times a ring all-reduce's
    2N(P - 1)/P; sharded moves a ring all-reduce's share where an update takes P gradients."""
    n, p = 1_000_000, 4
    central, collective, sharded = (ranks.PATHS[name] for name in ("central", "collective", "sharded"))
    assert central.traffic(n, p, p) == 2 * n * (p - 1) == p * collective.traffic(n, p, 1)
    assert collective.traffic(n, p, 1) == collective.traffic(n, p, p) == 2 * n * (p - 1) / p
    assert sharded.traffic(n, p, p) == collective.traffic(n, p, p) and sharded.traffic(n, p, 1) < central.traffic(n, p, 1)
