"""The data package wired into the commands: `autofit data`, `--dataset` on search and probe, the probe
on real batches (issue 11)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import yaml
from recipes import training_args

from autofit.cli import main
from autofit.config.spec import BATCHINGS
from autofit.core.errors import UsageError
from runs import CHAT, D1, data_run, moved_run

# ----------------------------------------------------------------------------- autofit data


def _recomputed(out: Path) -> np.ndarray:
    """The lengths the command cached, read without the data package."""
    (table,) = out.glob("lengths-*.json")
    return np.array(json.loads(table.read_text())["lengths"])


def test_data_command_prints_percentiles_recomputed_independently(tmp_path: Path, capsys) -> None:
    assert main(["data", str(D1), "--model", "tiny-llama", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    values = _recomputed(tmp_path)
    for q in (50, 90, 95, 99, 99.9, 100):
        assert f"p{q:g} {np.percentile(values, q):.1f}" in text
    cover = int(np.ceil(values.max() / 64) * 64)
    lost = np.clip(values - 448, 0, None).sum() / values.sum()
    assert f"{cover:>10}" in text and f"{lost:.2%}" in text
    assert "approximate" in text and (tmp_path / "lengths.png").stat().st_size > 1000


def test_data_command_json_with_the_users_lengths(tmp_path: Path, capsys) -> None:
    assert main(["data", str(CHAT), "--model", "tiny-llama", "--out", str(tmp_path), "--json",
                 "--max-length", "64", "128"]) == 0
    out = json.loads(capsys.readouterr().out)
    values = _recomputed(tmp_path)
    assert out["candidates"] == [64, 128] and out["approximate"] is True
    assert out["cuts"][0]["samples_truncated"] == pytest.approx((values > 64).mean())
    assert out["percentiles"]["p90"] == pytest.approx(np.percentile(values, 90))
    # search's and plan's comma list too (it was argparse's "invalid int value")
    assert main(["data", str(CHAT), "--model", "tiny-llama", "--out", str(tmp_path), "--json",
                 "--max-length", "64,128"]) == 0
    assert json.loads(capsys.readouterr().out)["candidates"] == [64, 128]


@pytest.mark.parametrize(("content", "args", "match"), [
    ("", (), "PATH: .*is empty"),
    ('{"prompt": "x"}\n', (), "no usable row .*missing 'text'.*--text-field"),
    ('{"text": "x"}\n', ("--max-length", "0"), "--max-length: 0 is not a length"),
    ('{"text": "x"}\n', ("--max-length", "1024", "2x"), "--max-length: 2x is not a length"),
    ('{"text": "x"}\n', ("--model", "nope-model"), "--model"),
])
def test_data_command_bad_inputs_exit_2_with_a_message(tmp_path: Path, capsys, content: str, args: tuple,
                                                       match: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    argv = ["data", str(path), "--out", str(tmp_path / "o"), *args]
    if "--model" not in args:
        argv += ["--model", "tiny-llama"]
    assert main(argv) == 2
    assert re.search(match, capsys.readouterr().err)


# ----------------------------------------------------------------------------- the probe on real batches


def test_probe_batching_without_a_dataset_is_a_usage_error(capsys) -> None:
    assert main(["probe", "--model", "tiny-llama", "--device", "cpu", "--set", "batching=packed"]) == 2
    assert "batching=packed needs --dataset" in capsys.readouterr().err


def test_probe_with_a_bad_dataset_names_the_flag(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\x00\x01\x02\xff")
    assert main(["probe", "--model", "tiny-llama", "--device", "cpu", "--dataset", str(bad)]) == 2
    assert "--dataset" in (err := capsys.readouterr().err) and "binary" in err


def test_the_batching_key_matches_the_data_package() -> None:
    from autofit.data import Batching

    assert tuple(b.value for b in Batching) == BATCHINGS


# ----------------------------------------------------------------------------- search --dataset


def test_search_with_a_dataset_takes_lengths_and_batching_from_the_data(tmp_path: Path) -> None:
    from autofit.config.models import resolve_model
    from autofit.data import length_stats, length_table, load_samples, tokenizer_for
    from autofit.run.rundir import RunSpec
    from autofit.run.session import SearchRequest, plan

    session = plan(SearchRequest(model="tiny-llama", space="cpu-demo", device="cpu", dataset=str(D1), out=tmp_path))
    space = session.spec.space
    data = load_samples(D1)
    table = length_table(data, tokenizer_for(resolve_model("tiny-llama"), data))
    assert space.dimensions["batching"] == list(BATCHINGS)
    assert sorted(space.values("max_length"), reverse=True) == list(length_stats(table, 2048).candidates)
    assert session.spec.dataset is not None and session.spec.dataset.content_hash == data.content_hash
    assert any("84 samples" in n for n in session.notes) and any("approximate" in n for n in session.notes)
    again = RunSpec.from_dict(session.spec.to_dict())
    assert again.dataset == session.spec.dataset and not list(tmp_path.iterdir())  # plan creates nothing


def test_search_max_length_overrides_the_datas_lengths_and_no_dataset_fixes_pad_max(tmp_path: Path) -> None:
    from autofit.run.session import SearchRequest, plan

    s = plan(SearchRequest(model="tiny-llama", space="cpu-demo", device="cpu", dataset=str(D1), max_length="256,128"))
    assert s.spec.space.dimensions["max_length"] == [256, 128] and "256: " in s.notes[0]
    space = tmp_path / "s.yaml"
    space.write_text("fixed: {global_batch: 4}\ndimensions:\n  micro_batch_size: [1, 2]\n"
                     "  batching: [pad_max, packed]\n")
    plain = plan(SearchRequest(model="tiny-llama", space=str(space), device="cpu"))
    assert plain.spec.space.values("batching") == ["pad_max"] and "fixed at pad_max" in plain.notes[0]
    assert plain.spec.dataset is None and "dataset" not in plain.spec.to_dict()


def test_search_bad_dataset_is_a_usage_error_before_anything_exists(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "d.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    assert main(["search", "--model", "tiny-llama", "--device", "cpu", "--dataset", str(bad),
                 "--out", str(tmp_path / "runs")]) == 2
    assert "--dataset" in (err := capsys.readouterr().err) and "missing 'text'" in err
    assert not (tmp_path / "runs").exists()


# ----------------------------------------------------------------------------- export with the measured strategy


def recipe_namespace(text: str) -> dict[str, Any]:
    """An exported recipe's constants and functions, executed as the module it is (main() not run)."""
    space: dict[str, Any] = {"__name__": "recipe"}
    exec(compile(text, "train.py", "exec"), space)  # noqa: S102  the recipe's own text
    return space


