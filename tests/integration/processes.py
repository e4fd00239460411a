"""Launching the scripts of tests/integration/scripts/ as a user would, from a clean environment."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).parent / "scripts"
# Lightning's and torchrun's launcher variables: a child inheriting them would think it is a rank.
LAUNCHER_VARIABLES = {"LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK",
                      "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED",
                      "PL_SEED_WORKERS"}


def clean_env():
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), env.get("PYTHONPATH", "")])
    return env


def run_script(name, tmp_path, timeout=420, **env):
    out = tmp_path / "result.json"
    result = subprocess.run([sys.executable, str(SCRIPTS / name), str(out)], cwd=tmp_path, env={**clean_env(), **env},
                            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    return json.loads(out.read_text())


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def books_balance(stats):
    return stats["gradients_received"] == (stats["gradients_applied"] + stats["gradients_dropped"]
                                           + stats["gradients_in_flight_at_stop"])
