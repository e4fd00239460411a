"""Modules as users write them on 2 real learner processes: what only several processes show
(one launch of tests/integration/scripts/user_modules.py, several fits; the in-process twin of
these checks is tests/unit/test_user_modules.py)."""

import importlib.util
import math

import pytest
import torch

from processes import books_balance


@pytest.fixture(scope="module")
def runs(launched):
    return launched("user_modules")  # tests/integration/conftest.py


def test_batchnorm_state_is_the_same_on_every_learner_and_in_the_checkpoint(runs):
    run = runs["batchnorm"]
    # three validations during fit and one after: learners in step hold the server's state
    assert run["same_on_every_learner"] == [True] * 4
    assert run["server_buffers_match_module"]
    assert run["buffers_in_checkpoint"] == [
        "net.1.num_batches_tracked",
        "net.1.running_mean",
        "net.1.running_var",
    ]
    # the checkpoint evaluated in one process gives the validation loss logged during fit
    assert run["checkpoint_eval"] == pytest.approx(run["logged"][-1], rel=1e-6)
    assert run["after_fit"] == pytest.approx(run["logged"][-1], rel=1e-6)
    assert run["applied_while_paused"] == 0  # nothing changes while everyone validates
    stats = run["stats"]
    assert stats["epochs"] == 3 and books_balance(stats) and min(stats["pushes_per_learner"]) > 0


def test_an_epoch_scheduler_steps_between_epochs_on_the_server(runs):
    run = runs["steplr"]
    # every update of epoch e used lr 0.1 * 0.5**e, as every DDP step of that epoch would
    for paused, lr, epoch in run["applied"]:
        assert not paused and lr == pytest.approx(0.1 * 0.5**epoch)
    assert {epoch for _, _, epoch in run["applied"]} == {0, 1, 2}
    assert run["final_lr"] == pytest.approx(0.1 * 0.5**3)  # the last epoch's step too


def test_reduce_lr_on_plateau_falls_on_the_server(runs):
    run = runs["plateau"]
    reference = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.2)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
        reference, mode="min", factor=0.5, patience=0
    )
    after = [0.2]  # the lr in force after each epoch's validation
    for loss in run["losses"]:
        plateau.step(loss)
        after.append(reference.param_groups[0]["lr"])
    assert len(run["losses"]) == 4 and after[-1] < 0.2
    for _, lr, epoch in run["applied"]:
        assert lr == pytest.approx(after[epoch])
    assert run["final_lr"] == pytest.approx(after[-1])


def test_warmup_is_sized_from_the_updates_of_two_learners(runs):
    run = runs["warmup"]
    # Async: 2 learners x 6 DDP steps per epoch = 12 updates per epoch, 2 epochs
    assert run["total_steps"] == run["stats"]["updates"] == 24


def test_max_time_ends_training_for_every_learner(runs):
    run = runs["max_time"]
    stats = run["stats"]
    assert run["finished"] and 2.0 <= run["elapsed"] < 15.0
    assert 0 < stats["updates"] and books_balance(stats) and min(stats["pushes_per_learner"]) > 0


def test_a_stop_set_in_the_modules_own_hook_on_one_learner_stops_every_learner(runs):
    run = runs["module_stop"]
    stats = run["stats"]
    assert run["finished"] and books_balance(stats)
    # learner 1 asked at its first batch past update 20 (an epoch is 12 updates; a learner
    # starved of CPU may first see update 25 or later): the server stopped both within the
    # epoch it asked in, long before max_epochs = 30, and the fit ended with that epoch
    assert 20 <= stats["updates"] < 36 and run["epoch"] == math.ceil(stats["updates"] / 12)
    # one validation per epoch's end, and one more when the stop came inside an epoch. The stop
    # can also reach the learners during an epoch's end (learner 1 may first see update 20 at
    # update 23, and the 24th ends the epoch): they all stop there, with no further validation.
    extra = run["validations"] - stats["epochs"]
    assert extra in (0, 1)
    if stats["updates"] > 12 * stats["epochs"]:  # stopped inside an epoch
        assert extra == 1
    if extra == 0:  # stopped at an epoch's end
        assert stats["updates"] == 12 * stats["epochs"]


def test_a_stop_asked_at_an_epochs_end_stops_every_learner_in_step(runs):
    run = runs["epoch_end_stop"]
    stats = run["stats"]
    assert run["finished"] and books_balance(stats)
    assert stats["epochs"] == 2  # asked for during the second epoch's end: no third epoch
    # every learner validated at each epoch's end, and once more together where the stop
    # reached them all only after it (at the next epoch's first batch)
    assert run["validations"] in (2, 3) and run["same"] == [True] * run["validations"]


@pytest.mark.parametrize("path", ["collective", "sharded"])
def test_batchnorm_state_on_the_scaled_paths(runs, path):
    run = runs[f"batchnorm@{path}"]
    assert run["stats"]["server_path"] == path
    # two validations during fit and one after: every learner holds the same buffers
    assert run["same_on_every_learner"] == [True] * 3 and run["same_after_fit"]
    assert run["checkpoint_eval"] == pytest.approx(run["logged"][-1], rel=1e-6)
    assert run["after_fit"] == pytest.approx(run["logged"][-1], rel=1e-6)
    stats = run["stats"]
    assert stats["epochs"] == 2 and books_balance(stats) and min(stats["pushes_per_learner"]) > 0
    if path == "collective":  # sync: the all-reduce ran during backward, BatchNorm's count the largest
        assert run["overlapped"][0] == run["overlapped"][1] > 0