def test_the_hf_trainer_recipe_of_a_data_run_batches_as_measured(tmp_path: Path) -> None:
    from autofit.export import export_run

    text = export_run(data_run(tmp_path, "padding_free"), "hf-trainer").text
    fields = training_args(text)
    assert (fields["per_device_train_batch_size"], fields["gradient_accumulation_steps"]) == (2, 2)
    assert "data_collator=DataCollatorWithFlattening()" in text and "pack_dataset" not in text
    assert "trained tokens/s on " in text and f"DATASET = {str(D1)!r}" in text
    compile(text, "train.py", "exec")


def test_the_recipes_tokens_per_s_is_its_steady_steps_tokens_over_their_time(tmp_path: Path, capsys) -> None:
    """The summary's figure as the exported recipe's Throughput callback computes it: steps of varying content
    (dynamic padding) weigh by their tokens, where a median of per-step rates would give a short step's rate;
    a step's tokens are the labels it trains (shifted, -100 not counted)."""
    import torch

    from autofit.export import export_run

    space = recipe_namespace(export_run(data_run(tmp_path, "pad_longest"), "trl").text)
    cb = space["Throughput"]()
    cb.on_train_begin(None, None, None, model=torch.nn.Linear(1, 1))
    cb.count(None, (), {"labels": torch.tensor([[5, 6, -100, 7], [1, 2, 3, -100]])})  # 2 + 2 trained
    cb.count(None, (), {"input_ids": torch.tensor([[1, 2]])})  # no labels: nothing trained
    cb.on_step_begin(None, None, None)
    cb.on_step_end(None, None, None)
    assert (cb.tokens, len(cb.times)) == ([4], 1)
    # two warm-up steps, then a short step, a long one and a short one
    cb.tokens, cb.times = [50, 60, 100, 1000, 100], [9.0, 1.0, 1.0, 2.0, 1.0]
    capsys.readouterr()
    cb.on_train_end(None, SimpleNamespace(log_history=[{"step": 1, "loss": 2.5}, {"train_runtime": 1}]), None)
    got = json.loads(capsys.readouterr().out.split("recipe-summary ", 1)[1])
    assert got["tokens_per_s"] == pytest.approx(1200 / 4)  # not the median step's 100
    assert (got["steady_tokens"], got["steady_seconds"], got["steps"], got["losses"]) == (1200, 4.0, 5, [[1, 2.5]])
    cb.tokens, cb.times = [10, 30], [1.0, 1.0]  # too short to skip warm-up
    cb.on_train_end(None, SimpleNamespace(log_history=[]), None)
    assert json.loads(capsys.readouterr().out.split("recipe-summary ", 1)[1])["tokens_per_s"] == 20


