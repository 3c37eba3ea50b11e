"""autofit.data: loading, lengths, stats, batching plans, collators, and the boundary check.

Real throughout: the committed corpus slice (tests/data, built by bench/data/make_corpus.py), the
stand-in BPE trained with `tokenizers`, real training steps of tiny-llama through each collator.
"""

from __future__ import annotations

import gzip
import json
import random
import statistics
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import DATA_DIR

from autofit.config.models import PRESETS, resolve_model
from autofit.core.errors import UsageError
from autofit.data import (
    Batching,
    Message,
    SourceKind,
    TextMode,
    length_stats,
    length_table,
    load_samples,
    plan,
)
from autofit.data.batching import step_shape
from autofit.data.library import packed_bins
from autofit.data.stats import format_stats, histogram_png
from autofit.data.tokenizer import PLAIN_CHAT, standin_tokenizer, tokenizer_for

ROOT = Path(__file__).resolve().parent.parent
DATA = DATA_DIR
D1 = DATA / "d1-slice.jsonl"
D2 = DATA / "d2-slice.jsonl"
TINY = resolve_model("tiny-llama")


def _write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return p


def _table(path: Path, cache: Path | None = None):
    data = load_samples(path)
    return data, length_table(data, tokenizer_for(TINY, data, cache), cache)


# ----------------------------------------------------------------------------- loading


