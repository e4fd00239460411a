"""Launching the scripts of tests/integration/scripts/ as a user would, from a clean environment."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).parent / "scripts"
# Lightning's and torchrun's launcher variables: a child inheriting them would think it is a rank.
LAUNCHER_VARIABLES = {"LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK",
                      "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED",
                      "PL_SEED_WORKERS"}


# The environment the session started with: the launches run in the background while tests
# change os.environ (tests/conftest.py's OMP_NUM_THREADS=1, a test's monkeypatch), and a launched
# run sees what a user's would.
SESSION_ENV = dict(os.environ)


def clean_env():
    env = {k: v for k, v in SESSION_ENV.items()
           if k not in LAUNCHER_VARIABLES and not k.startswith(("PYTEST_XDIST_", "PYTEST_CURRENT_TEST"))}
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), env.get("PYTHONPATH", "")])
    return env


def run_script(name, tmp_path, timeout=420, **env):
    out = tmp_path / "result.json"
    result = subprocess.run([sys.executable, str(SCRIPTS / name), str(out)], cwd=tmp_path, env={**clean_env(), **env},
                            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    return json.loads(out.read_text())


RACE_UPDATES = 30
RACE_COMMAND = [sys.executable, "-m", "lightning_stale.train", f"trainer.max_steps={RACE_UPDATES}",
                "delay.mean=0.01", "race.window=5", "race.target_loss=null",
                "race.contestants=[sync,k_sync:2,k_async:2,sync@ddp]"]


def run_race(tmp_path):
    """`python -m lightning_stale.train` from outside the checkout: the default race with fewer
    updates, smaller delays and a ddp contestant added. Returns the finished process and its
    Hydra run folder."""
    run_dir = tmp_path / "run"
    result = subprocess.run(RACE_COMMAND + [f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=clean_env(),
                            capture_output=True, text=True, timeout=420, stdin=subprocess.DEVNULL)
    return result, run_dir


def run_crash(tmp_path):
    """crash.py (a learner dies mid-run): the finished launcher and its wall-clock seconds."""
    start = time.monotonic()
    result = subprocess.run([sys.executable, str(SCRIPTS / "crash.py")], cwd=tmp_path, env=clean_env(),
                            capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    return result, time.monotonic() - start


def run_two_nodes(tmp_path):
    """two_nodes.py under torchrun, two nodes of two processes on this host: the two node
    launchers' exit statuses, their output, and the path of rank 0's results."""
    out = tmp_path / "result.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(SCRIPTS / "two_nodes.py"), str(out)]
    nodes = [subprocess.Popen(command[:3] + [f"--node-rank={rank}"] + command[3:], cwd=tmp_path, env=clean_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
             for rank in (0, 1)]
    logs = [node.communicate(timeout=300)[0] for node in nodes]
    return [node.returncode for node in nodes], logs, out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def books_balance(stats):
    return stats["gradients_received"] == (stats["gradients_applied"] + stats["gradients_dropped"]
                                           + stats["gradients_in_flight_at_stop"])
