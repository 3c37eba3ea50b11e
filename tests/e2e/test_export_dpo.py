"""A preference-tuning winner's export (issue 32): `--format trl` writes a TRL DPOTrainer recipe that trains 3 steps
on the CPU on a preference file, where autofit cannot be imported; hf-trainer refuses it, naming --format trl."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import DATA_DIR, run_cli
from recipes import imports_of, save_tiny_model, training_args

from autofit.config.spec import TrialConfig
from autofit.data import DatasetRef
from autofit.data.preference import read_preferences
from runs import write_run

PREFS = DATA_DIR / "prefs.jsonl"
GUARD = ("import sys; sys.modules['autofit'] = None; script = sys.argv[1]; sys.argv = sys.argv[1:]; "
         "exec(compile(open(script).read(), script, 'exec'))")
"""Runs a recipe where `import autofit` fails: it must need nothing of autofit."""


def dpo_run(tmp: Path, prefs: Path = PREFS, **settings: object) -> Path:
    """A run folder as a DPO search on `prefs` leaves it (written, not searched)."""
    cfg = TrialConfig.from_dict({"trainer": "dpo", "batching": "pad_longest", "max_length": 128,
                                 "micro_batch_size": 2, "global_batch": 4, "precision": "fp32", **settings})
    run = write_run(tmp / "run", config=cfg.to_dict())
    spec = yaml.safe_load((run / "spec.yaml").read_text())
    spec["dataset"] = DatasetRef.of_preferences(read_preferences(prefs)).to_dict()
    (run / "spec.yaml").write_text(yaml.safe_dump(spec))
    return run


def test_the_trl_dpo_recipe_trains_three_steps_and_hf_trainer_refuses(tmp_path: Path) -> None:
    run = dpo_run(tmp_path, precompute_ref_log_probs=True, gradient_checkpointing="every_2")
    script = tmp_path / "train_dpo.py"
    assert run_cli("export", str(run), "--format", "trl", "-o", str(script)).returncode == 0
    text = script.read_text()
    fields = training_args(text)
    assert "autofit" not in imports_of(script) and "DPOTrainer(model=model, ref_model=None" in text
    assert (fields["max_length"], fields["precompute_ref_log_probs"], fields["gradient_checkpointing"]) == (128, True,
                                                                                                           True)
    assert fields["activation_checkpointing_kwargs"]["every_n_layers"] == 2
    # the probe's fix to TRL's reference forward, called before the trainer is built; no type-checker comments
    assert "def keep_checkpointing_as_asked" in text and "    keep_checkpointing_as_asked()" in text
    assert text.index("keep_checkpointing_as_asked()  #") < text.index("DPOTrainer(") and "type: ignore" not in text
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", GUARD, str(script), "--model", str(save_tiny_model(tmp_path / "m")),
                           "--output-dir", str(out), "--max-steps", "3"], check=False, capture_output=True, text=True,
                          cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("recipe-summary ")]
    summary = json.loads(line.split(" ", 1)[1])
    assert summary["steps"] == 3 and summary["pairs_per_s"] > 0 and summary["steady_tokens"] > 0
    # one steady step: 2 micro-batches of 2 pairs, both rows of each at most 128 tokens
    assert summary["pairs_per_s"] * summary["steady_seconds"] == pytest.approx(4)
    assert summary["steady_tokens"] <= 4 * 2 * 128
    assert (out / "adapter_config.json").is_file()
    refused = run_cli("export", str(run), "--format", "hf-trainer")
    assert refused.returncode == 2 and "--format trl" in refused.stderr and "Traceback" not in refused.stderr
    default = run_cli("export", str(run))  # without --format a DPO winner gets TRL's script, the same text
    assert default.returncode == 0 and default.stdout == text, default.stderr


def test_conversation_pairs_train_where_the_tokenizer_has_no_chat_template(tmp_path: Path) -> None:
    """The DPO probe renders conversations with autofit's plain rendering where the tokenizer has no template
    (`data.tokenizer.PLAIN_CHAT`); the recipe stopped at TRL's "Cannot use chat template functions" instead."""
    run = dpo_run(tmp_path, DATA_DIR / "prefs-chat.jsonl")
    script = tmp_path / "train_dpo.py"
    assert run_cli("export", str(run), "--format", "trl", "-o", str(script)).returncode == 0
    model = save_tiny_model(tmp_path / "m")  # a tokenizer without a chat template
    assert "chat_template" not in json.loads((model / "tokenizer_config.json").read_text())
    proc = subprocess.run([sys.executable, "-c", GUARD, str(script), "--model", str(model), "--dataset",
                           str(DATA_DIR / "prefs-chat.jsonl"), "--output-dir", str(tmp_path / "out"), "--max-steps",
                           "3"], check=False, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("recipe-summary ")]
    assert json.loads(line.split(" ", 1)[1])["steps"] == 3