def test_a_table_of_no_rows_is_said_so(tmp_path: Path) -> None:
    """An empty parquet file read "has no usable row (no bad rows)"."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    with pytest.raises(UsageError, match=r"empty\.parquet holds no rows; give a file with at least one\.$"):
        load_samples(tmp_path / "empty.parquet")


def test_bad_rows_are_counted_with_their_first_line_numbers(tmp_path: Path) -> None:
    lines = ['{"text": "good one"}', "{not json", '{"other": 1}', '{"text": "  "}', "[1, 2]",
             '{"text": 5}', '{"messages": [{"role": "user"}]}', '{"text": "good two"}', '{"text": null}']
    data = load_samples(_write(tmp_path, "d.jsonl", "\n".join(lines)))
    assert [s.text for s in data.samples] == ["good one", "good two"]
    assert data.bad.count == 7
    assert data.bad.by_reason == {"not JSON": (2,), "missing 'text'": (3,), "empty 'text'": (4,),
                                  "not a JSON object": (5,), "'text' not a string": (6,),
                                  "malformed 'messages'": (7,), "no 'text' value": (9,)}  # null: not "missing"
    assert "7 rows skipped" in data.bad.summary() and "not JSON (line 2)" in data.bad.summary()


def test_a_json_array_and_an_upper_case_extension_read_as_rows(tmp_path: Path) -> None:
    """A .json export that is one array of rows, and DATA.JSONL, were read as plain text: every line, the
    JSON wrapper included, became a sample."""
    rows = [{"text": "first sample"}, {"messages": [{"role": "user", "content": "hi"}]}, {"txt": "typo"}]
    lines = load_samples(_write(tmp_path, "d.jsonl", "\n".join(json.dumps(r) for r in rows)))
    array = load_samples(_write(tmp_path, "d.json", json.dumps(rows, indent=2)))
    upper = load_samples(_write(tmp_path, "D.JSONL", "\n".join(json.dumps(r) for r in rows)))
    assert array.samples == lines.samples == upper.samples and len(lines.samples) == 2
    assert upper.kind is lines.kind and lines.bad.by_reason == {"missing 'text'": (3,)}
    # an indented array's rows are named by the line each starts on (they were its item numbers: 1, 2, 3)
    assert [s.line for s in array.samples] == [2, 5] and array.bad.by_reason == {"missing 'text'": (13,)}
    one_line = load_samples(_write(tmp_path, "o.json", json.dumps(rows)))  # every item on line 1: numbered
    assert [s.line for s in one_line.samples] == [1, 2] and one_line.bad.by_reason == {"missing 'text'": (3,)}


@pytest.mark.parametrize(("name", "content", "match"), [
    ("empty.jsonl", "", r"empty\.jsonl is empty"),
    ("blank.txt", "\n\n  \n", r"blank\.txt is empty"),
    ("bin.jsonl", b"\x00\x01\x02binary\xff", r"bin\.jsonl looks binary"),
    ("latin.txt", "caf\xe9".encode("latin-1"), r"latin\.txt is not UTF-8"),
    ("bad.jsonl", "{nope\n[also not\n", r"bad\.jsonl has no usable row \(2 rows skipped: 2 not JSON"),
    ("field.jsonl", '{"prompt": "x"}\n', r"no usable row .*missing 'text'.*--text-field"),
    # what the rows hold instead, as the flag that reads it: ShareGPT's conversations, Alpaca's fields
    ("sharegpt.jsonl", '{"id": "1", "conversations": [{"from": "human", "value": "hi"}]}\n',
     r"missing 'text'.* Its rows have a chat list 'conversations': give --messages-field conversations\.$"),
    ("sharegpt.json", '{"conversations": [{"from": "human", "value": "hi"}]}',  # one row on one line: a chat
     r"missing 'text'.* Its rows have a chat list 'conversations': give --messages-field conversations\.$"),
    ("alpaca.jsonl", '{"instruction": "a", "input": "", "output": "b"}\n',
     r"Its rows' text fields: 'instruction', 'output': give --text-field with the one to train on\.$"),
    # a malformed chat under the asked name is not offered back as the fix
    ("chat.jsonl", '{"messages": [{"speaker": "u", "text": "hi"}], "source": "web"}\n',
     r"malformed 'messages'.*--messages-field\. Its rows' text fields: 'source': give --text-field"),
])
def test_unusable_files_are_usage_errors_naming_the_file(tmp_path: Path, name: str, content: str | bytes,
                                                         match: str) -> None:
    with pytest.raises(UsageError, match=match) as info:
        load_samples(_write(tmp_path, name, content))
    assert info.value.exit_code == 2
    assert "--dataset" in str(info.value)


def test_a_text_field_named_as_messages_says_to_read_it_as_text(tmp_path: Path) -> None:
    """`--messages-field text` on rows of plain text said each row needs "a non-empty 'text' string",
    which every row had."""
    path = _write(tmp_path, "t.jsonl", '{"text": "one"}\n{"text": "two"}\n')
    with pytest.raises(UsageError, match=r"every row's 'text' is a string, not a chat.*give --text-field text "
                                         r"without --messages-field\.$"):
        load_samples(path, messages_field="text")
    with pytest.raises(UsageError, match=r"a string, not a chat.*give --text-field c without --messages-field\."):
        load_samples(_write(tmp_path, "c.jsonl", '{"c": "one"}\n'), messages_field="c")
    mixed = load_samples(_write(tmp_path, "m.jsonl", '{"c": "plain"}\n{"text": "ok"}\n'), messages_field="c")
    assert mixed.bad.by_reason == {"'c' a string, not messages": (1,)} and len(mixed) == 1


def test_data_reads_a_tokenizer_folder_without_weights(tmp_path: Path) -> None:
    """The weights check is for training: `autofit data` needs only the tokenizer (and the config)."""
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(PRESETS["tiny-llama"]))
    assert resolve_model(str(folder), weights=False).kind == "local"
    with pytest.raises(UsageError, match="has a config.json but no weights"):
        resolve_model(str(folder))

def test_missing_path_says_what_to_give(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"--dataset: no such file or folder: .*nope\.jsonl"):
        load_samples(tmp_path / "nope.jsonl")


def test_field_renames_and_chat_rendering(tmp_path: Path) -> None:
    rows = [{"body": "plain"}, {"conv": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    path = _write(tmp_path, "r.jsonl", "\n".join(json.dumps(r) for r in rows))
    data = load_samples(path, text_field="body", messages_field="conv")
    assert len(data) == 2 and data.samples[1].is_chat
    tok = tokenizer_for(TINY, data)
    assert tok.render(data.samples[1]) == PLAIN_CHAT.format(role="user", content="hi") + \
        PLAIN_CHAT.format(role="assistant", content="yo")
    only_text = load_samples(path, text_field="body")
    assert len(only_text) == 1 and only_text.bad.by_reason == {"missing 'body'": (2,)}
    both = _write(tmp_path, "b.jsonl", json.dumps({"text": "plain", "messages": [{"role": "user", "content": "hi"}]}))
    assert load_samples(both).samples[0].is_chat  # a row with both: its chat
    assert load_samples(both, messages_field="").samples[0].text == "plain"  # --text-field alone: its text
    assert only_text.content_hash != data.content_hash  # the options are part of the identity


def test_text_modes(tmp_path: Path) -> None:
    lines = _write(tmp_path, "l.txt", "one\ntwo\n\nthree\n")
    assert [s.text for s in load_samples(lines).samples] == ["one", "two", "three"]
    assert load_samples(lines).text_mode is TextMode.LINES
    prose = _write(tmp_path, "p.txt", "a\nb\n\nc\nd\n\ne\nf\n")
    assert [s.text for s in load_samples(prose).samples] == ["a\nb", "c\nd", "e\nf"]
    whole = load_samples(prose, text_mode=TextMode.WHOLE)
    assert len(whole) == 1 and whole.samples[0].text == "a\nb\n\nc\nd\n\ne\nf\n"


def test_what_real_files_hold_is_read_as_rows_and_samples(tmp_path: Path) -> None:
    """Files as users have them: a byte-order mark, U+2028 inside a JSON string (json.dumps with
    ensure_ascii=False writes it raw; splitlines() split the row there), a lone surrogate escape (a bad
    row, where it crashed the tokenizer), JSONL without a .jsonl name, CSV, ShareGPT chats, paragraphs
    with Windows line endings or a blank line holding spaces."""
    bom = load_samples(_write(tmp_path, "b.jsonl", b"\xef\xbb\xbf" + b'{"text": "one"}\n{"text": "two"}\n'))
    assert [s.text for s in bom.samples] == ["one", "two"] and not bom.bad.count
    bom_array = load_samples(_write(tmp_path, "b.json",
                                    b"\xef\xbb\xbf" + json.dumps([{"text": "a"}], indent=1).encode()))
    assert [s.text for s in bom_array.samples] == ["a"]
    sep = load_samples(_write(tmp_path, "u.jsonl", '{"text": "first\u2028second"}\n{"text": "ok"}\nnot json\n'))
    assert [s.text for s in sep.samples] == ["first\u2028second", "ok"] and sep.bad.by_reason == {"not JSON": (3,)}
    lone = load_samples(_write(tmp_path, "s.jsonl", '{"text": "abc \\ud800 def"}\n{"text": "fine"}\n'))
    assert [s.text for s in lone.samples] == ["fine"] and lone.bad.by_reason == {"'text' not valid Unicode": (1,)}
    unnamed = load_samples(_write(tmp_path, "train", '{"text": "x y"}\n{"text": "z"}\n'))
    assert unnamed.kind is SourceKind.JSONL and [s.text for s in unnamed.samples] == ["x y", "z"]
    table = load_samples(_write(tmp_path, "d.csv", 'id,text\n1,"hello, world"\n2,\n3,bye\n'))
    assert table.kind is SourceKind.CSV and [s.text for s in table.samples] == ["hello, world", "bye"]
    assert table.bad.by_reason == {"missing 'text'": (3,)}  # an empty cell is no value
    share = load_samples(_write(tmp_path, "g.jsonl", json.dumps({"conversations": [
        {"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}) + "\n"), messages_field="conversations")
    assert share.samples[0].messages == (Message("user", "hi"), Message("assistant", "yo"))
    for text in ("a1\na2\n\nb1\nb2\n\nc1\nc2".replace("\n", "\r\n"), "a1\na2\n \t\nb1\nb2\n\nc1\nc2"):
        paras = load_samples(_write(tmp_path, "p.txt", text))
        assert paras.text_mode is TextMode.PARAGRAPHS and [s.text for s in paras.samples] == ["a1\na2", "b1\nb2",
                                                                                              "c1\nc2"]


@pytest.mark.parametrize(("name", "content", "match"), [
    ("d.jsonl.gz", gzip.compress(b'{"text": "x"}\n', mtime=0), r"d\.jsonl\.gz is gzip-compressed\. Decompress it"),
    ("w.jsonl", '{"text": "x"}\n'.encode("utf-16"), r"w\.jsonl is UTF-16 text\. Convert it to UTF-8"),
    ("comma.json", '[{"text": "a"},\n {"text": "b"},\n]', r"comma\.json is not a valid JSON array \(.* line 3"),
    ("wrapped.json", json.dumps({"version": 1, "data": [{"text": "a"}]}, indent=1),
     r"wrapped\.json is one JSON object spread over several lines.*the list under 'data'"),
    # on one line it was read as a row whose 'data' was offered as a chat: --messages-field data, which then failed
    ("flat.json", json.dumps({"version": 1, "data": [{"text": "a"}, {"messages": []}]}),
     r"flat\.json is one JSON object on one line, not rows; its rows may be the list under 'data'\. Give a JSON"),
])
def test_files_that_are_not_rows_say_what_they_are(tmp_path: Path, name: str, content: str | bytes,
                                                   match: str) -> None:
    """Compressed and UTF-16 files were "binary"; a broken or wrapped JSON file was every line "not JSON"."""
    with pytest.raises(UsageError, match=match):
        load_samples(_write(tmp_path, name, content))


ALTERNATE = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
             "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
             "{{ m['content'] }}{% endfor %}")
"""A chat template that raises when roles do not alternate."""


def _tokenizer_folder(tmp_path: Path, template: str | None) -> Path:
    """A model folder with a real tokenizer (a word-level one) and tiny-llama's config.json, no weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1}, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="<unk>", eos_token="<eos>")
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(tmp_path / "tok")
    (tmp_path / "tok" / "config.json").write_text(json.dumps(PRESETS["tiny-llama"]))
    return tmp_path / "tok"


