"""The Python recipes of a run searched with `--dataset`: the measured batching strategy, its collator and
sampler in the script, samples truncated to MAX_LENGTH (no `packed_blocks` wrapping).

Text, as with script_parts: the recipe runs without autofit. What it reproduces of the probe:
- the tokenizer: the model's own (chat template where it has one), or for a shape preset the same
  stand-in (a byte-level BPE trained with `tokenizers` on the dataset to the preset's vocabulary);
- pad_max / pad_longest: rows padded to MAX_LENGTH / to the longest of the micro-batch, shuffled;
  group_by_length: Trainer's `train_sampling_strategy="group_by_length"`;
- padding_free: a seeded shuffle cut into groups of MICRO_BATCH_SIZE samples, each group one row through
  transformers' `DataCollatorWithFlattening`;
- packed: best-fit-decreasing bins of MAX_LENGTH, MICRO_BATCH_SIZE rows a micro-batch, positions
  restarting per sample and no attention mask (the boundaries are kept), at the accumulation the probe's
  plan gave (`ExportRun.accumulation`: rows hold however many samples fit, so the global batch of samples
  takes fewer of them than ceil(global_batch / micro_batch_size)).
The throughput line counts trained tokens (label-bearing, non-pad) as the probe did.
"""

from __future__ import annotations

import inspect

from autofit.data import DatasetRef, reader
from autofit.export.common import one_line

DATA_SETTINGS = '''
# The data the search measured on, and how it was batched.
BATCHING = {batching!r}
MICRO_BATCH_SIZE = {micro_batch_size}
TEXT_FIELD = {text_field!r}
MESSAGES_FIELD = {messages_field!r}
TEXT_MODE = {text_mode!r}
MEASURED_DATASET = {dataset_path!r}
DATASET_HELP = {dataset_help!r}
SEED = 0
'''


def reader_source() -> str:
    """autofit/data/reader.py without its module docstring, to be copied into a recipe."""
    source = inspect.getsource(reader)
    body = source[source.index('"""', 3) + 3:].strip("\n")
    return ("\n\n# ---- autofit's dataset reader (autofit/data/reader.py), copied so that the recipe reads "
            "the data as the search did\n\n" + body + "\n\n# ---- end of the reader")


