"""The exported Python recipes a user keeps (issue 33): for each batching strategy the `trl` recipe of a run
searched on a dataset trains 3 steps on the CPU in a process of its own, where autofit cannot be imported;
the `hf-trainer` recipe too (packed, its longest path).

The runs are written (`runs.data_run`: tiny-llama, max_length 96, micro-batch 2, accumulation 2); the model is
tiny-llama's shape saved once with a tokenizer, as a user's model folder is."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from recipes import imports_of, save_tiny_model, training_args

from autofit.config.spec import BATCHINGS
from autofit.data import load_samples
from autofit.data.tokenizer import model_tokenizer
from autofit.export import export_run
from runs import CHAT, D1, PREFS, data_run, dpo_run

GUARD = ("import sys; sys.modules['autofit'] = None; script = sys.argv[1]; sys.argv = sys.argv[1:]; "
         "exec(compile(open(script).read(), script, 'exec'))")
"""Runs a recipe where `import autofit` fails: it must need nothing of autofit."""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("model"))


def run_recipe(script: Path, model: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """The recipe for 3 optimizer steps on `model`, and its summary."""
    out = script.parent / "out"
    proc = subprocess.run([sys.executable, "-c", GUARD, str(script), "--model", str(model), "--output-dir", str(out),
                           "--max-steps", "3", *args], check=False, capture_output=True, text=True,
                          cwd=script.parent, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("recipe-summary ")]
    assert len(lines) == 1, proc.stdout[-2000:]
    assert (out / "adapter_config.json").is_file()
    return proc, json.loads(lines[0].split(" ", 1)[1])


def exported(tmp_path: Path, strategy: str, fmt: str, data: Path = D1) -> tuple[Path, str]:
    run = data_run(tmp_path, strategy, data)
    script = tmp_path / ("train_trl.py" if fmt == "trl" else "train.py")
    script.write_text(export_run(run, fmt).text)
    assert "autofit" not in imports_of(script)
    return script, script.read_text()


@pytest.mark.parametrize("strategy", BATCHINGS)
def test_the_trl_recipe_trains_three_steps_with_each_strategy(model: Path, tmp_path: Path, strategy: str) -> None:
    script, text = exported(tmp_path, strategy, "trl")
    fields = training_args(text)
    assert fields["per_device_train_batch_size"] == 2 and fields["gradient_accumulation_steps"] == 2
    assert fields["max_length"] == (None if strategy == "padding_free" else 96)
    assert (fields["packing"], fields.get("packing_strategy")) == (
        (True, "bfd") if strategy == "packed" else (False, None))
    assert fields.get("padding_free", False) is (strategy == "padding_free")  # bfd packing is padding-free itself
    assert fields.get("pad_to_multiple_of") == (96 if strategy == "pad_max" else None)
    assert fields.get("train_sampling_strategy") == ("group_by_length" if strategy == "group_by_length" else None)
    _, summary = run_recipe(script, model)
    assert summary["steps"] == 3 and summary["tokens_per_s"] > 0
    assert summary["tokens_per_s"] == pytest.approx(summary["steady_tokens"] / summary["steady_seconds"])
    # one steady step: micro-batch 2 x accumulation 2 of D1's samples (mean ~60 tokens), each cut to 96
    rows = 4 if strategy != "packed" else 4 * 96 // 60
    assert 0 < summary["steady_tokens"] <= rows * 95, summary
    if strategy == "pad_max":  # padded to 96, yet only the samples' own tokens count
        assert summary["steady_tokens"] < 4 * 95


@pytest.mark.parametrize("strategy", ["packed", "padding_free"])
def test_the_hf_trainer_recipe_trains_three_steps(model: Path, tmp_path: Path, strategy: str) -> None:
    """hf-trainer's own paths: TRL's pack_dataset bins flattened by TRL's collator; micro_batch_size samples
    flattened by transformers' DataCollatorWithFlattening (the padded strategies are trl's above, with TRL's
    collator: below)."""
    script, text = exported(tmp_path, strategy, "hf-trainer")
    _, summary = run_recipe(script, model)
    assert summary["steps"] == 3
    assert summary["tokens_per_s"] == pytest.approx(summary["steady_tokens"] / summary["steady_seconds"])
    if strategy == "packed":
        assert "pack_dataset(data, MAX_LENGTH" in text and "padding_free=True" in text
        assert 4 * 60 < summary["steady_tokens"] <= 4 * 95  # full rows, not one sample a row
    else:  # one step: 2 micro-batches of 2 samples, each cut to 96
        assert "DataCollatorWithFlattening()" in text and 0 < summary["steady_tokens"] <= 4 * 95


def test_without_a_pad_token_the_hf_trainer_recipe_trains_every_eos_as_trl_s_does(model: Path, tmp_path: Path) -> None:
    """A tokenizer without a pad token (Llama's) pads with its EOS. transformers' language-modeling collator then
    masked every label equal to the pad id, every EOS with it: the hf-trainer recipe trained 274 tokens a steady step
    here where the trl recipe (and the probe) train 277. It collates the padded strategies with TRL's collator now."""
    nopad = tmp_path / "model-nopad"
    shutil.copytree(model, nopad)
    config = json.loads((nopad / "tokenizer_config.json").read_text())
    config.pop("pad_token", None)
    (nopad / "tokenizer_config.json").write_text(json.dumps(config))
    hf, text = exported(tmp_path / "hf", "pad_longest", "hf-trainer")
    trl, _ = exported(tmp_path / "trl", "pad_longest", "trl")
    assert "mlm=False" not in text and "DataCollatorForLanguageModeling(tokenizer.pad_token_id)" in text
    with ThreadPoolExecutor(2) as pool:
        (_, hf_summary), (_, trl_summary) = pool.map(lambda s: run_recipe(s, nopad), [hf, trl])
    assert hf_summary["steady_tokens"] == trl_summary["steady_tokens"] > 0, (hf_summary, trl_summary)


def recipe_module(script: Path) -> dict[str, Any]:
    """The recipe's names (load_data, its constants, its helpers), its main() not run."""
    namespace: dict[str, Any] = {"__name__": "recipe"}
    exec(compile(script.read_text(), str(script), "exec"), namespace)
    return namespace


def test_the_recipe_reads_the_file_as_the_search_read_it(tmp_path: Path) -> None:
    """JSONL rows in a .txt file are JSON rows (read as text lines they trained on the braces); a folder of parquet
    files is read down every subfolder (load_from_disk refused it); preference rows in a .txt are JSON too."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    named = tmp_path / "rows.txt"
    shutil.copy(D1, named)
    parts = tmp_path / "parts"
    (parts / "more").mkdir(parents=True)
    rows = [json.loads(line) for line in D1.read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows[:10]), parts / "a.parquet")
    pq.write_table(pa.Table.from_pylist(rows[10:25]), parts / "more" / "b.parquet")
    for data in (named, parts):
        script, _ = exported(tmp_path / f"run-of-{data.name}", "pad_longest", "trl", data)
        recipe = recipe_module(script)
        assert recipe["DATA_FORMAT"] == ("json" if data == named else "parquet")
        read = recipe["load_data"](str(data))
        assert list(read["text"]) == [s.text for s in load_samples(data).samples], data
    # pandas' NA words are text to autofit's reader (the recipe refused the file: 'rows without a text field'),
    # and a .tsv cell may start with a quote (the recipe merged rows up to the next quote)
    na, quoted = tmp_path / "na.csv", tmp_path / "quoted.tsv"
    na.write_text("text,n\nNA,1\nnull,2\nN/A,3\n\"a, quoted one\",4\nplain,5\n")
    quoted.write_text('text\tn\n"unbalanced start\t1\nplain\t2\n"Quoted" start\t3\nlast\t4\n')
    for data in (na, quoted):
        script, _ = exported(tmp_path / f"run-of-{data.name}", "pad_longest", "trl", data)
        read = recipe_module(script)["load_data"](str(data))
        assert list(read["text"]) == [s.text for s in load_samples(data).samples], data
    assert len(load_samples(na)) == 5 and len(load_samples(quoted)) == 4
    pairs = tmp_path / "pairs.txt"
    shutil.copy(PREFS, pairs)
    script = tmp_path / "train_dpo.py"
    script.write_text(export_run(dpo_run(tmp_path, pairs), "trl").text)
    read = recipe_module(script)["load_data"](str(pairs))
    assert len(read) == len(PREFS.read_text().splitlines()) and {"chosen", "rejected"} <= set(read.column_names)


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("bos-model"), bos=True)


def test_text_rows_beside_chats_train_as_the_search_read_them(bos_model: Path, tmp_path: Path) -> None:
    """A file of text rows and chats: each row is tokenized as the probe counted it (a chat through the template,
    a text with its EOS and BOS), where TRL crashed on the first row's kind (None text) and hf-trainer on
    messages=None; the trl recipe trains 3 steps on it."""
    from transformers import AutoTokenizer

    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(a + b for a, b in zip(D1.read_text().splitlines(True)[:8],
                                                      CHAT.read_text().splitlines(True)[:8], strict=True)))
    script, _ = exported(tmp_path / "hf", "pad_longest", "hf-trainer", mixed)
    recipe = recipe_module(script)
    ids = recipe["tokenized"](recipe["load_data"](str(mixed)), AutoTokenizer.from_pretrained(bos_model))
    probe = model_tokenizer(str(bos_model)).encode(load_samples(mixed).samples)
    assert list(ids["input_ids"]) == [row[:96] for row in probe]
    script, _ = exported(tmp_path / "trl", "packed", "trl", mixed)
    _, summary = run_recipe(script, bos_model)
    assert summary["steps"] == 3


def test_the_recipe_says_in_one_line_what_its_data_or_model_lacks(model: Path, tmp_path: Path) -> None:
    """A text run's recipe given chats (a KeyError or TRL's ValueError), an empty file (StopIteration), a line that
    is not JSON (datasets' 'An error occurred while generating the dataset') or a model that is nowhere (a
    huggingface_hub traceback): exit 2 and one line naming the file or the model."""
    script, _ = exported(tmp_path, "pad_longest", "trl")
    shutil.copy(CHAT, tmp_path / "chats.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text(D1.read_text().splitlines()[0] + "\nnot json\n")
    cases = {"--dataset: chats.jsonl has no rows with a 'text' field": ["--dataset", "chats.jsonl"],
             "--dataset: cannot read empty.jsonl (it has no rows)": ["--dataset", "empty.jsonl"],
             "--dataset: cannot read bad.jsonl (JSON parse error": ["--dataset", "bad.jsonl"],
             "--model: cannot load no-such-model (": ["--model", "no-such-model"]}

    def run(args: list[str]) -> subprocess.CompletedProcess[str]:
        model_args = [] if "--model" in args else ["--model", str(model)]
        return subprocess.run([sys.executable, str(script), *model_args, *args], capture_output=True, text=True,
                              cwd=tmp_path, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})

    with ThreadPoolExecutor(len(cases)) as pool:
        said = dict(zip(cases, pool.map(run, cases.values()), strict=True))
    for expected, proc in said.items():
        errors = [x for x in proc.stderr.splitlines() if x.startswith(f"{script.name}: error:")]
        assert proc.returncode == 2 and len(errors) == 1 and expected in errors[0], (expected, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr
    bad_lines = said["--dataset: cannot read bad.jsonl (JSON parse error"].stderr
    assert "; `autofit data bad.jsonl` lists its bad rows" in bad_lines