def _rejecting_tokenizer(tmp_path: Path):
    """A tokenizer folder whose chat template raises when roles do not alternate, loaded as autofit does."""
    from autofit.data.tokenizer import model_tokenizer

    return model_tokenizer(str(_tokenizer_folder(tmp_path, ALTERNATE)))


def test_a_chat_template_that_rejects_rows_is_a_usage_error_naming_them(tmp_path: Path) -> None:
    """A template that raises (roles must alternate) was a jinja2 traceback that ended the search."""
    text = _rejecting_tokenizer(tmp_path)
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    bad = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    data = load_samples(_write(tmp_path, "c.jsonl", "\n".join(json.dumps(r) for r in (good, bad, good, bad))))
    with pytest.raises(UsageError, match=r"chat template rejects 2 of 4 chats \(line 2, 4\): Conversation roles "
                                         r"must alternate.*Fix or remove those rows"):
        text.encode(data.samples)
    assert len(text.encode(data.samples[::2])) == 2


def test_chats_rendered_without_a_template_are_said_so_and_errors_name_the_argument(tmp_path: Path) -> None:
    """A real tokenizer without a chat template rendered chats in the plain format without a word; and
    `autofit data PATH`'s template errors named --dataset, a flag it does not have."""
    from autofit.data import summarize

    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    bad = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    chats = _write(tmp_path, "c.jsonl", "\n".join(json.dumps(r) for r in (good, bad)))
    plain = resolve_model(str(_tokenizer_folder(tmp_path / "plain", None)), weights=False)
    said = summarize(chats, plain, flag="PATH")
    assert any("has no chat template: chats are rendered as plain text" in n for n in said.stats.notes)
    assert "has no chat template" in said.text
    texts = _write(tmp_path, "t.jsonl", json.dumps({"text": "hi there"}))
    assert not any("chat template" in n for n in summarize(texts, plain).stats.notes)  # no chat: nothing to say
    templated = resolve_model(str(_tokenizer_folder(tmp_path / "templated", ALTERNATE)), weights=False)
    with pytest.raises(UsageError, match=r"^PATH: the model's chat template rejects 1 of 2 chats"):
        summarize(chats, templated, flag="PATH")