DATA_HELPERS = reader_source() + '''


def read_samples(path):
    """The samples of --dataset as dicts ("text", or "messages" as {role, content} dicts), read exactly as
    the search read them: `read_dataset` above is autofit's own reader, copied here."""
    try:
        source = read_dataset(path, TEXT_FIELD, MESSAGES_FIELD, TEXT_MODE)
    except NoUsableRows as e:
        reasons = sorted({reason for reason, _ in e.bad})
        chats = f" or {MESSAGES_FIELD!r} chats" if MESSAGES_FIELD else ""
        fail(f"--dataset: {e} ({len(e.bad)} {'row' if len(e.bad) == 1 else 'rows'} skipped: {'; '.join(reasons)}); the search read "
             f"{TEXT_FIELD!r} text{chats}")
    except DatasetError as e:
        fail(f"--dataset: {e}")
    if source.bad:
        reason, line = source.bad[0]
        rows = "row" if len(source.bad) == 1 else "rows"
        print(f"note: {len(source.bad)} {rows} of {path} skipped, as in the search (the first: line {line}, "
              f"{reason})", file=sys.stderr)
    return source.samples


def plain_chat(messages):
    return "".join(f"<|{m['role']}|>\\n{m['content']}\\n" for m in messages)


def encoder(model_ref, samples):
    """(encode(list of samples) -> ids, pad id, the tokenizer as transformers wraps it): the model's own, or
    the preset's stand-in BPE."""
    if model_ref is None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        texts = [s.get("text") or plain_chat(s["messages"]) for s in samples]
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=max(MODEL_CONFIG.get("vocab_size", 32000), 300),
                                      special_tokens=["<pad>", "<eos>"], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer=trainer)
        print("note: stand-in tokenizer (a BPE trained on the dataset, as autofit measured a shape preset); "
              "use --model with real weights", file=sys.stderr)
        from transformers import PreTrainedTokenizerFast

        wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
        return (lambda ss: [e.ids for e in tok.encode_batch([s.get("text") or plain_chat(s["messages"])
                                                             for s in ss])]), tok.token_to_id("<pad>"), wrapped
    tok = tokenizer_of(model_ref)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)

    def render(s):
        if "text" in s:
            return s["text"]
        if not tok.chat_template:
            return plain_chat(s["messages"])
        try:
            return tok.apply_chat_template(s["messages"], tokenize=False)
        except Exception as e:  # the template's raise_exception (jinja2's TemplateError), as the search reported
            fail(f"--dataset: the model's chat template rejects the chat at line {s.get('line')}: {e}")
    return (lambda ss: [list(x) for x in tok([render(s) for s in ss])["input_ids"]]), pad, tok


def best_fit_decreasing(lengths, capacity):
    """TRL's `bfd` binning: longest first, each into the fullest bin it fits (first opened among equals)."""
    bins, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fits = [b for b in range(len(bins)) if room[b] >= lengths[i]]
        b = min(fits, key=lambda b: (room[b], b)) if fits else None
        if b is None:
            bins.append([])
            room.append(capacity)
            b = len(bins) - 1
        bins[b].append(i)
        room[b] -= lengths[i]
    return bins


def flattened_rows(ids):
    """padding_free as the probe planned it: a seeded shuffle cut into groups of MICRO_BATCH_SIZE samples, each
    group flattened into one row (transformers' DataCollatorWithFlattening)."""
    import random

    order = list(range(len(ids)))
    random.Random(SEED).shuffle(order)
    return [order[i:i + MICRO_BATCH_SIZE] for i in range(0, len(order), MICRO_BATCH_SIZE)]


def packed_row(group, ids, pad):
    row, pos, labels = [], [], []
    for i in group:
        row += ids[i]
        pos += list(range(len(ids[i])))
        labels += [-100] + ids[i][1:]
    tail = MAX_LENGTH - len(row)
    return {"input_ids": row + [pad] * tail, "position_ids": pos + list(range(tail)), "labels": labels + [-100] * tail}


def batches(ids, pad):
    """(train dataset, collator, TrainingArguments changes) for BATCHING."""
    from transformers import DataCollatorWithFlattening

    if BATCHING == "padding_free":
        flatten = DataCollatorWithFlattening(return_tensors="pt")
        data = [[{"input_ids": ids[i]} for i in g] for g in flattened_rows(ids)]
        return data, lambda features: flatten(features[0]), {"per_device_train_batch_size": 1,
                                                            "train_sampling_strategy": "sequential"}
    if BATCHING == "packed":
        data = [packed_row(g, ids, pad) for g in best_fit_decreasing([len(x) for x in ids], MAX_LENGTH)]
        return data, lambda fs: {k: torch.tensor([f[k] for f in fs]) for k in fs[0]}, {}

    def pad_rows(features):
        width = MAX_LENGTH if BATCHING == "pad_max" else max(len(f["input_ids"]) for f in features)
        rows = [f["input_ids"] + [pad] * (width - len(f["input_ids"])) for f in features]
        mask = [[1] * len(f["input_ids"]) + [0] * (width - len(f["input_ids"])) for f in features]
        labels = [[t if m else -100 for t, m in zip(r, mm)] for r, mm in zip(rows, mask)]
        return {"input_ids": torch.tensor(rows), "attention_mask": torch.tensor(mask), "labels": torch.tensor(labels)}
    sampling = "group_by_length" if BATCHING == "group_by_length" else "random"
    return [{"input_ids": x} for x in ids], pad_rows, {"train_sampling_strategy": sampling}


def prepare_data():
    """Arguments, the dataset's token ids (truncated to MAX_LENGTH), and the adapted model."""
    a = arguments()
    samples = read_samples(a.dataset)  # a bad file fails here, before anything is loaded
    load_torch()
    check_kernels()
    emulate(a.emulate_memory_gib)
    encode, pad, tokenizer = encoder(a.model, samples)
    ids = truncated(a.dataset, encode(samples))
    return a, ids, pad, tokenizer, adapt(build_model(a.model))


def truncated(path, ids):
    """Each sample cut to MAX_LENGTH, as the search measured it (saying how much is cut); a dataset whose every
    sample is one token has nothing to train on (each token is learnt from the ones before it)."""
    if max(len(x) for x in ids) < 2:
        fail(f"--dataset: {path}: no sample has a token to train on (all {len(ids)} are one token long or "
             "empty; each token is learnt from the ones before it); give longer samples")
    long = [len(x) for x in ids if len(x) > MAX_LENGTH]
    if long:
        cut = sum(n - MAX_LENGTH for n in long) / sum(len(x) for x in ids)
        print(f"note: samples longer than MAX_LENGTH ({MAX_LENGTH} tokens): {len(long)} of {len(ids)}, cut to it as "
              f"in the search; {cut:.1%} of the tokens are not trained", file=sys.stderr)
    return [x[:MAX_LENGTH] for x in ids]


def data_below_one_step(ids, pad, per_device, accumulation, world_size):
    """`below_one_step` on the rows BATCHING makes of the data (TRL packs into the same bins)."""
    rows, _, changes = batches(ids, pad)
    per_device = changes.get("per_device_train_batch_size", per_device)
    return below_one_step(len(rows), per_device * accumulation * world_size,
                          "sample" if BATCHING in ("pad_max", "pad_longest", "group_by_length") else "row")
'''  # noqa: E501  a recipe's own code, written as it is

