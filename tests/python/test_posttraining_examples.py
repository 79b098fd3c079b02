"""examples/grpo.py and examples/dpo.py end to end with tiny settings on the CPU: every loss runs through
its fuseforge module, the loss falls, and the curves, plot and JSON appear."""
import importlib.util
import json
import math
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_example(name):
    path = os.path.join(ROOT, "examples", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"fuseforge_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grpo_example_tiny_cpu(tmp_path, capsys):
    summary = load_example("grpo").main(["--device", "cpu", "--steps", "3", "--prompts", "2", "--group", "4",
                                         "--completion-len", "6", "--updates", "2", "--out", str(tmp_path)])
    curves = summary["curves"]
    assert len(curves["loss"]) == 6 and len(curves["reward"]) == len(curves["kl"]) == 3
    assert all(math.isfinite(v) for v in curves["loss"] + curves["reward"] + curves["kl"])
    assert curves["kl"][0] == 0.0 and curves["kl"][-1] > 0.0  # the policy moved away from its reference
    assert "step    1/3" in capsys.readouterr().out
    assert (tmp_path / "grpo_curves.png").stat().st_size > 0
    assert json.loads((tmp_path / "grpo.json").read_text())["curves"] == curves


@pytest.mark.parametrize("loss", ["dpo", "ipo", "hinge", "simpo", "cpo", "orpo", "kto"])
def test_dpo_example_tiny_cpu(tmp_path, loss):
    summary = load_example("dpo").main(["--device", "cpu", "--loss", loss, "--steps", "4", "--batch", "4",
                                        "--accumulate", "2", "--held-out", "4", "--eval-every", "2",
                                        "--out", str(tmp_path)])
    curves = summary["curves"]
    assert len(curves["loss"]) == 4 and [s for s, _ in curves["held_out_accuracy"]] == [0, 2, 4]
    assert all(math.isfinite(v) for v in curves["loss"])
    assert curves["loss"][-1] < curves["loss"][0]
    assert (tmp_path / f"{loss}_curves.png").stat().st_size > 0
