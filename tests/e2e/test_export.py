"""`autofit export`: recipes that run for real and never import autofit (end to end, marked slow); the
run folder checks, --force and the import discipline in-process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import run_cli
from recipes import DATA, imports_of, save_tiny_model

from autofit.export.yaml_targets import AXOLOTL, LLAMA_FACTORY
from runs import write_run


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-llama's shape saved with a tokenizer: the --model a recipe of the preset's run is given."""
    return save_tiny_model(tmp_path_factory.mktemp("model"))


def export(run: Path, fmt: str, out: Path) -> subprocess.CompletedProcess[str]:
    return run_cli("export", str(run), "--format", fmt, "-o", str(out))


@pytest.mark.parametrize("fmt, name", [("hf-trainer", "train.py"), ("trl", "train_trl.py")])
def test_python_recipes_train_three_steps(tiny_run: Path, model: Path, tmp_path: Path, fmt: str, name: str) -> None:
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
    argv = [str(script), "--model", str(model), "--dataset", str(DATA), "--output-dir", str(out), "--max-steps", "3"]
    run = subprocess.run([sys.executable, "-c", ("import sys; sys.modules['autofit'] = None; "
                          f"sys.argv = {argv!r}; "
                          f"exec(compile(open({str(script)!r}).read(), {str(script)!r}, 'exec'))")],
                         check=False, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = [x for x in (run.stdout + run.stderr).splitlines() if x.startswith("recipe-summary ")]
    assert summary and json.loads(summary[-1].split(" ", 1)[1])["steps"] == 3
    assert (out / "adapter_config.json").is_file()


def test_a_file_shorter_than_one_block_is_one_line_and_exit_2(tiny_run: Path, model: Path, tmp_path: Path) -> None:
    """A run on random tokens trains full MAX_LENGTH blocks of the text: a file holding fewer tokens than one
    block gave Trainer's `num_samples=0` traceback."""
    script = tmp_path / "train.py"
    assert export(tiny_run, "hf-trainer", script).returncode == 0
    short = tmp_path / "two.jsonl"
    short.write_text(json.dumps({"text": "a few words, far fewer tokens than a block"}) + "\n")
    ran = subprocess.run([sys.executable, str(script), "--model", str(model), "--dataset", str(short),
                          "--output-dir", str(tmp_path / "out"), "--max-steps", "1"], check=False,
                         capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert ran.returncode == 2 and "Traceback" not in ran.stderr, ran.stderr[-2000:]
    assert f"train.py: error: --dataset: {short} holds fewer than MAX_LENGTH (" in ran.stderr


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
    # measured on full max_length rows: the pre-training stage's packing joins the texts and cuts cutoff_len - 1
    # blocks (its DataArguments take one off); SFT's packing would fit whole samples and mask their prompts
    assert (lf["stage"], lf["packing"], lf["cutoff_len"]) == ("pt", True, best["max_length"] + 1)
    entry = '"my_dataset": {"file_name": "data.jsonl", "columns": {"prompt": "text"}}'
    assert entry in (tmp_path / "l.yaml").read_text()
    assert lf["per_device_train_batch_size"] == best["micro_batch_size"]
    assert lf["gradient_accumulation_steps"] == best["gradient_accumulation_steps"]
    assert lf["disable_gradient_checkpointing"] == (best["gradient_checkpointing"] == "off")
    assert set(lf) <= LLAMA_FACTORY["keys"]


def test_what_a_target_cannot_express_is_a_comment_and_a_warning(tiny_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    best = json.loads((run / "best.json").read_text())
    best["config"].update(gradient_checkpointing="every_2", expandable_segments=True, torch_compile=True)
    (run / "best.json").write_text(json.dumps(best))
    for fmt in ("axolotl", "llama-factory"):
        proc = export(run, fmt, tmp_path / f"{fmt}.yaml")
        assert proc.returncode == 0
        assert "cannot express gradient_checkpointing=every_2" in proc.stderr
        assert "expandable_segments" in proc.stderr and "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=1" in proc.stderr
        text = (tmp_path / f"{fmt}.yaml").read_text()
        assert "NOT EXPRESSED: gradient_checkpointing=every_2" in text
    script = tmp_path / "t.py"
    assert export(run, "hf-trainer", script).returncode == 0
    text = script.read_text()
    assert "'every_n_layers': 2" in text and "expandable_segments:True" in text  # Trainer expresses both
    assert "os.environ.setdefault('ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION', '1')" in text  # compiled per block


def test_bad_export_input_exits_2(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run")
    cases = [
        (["export", str(tmp_path)], (f"RUN: {tmp_path} is not an autofit run (it has no spec.yaml); give a folder "
                                    "made by `autofit search`.")),
        (["export", str(run), "--format", "deepspeed"],
         "--format: 'deepspeed' is not known; expected one of hf-trainer, trl, axolotl, llama-factory."),
        (["export", str(run), "--format", "axolotl", "-o", str(tmp_path / "no" / "dir" / "t.yaml")],
         f"-o: the folder {tmp_path / 'no' / 'dir'} does not exist. Give a file path in a folder that exists."),
    ]
    for args, message in cases:
        proc = run_cli(*args)
        assert (proc.returncode, proc.stderr) == (2, f"autofit: error: {message}\n"), args


def test_an_export_of_a_running_search_says_it_takes_the_best_so_far(tmp_path: Path) -> None:
    from autofit.run import locks
    from autofit.run.rundir import SEARCH_LOCK

    run = write_run(tmp_path / "run")
    with locks.held(run / SEARCH_LOCK, lambda who: None):  # as the search holds its folder
        proc = run_cli("export", str(run), "-o", str(tmp_path / "train.py"))
    assert proc.returncode == 0 and (tmp_path / "train.py").is_file(), proc.stderr
    assert f"a search is running in {run} (pid {os.getpid()}, since " in proc.stderr
    assert "exports the best found so far" in proc.stderr
    again = run_cli("export", str(run), "-o", str(tmp_path / "after.py"))  # the search ended: no word of it
    assert again.returncode == 0 and "search is running" not in again.stderr




def test_export_to_stdout(tiny_run: Path, tmp_path: Path) -> None:
    proc = run_cli("export", str(tiny_run))
    assert proc.returncode == 0 and proc.stdout.startswith("#!/usr/bin/env python3")
    dash = run_cli("export", str(tiny_run), "-o", "-", cwd=tmp_path)  # the usual spelling of stdout
    assert (dash.returncode, dash.stdout) == (0, proc.stdout) and not (tmp_path / "-").exists()


def test_a_4bit_recipe_trains_three_steps_on_nf4_layers(tiny_run: Path, model: Path, tmp_path: Path) -> None:
    """A QLoRA recipe loads the model 4-bit (bitsandbytes' CPU kernels here), prepares it for k-bit training as
    the probe did, and trains 3 real steps."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns("logs", "*.png"))
    best = json.loads((run / "best.json").read_text())
    best["config"]["quantization"] = "nf4"
    (run / "best.json").write_text(json.dumps(best))
    script = tmp_path / "train.py"
    proc = export(run, "hf-trainer", script)
    assert proc.returncode == 0, proc.stderr
    text = script.read_text()
    assert "bnb_4bit_quant_type='nf4'" in text and "prepare_model_for_kbit_training(model" in text
    done = subprocess.run([sys.executable, str(script), "--model", str(model), "--dataset", str(DATA), "--output-dir",
                           str(tmp_path / "out"), "--max-steps", "3"], check=False, capture_output=True, text=True,
                          cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = [x for x in (done.stdout + done.stderr).splitlines() if x.startswith("recipe-summary ")]
    assert summary and json.loads(summary[-1].split(" ", 1)[1])["steps"] == 3