HF_DATA_MAIN = '''

def main():
    a, ids, pad, _, model = prepare_data()  # first: a bad argument or dataset is said before the imports
    from transformers import Trainer, TrainingArguments

    data, collator, changes = batches(ids, pad)
    args = TrainingArguments(output_dir=a.output_dir, **{**TRAINING_ARGS, **changes, "max_steps": a.max_steps})
    short = data_below_one_step(ids, pad, args.per_device_train_batch_size, args.gradient_accumulation_steps,
                                args.world_size)
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collator,
                      callbacks=[throughput_callback(token_counter(model), short)])
'''  # noqa: E501  a recipe's own code, written as it is


PACKED_DOC = """--dataset: JSONL with a "text" field per line, or a plain text file. The text is tokenized,
joined and cut into blocks of MAX_LENGTH tokens: every sequence is full, as in the probe that
measured this configuration (its speed and memory hold for exactly that)."""

DATA_DOC = """--dataset: the data the search measured on, or more in the same form: {fields}.
Each sample is tokenized and truncated to MAX_LENGTH, and batched as measured ({batching}); the
throughput line counts trained (label-bearing, non-pad) tokens, as the probe did."""

TEXT_MODE_WORDS = {"lines": "one sample a line", "paragraphs": "one sample a blank-line separated block",
                   "whole": "the whole file one sample",
                   "auto": "one sample a line, or a block where most blocks span several lines"}


def dataset_fields(dataset: DatasetRef) -> str:
    """What the recipe reads as samples, in the run's own field names and text mode."""
    mode = TEXT_MODE_WORDS.get(dataset.text_mode, TEXT_MODE_WORDS["auto"])
    chats = dataset.messages_field
    rows = f"'{dataset.text_field}' text" + (f" or '{chats}' chats" if chats else "")
    return f"rows with {rows} (JSONL, CSV, parquet, a save_to_disk folder), or plain text ({mode})"


def data_header(header: str, batching: str, dataset: DatasetRef) -> str:
    """The script's docstring says how this recipe batches (the packed-blocks paragraph replaced)."""
    assert PACKED_DOC in header  # script_parts.HEADER and this module move together
    fields = one_line(dataset_fields(dataset)).replace("\\", "\\\\").replace('"', '\\"')  # in the docstring
    return header.replace(PACKED_DOC, DATA_DOC.format(batching=batching, fields=fields))


TRL_DATA_MAIN = '''

def main():
    # Tokenized and truncated as the search measured; TRL then batches as TRL_BATCHING says.
    a, ids, pad, tokenizer, model = prepare_data()  # first: a bad argument or dataset is said before the imports
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    data = Dataset.from_dict({"input_ids": ids})
    config = SFTConfig(output_dir=a.output_dir, **{**TRAINING_ARGS, **TRL_BATCHING, "max_steps": a.max_steps},
                       dataset_text_field="text")
    short = data_below_one_step(ids, pad, config.per_device_train_batch_size, config.gradient_accumulation_steps,
                                config.world_size)
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                         callbacks=[throughput_callback(token_counter(model), short)])
'''  # noqa: E501  a recipe's own code, written as it is


def trl_batching(batching: str, micro_batch_size: int,
                 max_length: int) -> tuple[dict[str, object], list[str]]:
    """SFTConfig (TRL 1.16) settings for a strategy, and how they differ from what was measured."""
    if batching == "pad_max":
        return {"max_length": max_length, "packing": False, "padding_free": False,
                "pad_to_multiple_of": max_length}, []
    if batching in ("pad_longest", "group_by_length"):
        sampling = {"train_sampling_strategy": "group_by_length"} if batching == "group_by_length" else {}
        return {"max_length": max_length, "packing": False, "padding_free": False, **sampling}, []
    if batching == "padding_free":
        return ({"max_length": micro_batch_size * max_length, "packing": True, "packing_strategy": "bfd",
                 "per_device_train_batch_size": 1},
                [("padding_free as TRL bfd packing into one row of up to micro_batch_size x max_length "
                  "tokens: the probe flattened micro_batch_size samples a row in a seeded order, so a row "
                  "here holds more samples (best-fit-decreasing)")])
    return ({"max_length": max_length, "packing": True, "packing_strategy": "bfd"},
            [("packed as TRL lays bfd bins out: flattened into one row per micro-batch (the probe measured "
             "max_length rows)")])


def data_settings(batching: str, micro_batch_size: int, dataset: DatasetRef) -> str:
    return DATA_SETTINGS.format(batching=batching, micro_batch_size=micro_batch_size,
                                text_field=dataset.text_field, messages_field=dataset.messages_field,
                                text_mode=dataset.text_mode, dataset_path=dataset.path,
                                dataset_help=dataset_fields(dataset))