def test_the_content_hash_of_an_unchanged_file_is_the_one_stored_runs_hold(tmp_path: Path) -> None:
    """Stored runs compare it: sha256 of the file's bytes (a byte-order mark and CRLF included), then of
    that digest with the source kind and fields. A new reader must not change it for the same file."""
    import hashlib

    for name, content, options in (("a.jsonl", b'{"text": "one"}\n{"text": "two"}\n', "jsonl|text|messages"),
                                   ("b.jsonl", b'\xef\xbb\xbf{"text": "one"}\r\n', "jsonl|text|messages"),
                                   ("c.txt", b"line one\nline two\n", "text|text|messages|lines")):
        digest = hashlib.sha256(content).hexdigest()
        want = hashlib.sha256(f"{digest}|{options}".encode()).hexdigest()
        assert load_samples(_write(tmp_path, name, content)).content_hash == want, name


def test_what_the_reader_review_found(tmp_path: Path) -> None:
    """pandas' unnamed index column with --text-field alone; an empty chat cell; a long CSV cell; a
    ShareGPT 'from' that is not a string; classic-Mac line ends; a JSON array under a .txt name;
    paragraphs split by several blank lines holding spaces."""
    pandas_csv = _write(tmp_path, "pd.csv", ",text\n0,hello world\n1,more text\n")
    assert [s.text for s in load_samples(pandas_csv, messages_field="").samples] == ["hello world", "more text"]
    empty_chat = _write(tmp_path, "e.csv", "text,messages\nhello,\n")
    assert [s.text for s in load_samples(empty_chat).samples] == ["hello"]
    long = "x" * 200_000
    assert load_samples(_write(tmp_path, "l.csv", f"text\n{long}\n")).samples[0].text == long
    odd = _write(tmp_path, "o.jsonl", json.dumps({"c": [{"from": ["human"], "value": "hi"}]}) + "\n"
                 + json.dumps({"c": [{"from": "human", "value": "hi"}]}) + "\n")
    got = load_samples(odd, messages_field="c")
    assert len(got) == 1 and got.bad.by_reason == {"malformed 'c'": (1,)}
    mac = load_samples(_write(tmp_path, "m.jsonl", b'{"text": "a"}\r{"text": "b"}\r'))
    assert [s.text for s in mac.samples] == ["a", "b"]
    array = load_samples(_write(tmp_path, "a.txt", json.dumps([{"text": "p"}, {"text": "q"}], indent=1)))
    assert array.kind is SourceKind.JSONL and [s.text for s in array.samples] == ["p", "q"]
    paras = load_samples(_write(tmp_path, "p.txt", "a\nb\n \n\t\nc\nd\n\ne\nf"), text_mode=TextMode.PARAGRAPHS)
    assert [s.text for s in paras.samples] == ["a\nb", "c\nd", "e\nf"]


def test_template_rejections_are_counted_over_every_chunk(tmp_path: Path) -> None:
    from autofit.data.lengths import length_table

    tok = _rejecting_tokenizer(tmp_path)
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    bad = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    rows = [bad if i % 500 == 7 else good for i in range(1100)]  # lines 8, 508 and 1008: chunks 1 and 2
    data = load_samples(_write(tmp_path, "c.jsonl", "\n".join(json.dumps(r) for r in rows)))
    with pytest.raises(UsageError, match=r"rejects 3 of 1100 chats \(line 8, 508, 1008\)"):
        length_table(data, tok)


