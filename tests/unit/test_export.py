"""`autofit export`: recipes that run for real and never import autofit (end to end, marked slow); the
run folder checks, --force and the import discipline in-process."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest
import yaml
from recipes import DATA

from autofit.cli import main
from autofit.config.models import resolve_model
from autofit.config.spec import TrialConfig
from autofit.core.errors import UsageError
from autofit.data import DatasetRef, load_samples
from autofit.export import FORMATS, SCRIPTS, export_run
from autofit.export.common import check_fields
from runs import BASE, write_run


def test_a_renamed_field_fails_at_export() -> None:
    from autofit.export.fields import installed_fields

    with pytest.raises(UsageError, match="no field.*gradient_checkpointing_every"):
        check_fields(installed_fields()["TrainingArguments"], {"learning_rate", "gradient_checkpointing_every"},
                     "TrainingArguments")


def test_the_installed_field_names_are_cached_by_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    import peft
    import trl
    from transformers import TrainingArguments

    from autofit.export import fields

    monkeypatch.setenv("AUTOFIT_CACHE", str(tmp_path))
    first = fields.installed_fields()
    assert first["TrainingArguments"] == set(fields.names_of(TrainingArguments))
    assert first["LoraConfig"] == set(fields.names_of(peft.LoraConfig)) and "r" in first["LoraConfig"]
    assert first["SFTConfig"] == set(fields.names_of(trl.SFTConfig)) and "packing" in first["SFTConfig"]
    (cached,) = tmp_path.glob("fields-*.json")
    doc = json.loads(cached.read_text())
    assert doc["versions"] == fields.versions() and doc["versions"]["transformers"]
    doc["fields"]["LoraConfig"] = ["only_this"]  # what the cache says is what an export checks against
    cached.write_text(json.dumps(doc))
    assert fields.installed_fields()["LoraConfig"] == {"only_this"}
    doc["versions"]["peft"] = "0.0.1"  # another version's names are never used: read afresh
    cached.write_text(json.dumps(doc))
    assert fields.installed_fields()["LoraConfig"] == first["LoraConfig"]


def test_every_format_renders_the_winner_in_process(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run")
    for fmt in FORMATS:
        text = export_run(run, fmt).text
        assert "Exported by autofit from run run." in text and "Measured on: CPU (no GPU), 2 GiB memory limit" in text
        assert "Probe: 1,000 tokens/s, peak 100 MiB (every sequence 128 tokens" in text, fmt
        assert "Tokens/s: measured in one process, not repeated" in text, fmt
    again = write_run(tmp_path / "again", extra={"measurements": [950.0, 1000.0, 1100.0]})
    for fmt in FORMATS:
        text = export_run(again, fmt).text
        assert "Tokens/s: the median of 3 fresh processes (950, 1,000, 1,100)." in text, fmt
        assert "not repeated" not in text, fmt


def test_a_written_script_keeps_the_permissions_of_the_file_it_replaces(tmp_path: Path) -> None:
    """-o --force over a private file made it world-readable (0755 on any path, /dev/null included)."""
    from autofit.export.common import write_recipe

    new = tmp_path / "new.py"
    write_recipe("print(1)\n", new, force=False, executable=True)
    assert new.stat().st_mode & 0o777 == 0o755
    private = tmp_path / "private.py"
    private.write_text("# mine\n")
    private.chmod(0o600)
    write_recipe("print(1)\n", private, force=True, executable=True)
    assert private.stat().st_mode & 0o777 == 0o700 and private.read_text() == "print(1)\n"
    config = tmp_path / "c.yaml"
    write_recipe("a: 1\n", config, force=False, executable=False)
    assert config.stat().st_mode & 0o111 == 0
    for force in (False, True):  # a folder is named as one, not offered --force (which then failed)
        with pytest.raises(UsageError, match=r"is a folder; give a file path such as .*train\.py"):
            write_recipe("print(1)\n", tmp_path, force=force, executable=True)
    write_recipe("print(1)\n", Path(os.devnull), force=False, executable=True)  # a device: written into, kept
    assert Path(os.devnull).is_char_device() and Path(os.devnull).stat().st_mode & 0o777 == 0o666


def test_every_format_renders_a_4bit_winner_against_the_installed_libraries(tmp_path: Path) -> None:
    """The quantization keys are validated against the installed BitsAndBytesConfig: in transformers 5.25
    its base became a dataclass of one field, and reading only the dataclass fields refused load_in_4bit."""
    run = write_run(tmp_path / "run", config=BASE.config.replace(quantization="nf4").to_dict())
    for fmt in FORMATS:
        text = export_run(run, fmt).text
        assert "nf4" in text, fmt


def test_the_trl_recipe_says_its_loss_runs_otherwise_than_the_probe(tmp_path: Path) -> None:
    """TRL's SFTTrainer computes the loss through its own fused LM head, not the model's the probe ran: the trl
    recipe's speed is not the one measured (1.2-1.3x slower on the CPU), which no comment or warning said."""
    run = write_run(tmp_path / "run")
    trl, hf = export_run(run, "trl"), export_run(run, "hf-trainer")
    said = [x for x in trl.unexpressed if "fused LM head" in x]
    assert len(said) == 1 and said[0].endswith("--format hf-trainer is the one measured")
    assert f"# DIFFERS FROM THE PROBE: {said[0]}" in trl.text
    assert not any("fused LM head" in x for x in hf.unexpressed)


