"""The tokenizer that turns samples into token ids: the model's own, or a stand-in for a preset.

A model folder or a hub id in the local cache has its own tokenizer (transformers AutoTokenizer,
offline). A shape preset (random weights) has none: the stand-in is a byte-level BPE trained with
the `tokenizers` package on the dataset itself, to the preset's vocabulary size (fewer tokens if
the data has fewer merges), deterministic for the same data: tokens of at most 16 bytes, merges learned
from each sample's first few thousand characters (`_STANDIN_RECIPE`). Every length it gives is
approximate, and every output says so (`TextTokenizer.approximate`).

Chat samples use the tokenizer's chat template where it has one; otherwise (and always with the
stand-in) the plain rendering `PLAIN_CHAT`: each message as "<|role|>\\n" + content + "\\n".

The ids are the ones TRL's SFTTrainer trains (trl 1.16, `_prepare_dataset`), so the probe measures what an
exported recipe runs: a text row gets the tokenizer's end-of-sequence token appended as text (unless it ends
with it already) and is tokenized with the tokenizer's special tokens (a BOS where its post-processor adds
one); a chat is its template's text tokenized without them (as `apply_chat_template(tokenize=True)` does:
the template writes its own BOS), and no end-of-sequence token is appended.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from autofit.config.models import ModelSource
from autofit.core.errors import UsageError
from autofit.core.files import write_atomic
from autofit.data.loading import Sample, SampleSet

if TYPE_CHECKING:
    from tokenizers import Tokenizer

PLAIN_CHAT = "<|{role}|>\n{content}\n"
STANDIN_EOS = "<eos>"
_STANDIN_SPECIALS = ["<pad>", STANDIN_EOS]
_STANDIN_RECIPE = "2"
"""The stand-in's training recipe, part of its cache key: a stand-in cached by an older recipe is trained again.
1: merges unbounded, trained on whole samples. 2: tokens of at most `_STANDIN_MAX_TOKEN` bytes, trained on each
sample's first `_STANDIN_TRAIN_CHARS` characters."""
_STANDIN_MAX_TOKEN = 16
"""The longest token, in bytes, the stand-in may learn. Unbounded, BPE trained on a repetitive sample merged it
into a few giant tokens (a sample of 200,000 x's counted 3 tokens; a real tokenizer's tokens are short). Real
byte-level vocabularies (GPT-2's, Llama's) keep nearly every token within 16 bytes (a word, or a short run of spaces
or punctuation); their rare longer tokens could not shorten a sample much. The BPE's ByteLevel alphabet writes each
byte as one character, so the trainer's `max_token_length` (characters) counts bytes. tokenizers 0.23.3 learns only
tokens shorter than it (a merge that reaches it is skipped; its docs say "longer than"): at most 15 bytes there,
16 under the documented reading, within 16 either way."""
_STANDIN_TRAIN_CHARS = 4096
"""The stand-in learns its merges from each sample's first this many characters, and encodes every sample whole:
one giant line (5 MB of one word) kept training busy for over 10 minutes. A few thousand characters of each sample
hold the words and merges the dataset uses."""
TRL_IDS = "+trl-eos"
"""Marks a tokenizer's identity (the key of cached length tables) as counting TRL's ids: a table counted before
text rows got their end-of-sequence token is not read."""


