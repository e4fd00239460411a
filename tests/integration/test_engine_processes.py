"""StaleStrategy on real processes (CPU, gloo): what only a multi-process run can show.

Each test checks what global rank 0 wrote in a launch of a script from tests/integration/scripts/
(four processes, about 8 s of start-up each), launched in the background from the start of the
session (tests/integration/conftest.py). The decision logic itself is tested in-process in tests/unit (test_rules.py, test_server_loop.py).
"""

import json
import re
from pathlib import Path

import pytest

from processes import books_balance


@pytest.fixture(scope="module")
def variants(launched):
    return launched("variants")  # beside other launches (tests/integration/conftest.py)


@pytest.mark.parametrize("name", ["sync", "k_sync", "k_batch_sync", "async", "k_async", "k_batch_async"])
def test_every_variant_counts_every_gradient_and_learns(variants, name):
    run = variants[name]
    stats = run["stats"]
    assert stats["updates"] == 60 and books_balance(stats)
    assert all(n > 0 for n in stats["pushes_per_learner"])
    assert set(stats["gradients_dropped_by_reason"]) <= {"stale", "epoch_end", "flushed"}
    assert run["updates"] == list(range(1, 61))  # one record per server update, in order
    losses = run["losses"]
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10  # the loss falls
    assert run["module_matches_server"]  # after fit the module holds the server's parameters
    # validation ran on the server's trained parameters: well above chance (0.1 for ten digits);
    # Async applies only 60 single gradients here, so its accuracy is the lowest (0.5 to 0.7)
    assert run["callback_metrics"]["val/acc"] > 0.3
    assert stats["trace_path"].endswith("delays.csv") and Path(stats["trace_path"]).is_file()


def test_sync_family_never_applies_a_stale_gradient(variants):
    for name, k in [("sync", 4), ("k_sync", 2), ("k_batch_sync", 3)]:
        run = variants[name]
        assert set(run["stats"]["staleness_histogram"]) == {"0"}
        assert all(len(learners) == k for learners in run["learners"])
    # K-sync takes one gradient per learner per update; sync takes all four
    assert all(len(set(ls)) == 2 for ls in variants["k_sync"]["learners"])
    assert all(sorted(ls) == [0, 1, 2, 3] for ls in variants["sync"]["learners"])
    # K-sync cancels stragglers; pushes that crossed their cancellation were dropped as stale
    assert variants["k_sync"]["stats"]["cancellations"] > 0


def test_async_family_applies_stale_gradients_from_the_right_learners(variants):
    assert all(len(set(ls)) == 2 for ls in variants["k_async"]["learners"])  # K distinct learners
    for name in ("async", "k_async", "k_batch_async"):
        assert max(variants[name]["staleness_max"]) > 0


def test_batch_variants_let_a_learner_contribute_several_gradients(variants):
    for name in ("k_batch_sync", "k_batch_async"):
        assert any(len(set(ls)) < len(ls) for ls in variants[name]["learners"]), name


def test_server_steps_the_lr_schedule_per_update(variants):
    assert variants["k_batch_async"]["server_lr"] < 0.2 * 0.01  # cosine over max_steps updates
    assert variants["k_async"]["server_lr"] == 0.2


def test_adaptive_k_grows_and_compensated_runs_learn(variants):
    adaptive = variants["adaptive"]
    ks = adaptive["k"]
    assert ks[0] == 1 and ks == sorted(ks) and max(ks) > 1 and max(ks) <= 4  # only grows, capped at P
    history = adaptive["stats"]["k_history"]
    assert [k for _, k in history] == sorted(k for _, k in history)
    for label in ("adaptive", "norm"):
        run = variants[label]
        assert books_balance(run["stats"]) and run["stats"]["updates"] == 120
        assert sum(run["losses"][-10:]) < sum(run["losses"][:10])


def test_boring_model_runs_unchanged(variants):
    boring = variants["boring"]
    assert boring["stats"]["updates"] == 20 and books_balance(boring["stats"])
    assert boring["predicted"] > 0 and len(boring["tested"]) == 1


def test_checkpoint_holds_the_server_and_resume_continues(variants):
    resume = variants["resume"]
    assert resume["saved_server"]["updates"] == 30 == resume["first_run_updates"]
    assert resume["adam_state"] > 0 and resume["saved_matches_final"]
    assert resume["updates"][0] == 31 and resume["stats"]["updates"] == 50


@pytest.fixture(scope="module")
def frozen(launched):
    return launched("frozen")