def test_save_to_disk_and_parquet_folders(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")  # installed with trl; writes the formats users have
    ds = datasets.Dataset.from_list([{"text": "alpha beta"}, {"text": ""}, {"text": "gamma"}])
    ds.save_to_disk(str(tmp_path / "saved"))
    ds.to_parquet(str(tmp_path / "d.parquet"))
    for path, kind in ((tmp_path / "saved", SourceKind.ARROW), (tmp_path / "d.parquet", SourceKind.PARQUET)):
        data = load_samples(path)
        assert data.kind is kind
        assert [s.text for s in data.samples] == ["alpha beta", "gamma"]
        assert data.bad.by_reason == {"empty 'text'": (2,)}
    splits = datasets.DatasetDict({"train": ds, "test": datasets.Dataset.from_list([{"text": "held out"}])})
    splits.save_to_disk(str(tmp_path / "dict"))
    assert [s.text for s in load_samples(tmp_path / "dict").samples] == ["alpha beta", "gamma"]


# ----------------------------------------------------------------------------- lengths and stats


def test_percentiles_candidates_and_cuts_match_numpy() -> None:
    _, table = _table(D1)
    values = np.array(table.lengths)
    stats = length_stats(table, max_positions=PRESETS["tiny-llama"]["max_position_embeddings"])
    for q, got in stats.percentiles.items():
        assert got == pytest.approx(np.percentile(values, q), abs=1e-9)
    expected = []
    for share in (1.0, 0.999, 0.99, 0.95):
        length = next(m for m in range(64, 10**6, 64) if (values <= m).mean() >= share)
        expected.append(length)
    assert stats.candidates == tuple(sorted(set(expected), reverse=True))
    for c in stats.cuts:
        assert c.samples_truncated == pytest.approx((values > c.max_length).mean())
        assert c.tokens_lost == pytest.approx(np.clip(values - c.max_length, 0, None).sum() / values.sum())
    assert stats.approximate and "approximate" in format_stats(stats)


def test_a_sample_longer_than_the_model_positions_is_named() -> None:
    _, table = _table(D2)
    stats = length_stats(table, max_positions=512)
    assert max(stats.candidates) == 512
    assert any("longer than the model's 512 positions" in n for n in stats.notes)
    assert stats.cuts[0].samples_truncated > 0 and "truncat" in format_stats(stats)


def test_one_sample_is_said_in_the_singular(tmp_path: Path) -> None:
    """`autofit data` printed "1 samples, 2 tokens" and "1 samples (100.00%) are longer"."""
    _, table = _table(_write(tmp_path, "one.jsonl", '{"text": "hello there, hello world"}\n'))
    stats = length_stats(table, max_positions=1)
    assert format_stats(stats).startswith(f"1 sample, {table.total_tokens} tokens, mean")
    assert any(n.startswith("1 sample (100.00%) is longer than the model's 1 positions") for n in stats.notes)


def test_length_table_is_cached_by_content_and_tokenizer(tmp_path: Path) -> None:
    copy = _write(tmp_path, "d.jsonl", D1.read_bytes())
    data, table = _table(copy, tmp_path / "run")
    files = sorted((tmp_path / "run").glob("lengths-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["lengths"] == list(table.lengths)
    assert length_table(data, tokenizer_for(TINY, data, tmp_path / "run"), tmp_path / "run") == table
    copy.write_text(copy.read_text() + json.dumps({"text": "one more sample"}) + "\n")
    _, changed = _table(copy, tmp_path / "run")
    assert changed.dataset_hash != table.dataset_hash and len(changed) == len(table) + 1
    assert len(list((tmp_path / "run").glob("lengths-*.json"))) == 2


def test_standin_tokenizer_is_deterministic_and_within_the_vocabulary() -> None:
    data = load_samples(D1)
    a, b = standin_tokenizer(data, 1024), standin_tokenizer(data, 1024)
    ids_a, ids_b = a.encode(data.samples[:20]), b.encode(data.samples[:20])
    assert ids_a == ids_b and max(max(x) for x in ids_a) < 1024


def test_histogram_png(tmp_path: Path) -> None:
    _, table = _table(D1)
    out = histogram_png(table, tmp_path / "h.png", cuts=(448, 1920))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


# ----------------------------------------------------------------------------- plans


@pytest.mark.parametrize("strategy", list(Batching))
def test_plans_cover_every_sample_once_and_are_seeded(strategy: Batching) -> None:
    _, table = _table(D2)
    p = plan(strategy, table.lengths, 1024, 4, seed=3)
    assert sorted(i for b in p.batches for i in b.samples) == list(range(len(table)))
    assert p == plan(strategy, table.lengths, 1024, 4, seed=3)
    cut = [min(n, 1024) for n in table.lengths]
    assert sum(b.real_tokens for b in p.batches) == sum(cut)
    assert p.trained_tokens == sum(cut) - len(cut)
    assert p.heaviest.tensor_tokens >= max(b.tensor_tokens for b in p.batches)
    assert p.heaviest.tensor_tokens <= 4 * 1024


def test_pad_fractions_order_and_padding_free_budget() -> None:
    _, table = _table(D2)
    frac = {s: plan(s, table.lengths, 2048, 4).pad_fraction for s in Batching}
    assert frac[Batching.PADDING_FREE] == 0.0
    assert frac[Batching.PAD_MAX] > frac[Batching.PAD_LONGEST] > frac[Batching.GROUP_BY_LENGTH]
    assert frac[Batching.PACKED] < frac[Batching.GROUP_BY_LENGTH]
    mean = sum(min(n, 2048) for n in table.lengths) / len(table)
    assert frac[Batching.PAD_MAX] == pytest.approx(1 - mean / 2048)
    free = plan(Batching.PADDING_FREE, table.lengths, 2048, 4)
    assert all(b.real_tokens <= 4 * 2048 for b in free.batches)


def test_group_by_length_puts_the_longest_first_and_sorts_mega_batches() -> None:
    _, table = _table(D1)
    p = plan(Batching.GROUP_BY_LENGTH, table.lengths, 4096, 2, seed=0)
    first = p.batches[0].samples[0]
    assert table.lengths[first] == max(table.lengths)


def test_packed_micro_batches_come_in_a_seeded_shuffle_not_longest_first() -> None:
    """The probe times the plan's first micro-batches: in bfd's order they would be the longest samples
    one a row (a faster attention layout than the epoch's rows of several samples)."""
    rng = random.Random(0)
    lengths = [max(2, int(rng.lognormvariate(5.15, 1.05))) for _ in range(4000)]  # D2's shape: mean ~300
    cut = [min(n, 2048) for n in lengths]
    p = plan(Batching.PACKED, lengths, 2048, 2, seed=0)
    bins = packed_bins(cut, 2048)  # TRL's rows, in its order
    assert sorted(r for b in p.batches for r in b.rows) == sorted(bins)  # the same rows, all of them
    mean = statistics.mean(len(r) for r in bins)  # samples per row over the epoch: ~7
    old_first = statistics.mean(len(r) for r in bins[:32])  # bfd's first rows: the longest samples, alone
    first = statistics.mean(len(r) for b in p.batches[:16] for r in b.rows)
    assert old_first < 0.5 * mean < first
    assert plan(Batching.PACKED, lengths, 2048, 2, seed=0).batches == p.batches  # seeded
    assert plan(Batching.PACKED, lengths, 2048, 2, seed=1).batches != p.batches


# ----------------------------------------------------------------------------- collators on tiny-llama


def _tiny_model(attn: str = "sdpa"):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**PRESETS["tiny-llama"]),
                                             attn_implementation=attn)
    model.config.use_cache = False  # what Trainer 5.24 does (args.use_cache); packed masks need it
    return model


@pytest.fixture(scope="module")
def d1_ids():
    data = load_samples(D1)
    tok = tokenizer_for(TINY, data)
    return tok.encode(data.samples), tok.pad_id, length_table(data, tok)


@pytest.mark.parametrize("strategy", list(Batching))
def test_every_strategy_trains_tiny_llama_from_jsonl(strategy: Batching, d1_ids) -> None:
    import torch

    from autofit.data.collate import collate, model_inputs
    from autofit.probe.child.boundaries import check_batch

    ids, pad, table = d1_ids
    p = plan(strategy, table.lengths, 256, 4, seed=0)
    model = _tiny_model()
    assert check_batch(model, strategy, p.batches[0], ids, pad, 256).ok
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = [model_inputs(collate(strategy, b, ids, pad, 256)) for b in p.batches[:3]]
    model.train()
    losses = []
    for step in range(6):
        loss = model(**batches[step % 3]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(np.isfinite(losses))
    assert losses[3] < losses[0] and losses[5] < losses[2], losses  # the same batches, after a step


def test_padding_free_and_packed_layouts(d1_ids) -> None:
    from autofit.data.collate import collate

    ids, pad, table = d1_ids
    free = plan(Batching.PADDING_FREE, table.lengths, 256, 4).batches[0]
    out = collate(Batching.PADDING_FREE, free, ids, pad, 256)
    assert out["input_ids"].shape == (1, free.real_tokens) and "attention_mask" not in out
    starts = (out["position_ids"][0] == 0).nonzero().flatten().tolist()
    assert len(starts) == len(free.samples) and all(out["labels"][0, s] == -100 for s in starts)
    packed = plan(Batching.PACKED, table.lengths, 256, 4).batches[0]
    out = collate(Batching.PACKED, packed, ids, pad, 256)  # TRL's rows flattened into one, as SFTTrainer does
    assert out["input_ids"].shape == (1, packed.real_tokens) == (1, packed.tensor_tokens)
    assert "attention_mask" not in out and len(packed.rows) == 4
    starts = (out["position_ids"][0] == 0).nonzero().flatten().tolist()
    assert len(starts) == len(packed.samples) and int((out["labels"] != -100).sum()) == packed.trained_tokens


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_the_loss_check_catches_a_leaking_collator(attn: str, d1_ids) -> None:
    from autofit.data.collate import packed_rows
    from autofit.probe.child.boundaries import check_batch

    ids, pad, table = d1_ids
    batch = next(b for b in plan(Batching.PACKED, table.lengths, 256, 4).batches if len(b.rows[0]) > 2)
    model = _tiny_model(attn)
    good = check_batch(model, Batching.PACKED, batch, ids, pad, 256)
    leak = check_batch(model, Batching.PACKED, batch, ids, pad, 256,
                       candidate=packed_rows(batch, ids, pad, 256, boundaries=False))
    assert good.ok and good.max_loss_diff <= good.tolerance
    assert not leak.ok and leak.max_loss_diff > 10 * leak.tolerance
    assert "see each other" in leak.reason


def test_the_tolerance_follows_the_models_own_rounding_in_bf16_and_a_leak_stands_above_it(d1_ids) -> None:
    import torch

    from autofit.data.collate import packed_rows
    from autofit.data.correctness import FLOOR_FACTOR, TOLERANCE
    from autofit.probe.child.boundaries import check_batch

    ids, pad, table = d1_ids
    batch = next(b for b in plan(Batching.PACKED, table.lengths, 256, 4).batches if len(b.rows[0]) > 2)
    model = _tiny_model().to(torch.bfloat16)
    good = check_batch(model, Batching.PACKED, batch, ids, pad, 256, precision="bf16")
    leak = check_batch(model, Batching.PACKED, batch, ids, pad, 256, precision="bf16",
                       candidate=packed_rows(batch, ids, pad, 256, boundaries=False))
    assert good.floor > 0, "bf16 rounds differently in a row of its own length: the floor is measured"
    assert good.tolerance == max(TOLERANCE["bf16"], FLOOR_FACTOR * good.floor)
    assert good.ok and good.to_dict()["floor"] == good.floor
    assert not leak.ok and leak.max_loss_diff > 3 * leak.tolerance, (leak.max_loss_diff, leak.tolerance)


def test_leaving_the_cache_on_leaks_packed_samples(d1_ids) -> None:
    import torch

    from autofit.data.collate import collate, model_inputs

    ids, pad, table = d1_ids
    batch = collate(Batching.PADDING_FREE, plan(Batching.PADDING_FREE, table.lengths, 256, 4).batches[0],
                    ids, pad, 256)
    model = _tiny_model()
    model.train()
    with torch.no_grad():
        cached = model(**model_inputs(batch), use_cache=True).logits
        clean = model(**model_inputs(batch), use_cache=False).logits
    assert float((cached - clean).abs().max()) > 0.05  # the finding the check guards against


def test_boundary_support_is_measured_and_missing_kernels_have_reasons() -> None:
    from autofit.probe.child.support import boundary_support

    rows = boundary_support(["sdpa", "eager", "flash_attention_2"])
    assert {(r.attn_implementation, r.strategy) for r in rows if r.supported} == \
        {(a, s) for a in ("sdpa", "eager") for s in Batching}
    flash = [r for r in rows if r.attn_implementation == "flash_attention_2"]
    assert len(flash) == len(Batching) and all("flash_attn" in r.reason or "CUDA" in r.reason for r in flash)


# ----------------------------------------------------------------------------- summary, reference, feed


def test_summary_writes_json_and_png_and_its_text_has_the_recomputable_percentiles(tmp_path: Path) -> None:
    from autofit.data import summarize

    s = summarize(D1, TINY, tmp_path)
    saved = json.loads((tmp_path / "data.json").read_text())
    values = np.array(s.table.lengths)
    assert saved["percentiles"]["p50"] == pytest.approx(np.percentile(values, 50))
    assert f"p99 {np.percentile(values, 99):.1f}" in s.text
    assert saved["approximate"] is True and (tmp_path / "lengths.png").is_file()
    assert saved["dataset"]["content_hash"] == s.data.content_hash


def test_dataset_reference_reports_a_changed_or_missing_file(tmp_path: Path) -> None:
    from autofit.data import DatasetRef, RefState

    copy = _write(tmp_path, "d.jsonl", D1.read_bytes())
    ref = DatasetRef.from_dict(json.loads(json.dumps(DatasetRef.of(load_samples(copy)).to_dict())))
    assert ref.load()[0] is RefState.SAME
    copy.write_text(copy.read_text().replace("a", "b", 1))
    assert ref.load()[0] is RefState.CHANGED
    copy.unlink()
    assert ref.load()[0] is RefState.MISSING


@pytest.mark.parametrize("strategy", list(Batching))
def test_the_heaviest_micro_batch_is_the_largest_tensor(strategy: Batching, d1_ids) -> None:
    """The probe runs the plan's heaviest micro-batch for the worst-case peak: no batch the collator builds
    from the plan is larger."""
    from autofit.data.collate import collate

    ids, pad, _ = d1_ids
    p = plan(strategy, [len(t) for t in ids], 512, 4, seed=0)
    heavy = collate(strategy, p.heaviest, ids, pad, 512)
    sizes = [collate(strategy, mb, ids, pad, 512)["input_ids"].numel() for mb in p.batches]
    assert heavy["input_ids"].numel() == p.heaviest.tensor_tokens >= max(sizes)


def test_the_probes_micro_batches_sample_the_whole_epoch_not_its_longest_first_start() -> None:
    """group_by_length's plan starts with its longest micro-batches: a window of the first ones is far
    heavier than the epoch's mean; the drawn window is a seeded sample of the whole epoch."""
    from autofit.data import Batching, plan
    from autofit.probe.child.batches import drawn

    rng = random.Random(0)
    lengths = [max(2, int(rng.lognormvariate(5.15, 1.05))) for _ in range(4000)]  # D2's shape: mean ~300
    p = plan(Batching.GROUP_BY_LENGTH, lengths, 2048, 8, 0)
    mean = sum(b.tensor_tokens for b in p.batches) / len(p.batches)
    first = [b.tensor_tokens for b in p.batches[:24]]
    window = [b.tensor_tokens for b in drawn(p.batches, 24, 0)]
    assert sum(first) / len(first) > 1.5 * mean  # what the old window timed
    assert abs(sum(window) / len(window) - mean) < 0.5 * mean
    assert [b.tensor_tokens for b in drawn(p.batches, 24, 0)] == window  # seeded
    past = Counter(map(id, drawn(p.batches, 3 * len(p.batches), 1)))  # past the epoch: every one 3 times
    assert past == {id(b): 3 for b in p.batches}
    assert drawn([], 5, 0) == []


def test_the_probe_runs_the_heaviest_micro_batch_then_the_seeded_sample(tmp_path: Path) -> None:
    """What the probe child builds from a request with --dataset: the worst case first (its peak is the
    config's), then the drawn window, not the plan's first micro-batches."""
    from autofit.config.spec import TrialConfig
    from autofit.data import DatasetRef
    from autofit.probe.child.batches import drawn, real_batches
    from autofit.protocol.request import ProbeRequest

    cfg = TrialConfig(batching="group_by_length", max_length=256, micro_batch_size=4, global_batch=8)
    req = ProbeRequest(cfg, resolve_model("tiny-llama"), str(tmp_path / "r.json"),
                       dataset=DatasetRef.of(load_samples(D2)).to_dict(), data_cache=str(tmp_path), data_seed=3)
    rb = real_batches(req)
    p = plan(Batching.GROUP_BY_LENGTH, [len(t) for t in rb.token_ids], 256, 4, 3, group=8)
    n = req.micro_batches  # every step of the probe: accumulation 2 (8 / 4), no packed rows to count
    assert rb.order[0] == p.heaviest and len(rb.order) == n and rb.step.accumulation == 2
    assert list(rb.order[1:]) == drawn(p.batches, n - 1, 3)
    assert list(rb.order[1:]) != p.batches[:n - 1]  # the plan's start: its longest micro-batches


def test_a_probe_on_data_reports_the_plans_trained_tokens_per_s_not_the_samples_its_window_drew() -> None:
    """Steps timed exactly by a fixed cost per micro-batch plus a cost per tensor token (micro-batch 1 of
    chat-like samples on a GPU: the fixed cost dominates): the figure is one epoch's trained tokens/s,
    the same from every step, while each step's own tokens over its time swing with its samples."""
    import random as rnd

    from autofit.data import Batching, plan
    from autofit.probe.child.batches import RealBatches
    from autofit.probe.child.timing import spread

    lengths = [20 + (i * 37) % 1300 for i in range(600)]
    p = plan(Batching.PAD_LONGEST, lengths, 2048, 1, 0)
    n = len(p.batches)
    rb = RealBatches(Batching.PAD_LONGEST, [], 0, 2048, (p.heaviest, *p.batches[:60]), p.pad_fraction, 0.0,
                     plan_trained=p.trained_tokens / n, plan_tensor=sum(b.tensor_tokens for b in p.batches) / n,
                     step=step_shape(Batching.PAD_LONGEST, 16, 1, 1, 1, p.trained_tokens / n))
    a, b, acc, config_acc, first = 0.15, 2e-5, 4, 16, 2
    steps = range(first, first + 8)
    seconds = [config_acc * (a + b * sum(m.tensor_tokens for m in rb.step_batches(k, acc)) / acc) for k in steps]
    truth = rb.plan_trained / (a + b * rb.plan_tensor)
    rates = rb.tokens_per_s(seconds, first, acc, config_acc)
    assert rates == pytest.approx([truth] * len(rates), rel=1e-9)
    assert rb.time_model(seconds, first, acc, config_acc) == pytest.approx((a, b), rel=1e-6)
    own = [sum(m.trained_tokens for m in rb.step_batches(k, acc)) * config_acc / acc / t
           for k, t in zip(steps, seconds)]
    assert spread(own) > 1.5  # what the steps' own samples did to the old per-step figure
    # with 3% timing noise the figure stays within it and the spread rule sees the timing alone
    noisy = [t * rnd.Random(k).uniform(0.985, 1.015) for k, t in enumerate(seconds)]
    rates = rb.tokens_per_s(noisy, first, acc, config_acc)
    assert statistics.median(rates) == pytest.approx(truth, rel=0.03) and spread(rates) < 1.1
    fig = rb.figures(seconds, first, acc, config_acc)
    assert fig["plan_trained_per_micro_batch"] == pytest.approx(rb.plan_trained, abs=0.01)
    timed = sum(m.trained_tokens for k in steps for m in rb.step_batches(k, acc))
    assert fig["window_tokens_per_s"] == pytest.approx(timed * config_acc / acc / sum(seconds))


def test_a_text_mode_given_for_rows_is_refused_not_dropped(tmp_path: Path) -> None:
    """--text-mode on a JSONL file was accepted without a word (and copied into plan's next command)."""
    rows = _write(tmp_path, "d.jsonl", '{"text": "a b c"}\n')
    with pytest.raises(UsageError, match=r"^--text-mode lines: --dataset .*d\.jsonl is jsonl rows, not plain text; "
                                         r"--text-mode splits text files only: drop it"):
        load_samples(rows, text_mode=TextMode.LINES)
    assert len(load_samples(rows)) == 1  # auto: as before
    text = _write(tmp_path, "t.txt", "a\nb\n")
    assert len(load_samples(text, text_mode=TextMode.LINES)) == 2


def test_a_dataset_dict_without_a_train_split_is_refused_by_name(tmp_path: Path) -> None:
    """All its splits' rows were searched, while the recipe reads the train split and found none."""
    from datasets import Dataset, DatasetDict

    DatasetDict({"validation": Dataset.from_dict({"text": ["a", "b"]}),
                 "test": Dataset.from_dict({"text": ["c"]})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(UsageError, match=r"dd is a DatasetDict with no 'train' split \(its splits: test, validation\); "
                                         r"save the split to train on"):
        load_samples(tmp_path / "dd")
    DatasetDict({"train": Dataset.from_dict({"text": ["a", "b"]}),
                 "test": Dataset.from_dict({"text": ["c"]})}).save_to_disk(str(tmp_path / "tt"))
    assert [s.text for s in load_samples(tmp_path / "tt").samples] == ["a", "b"]


def test_a_config_json_beside_its_tokenizer_measures_with_that_tokenizer(tmp_path: Path) -> None:
    """`autofit data --model folder/config.json` said "a shape preset without a tokenizer" and trained a stand-in,
    the folder's own tokenizer beside it; a model folder without tokenizer files leaked the loader's
    "Couldn't instantiate the backend tokenizer" and asked to download a local folder."""
    from recipes import save_tiny_model

    from autofit.config.models import resolve_model
    from autofit.data.tokenizer import tokenizer_for

    folder = save_tiny_model(tmp_path / "m")
    data = load_samples(D1)
    beside = tokenizer_for(resolve_model(str(folder / "config.json")), data, tmp_path / "cache")
    assert not beside.approximate and beside.identity.startswith(str(folder))
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((folder / name).read_bytes())
    with pytest.raises(UsageError, match=r"^--model: .*bare has no tokenizer files \(tokenizer\.json, "
                                         r"tokenizer_config\.json, tokenizer\.model\); save the tokenizer beside"):
        tokenizer_for(resolve_model(str(bare)), data, tmp_path / "cache")
    alone = tokenizer_for(resolve_model(str(bare / "config.json")), data, tmp_path / "cache")
    assert alone.approximate and "a preset, or a config.json" in alone.note  # no tokenizer: the stand-in