def test_warmup_on_the_collective_path_steps_on_every_learner(runs):
    run = runs["warmup@collective"]
    stats = run["stats"]
    # K = P = 2: 12 pushes per epoch make 6 updates, 2 epochs
    assert stats["server_path"] == "collective" and run["total_steps"] == stats["updates"] == 12
    warmup_steps = max(1, int(run["warmup"] * run["total_steps"]))
    for seen in run["rates"]:  # each learner, after every push: the lr of the updates applied
        assert len(seen) > 0
        for version, lr in seen:
            assert lr == pytest.approx(run["lr"] * min(1.0, (version + 1) / warmup_steps))
    assert run["same_after_fit"] and books_balance(stats)
    # K = P: every update but the first of each epoch reduced during backward, on both learners
    assert run["overlapped"] == [10, 10]


@pytest.mark.parametrize("path", ["sharded", "collective"])
def test_frozen_backbone_on_the_scaled_paths(runs, path):
    run = runs[f"frozen@{path}"]
    assert run["stats"]["server_path"] == path
    assert run["backbone_unchanged"] and run["backbone_unchanged_in_checkpoint"]
    assert run["head_moved"] and run["same_after_fit"]
    # AdamW state gathered from the shards, or rank 0's own: one entry per trainable tensor, none
    # for the frozen ones
    assert run["adamw_states"] == run["trainable_tensors"] > 0
    assert books_balance(run["stats"]) and run["stats"]["updates"] > 0
    if path == "collective":  # `sync`: reduced during backward, on every learner alike
        assert len(set(run["overlapped"])) == 1 and run["overlapped"][0] > run["stats"]["updates"] / 2


def test_a_module_too_large_for_a_frame_trains_through_shared_memory(runs):
    """A frozen backbone, BatchNorm and AdamW with a warm-up on the central path, every push and
    answer of learner 1 crossing in shared memory (answers to it alone written there by the
    server thread, its pushes read in their slot by the server and its answers loaded from
    theirs), the same parameters and buffers on every learner at each validation."""
    from lightning_stale.engine.distributed.transport import INLINE_PAYLOAD_BYTES

    run = runs["wide@central"]
    stats = run["stats"]
    assert run["push_bytes"] > INLINE_PAYLOAD_BYTES
    assert stats["server_path"] == "central" and stats["shared_memory_learners"] == [1]
    assert run["same_on_every_learner"] == [True] * 2 and run["same_after_fit"]
    assert run["backbone_unchanged"] and run["head_moved"]
    # Async: 2 learners x 6 DDP steps per epoch, 2 epochs; the warm-up is over by the end
    assert run["total_steps"] == stats["updates"] == 24 and run["lr"] == pytest.approx(run["configured_lr"])
    assert books_balance(stats) and min(stats["pushes_per_learner"]) > 0
    assert run["placed_answers"] > 0  # K = 1: answers written straight into learner 1's slot
    assert run["lent_pushes"] > 0  # and its pushes read in theirs


def test_a_users_module_trains_with_its_payloads_on_device_channels(runs):
    """AdamW with a warm-up, a frozen backbone and BatchNorm, as above, with the pushes and answers
    on the groups of their directions (``payload_channels=True``) instead of shared memory."""
    run = runs["wide@central-channels"]
    stats = run["stats"]
    assert stats["server_path"] == "central" and stats["payload_channels"] == "gloo"
    assert stats["shared_memory_learners"] == [] and stats["payloads_on_channels"] > 0
    assert run["same_on_every_learner"] == [True] * 2 and run["same_after_fit"] and run["backbone_unchanged"]
    assert run["total_steps"] == stats["updates"] == 24 and run["lr"] == pytest.approx(run["configured_lr"])
    assert books_balance(stats) and min(stats["pushes_per_learner"]) > 0


def test_auto_runs_a_mid_sized_sync_model_central_on_the_lanes_it_opened_to_decide(runs):
    from lightning_stale.engine.distributed.paths.registry import ONE_HOST_COLLECTIVE_MIN_NUMEL, SCALE_MIN_NUMEL

    run = runs["wider@auto"]
    stats = run["stats"]
    assert SCALE_MIN_NUMEL <= run["numel"] < ONE_HOST_COLLECTIVE_MIN_NUMEL  # collective over gloo
    assert stats["server_path"] == "central" and stats["shared_memory_learners"] == [1]
    assert run["same_on_every_learner"] and all(run["same_on_every_learner"]) and run["same_after_fit"]
    assert books_balance(stats) and stats["updates"] > 0


@pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None, reason="`lightning` is not installed"
)
@pytest.mark.parametrize("label, path", [("lightning", "central"), ("lightning@collective", "collective"),
                                         ("lightning@sharded", "sharded")])
def test_a_lightning_pytorch_trainer_runs_the_real_engine_on_every_path(runs, label, path):
    run = runs[label]
    assert run["trainer"] == "lightning.pytorch.trainer.trainer"
    assert run["stats"]["server_path"] == path
    assert run["stats"]["updates"] == 12 == run["total_steps"] and books_balance(run["stats"])
    assert run["lr"] == 0.01  # the warm-up (6 of the 12 updates) is over: stepped once per update
    assert run["val_loss"] == run["val_loss"]  # validated (a number, not NaN)
    if path == "collective":  # K = P = 2: the all-reduce during backward, as under a pl.Trainer
        assert run["overlapped"][0] == run["overlapped"][1] > 0