def test_a_frozen_learner_does_not_stall_the_server(frozen):
    result = frozen
    for name in ("k_async", "k_sync"):
        run = result[name]
        # it really was stopped (a push already on the wire when SIGSTOP hit may still land)
        assert run["pushes_while_frozen"] <= 1, run
        assert run["updates_frozen"] > 50, run  # the others went on without it (K < P)
        assert run["stats"]["pushes_per_learner"][3] >= run["pushes_3_at_thaw"] + 20  # it rejoined
        # rank 0 stopped the run from its side: everyone left cleanly, every gradient counted
        assert run["updates_at_stop_request"] <= run["stats"]["updates"] < 100_000
        assert books_balance(run["stats"])
    # its old gradient arrived after the thaw and was applied, hundreds of updates stale
    assert max(int(s) for s in result["k_async"]["stats"]["staleness_histogram"]) > 50


@pytest.fixture(scope="module")
def crash(launched):
    return launched("crash")  # processes.run_crash


def test_a_dead_learner_ends_the_run_with_an_error_not_a_hang(crash):
    result, elapsed = crash
    assert result.returncode == 1
    assert elapsed < 200
    # every other learner names the dead one (its connection broke: the server's receiving or
    # sending thread noticed), not just a broken connection of its own
    output = result.stdout + result.stderr
    for rank in (0, 1, 3):
        assert re.search(rf"\[rank{rank}\]: \S*ServerFailed: learner 2 died", output), output[-3000:]


@pytest.fixture(scope="module")
def two_nodes(launched):
    return launched("two_nodes")  # processes.run_two_nodes


def test_two_nodes_of_two_processes_under_torchrun(two_nodes):
    statuses, logs, out = two_nodes
    assert statuses == [0, 0], "\n".join(log[-3000:] for log in logs)
    result = json.loads(out.read_text())
    assert result["is_torchelastic"]
    assert result["stats"]["p"] == 4 and all(n > 0 for n in result["stats"]["pushes_per_learner"])
    assert result["stats"]["updates"] == 40 and books_balance(result["stats"])
    channels = result["channels"]["stats"]  # the sharded path with its payloads on channels
    assert channels["server_path"] == "sharded" and channels["payload_channels"] == "gloo"
    assert channels["payloads_on_channels"] > 0 and channels["updates"] == 20 and books_balance(channels)


@pytest.fixture(scope="module")
def transports(launched):
    return launched("transport")


@pytest.mark.parametrize("transport", ["gloo", "lanes"])
def test_the_transport_carries_small_and_large_payloads_and_the_servers_hold(transports, transport):
    """Both framings over a real gloo group: a payload inside its header's frame, and one over
    the frame's size following its header, or with lanes in shared memory behind it; every field
    survives, and the answer's ``pushes`` and ``hold`` let the learner take the server's time out
    of its round trip."""
    run = transports[transport]
    if transport == "lanes":  # same host: learner 1 has lanes; only the two large payloads used them
        assert run["lanes"] == [False, True] and run["through_lanes"] == [1, 1]
    else:
        assert run["lanes"] is None and run["through_lanes"] == []
    assert run["placed"] == (transport == "lanes")  # the stop's payload, written in its slot
    pushes, bye = run["received"][:2], run["received"][2]
    assert [(m["kind"], m["learner"], m["samples"], m["loss"]) for m in pushes] == [(1, 1, 8, 0.5), (1, 1, 9, 0.25)]
    assert pushes[1]["numel"] > pushes[0]["numel"] and all(m["payload_ok"] for m in pushes)
    assert (bye["kind"], bye["cancelled"], bye["numel"], bye["payload"]) == (2, 3, 2, [0.1, 0.2])
    params, stop = run["inbox"]
    assert (params["kind"], params["version"], params["numel"], params["payload_ok"]) == (3, 1, 10, True)
    assert params["pushes"] == 2 and params["hold"] >= 0.2  # the server held push 2 for 0.2 s
    assert params["age"] >= params["hold"]  # and answered push 1, which arrived before push 2
    assert run["round_trip"] >= params["hold"]  # what is left is the time on the wire
    assert (stop["kind"], stop["payload_ok"]) == (5, True) and stop["numel"] > params["numel"]
    assert run["threads_left"] == [] and run["thread_done"]


@pytest.fixture(scope="module")
def paths(launched):
    return launched("paths")


@pytest.mark.parametrize("run", ["sync@collective", "k_sync@collective", "k_batch_sync@collective",
                                 "async@sharded", "k_async@sharded", "k_batch_async@sharded",
                                 "k_sync@sharded"])
def test_the_collective_and_sharded_paths_keep_every_count_and_learn(paths, run):
    result = paths[run]
    stats = result["stats"]
    assert stats["server_path"] == run.split("@")[1] and stats["updates"] == 60 and books_balance(stats)
    assert result["updates"] == list(range(1, 61))
    assert sum(result["losses"][-10:]) < sum(result["losses"][:10])
    assert result["same_everywhere"]  # every learner ends with the server's parameters
    assert result["final_update_applied"] == [1, 1, 1, 1]  # the 60th, which came with the stop
    if run.startswith(("sync", "k_sync", "k_batch_sync")):
        assert set(stats["staleness_histogram"]) == {"0"}
    # Only where every update takes one gradient from each learner does the all-reduce run during
    # backward: then on every learner alike, for every update but the first of the fit, the first
    # of each epoch and one whose pushes an epoch's end may cut.
    overlapped = result["overlapped"]
    if run == "sync@collective":
        assert len(set(overlapped)) == 1 and 60 - 1 - 2 * stats["epochs"] <= overlapped[0] < 60
    else:
        assert overlapped == [0, 0, 0, 0]


