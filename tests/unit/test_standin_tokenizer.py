"""The stand-in BPE of a shape preset (no tokenizer of its own) on data that broke it: a repetitive sample merged
into a few giant tokens, one giant line that kept training busy for minutes, and a stand-in cached by that
recipe. Real `tokenizers` training throughout; ordinary text is measured against the old recipe's lengths."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from conftest import DATA_DIR, run_cli

from autofit.config.models import resolve_model
from autofit.data import length_table, load_samples
from autofit.data.loading import SampleSet
from autofit.data.tokenizer import STANDIN_EOS, render_plain_chat, standin_tokenizer, tokenizer_for

TINY = resolve_model("tiny-llama")
CAP = 16
"""The longest token the stand-in may learn, in bytes (one ByteLevel character a byte)."""


def _rows(tmp_path: Path, *texts: str) -> Path:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def _old_recipe(data: SampleSet, vocab_size: int):
    """The stand-in as it was trained before the cap: unbounded merges, learned from whole samples."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=max(vocab_size, 300), special_tokens=["<pad>", STANDIN_EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([render_plain_chat(s) if s.is_chat else s.text or "" for s in data.samples],
                            trainer=trainer)
    return tok


def test_a_repetitive_sample_counts_tokens_of_at_most_the_cap(tmp_path: Path) -> None:
    """200,000 x's and 'hello world' counted 5 tokens: the BPE merged the x's into tokens of 65,536 and more."""
    data = load_samples(_rows(tmp_path, "x" * 200_000, "hello world"))
    table = length_table(data, tokenizer_for(TINY, data, tmp_path / "cache"), tmp_path / "cache")
    assert table.lengths[0] >= 200_000 // CAP and table.lengths[1] >= 2
    (saved,) = (tmp_path / "cache").glob("standin-bpe-*.json")
    vocab = json.loads(saved.read_text(encoding="utf-8"))["model"]["vocab"]
    assert max(len(token) for token in vocab if token not in ("<pad>", STANDIN_EOS)) <= CAP


def test_one_giant_line_is_measured_whole_in_seconds(tmp_path: Path) -> None:
    """One 5 MB line kept `autofit data` training for over 10 minutes (and would have counted it as a few tokens).
    The bound is generous (it takes seconds): a run past it fails here instead of hanging the suite."""
    path = _rows(tmp_path, "x" * 5_000_000)
    out = tmp_path / "out"
    proc = run_cli("data", str(path), "--model", "tiny-llama", "--out", str(out), "--json", timeout=180)
    assert proc.returncode == 0, proc.stderr
    (table,) = out.glob("lengths-*.json")
    assert json.loads(table.read_text())["lengths"][0] >= 5_000_000 // CAP


def test_ordinary_text_keeps_the_old_recipes_lengths() -> None:
    """The cap and the cut change little where no token was giant: every sample of the committed slices (long
    samples past the training cut included) within a factor of 1.5 of the old recipe's count, and the totals
    within 5%. The old recipe is trained here as it was; the new one is trained again, not read from a cache
    (its key names the recipe)."""
    for name in ("d1-slice.jsonl", "d2-slice.jsonl"):
        data = load_samples(DATA_DIR / name)
        new = length_table(data, standin_tokenizer(data, 1024)).lengths
        old_tok = _old_recipe(data, 1024)
        old = [len(e.ids) for e in old_tok.encode_batch([(s.text or "") + STANDIN_EOS for s in data.samples])]
        assert max(len(s.text or "") for s in data.samples) > 4096  # some samples are longer than the cut
        assert all(o / 1.5 <= n <= o * 1.5 for o, n in zip(old, new, strict=True)), name
        assert abs(sum(new) - sum(old)) <= 0.05 * sum(old), name


def test_a_stand_in_cached_by_the_old_recipe_is_not_reused(tmp_path: Path) -> None:
    """The cache key was the data and the vocabulary size only: the giant-token stand-in a user's cache already
    holds would have been read back, counting the repetitive sample as a few tokens still."""
    data = load_samples(_rows(tmp_path, "x" * 20_000, "hello world"))
    old_key = hashlib.sha256(f"{data.content_hash}|1024".encode()).hexdigest()[:16]
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / f"standin-bpe-{old_key}.json").write_text(_old_recipe(data, 1024).to_str(), encoding="utf-8")
    tok = standin_tokenizer(data, 1024, cache)
    assert old_key not in tok.identity
    assert length_table(data, tok).lengths[0] >= 20_000 // CAP