@pytest.mark.parametrize(("strategy", "axolotl", "llama_factory", "lost"), [
    ("pad_max", {"sample_packing": False, "pad_to_sequence_len": True}, {"packing": False}, ["llama-factory"]),
    ("pad_longest", {"sample_packing": False, "pad_to_sequence_len": False}, {"packing": False}, []),
    ("group_by_length", {"group_by_length": True, "sample_packing": False}, {"group_by_length": True}, []),
    ("padding_free", {"sample_packing": False}, {"packing": False}, ["axolotl", "llama-factory"]),
    # D1 is text: LLaMA-Factory's pre-training stage, whose packing joins the texts and which refuses neat_packing
    ("packed", {"sample_packing": True, "pad_to_sequence_len": True},
     {"stage": "pt", "packing": False, "cutoff_len": 96}, ["axolotl", "llama-factory"]),
])
def test_every_format_carries_the_measured_strategy(tmp_path: Path, strategy: str, axolotl: dict,
                                                    llama_factory: dict, lost: list[str]) -> None:
    """Each format spells the measured batching in its own keys, or lists it as not kept (TRL lays a packed
    micro-batch out as the probe does since the probe packs and collates through TRL: nothing to list)."""
    import yaml

    from autofit.export import export_run

    run = data_run(tmp_path, strategy)
    ax = export_run(run, "axolotl")
    assert yaml.safe_load(ax.text).items() >= axolotl.items()
    assert yaml.safe_load(ax.text)["datasets"][0]["path"] == str(D1)
    lf = export_run(run, "llama-factory")
    assert yaml.safe_load(lf.text).items() >= llama_factory.items()
    assert "neat_packing" not in yaml.safe_load(lf.text)  # LLaMA-Factory refuses it outside SFT
    trl, hf = export_run(run, "trl"), export_run(run, "hf-trainer")
    sft = training_args(trl.text)
    assert sft["padding_free"] is (strategy == "padding_free") if "padding_free" in sft else strategy == "packed"
    assert (sft["packing"], sft.get("packing_strategy")) == ((True, "bfd") if strategy == "packed" else (False, None))
    assert sft.get("pad_to_multiple_of") == (96 if strategy == "pad_max" else None)
    grouped = {"train_sampling_strategy": "group_by_length"} if strategy == "group_by_length" else {}
    for text in (hf.text, trl.text):
        assert {k: v for k, v in training_args(text).items() if k == "train_sampling_strategy"} == grouped
        assert f"DATASET = {str(D1)!r}" in text and "TEXT_FIELD = 'text'" in text
    assert ("pad_to_multiple_of=MAX_LENGTH" in hf.text) is (strategy == "pad_max")
    for fmt, rendered in (("axolotl", ax), ("llama-factory", lf), ("trl", trl), ("hf-trainer", hf)):
        assert bool([x for x in rendered.unexpressed if "batching" in x or strategy in x]) == (fmt in lost), fmt