def test_every_format_renders_all_linear_adapters_in_its_own_words(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", config=BASE.config.replace(lora_targets="all-linear").to_dict())
    texts = {fmt: export_run(run, fmt).text for fmt in FORMATS}
    for fmt in ("hf-trainer", "trl"):
        assert "LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules='all-linear'," in texts[fmt], fmt
    axolotl = yaml.safe_load(texts["axolotl"])
    assert axolotl["lora_target_linear"] is True and "lora_target_modules" not in axolotl
    assert yaml.safe_load(texts["llama-factory"])["lora_target"] == "all"


@pytest.mark.parametrize("content, problem", [
    ('{"outcome":', "is not valid JSON (line 1 column 12: Expecting value)"),
    ("[1,2,3]", "holds a JSON list, not an object with the winner"),
    ('{"tokens_per_s": 5, "peak_memory_bytes": 9}', "the winner: config is missing or not an object"),
    # fields beside the entry that the provenance reads (a ValueError, TypeError or AttributeError traceback)
    ('{"extra": {"measurements": ["a"]}}', "extra.measurements is ['a'], expected a list of tokens/s"),
    ('{"extra": [1]}', "extra is a JSON list, expected an object"),
    ('{"target": {"memory_limit_bytes": "24GiB"}}', "target.memory_limit_bytes is '24GiB', expected a number"),
])
def test_a_corrupt_best_json_is_a_usage_error_naming_it(tmp_path: Path, content: str, problem: str) -> None:
    run = write_run(tmp_path / "run")
    (run / "best.json").write_text(content)
    with pytest.raises(UsageError) as e:
        export_run(run, "axolotl")
    assert e.value.problems[0].startswith(f"RUN: {run / 'best.json'}")
    assert problem in e.value.problems[0]
    assert e.value.problems[-1].endswith(f"`autofit report {run}` rewrites it from the study.")


def test_a_missing_best_json_says_how_to_rebuild_it(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run")
    (run / "best.json").unlink()
    with pytest.raises(UsageError) as e:
        export_run(run, "axolotl")
    assert e.value.problems == [(f"RUN: {run} has no fitting probe (no best.json), so there is nothing to use; "
                                f"run `autofit report {run}` to see why, or search with more options.")]
    rows = [{"trial": 0, "outcome": "oom"}, {"trial": 1, "outcome": "fit"}, {"trial": 2, "outcome": "fit"}]
    (run / "trials.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"cut sh')
    with pytest.raises(UsageError) as e:
        export_run(run, "axolotl")
    assert e.value.problems == [
        (f"RUN: {run} has no best.json, but trials.jsonl records 2 fitting probe(s): the search stopped before "
        f"writing it. Run `autofit report {run}` (it rebuilds best.json from the study), then run this command "
        "again.")]


def test_an_existing_output_needs_force(tmp_path: Path) -> None:
    run, out = write_run(tmp_path / "run"), tmp_path / "a.yaml"
    out.write_text("# edited by hand\n")
    assert main(["export", str(run), "--format", "axolotl", "-o", str(out)]) == 2
    assert out.read_text() == "# edited by hand\n"
    assert main(["export", str(run), "--format", "axolotl", "-o", str(out), "--force"]) == 0
    assert yaml.safe_load(out.read_text())["sequence_len"] == 128


@pytest.mark.parametrize(("stop_reason", "unfinished", "warned"), [
    ("budget spent", False, False),
    ("interrupted (Ctrl-C, SIGTERM, SIGHUP or SIGQUIT); continue with --resume", True, True),
    ("", False, True),  # killed: the study records no end (`autofit report` rebuilt the outputs)
])
def test_export_says_when_the_search_did_not_finish(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    stop_reason: str, unfinished: bool, warned: bool) -> None:
    """An interrupted or killed search's best so far was exported with no word (report.md said 'not finished')."""
    from autofit.protocol.result import ProbeResult
    from autofit.run.report.outputs import write_outputs
    from autofit.run.rundir import load_spec

    run = write_run(tmp_path / "run")
    row = {"trial": 0, **ProbeResult.from_dict(json.loads((run / "best.json").read_text())).to_dict()}
    write_outputs(run, load_spec(run), [row], [(1.0, 1000.0)], stop_reason, unfinished=unfinished)
    assert json.loads((run / "best.json").read_text())["search_finished"] is not warned
    assert main(["export", str(run), "-o", str(tmp_path / "train.py")]) == 0
    err = capsys.readouterr().err
    assert ("did not finish" in err and f"autofit search --resume {run}" in err) is warned, err


ODD = {"method": ("lora", "full"), "precision": ("bf16", "fp16", "fp32"), "quantization": ("none", "8bit", "nf4"),
       "optimizer": ("adamw_torch_fused", "paged_adamw_8bit", "adafactor", "sgd"),
       "attn_implementation": ("sdpa", "eager", "flex_attention", "flash_attention_2"), "liger": (False, True),
       "torch_compile": (False, True), "expandable_segments": (False, True),
       "gradient_checkpointing": ("off", "on", "every_3", "on+offload"), "lora_targets": ("q_proj", "all-linear"),
       "micro_batch_size": (1, 3, 8), "global_batch": (1, 3, 16), "max_length": (8, 4096), "gpus": (1, 2, 4),
       "engine": ("none", "fsdp2", "zero2", "zero3"), "cpu_offload": ("off", "optimizer", "all"),
       "reshard_after_forward": (True, False)}
"""Values of every key, extremes among them: the winners of the sweep below are drawn from them."""


def odd_winners(n: int) -> list[TrialConfig]:
    """`n` valid configs drawn at random (seeded) from ODD: each of the four formats must render them all."""
    import random

    rng, out = random.Random(28), []
    while len(out) < n:
        try:
            out.append(TrialConfig.from_dict({k: rng.choice(v) for k, v in ODD.items()}))
        except UsageError:  # a combination the spec refuses (an engine on one GPU without offload, ...)
            continue
    return out


def test_every_format_renders_odd_winners_as_text_its_tool_reads(tmp_path: Path) -> None:
    """24 winners drawn over every key, on a run whose model folder and dataset have names with a newline and
    a byte that is not UTF-8 (and a text field named with quotes and a backslash): each recipe is UTF-8 text, a
    script compiles (its docstring whole), a YAML and its companions parse, every comment is one line."""
    model = tmp_path / os.fsdecode(b"my\nmodel-\xff")
    model.mkdir()
    (model / "config.json").write_text(json.dumps(resolve_model("tiny-llama").config))
    (model / "model.safetensors").write_bytes(b"")  # read by no one here: its name makes the folder a model
    data = tmp_path / os.fsdecode(b"d\xff.jsonl")
    data.write_bytes(DATA.read_bytes())
    source, dataset = resolve_model(str(model)).to_dict(), DatasetRef.of(load_samples(data)).to_dict()
    elsewhere = {**dataset, "path": str(tmp_path / "gone" / os.fsdecode(b"\xfe.jsonl")), "text_field": 'a"""b\\'}
    for i, cfg in enumerate(odd_winners(24)):
        run = write_run(tmp_path / f"run{i}", config=cfg.to_dict())
        spec = yaml.safe_load((run / "spec.yaml").read_text())
        spec["model"] = source
        if i % 2:  # half of them searched on a dataset, with the measured batching: here, or not here with
            spec["dataset"] = elsewhere if i % 4 == 1 else dataset  # a field name that could end a docstring
        (run / "spec.yaml").write_text(yaml.safe_dump(spec))
        for fmt in FORMATS:
            r = export_run(run, fmt)
            raw = r.text.encode("utf-8")  # no lone surrogate: the file can be written, Python can read it
            assert all(not line.startswith(b"#") or b"\xff" not in line for line in raw.splitlines()), fmt
            if fmt in SCRIPTS:  # it compiles, and its constants hold what it was given
                tree = ast.parse(raw)
                assert "Fine-tune" in (ast.get_docstring(tree) or ""), fmt
                values = {n.targets[0].id: n.value for n in tree.body if isinstance(n, ast.Assign)
                          and isinstance(n.targets[0], ast.Name)}
                field = ast.literal_eval(values["TEXT_FIELD"])
                assert field == ('a"""b\\' if spec.get("dataset") is elsewhere else "text"), fmt
            else:
                yaml.safe_load(r.text)
            for name, text in r.companions.items():
                (json.loads if name.endswith(".json") else yaml.safe_load)(text)
            # the newline in the model's name did not end a comment
            assert not any(line.startswith("model-") for line in r.text.splitlines()), fmt


def test_the_recipes_follow_the_probes_step_rule_on_data(tmp_path: Path) -> None:
    """One effective batch (data.batching.step_shape): a packed step takes the accumulation the probe's plan
    gave (rows hold what fits: here 1 micro-step where ceil(16 / 2) would train 8x the samples), in every
    format, said once as samples per step on average; padding_free flattens micro_batch_size samples a row
    (TRL's padding_free: per_device_train_batch_size samples, flattened)."""
    from recipes import training_args

    packed = write_run(tmp_path / "packed", config=BASE.config.replace(batching="packed", micro_batch_size=2,
                                                                      global_batch=16).to_dict(),
                       extra={"gradient_accumulation_steps": 1, "samples_per_step": 15.5})
    spec = yaml.safe_load((packed / "spec.yaml").read_text())
    spec["dataset"] = DatasetRef.of(load_samples(DATA)).to_dict()
    (packed / "spec.yaml").write_text(yaml.safe_dump(spec))
    for fmt in SCRIPTS:
        text = export_run(packed, fmt).text
        assert "'gradient_accumulation_steps': 1,  # packed rows: 15.5 samples per optimizer step on average" in text
        assert training_args(text)["per_device_train_batch_size"] == 2, fmt
    assert yaml.safe_load(export_run(packed, "axolotl").text)["gradient_accumulation_steps"] == 1
    assert yaml.safe_load(export_run(packed, "llama-factory").text)["gradient_accumulation_steps"] == 1
    # the plan's accumulation equal to the config's (8 rows a micro-step, global batch 8): the comment said the
    # config's 8 samples, the probe trained 18, off the global batch
    over = write_run(tmp_path / "over", config=BASE.config.replace(batching="packed", micro_batch_size=8,
                                                                    global_batch=8).to_dict(),
                     extra={"gradient_accumulation_steps": 1, "samples_per_step": 18.0, "keeps_global_batch": False})
    (over / "spec.yaml").write_text(yaml.safe_dump({**yaml.safe_load((over / "spec.yaml").read_text()),
                                                    "dataset": spec["dataset"]}))
    for fmt in SCRIPTS:
        assert ("'gradient_accumulation_steps': 1,  # packed rows: 18 samples per optimizer step on average, as "
                "measured, +125% against the global batch of 8: changes what is learned") in export_run(over, fmt).text
    random_tokens = write_run(tmp_path / "blocks", extra={"gradient_accumulation_steps": 1})  # no dataset: the config's
    assert f"'gradient_accumulation_steps': {BASE.config.gradient_accumulation_steps}," in export_run(
        random_tokens, "hf-trainer").text
    flat = write_run(tmp_path / "flat", config=BASE.config.replace(batching="padding_free", micro_batch_size=3,
                                                                    global_batch=16).to_dict())
    spec["dataset"] = DatasetRef.of(load_samples(DATA)).to_dict()
    (flat / "spec.yaml").write_text(yaml.safe_dump({**yaml.safe_load((flat / "spec.yaml").read_text()),
                                                    "dataset": spec["dataset"]}))
    trl = training_args(export_run(flat, "trl").text)
    assert (trl["per_device_train_batch_size"], trl["padding_free"], trl["gradient_accumulation_steps"]) == (3, True, 6)
    hf = export_run(flat, "hf-trainer").text
    assert "data_collator=DataCollatorWithFlattening()" in hf and training_args(hf)["per_device_train_batch_size"] == 3


def test_rows_the_search_skipped_are_said_at_export(tmp_path: Path) -> None:
    """The search measured the good rows; a recipe's `datasets` skips none (it stops at a line that is not JSON):
    export says how many the search skipped and why, for every format, from the run's data.json."""
    from autofit.data import summarize
    from runs import D1, data_run

    data = tmp_path / "some-bad.jsonl"
    data.write_text(DATA.read_text() + "not json\n" + json.dumps({"title": "no text"}) + "\n")
    run = data_run(tmp_path, "pad_longest", data)
    summarize(data, resolve_model("tiny-llama"), run / "data")
    said = ("2 rows of " + str(data) + " were skipped by the search (1 not JSON, 1 missing 'text'); the recipe's "
            "`datasets` loader skips none")
    for fmt in FORMATS:
        notes = export_run(run, fmt).notes
        assert any(said in n and f"`autofit data {data}` lists their lines" in n for n in notes), (fmt, notes)
    clean = data_run(tmp_path / "clean", "pad_longest")
    summarize(D1, resolve_model("tiny-llama"), clean / "data")
    assert not any("skipped" in n for n in export_run(clean, "trl").notes)
