"""What the tests of exported recipes share: the dataset they train on, a model folder as a user has one, and a
recipe read as text (the modules it imports, its TRAINING_ARGS literal)."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

from conftest import DATA_DIR

from autofit.config.models import PRESETS
from autofit.config.spec import TrialConfig
from runs import D1, write_run

DATA = DATA_DIR / "tiny.jsonl"
"""A few lines of text: enough rows for a recipe's three steps."""


BOS_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
                     "{% endfor %}")
"""A chat template that writes its own BOS token, as Llama's does."""


def save_tiny_model(folder: Path, data: Path = D1, bos: bool = False) -> Path:
    """tiny-llama's shape with random weights and a byte-level BPE trained on `data`: a model folder as a
    user has one (weights, config, tokenizer). `bos`: the tokenizer adds a BOS token to text (a post-processor,
    as Llama's) and has a chat template that writes its own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    texts = [json.loads(line)["text"] for line in data.read_text().splitlines() if line.strip()]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<eos>"] + (["<bos>"] if bos else [])
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=1000, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    extra = {}
    if bos:
        bpe.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[
            ("<bos>", bpe.token_to_id("<bos>"))])
        extra = {"bos_token": "<bos>", "chat_template": BOS_CHAT_TEMPLATE}
    PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="<eos>", **extra).save_pretrained(folder)
    config = AutoConfig.for_model(**{**PRESETS["tiny-llama"], "vocab_size": 1000})
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def imports_of(path: Path) -> set[str]:
    """The top-level modules a script imports, anywhere in it."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def training_args(script: str) -> dict[str, Any]:
    """TRAINING_ARGS of an exported Python recipe, read as the literal it is."""
    for node in ast.parse(script).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "TRAINING_ARGS":
            return ast.literal_eval(node.value)
    raise AssertionError("no TRAINING_ARGS in the recipe")


def distributed_run(tmp_path: Path, **settings: Any) -> Path:
    """A run folder whose winner spans several GPUs (a small valid config of tiny-llama)."""
    cfg = TrialConfig(max_length=128, micro_batch_size=2, global_batch=8, gpus=2, **settings)
    return write_run(tmp_path / "run", config=cfg.to_dict())