@dataclass(frozen=True)
class TextTokenizer:
    """Encodes rendered samples to ids. `identity` names it in caches and reports."""

    identity: str
    approximate: bool
    pad_id: int
    encode_batch: Callable[[list[str]], list[list[int]]]
    """Ids of text rows, with the tokenizer's special tokens."""
    chat_template: Callable[[Sample], str] | None = None
    note: str = ""
    chat_note: str = ""
    """What is said of chats where there is no chat template to render them (`PLAIN_CHAT` instead)."""
    eos: str = ""
    """The end-of-sequence token's text, appended to text rows as TRL appends it ('' where there is none)."""
    encode_chats: Callable[[list[str]], list[list[int]]] | None = None
    """Ids of rendered chats, without special tokens (None: `encode_batch`, a tokenizer that adds none)."""

    def render(self, sample: Sample) -> str:
        if not sample.is_chat:
            return sample.text or ""
        if self.chat_template is not None:
            return self.chat_template(sample)
        return render_plain_chat(sample)

    def encode(self, samples: Sequence[Sample]) -> list[list[int]]:
        """Token ids of each sample as TRL's SFTTrainer tokenizes it (the module's docstring); RejectedChats
        where the chat template rejects any (every one counted)."""
        texts, rejected = [], []
        for s in samples:
            try:
                texts.append(self.render(s))
            except Exception as e:  # noqa: BLE001  a template's raise_exception (jinja2's TemplateError) or its own bug
                rejected.append((s, e))
        if rejected:
            raise RejectedChats(rejected, len(samples))
        chats = [k for k, s in enumerate(samples) if s.is_chat]
        rows = [k for k, s in enumerate(samples) if not s.is_chat]
        ids: list[list[int]] = [[] for _ in samples]
        text_ids = self.encode_batch([self._ended(texts[k]) for k in rows]) if rows else []
        chat_ids = (self.encode_chats or self.encode_batch)([texts[k] for k in chats]) if chats else []
        for k, one in [*zip(rows, text_ids), *zip(chats, chat_ids)]:
            ids[k] = one
        return ids

    def _ended(self, text: str) -> str:
        """A text row as TRL's `add_eos` leaves it: the end-of-sequence token appended unless it ends with it."""
        return text if not self.eos or text.endswith(self.eos) else text + self.eos


class RejectedChats(UsageError):
    """Chats the model's template rejects: the samples, why, and of how many (exit 2)."""

    def __init__(self, rejected: list[tuple[Sample, Exception]], total: int, flag: str = "--dataset") -> None:
        self.rejected = rejected
        self.total = total
        super().__init__(rejected_chats(rejected, total, flag))


def rejected_chats(rejected: list[tuple[Sample, Exception]], total: int, flag: str = "--dataset") -> str:
    lines = [str(s.line) for s, _ in rejected[:5] if s.line is not None]
    where = f" (line {', '.join(lines)}{', ...' if len(rejected) > len(lines) else ''})" if lines else ""
    error = rejected[0][1]
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (f"{flag}: the model's chat template rejects {len(rejected)} of {total} chats{where}: {first}. "
            "Fix or remove those rows, or give --model a tokenizer whose chat template accepts them.")


def render_plain_chat(sample: Sample) -> str:
    return "".join(PLAIN_CHAT.format(role=m.role, content=m.content) for m in sample.messages or ())


def tokenizer_for(model: ModelSource, data: SampleSet, cache_dir: str | Path | None = None) -> TextTokenizer:
    """The model's tokenizer, or for a preset/config the stand-in BPE trained on `data`."""
    if model.kind == "config" and has_tokenizer(Path(model.ref).parent):  # a config.json beside its tokenizer
        return model_tokenizer(str(Path(model.ref).parent))
    if model.random_weights:
        vocab = int(model.config.get("vocab_size", 32000))
        return standin_tokenizer(data, vocab, cache_dir)
    if model.kind == "local" and not has_tokenizer(Path(model.ref)):
        raise UsageError(f"--model: {model.ref} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); save the "
                         "tokenizer beside the weights (tokenizer.save_pretrained), or give the folder's "
                         "config.json to measure with a stand-in tokenizer trained on the data.")
    return model_tokenizer(model.ref)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
"""What a folder saved with a tokenizer holds (one of them at least)."""