def test_the_yaml_trainers_read_chats_as_chats_and_text_as_text(tmp_path: Path) -> None:
    """A chat dataset was written as axolotl `type: completion` on a 'text' field (nothing to train on) and
    LLaMA-Factory said only "Register my_dataset"."""
    import yaml

    from autofit.export import export_run

    text = export_run(data_run(tmp_path / "t", "pad_longest"), "axolotl")
    assert yaml.safe_load(text.text)["datasets"] == [{"path": str(D1), "type": "completion", "field": "text"}]
    chats = data_run(tmp_path / "c", "pad_longest", CHAT)
    ax = yaml.safe_load(export_run(chats, "axolotl").text)
    assert ax["datasets"] == [{"path": str(CHAT), "type": "chat_template", "field_messages": "messages",
                               "message_property_mappings": {"role": "role", "content": "content"}}]
    assert ax["chat_template"] == "tokenizer_default"
    assert ax["train_on_inputs"] is True  # the probe trains every token; axolotl the assistant's turns alone
    lf = export_run(chats, "llama-factory")
    assert yaml.safe_load(lf.text)["train_on_prompt"] is True  # SFT masks the prompt otherwise
    entry = json.loads(lf.text.split('"my_dataset": ', 1)[1].splitlines()[0])
    assert entry["formatting"] == "sharegpt" and entry["columns"] == {"messages": "messages"}
    assert yaml.safe_load(lf.text)["stage"] == "sft" and any("template" in x for x in lf.unexpressed)
    # the warning reads "llama-factory cannot express <item>": it read "... cannot express chats were measured
    # rendered with the tokenizer's own chat template", where the stand-in had none
    said = next(x for x in lf.unexpressed if "template" in x)
    assert said.startswith("the chat format as measured: LLaMA-Factory renders chats with its own `template`")
    assert "where the tokenizer had none, its plain <|role|> lines" in said
    pt = export_run(data_run(tmp_path / "p", "pad_longest"), "llama-factory")
    assert yaml.safe_load(pt.text)["stage"] == "pt" and '"columns": {"prompt": "text"}' in pt.text
    assert "train_on_prompt" not in yaml.safe_load(pt.text)  # refused outside SFT; pt trains every token
    packed_chats = yaml.safe_load(export_run(data_run(tmp_path / "pc", "packed", CHAT), "llama-factory").text)
    assert (packed_chats["stage"], packed_chats["neat_packing"], packed_chats["cutoff_len"]) == ("sft", True, 97)
    sharegpt = tmp_path / "g.jsonl"  # ShareGPT's keys are carried as the message keys
    sharegpt.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"},
                                                      {"from": "gpt", "value": "yo"}]}) + "\n")
    g = yaml.safe_load(export_run(data_run(tmp_path / "g", "pad_longest", sharegpt, "conversations"),
                                  "axolotl").text)
    assert g["datasets"][0]["field_messages"] == "conversations"
    assert g["datasets"][0]["message_property_mappings"] == {"role": "from", "content": "value"}
    tags = json.loads(export_run(tmp_path / "g" / "run-pad_longest", "llama-factory").text.split(
        '"my_dataset": ', 1)[1].splitlines()[0])["tags"]  # LLaMA-Factory's tags: the role names the data uses
    assert (tags["role_tag"], tags["user_tag"], tags["assistant_tag"]) == ("from", "human", "gpt")
    assert (entry["tags"]["user_tag"], entry["tags"]["assistant_tag"]) == ("user", "assistant")


# ----------------------------------------------------------------------------- regress with the stored dataset


def test_regress_reads_the_stored_dataset_and_follows_a_moved_file(tmp_path: Path) -> None:
    from autofit.run import regress

    run, copy = moved_run(tmp_path)
    p = regress.plan(run, 1)
    assert p.dataset is not None and p.dataset.path == str(copy.resolve())
    moved = tmp_path / "elsewhere.jsonl"
    copy.rename(moved)
    with pytest.raises(UsageError, match=r"is missing; give its new place with --dataset PATH"):
        regress.plan(run, 1)
    p = regress.plan(run, 1, dataset=str(moved))
    assert p.dataset is not None and p.dataset.path == str(moved.resolve())


def test_export_names_a_moved_dataset_and_refuses_a_changed_or_missing_one(tmp_path: Path, capsys) -> None:
    import yaml

    from autofit.cli import main
    from autofit.export import export_run

    run, copy = moved_run(tmp_path)
    moved = tmp_path / "elsewhere.jsonl"
    copy.rename(moved)
    text = export_run(run, "axolotl").text  # without --dataset: the stored path, the file need not be here
    assert str(copy.resolve()) in text
    for fmt in ("hf-trainer", "axolotl", "trl"):
        text = export_run(run, fmt, dataset=str(moved)).text
        assert str(moved.resolve()) in text and str(copy.resolve()) not in text, fmt
    moved.write_text(moved.read_text().replace("the", "a"))
    assert main(["export", str(run), "--dataset", str(moved)]) == 2
    err = capsys.readouterr().err
    assert "dataset changed since the run" in err and "the winner was measured on" in err and "Traceback" not in err
    assert main(["export", str(run), "--dataset", str(tmp_path / "nowhere.jsonl")]) == 2
    assert "no such file or folder" in (err := capsys.readouterr().err) and "nowhere.jsonl" in err
    plain = data_run(tmp_path, "pad_max")
    doc = yaml.safe_load((plain / "spec.yaml").read_text())
    del doc["dataset"]  # a run searched without --dataset
    (plain / "spec.yaml").write_text(yaml.safe_dump(doc))
    assert main(["export", str(plain), "--dataset", str(D1)]) == 2
    assert "searched on random tokens" in capsys.readouterr().err


