"""`autofit export`: recipes that run for real and never import autofit."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autofit.errors import UsageError
from autofit.export.common import check_fields
from autofit.export.yaml_targets import AXOLOTL, LLAMA_FACTORY
from conftest import ROOT, run_cli

DATA = ROOT / "tests" / "data" / "tiny.jsonl"


def export(run: Path, fmt: str, out: Path) -> subprocess.CompletedProcess[str]:
    return run_cli("export", str(run), "--format", fmt, "-o", str(out))


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("fmt, name", [("hf-trainer", "train.py"), ("trl", "train_trl.py")])
def test_python_recipes_train_three_steps(tiny_run: Path, tmp_path: Path, fmt: str, name: str) -> None:
    script = tmp_path / name
    proc = export(tiny_run, fmt, script)
    assert proc.returncode == 0, proc.stderr
    assert "autofit" not in imports_of(script)
    text = script.read_text()
    best = json.loads((tiny_run / "best.json").read_text())
    assert best["run_id"] in text and f"{best['tokens_per_s']:,.0f} tokens/s" in text  # provenance
    assert f"MAX_LENGTH = {best['config']['max_length']}" in text
    assert f"'gradient_accumulation_steps': {best['config']['gradient_accumulation_steps']}" in text
    # run it where autofit cannot be imported at all
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-c", "import sys; sys.modules['autofit'] = None; "
                          f"sys.argv = {[str(script), '--dataset', str(DATA), '--output-dir', str(out), '--max-steps', '3']!r}; "
                          f"exec(compile(open({str(script)!r}).read(), {str(script)!r}, 'exec'))"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = [x for x in (run.stdout + run.stderr).splitlines() if x.startswith("recipe-summary ")]
    assert summary and json.loads(summary[-1].split(" ", 1)[1])["steps"] == 3
    assert "stand-in tokenizer" in run.stderr
    assert (out / "adapter_config.json").is_file()


def test_yaml_recipes_parse_and_carry_the_winner(tiny_run: Path, tmp_path: Path) -> None:
    best = json.loads((tiny_run / "best.json").read_text())["config"]
    assert export(tiny_run, "axolotl", tmp_path / "a.yaml").returncode == 0
    ax = yaml.safe_load((tmp_path / "a.yaml").read_text())
    assert ax["sequence_len"] == best["max_length"]
    assert ax["micro_batch_size"] == best["micro_batch_size"]
    assert ax["gradient_accumulation_steps"] == best["gradient_accumulation_steps"]
    assert ax["lora_r"] == best["lora_r"] and ax["optimizer"] == best["optimizer"]
    assert ax["gradient_checkpointing"] == (best["gradient_checkpointing"] != "off")
    assert set(ax) <= AXOLOTL["keys"]
    assert f"axolotl {AXOLOTL['version']}" in (tmp_path / "a.yaml").read_text()
    assert export(tiny_run, "llama-factory", tmp_path / "l.yaml").returncode == 0
    lf = yaml.safe_load((tmp_path / "l.yaml").read_text())
    assert lf["cutoff_len"] == best["max_length"]
    assert lf["per_device_train_batch_size"] == best["micro_batch_size"]
    assert lf["gradient_accumulation_steps"] == best["gradient_accumulation_steps"]
    assert lf["disable_gradient_checkpointing"] == (best["gradient_checkpointing"] == "off")
    assert set(lf) <= LLAMA_FACTORY["keys"]


def test_what_a_target_cannot_express_is_a_comment_and_a_warning(tiny_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    best = json.loads((run / "best.json").read_text())
    best["config"].update(gradient_checkpointing="every_2", expandable_segments=True)
    (run / "best.json").write_text(json.dumps(best))
    for fmt in ("axolotl", "llama-factory"):
        proc = export(run, fmt, tmp_path / f"{fmt}.yaml")
        assert proc.returncode == 0
        assert "cannot express gradient_checkpointing=every_2" in proc.stderr
        assert "expandable_segments" in proc.stderr
        text = (tmp_path / f"{fmt}.yaml").read_text()
        assert "NOT EXPRESSED: gradient_checkpointing=every_2" in text
    script = tmp_path / "t.py"
    assert export(run, "hf-trainer", script).returncode == 0
    text = script.read_text()
    assert "'every_n_layers': 2" in text and "expandable_segments:True" in text  # Trainer expresses both


def test_a_renamed_field_fails_at_export() -> None:
    from transformers import TrainingArguments

    with pytest.raises(UsageError, match="no field.*gradient_checkpointing_every"):
        check_fields(TrainingArguments, {"learning_rate", "gradient_checkpointing_every"}, "TrainingArguments")


def test_bad_export_input_exits_2(tiny_run: Path, tmp_path: Path) -> None:
    cases = [
        (["export", str(tmp_path)], "is not an autofit run"),
        (["export", str(tiny_run), "--format", "deepspeed"], "--format: 'deepspeed' is not known"),
        (["export", str(tiny_run), "-o", str(tmp_path / "no" / "such" / "dir" / "t.py")], "-o: cannot write"),
    ]
    nofit = tmp_path / "nofit"
    shutil.copytree(tiny_run, nofit)
    (nofit / "best.json").unlink()
    cases.append((["export", str(nofit)], "has no fitting probe"))
    for args, message in cases:
        proc = run_cli(*args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert message in proc.stderr
        assert "Traceback" not in proc.stderr


def test_export_to_stdout(tiny_run: Path) -> None:
    proc = run_cli("export", str(tiny_run))
    assert proc.returncode == 0 and proc.stdout.startswith("#!/usr/bin/env python3")
