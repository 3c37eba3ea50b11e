"""The kernel keys wired through autofit (issue 12): keys, recipe, probe, runner, objective.

The gate's power on its own is tested in test_kernels.py; here it runs inside a real probe child,
with a deliberately wrong kernel injected at the process boundary (`TEST_LOSS_SCALE_ENV`).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import probe_json
from optuna.trial import create_trial
from recipes import DATA

from autofit.config import kernels
from autofit.config.models import resolve_model
from autofit.config.spec import TrialConfig
from autofit.config.target import Target
from autofit.estimate.memory import Shape
from autofit.export import export_run
from autofit.probe.child.gate import TEST_LOSS_SCALE_ENV
from autofit.probe.runner import Runner
from autofit.protocol.result import Outcome
from autofit.search.knowledge import Knowledge, Verdict
from autofit.search.objective import best_of
from runs import write_run

SHORT = {"max_length": 128, "global_batch": 4}


def test_liger_probe_is_unsupported_with_the_reason_on_the_cpu(tmp_path) -> None:
    r = probe_json("--set", "liger=on", "--set", "max_length=128", "--set", "global_batch=4", cwd=tmp_path)
    assert r["outcome"] == "unsupported"
    assert "Liger's kernels are Triton GPU kernels" in r["reason"]


def test_the_gate_in_a_real_probe_catches_a_wrong_kernel(tmp_path, monkeypatch) -> None:
    """torch_compile runs on the CPU; the test-only factor makes its loss 1.5x: a mismatch, and the
    study's next config with the same kernels is skipped from that stored verdict, without a child."""
    monkeypatch.setenv(TEST_LOSS_SCALE_ENV, "1.5")
    cfg = TrialConfig(torch_compile=True, precision="fp32", **SHORT)
    with Runner(Target(), tmp_path, standby=0) as runner:
        res = runner.run(cfg, resolve_model("tiny-llama"), name="wrong", timeout=600)
    assert res.outcome is Outcome.MISMATCH, res.reason + res.error_tail
    assert res.extra["gate"]["ok"] is False and res.extra["gate_key"] == kernels.gate_key(cfg)
    assert res.extra["gate"]["loss_rel_err"] == pytest.approx(0.5, rel=1e-3)
    assert best_of([res]) is None  # never a winner
    stored = create_trial(value=0.0, user_attrs={"kind": "probe", "config_key": cfg.key(), "result": res.to_dict()})
    stored.number = 3
    know = Knowledge.build([stored], Shape.from_config(resolve_model("tiny-llama").config), False, None)
    assert know.verdict(cfg.replace(micro_batch_size=2)) == (
        Verdict.MISMATCHED, "trial 3: the kernels failed the correctness gate")


def test_a_compiled_probe_passes_the_gate_and_reports_compile_seconds(tmp_path) -> None:
    r = probe_json("--set", "torch_compile=on", "--set", "max_length=128", "--set", "global_batch=4",
                   cwd=tmp_path)
    assert r["outcome"] == "fit", r["reason"]
    assert r["extra"]["gate"]["ok"] is True
    assert r["compile_seconds"] > 0 and r["extra"]["first_step_s"] > r["compile_seconds"] / 2
    assert r["extra"]["dynamo"]["graphs"] >= 1
    # regional compilation: every decoder block compiled, the top-level forward (the loss) eager
    assert r["extra"]["compiled_regions"] >= r["n_layers"] and r["extra"]["compiled_whole_model"] is False


# ----------------------------------------------------------------------------- export

KERNELS = TrialConfig(liger=True, torch_compile=True, **SHORT)


def test_a_liger_script_fails_clearly_where_liger_cannot_run(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(export_run(write_run(tmp_path / "run", config=KERNELS.to_dict()), "hf-trainer").text)
    proc = subprocess.run([sys.executable, str(script), "--dataset", str(DATA), "--max-steps", "3",
                           "--output-dir", str(tmp_path / "out")],
                          check=False, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "use_liger_kernel=True" in proc.stderr
    assert "pip install 'liger-kernel>=0.8.5'" in proc.stderr or "this machine has no" in proc.stderr
