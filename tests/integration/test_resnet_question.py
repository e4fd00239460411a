"""docs/examples/resnet_question.py at a tiny size: a real k_batch_async run on two CPU processes,
recorded and replayed as recorded and with momentum 0 (the figures in docs/replay.md come from the
full size)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from processes import clean_env

pytest.importorskip("transformers", reason="the example builds a Hugging Face ResNet: pip install transformers")
SCRIPT = Path(__file__).parents[2] / "docs" / "examples" / "resnet_question.py"


def test_the_resnet_question_script_records_and_replays(tmp_path):
    command = [sys.executable, str(SCRIPT), "--steps", "3", "--launches", "1", "--no-baselines",
               "--replays", "as recorded,momentum 0", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    replays = json.loads((tmp_path / "replays.json").read_text())
    # the engine applied what the method prescribes for the recorded events, bit for bit
    assert replays["as recorded"]["checked_updates"] == 3 and replays["as recorded"]["identical"]
    # a counterfactual on the same arrival pattern differs from the first update on
    assert replays["momentum 0"]["first_differing_update"] == 1
    assert replays["momentum 0"]["max_relative_difference"] > 1e-3