def has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def model_tokenizer(ref: str) -> TextTokenizer:
    from transformers import AutoTokenizer  # deferred: transformers is heavy and only needed here

    try:
        tok = AutoTokenizer.from_pretrained(ref, local_files_only=True)
    except (OSError, ValueError) as e:
        where = ("its tokenizer files could not be read" if Path(ref).is_dir() else
                 "it is not in the local cache; download the model once, or give a folder with tokenizer files")
        raise UsageError(f"--model: cannot load the tokenizer of {ref}: {where} "
                         f"({str(e).splitlines()[0] if str(e).strip() else type(e).__name__}).") from None
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    def chat(sample: Sample) -> str:
        msgs = [{"role": m.role, "content": m.content} for m in sample.messages or ()]
        return str(tok.apply_chat_template(msgs, tokenize=False))
    template = chat if getattr(tok, "chat_template", None) else None
    ident = f"{ref}@{getattr(tok, 'name_or_path', ref)}:{len(tok)}{TRL_IDS}"

    def encode_batch(texts: list[str]) -> list[list[int]]:
        return [list(x) for x in tok(texts, add_special_tokens=True)["input_ids"]]

    def encode_chats(texts: list[str]) -> list[list[int]]:
        return [list(x) for x in tok(texts, add_special_tokens=False)["input_ids"]]
    return TextTokenizer(ident, False, int(pad), encode_batch, template, "the model's own tokenizer",
                         "" if template else plain_chat_note(f"{ref}'s tokenizer"), tok.eos_token or "",
                         encode_chats)


def standin_tokenizer(data: SampleSet, vocab_size: int, cache_dir: str | Path | None = None) -> TextTokenizer:
    """Byte-level BPE trained on the dataset itself (cached as tokenizer.json under cache_dir)."""
    from tokenizers import Tokenizer  # deferred: a Rust extension, only needed for presets

    key = hashlib.sha256(f"{data.content_hash}|{vocab_size}|recipe{_STANDIN_RECIPE}".encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"standin-bpe-{key}.json" if cache_dir else None
    # read and written as text: tokenizers takes no path that is not UTF-8
    if path is not None and path.is_file():
        tok = Tokenizer.from_str(path.read_text(encoding="utf-8"))
    else:
        tok = _train_bpe([(render_plain_chat(s) if s.is_chat else s.text or "")[:_STANDIN_TRAIN_CHARS]
                          for s in data.samples], vocab_size)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, tok.to_str())  # whole or not at all: a cut cache would be read next time

    def encode_batch(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tok.encode_batch(texts)]
    note = (f"lengths are approximate: the model is a shape (a preset, or a config.json) without a tokenizer; a "
            f"byte-level BPE trained on the dataset to {tok.get_vocab_size()} tokens (asked {vocab_size}) stands in")
    pad = tok.token_to_id("<pad>")
    if pad is None:  # one of _STANDIN_SPECIALS: every trained stand-in has it
        raise RuntimeError(f"the stand-in tokenizer {key} has no <pad> token")
    return TextTokenizer(f"standin-bpe-{key}{TRL_IDS}", True, pad, encode_batch, None, note,
                         plain_chat_note("the stand-in tokenizer"), STANDIN_EOS)


def plain_chat_note(whose: str) -> str:
    """The note for chats rendered without a chat template: a format the user did not choose, said once."""
    return (f"{whose} has no chat template: chats are rendered as plain text, each message as <|role|> and "
            "its content on lines of their own (the probes and the exported recipe do the same); give "
            "--model a tokenizer with a chat template to measure the format it trains with")


def _train_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=max(vocab_size, 300), special_tokens=_STANDIN_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
                                  max_token_length=_STANDIN_MAX_TOKEN)
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() > vocab_size:  # a preset smaller than the byte alphabet: cannot honour it
        raise UsageError(f"--model: vocabulary {vocab_size} is smaller than a byte-level stand-in needs "
                         "(300).")
    return tok


def describe(tok: TextTokenizer) -> dict[str, object]:
    return {"tokenizer": tok.identity, "approximate": tok.approximate, "note": tok.note}