def test_regress_on_a_changed_dataset_exits_2_and_says_so_not_a_regression(tmp_path: Path, capsys) -> None:
    run, copy = moved_run(tmp_path)
    copy.write_text(copy.read_text().replace("the", "a"))
    junit = tmp_path / "r.xml"
    assert main(["regress", str(run), "--junit", str(junit)]) == 2
    err = capsys.readouterr().err
    assert "dataset changed since the run" in err and "not a regression" in err
    assert "<error" in junit.read_text() and "<failure" not in junit.read_text()


def test_the_spread_rule_compares_seconds_per_unit_of_work_when_steps_differ_in_size() -> None:
    """Steps timed exactly by a fixed cost per micro-batch plus a cost per token (short samples on a GPU)
    are not noise: the rule divides by each step's work as the speed model counts it."""
    from autofit.data import Batching, plan
    from autofit.data.batching import step_shape
    from autofit.estimate.effects import HALF_TOKENS
    from autofit.probe.child.batches import RealBatches
    from autofit.probe.child.timing import ProbeCallback, TimingPlan, spread

    p = plan(Batching.PAD_LONGEST, [20 + (i * 37) % 1300 for i in range(300)], 2048, 1, 0)
    rb = RealBatches(Batching.PAD_LONGEST, [], 0, 2048, (p.heaviest, *p.batches[:40]), p.pad_fraction, 0.0, 1.0, 1.0,
                     step_shape(Batching.PAD_LONGEST, 16, 1, 1, 1, 1.0))
    cb = ProbeCallback(None, lambda: None, TimingPlan(2, 5, 5, 0, lambda event: None))  # type: ignore[arg-type]
    cost = [1e-4 * rb.step_cost(k, 4) for k in range(7)]  # 0.1 s a micro-batch of HALF_TOKENS' worth
    cb.steps = [{"seconds": c, "micro": 0.0, "optimizer": 0.0, "reserved": 0} for c in cost]
    assert spread(cb.spread_basis()) > 1.2  # the times themselves swing with the samples
    cb.step_cost = lambda step: rb.step_cost(step, 4)
    assert spread(cb.spread_basis()) == pytest.approx(1.0)  # the same speed on every step
    per_token = [t / sum(m.trained_tokens for m in rb.step_batches(k, 4)) for k, t in enumerate(cost)][2:]
    assert spread(per_token) > 1.5  # what the old rule (seconds per trained token) took for noise
    assert rb.step_cost(1, 4) == sum(m.tensor_tokens + HALF_TOKENS for m in rb.step_batches(1, 4))