def test_reducing_during_backward_ends_where_reducing_after_the_decision_ends(paths):
    run = paths["sync@collective-compared"]
    # 60 updates over several epochs: all reduced during backward but the first and the first of
    # each new epoch (the update that ends an epoch arms nothing), on every learner
    ended = len([update for update in run["epoch_ends"] if update < 60])
    assert ended >= 3
    during, after, again = run["losses"]
    assert run["overlapped"] == [[60 - 1 - ended] * 4, [0] * 4, [60 - 1 - ended] * 4]
    assert len(during) == 60 and during == pytest.approx(after, rel=1e-6)
    assert run["largest_difference"] < 1e-6
    # the same seeds, the same fit: the epochs' ends no longer depend on when their news arrives
    assert again == during and run["identical_again"]


def test_a_stop_inside_a_batch_leaves_no_overlapped_round_waiting(paths):
    stopped = paths["sync@collective-stopped"]
    stats = stopped["stats"]
    assert stats["updates"] < 60 and books_balance(stats) and stopped["same_everywhere"]
    assert len(set(stopped["overlapped"])) == 1 and stopped["overlapped"][0] > 0


@pytest.mark.parametrize("run", ["k_batch_async@central", "k_sync@central", "k_async@central-gloo"])
def test_on_one_host_the_central_paths_large_payloads_cross_in_shared_memory(paths, run):
    """Pushes and answers over a header frame's size go through each learner's lanes (or over
    gloo when shared memory is off) with every count kept, the loss falling and every learner
    ending with the server's parameters."""
    from lightning_stale.engine.distributed.transport import INLINE_PAYLOAD_BYTES

    result = paths[run]
    stats = result["stats"]
    assert 4 * result["parameters"] > INLINE_PAYLOAD_BYTES  # no payload fits a frame
    assert stats["server_path"] == "central" and stats["updates"] == 40 and books_balance(stats)
    assert stats["shared_memory_learners"] == ([] if run.endswith("gloo") else [1, 2, 3])
    assert result["updates"] == list(range(1, 41)) and result["same_everywhere"]
    assert sum(result["losses"][-10:]) < sum(result["losses"][:10])
    assert {learner for update in result["learners"] for learner in update} == {0, 1, 2, 3}


@pytest.mark.parametrize("run", ["k_async@central-channels", "k_batch_async@sharded-channels"])
def test_payloads_on_channels_keep_every_count_and_learn(paths, run):
    """``payload_channels=True``: every payload too large for a frame goes on the group of its
    direction (gloo here, NCCL on GPUs), in the order of the headers, with nothing in shared
    memory; every count kept, the loss falling, every learner ending with the server's state."""
    from lightning_stale.engine.distributed.transport import INLINE_PAYLOAD_BYTES

    result = paths[run]
    stats = result["stats"]
    assert 4 * result["parameters"] > INLINE_PAYLOAD_BYTES
    assert stats["server_path"] == run.split("@")[1].split("-")[0] and stats["payload_channels"] == "gloo"
    assert stats["shared_memory_learners"] == [] and stats["updates"] == 40 and books_balance(stats)
    # rank 0 received pushes (central) or its owner's pieces (sharded) from three learners
    assert stats["payloads_on_channels"] >= 3 * 10
    assert result["updates"] == list(range(1, 41)) and result["same_everywhere"]
    assert sum(result["losses"][-10:]) < sum(result["losses"][:10])
    assert {learner for update in result["learners"] for learner in update} == {0, 1, 2, 3}


def test_a_sharded_checkpoint_gathers_the_model_and_resumes_on_the_central_path(paths):
    saved = paths["sharded_checkpoint"]
    version = saved["saved_server"]["version"]
    assert 2 <= version < 20 and saved["differs_from_final"]  # written during training
    assert saved["adam_states"] == saved["trainable_tensors"]  # every owner's optimizer state
    resumed = saved["resumed"]
    assert resumed["stats"]["server_path"] == "central" and resumed["updates"][0] == version + 1
    assert resumed["stats"]["updates"] == 30 and books_balance(resumed["stats"])


def test_a_collective_checkpoint_resumes_on_the_sharded_path(paths):
    saved = paths["collective_checkpoint"]
    assert saved["matches_module"] and saved["adam_states"] == 6 and saved["saved_server"]["version"] == 15
    resumed = saved["resumed"]
    assert resumed["stats"]["server_path"] == "sharded" and resumed["updates"][0] == 16
    assert resumed["stats"]["updates"] == 25 and saved["same_everywhere"]
