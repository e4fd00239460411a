"""StaleStrategy's local updates on 2 real processes (tests/integration/scripts/local_updates.py):
what only processes show, the pseudo-gradients of a learner on another process crossing shared
memory or gloo, and on the collective path each process's copy of the server's state kept
equal by the all-reduces. The update rule itself is recomputed by hand in-process
(tests/unit/test_local_updates_real.py, test_local_updates_collective.py)."""

import pytest

from processes import books_balance


@pytest.fixture(scope="module")
def runs(launched):
    return launched("local_updates")  # tests/integration/conftest.py


@pytest.mark.parametrize("name,h", [("sync_diloco", 4), ("async_slow_learner", 3), ("k_batch_sync_gloo", 2)])
def test_both_learners_push_rounds_and_the_counts_are_inner_steps(runs, name, h):
    run = runs[name]
    stats = run["stats"]
    assert books_balance(stats)
    assert stats["updates"] == 48 // h  # max_steps counts inner steps, H per update
    assert run["global_step"] == h * stats["updates"]
    assert all(n > 0 for n in stats["pushes_per_learner"]) and len(stats["pushes_per_learner"]) == 2
    assert run["module_matches_server"]
    assert run["losses"][-1] < run["losses"][0]


def test_the_outer_nesterov_step_and_staleness(runs):
    assert runs["sync_diloco"]["outer"] == "SGD" and all(runs["sync_diloco"]["outer_momentum"])
    assert runs["sync_diloco"]["stats"]["shared_memory_learners"] == [1]
    assert max(runs["async_slow_learner"]["staleness_max"]) >= 1  # the fast learner went on
    assert runs["k_batch_sync_gloo"]["stats"]["shared_memory_learners"] == []


def test_epochs_are_passes_of_inner_steps_and_rounds_go_on_over_their_ends(runs):
    run = runs["async_epochs"]
    stats = run["stats"]
    assert stats["updates"] == 20 and run["global_step"] == 60 and books_balance(stats)
    assert stats["epochs"] == 2  # 8 pushes an epoch: 2 x ceil(12 / 3)
    assert "val/loss" in run["callback_metrics"] and run["module_matches_server"]


def test_the_collective_path_all_reduces_rounds_across_processes_and_keeps_the_copies_equal(runs):
    run = runs["k_sync_collective"]
    stats = run["stats"]
    assert stats["server_path"] == "collective" and books_balance(stats)
    assert stats["updates"] == 20 and run["global_step"] == 60  # max_steps=60 inner steps, 3 per update
    assert stats["epochs"] >= 2 and "val/loss" in run["callback_metrics"]  # rounds went on over epochs' ends
    assert stats["cancellations"] >= 1  # a round abandoned where the other's (K = 1) made an update
    assert all(n > 0 for n in stats["pushes_per_learner"]) and sum(stats["pushes_per_learner"]) >= 20
    assert {1} in [set(learners) for learners in run["learners"]]  # learner 1's rounds made updates too
    # both processes' copies of the server's parameters and of DiLoCo's momentum, and their modules
    assert run["replicas_agree"] and run["module_matches_server"]
    assert run["outer"] == "SGD" and run["outer_momentum"] and all(run["outer_momentum"])
    assert run["losses"][-1] < run["losses"][0]


def test_each_learner_steps_the_inner_schedule_along_the_servers_trajectory(runs):
    """Each process steps its own copy of the cosine schedule (the server steps none): at the stop
    both stand at the final version's inner step, global_step, with the cosine's learning rate
    there: 0.1 x (1 + cos(pi x 60 / 120)) / 2 = 0.05."""
    run = runs["scheduled_sync"]
    assert run["stats"]["updates"] == 20 and run["global_step"] == 60 and books_balance(run["stats"])
    (rank0,), (rank1,) = run["schedules"]
    assert rank0 == rank1 and rank0[0] == 60 and rank0[1] == pytest.approx(0.05)
    assert all(schedules == [] for name, r in runs.items() if name != "scheduled_sync"
               for schedules in r["schedules"])