def test_start_writes_the_data_files_and_resume_refuses_a_changed_dataset(tmp_path: Path) -> None:
    from autofit.run.rundir import RunDir
    from autofit.run.session import SearchRequest, plan, start

    copy = tmp_path / "d.jsonl"
    copy.write_bytes(D1.read_bytes())
    session = plan(SearchRequest(model="tiny-llama", space="cpu-demo", device="cpu", dataset=str(copy),
                                 max_length="256", out=tmp_path / "runs"))
    start(session)
    data = RunDir(session.run_dir).data
    assert (data / "lengths.png").is_file() and list(data.glob("standin-bpe-*.json"))
    assert json.loads((data / "data.json").read_text())["cuts"][0]["max_length"] == 256
    assert plan(SearchRequest(resume=session.run_dir)).spec.dataset == session.spec.dataset
    moved = tmp_path / "moved.jsonl"  # --resume follows a moved file of the same content (it ignored --dataset)
    moved.write_bytes(copy.read_bytes())
    copy.write_text(copy.read_text() + '{"text": "one more sample"}\n')
    with pytest.raises(UsageError, match=r"--resume: the run's dataset .* is changed since the search measured.*"
                                         r"give its new place with --dataset PATH"):
        plan(SearchRequest(resume=session.run_dir))
    assert plan(SearchRequest(resume=session.run_dir, dataset=str(moved))).spec.dataset.path == str(moved.resolve())
    with pytest.raises(UsageError, match=r"dataset changed since the run: .*d\.jsonl no longer has the content"):
        plan(SearchRequest(resume=session.run_dir, dataset=str(copy)))
    with pytest.raises(UsageError, match=r"--dataset: no such file or folder: .*gone\.jsonl\. Give the file"):
        plan(SearchRequest(resume=session.run_dir, dataset=str(tmp_path / "gone.jsonl")))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Model folders with their tokenizers: `bos` adds a BOS token to text and has a chat template that writes its
    own (as Llama's); `plain` adds no special token and has no chat template (autofit's plain rendering)."""
    from recipes import save_tiny_model

    return {name: save_tiny_model(tmp_path_factory.mktemp(name), bos=name == "bos") for name in ("bos", "plain")}


@pytest.mark.parametrize(("path", "tokenizer"), [(D1, "bos"), (CHAT, "bos"), ("array", "plain"), ("paragraphs", "bos")])
def test_the_recipe_tokenizes_the_dataset_exactly_as_the_probe(path: Path | str, tokenizer: str, tmp_path: Path,
                                                               models: dict[str, Path]) -> None:
    """The token ids TRL's SFTTrainer trains from what the trl recipe's load_data reads are the ids the probe
    trains (its reader and tokenizer, each sample cut to max_length): text rows from JSONL with TRL's
    end-of-sequence token and the tokenizer's BOS, `messages` chats through the template that writes its own BOS
    (or autofit's plain rendering where there is none), a JSON array of chats, and a text file of paragraphs with
    Windows line endings and blank lines of spaces (`datasets`' text loader splits at '\\n\\n' only)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from autofit.config.models import resolve_model
    from autofit.config.spec import TrialConfig
    from autofit.data import DatasetRef
    from autofit.export import export_run
    from autofit.probe.child.batches import real_batches
    from autofit.protocol.request import ProbeRequest

    if path == "array":  # one JSON array of the chat rows, with an upper-case extension
        rows = [json.loads(x) for x in CHAT.read_text().splitlines() if x.strip()]
        path = tmp_path / "CHAT.JSON"
        path.write_text(json.dumps(rows, indent=1))
    elif path == "paragraphs":
        texts = [" ".join(json.loads(x)["text"].split()) for x in D1.read_text().splitlines()[:40]]
        path = tmp_path / "notes.txt"
        path.write_bytes("\r\n \r\n".join(f"{a}\r\n{b}" for a, b in zip(texts[::2], texts[1::2])).encode())
    assert isinstance(path, Path)
    model = models[tokenizer]
    run = data_run(tmp_path, "pad_longest", path)
    space = recipe_namespace(export_run(run, "trl").text)
    tok = AutoTokenizer.from_pretrained(model)  # main()'s steps before the trainer
    tok.chat_template = tok.chat_template or space.get("PLAIN_CHAT")
    args = SFTConfig(output_dir=str(tmp_path / "out"), **space["TRAINING_ARGS"])
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(model), args=args,
                         train_dataset=space["load_data"](str(path)), processing_class=tok)
    recipe = trainer.train_dataset["input_ids"]

    ref = yaml.safe_load((run / "spec.yaml").read_text())["dataset"]
    cfg = TrialConfig(batching="pad_longest", max_length=96, micro_batch_size=2, global_batch=4)
    probe = real_batches(ProbeRequest(cfg, resolve_model(str(model)), str(tmp_path / "r.json"),
                                      dataset=DatasetRef.from_dict(ref).to_dict(), data_cache=str(tmp_path)))
    assert probe is not None and len(probe.token_ids) == len(recipe) > 1
    assert [ids[:96] for ids in probe.token_ids] == recipe
    if tokenizer == "bos":  # what TRL adds, and only where it adds it
        bos, eos = tok.bos_token_id, tok.eos_token_id
        assert all(ids[0] == bos and ids.count(bos) == 1 for ids in probe.token_ids)
        assert all((ids[-1] == eos) is (path != CHAT) for ids in probe.token_ids)  # none after a chat
