"""Preference data wired into the search and the probe, in-process: `--dataset` on a DPO space takes its
max_length candidates from the pairs and fixes batching at pad_longest, the run keeps a preference reference
that is read again (moved, changed, bad rows) with the preference reader, the search's speed expectation follows
the pairs' lengths, and `probe --dataset` reads a pair file as pairs."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from autofit.cli.common import dataset_ref
from autofit.cli.probe import check_data_kind
from autofit.config.models import resolve_model
from autofit.config.spec import TrialConfig
from autofit.core.errors import UsageError
from autofit.data.preference import PairLengths, file_pair_lengths, micro_batch_means, read_preferences
from autofit.data.reference import DatasetRef
from autofit.data.shapes import PairShapes, shapes_of
from autofit.estimate import effects
from autofit.run.rundir import write_spec
from autofit.run.session import SearchRequest, plan

DATA = Path(__file__).resolve().parents[1] / "data"
PREFS = DATA / "prefs.jsonl"
SPACE = str(DATA / "dpo-space.yaml")
TINY = resolve_model("tiny-llama")


def test_a_dpo_search_takes_its_lengths_from_the_pairs_and_pads_to_the_longest(tmp_path: Path) -> None:
    session = plan(SearchRequest(model="tiny-llama", space=SPACE, device="cpu", dataset=str(PREFS), out=tmp_path))
    space, ref = session.spec.space, session.spec.dataset
    assert ref is not None and ref.preference and ref.samples == 40
    assert ref.content_hash == read_preferences(PREFS).content_hash
    # prefs.jsonl: longest pair 141 tokens under the stand-in: 192 keeps every pair, 128 cuts two
    assert space.lengths == [192, 128] and space.values("batching") == ["pad_longest"]
    assert "40 preference pairs" in session.notes[0] and "2 truncated" in session.notes[0]
    assert not list(tmp_path.iterdir())  # plan creates nothing
    fixed = plan(SearchRequest(model="tiny-llama", space=SPACE, device="cpu", dataset=str(PREFS), out=tmp_path,
                               max_length="64"))
    assert fixed.spec.space.lengths == [64]


def test_one_search_trains_one_kind_of_data(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="holds preference pairs .* --space dpo"):
        plan(SearchRequest(model="tiny-llama", space="cpu-demo", device="cpu", dataset=str(PREFS), out=tmp_path))
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text(Path(SPACE).read_text().replace("  trainer: dpo\n", "") + "  trainer: [sft, dpo]\n")
    with pytest.raises(UsageError, match="trainer takes dpo, sft"):
        plan(SearchRequest(model="tiny-llama", space=str(mixed), device="cpu", dataset=str(PREFS), out=tmp_path))
    samples = tmp_path / "samples.jsonl"
    samples.write_text('{"text": "a sample for supervised fine-tuning"}\n')
    with pytest.raises(UsageError, match="line 1: 'chosen' is missing"):  # the preference reader's own error
        plan(SearchRequest(model="tiny-llama", space=SPACE, device="cpu", dataset=str(samples), out=tmp_path))


def test_a_resumed_dpo_search_finds_its_pairs_moved_and_refuses_them_changed(tmp_path: Path) -> None:
    prefs = tmp_path / "prefs.jsonl"
    shutil.copy(PREFS, prefs)
    session = plan(SearchRequest(model="tiny-llama", space=SPACE, device="cpu", dataset=str(prefs),
                                 out=tmp_path / "runs"))
    session.run_dir.mkdir(parents=True)
    write_spec(session.run_dir, session.spec)
    assert plan(SearchRequest(resume=session.run_dir)).spec.dataset == session.spec.dataset
    moved = tmp_path / "moved.jsonl"
    prefs.rename(moved)
    with pytest.raises(UsageError, match="is missing"):
        plan(SearchRequest(resume=session.run_dir))
    found = plan(SearchRequest(resume=session.run_dir, dataset=str(moved))).spec.dataset
    assert found is not None and found.preference and found.path == str(moved.resolve())
    moved.write_text(moved.read_text().replace("Question 0:", "Question zero:"))
    with pytest.raises(UsageError, match="dataset changed since the run"):
        plan(SearchRequest(resume=session.run_dir, dataset=str(moved)))
    moved.write_text('{"prompt": "p", "chosen": "same", "rejected": "same"}\n')
    with pytest.raises(UsageError, match="line 1: 'chosen' and 'rejected' are the same"):
        plan(SearchRequest(resume=session.run_dir, dataset=str(moved)))


def test_a_stored_reference_before_kinds_reads_as_samples() -> None:
    old = {"path": "/data/train.jsonl", "content_hash": "ab", "samples": 3}
    assert DatasetRef.from_dict(old).kind == "samples" and not DatasetRef.from_dict(old).preference


def test_the_search_expects_the_pairs_lengths_as_the_probe_measures_them(tmp_path: Path) -> None:
    ref = DatasetRef.of_preferences(read_preferences(PREFS))
    shapes = shapes_of(ref.to_dict(), TINY, tmp_path)
    assert isinstance(shapes, PairShapes)
    lengths = file_pair_lengths(read_preferences(PREFS), TINY, tmp_path)
    real, tensor = shapes.per_micro_batch("pad_longest", 128, 2)
    assert (real, tensor) == micro_batch_means(lengths, 128, 2, False)  # the DPO probe's own figure
    assert real < tensor < 2 * 2 * 128  # two rows a pair, padded to the longer pair of the two
    assert shapes.per_micro_batch("pad_max", 128, 2)[1] == 2 * 2 * 128
    assert shapes.step("pad_longest", 128, 2, 4).samples == 4  # pairs per optimizer step
    # short pairs: micro-batch 1 pays the fixed cost on few tokens, so a larger one is expected faster
    dpo = TrialConfig(trainer="dpo", batching="pad_longest", max_length=128, micro_batch_size=1)
    assert effects.factor(dpo.replace(micro_batch_size=4), shapes) > 1.5 * effects.factor(dpo, shapes)
    changed = DatasetRef(ref.path, "0" * 64, kind="preference").to_dict()
    assert shapes_of(changed, TINY, tmp_path) is None  # a changed file: full rows, as for samples


def test_pairs_a_max_length_drops_are_not_in_the_mean() -> None:
    lengths = [PairLengths(100, 10, 20), PairLengths(10, 5, 7)]
    assert micro_batch_means(lengths, 64, 1, False) == (15 + 17, 2 * 17)  # the 100-token prompt fills 64
    assert micro_batch_means(lengths, 64, 2, True) == (15 + 17, 2 * 64)
    assert micro_batch_means([PairLengths(100, 1, 1)], 64, 1, False) == (0.0, 0.0)


def test_probe_dataset_reads_a_pair_file_as_pairs(tmp_path: Path) -> None:
    args = argparse.Namespace(dataset=str(PREFS), text_field=None, messages_field=None, text_mode="auto")
    ref = dataset_ref(args)
    assert ref is not None and ref.preference and ref.samples == 40
    check_data_kind(TrialConfig(trainer="dpo"), ref)
    with pytest.raises(UsageError, match="add --set trainer=dpo"):
        check_data_kind(TrialConfig(), ref)
    samples = tmp_path / "samples.jsonl"
    samples.write_text('{"text": "a sample"}\n')
    sft = dataset_ref(argparse.Namespace(dataset=str(samples), text_field=None, messages_field=None,
                                         text_mode="auto"))
    with pytest.raises(UsageError, match="holds samples, not preference pairs"):
        check_data_kind(TrialConfig(trainer="dpo"), sft)


def test_pairs_are_summarized_into_a_new_folder_with_a_real_tokenizer(tmp_path: Path) -> None:
    """A DPO search (and `autofit data` on pairs) on a model folder crashed before its first probe: the summary was
    written into a folder nothing had made (a shape preset's stand-in tokenizer made it, caching itself there)."""
    from recipes import save_tiny_model

    from autofit.data.preference import summarize_preferences
    from runs import PREFS

    model = resolve_model(str(save_tiny_model(tmp_path / "model")))
    out = tmp_path / "run" / "data"
    summary = summarize_preferences(PREFS, model, out, (128,), file="preferences.json")
    assert not summary.approximate and (out / "preferences.json").is_file()
