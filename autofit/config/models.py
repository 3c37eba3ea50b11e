"""Model sources for `--model`: shape presets, a config.json, a local folder, a hub id.

This module reads configs as plain JSON and never imports torch: the search process
must not initialise CUDA. Building the model happens in the probe (`probe.py`).
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import socket
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from autofit.config.spec import ALL_LINEAR
from autofit.core import paths
from autofit.core.documents import JSONObject
from autofit.core.errors import UsageError

ModelConfig = dict[str, Any]
"""A transformers config.json as JSON: the probe hands it to transformers whole; autofit reads only the shape
fields it needs (`estimate.memory.Shape.from_config`, `ModelSource.positions`)."""

_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
          "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": False}

# Architecture presets: config only, random weights. A random 7B has the memory and speed of
# the trained one, which is all a probe measures. Numbers from each family's published config.
PRESETS: dict[str, ModelConfig] = {
    "llama2-7b": {**_LLAMA, "hidden_size": 4096, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 32,
                  "intermediate_size": 11008, "vocab_size": 32000,
                  "max_position_embeddings": 4096, "rope_theta": 10000.0},
    "llama3-8b": {**_LLAMA, "hidden_size": 4096, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8,
                  "intermediate_size": 14336, "vocab_size": 128256,
                  "max_position_embeddings": 8192, "rope_theta": 500000.0},
    "llama3.2-3b": {**_LLAMA, "hidden_size": 3072, "num_hidden_layers": 28,
                    "num_attention_heads": 24, "num_key_value_heads": 8,
                    "intermediate_size": 8192, "vocab_size": 128256, "tie_word_embeddings": True,
                    "max_position_embeddings": 131072, "rope_theta": 500000.0},
    "mistral-7b": {"model_type": "mistral", "architectures": ["MistralForCausalLM"],
                   "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                   "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32768,
                   "max_position_embeddings": 32768, "rope_theta": 1000000.0,
                   "sliding_window": None},
    "qwen2.5-7b": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                   "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                   "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
                   "max_position_embeddings": 32768, "rope_theta": 1000000.0,
                   "use_sliding_window": False},
    # A few MB: tests and CPU demos. Same code paths as the 7B shapes.
    "tiny-llama": {**_LLAMA, "hidden_size": 128, "num_hidden_layers": 4,
                   "num_attention_heads": 4, "num_key_value_heads": 4,
                   "intermediate_size": 344, "vocab_size": 1024,
                   "max_position_embeddings": 8192, "rope_theta": 10000.0},
}

PRESET_HELP = {
    "llama2-7b": "Llama-2-7B shape (h 4096, 32 layers, vocab 32000)",
    "llama3-8b": "Llama-3-8B shape (GQA 8 KV heads, vocab 128256)",
    "llama3.2-3b": "Llama-3.2-3B shape (h 3072, 28 layers, GQA 8 KV heads, tied vocab 128256)",
    "mistral-7b": "Mistral-7B v0.3 shape (GQA, vocab 32768)",
    "qwen2.5-7b": "Qwen2.5-7B shape (h 3584, 28 layers, vocab 152064)",
    "tiny-llama": "4-layer Llama, ~1M parameters: tests and CPU demos",
}


@dataclass(frozen=True)
class ModelSource:
    """Where the weights come from, and the architecture config as plain JSON."""

    kind: str
    """preset | config | local | hub"""
    ref: str
    """Preset name, config.json path, folder, or hub id."""
    config: ModelConfig = field(default_factory=dict)

    @property
    def random_weights(self) -> bool:
        return self.kind in ("preset", "config")

    @property
    def name(self) -> str:
        """A short name for run folders."""
        base = Path(self.ref).name if self.kind in ("local", "config") else self.ref
        if self.kind == "config":
            base = Path(self.ref).parent.name or "config"
        return "".join(c if c.isalnum() or c in "-_." else "-" for c in base.replace("/", "--"))

    @property
    def positions(self) -> int | None:
        """The longest sequence the architecture takes (max_position_embeddings; None where the config
        does not say, or stretches it with rope_scaling)."""
        limit = self.config.get("max_position_embeddings")
        if not isinstance(limit, int) or self.config.get("rope_scaling"):
            return None
        return limit

    def check_lengths(self, lengths: list[int], flag: str) -> None:
        """A max_length longer than the model's positions is the user's mistake, said before anything runs."""
        limit = self.positions
        longest = max(lengths, default=0)
        if limit is not None and longest > limit:
            how = f" with --max-length (for one, --max-length {limit})" if flag.startswith("--space") else ""
            raise UsageError(f"{flag}: max_length {longest} is longer than {self.ref}'s {limit} positions "
                             f"(max_position_embeddings in its config); give at most {limit}{how}.")

    def check_targets(self, targets: list[str], flag: str) -> None:
        """lora_targets naming no module of this architecture are the user's mistake, said before anything runs
        (each probe would crash on it). A preset's names are PRESET_MODULES (no model built); a config with
        remote code is the probe's to build."""
        named = [t for t in dict.fromkeys(targets) if t != ALL_LINEAR]
        if "auto_map" in self.config or not named:
            return
        modules, linear = ((PRESET_MODULES, list(PRESET_LINEAR)) if self.kind == "preset"
                           else module_names(self.config))
        missing = sorted({n for t in named for n in t.split(",") if n not in modules})
        if missing:
            adapt = ",".join(n for n in linear if n != "lm_head")
            raise UsageError(f"{flag}: {self.ref} ({self.config.get('model_type')}) has no module "
                             f"{', '.join(missing)} for lora_targets to adapt; its linear layers are "
                             f"{', '.join(linear)}. "
                             f"Give a --space file with lora_targets: {adapt} (or all-linear); a probe takes "
                             f"--set lora_targets={adapt}.")

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "ref": self.ref, "config": self.config}

    @classmethod
    def from_dict(cls, d: JSONObject) -> ModelSource:
        return cls(kind=d["kind"], ref=d["ref"], config=dict(d.get("config") or {}))


PRESET_LINEAR = ("down_proj", "gate_proj", "k_proj", "lm_head", "o_proj", "q_proj", "up_proj", "v_proj")
PRESET_MODULES = frozenset({*PRESET_LINEAR, "act_fn", "embed_tokens", "input_layernorm", "layers", "mlp", "model",
                            "norm", "post_attention_layernorm", "rotary_emb", "self_attn"})
"""The module names of every preset (Llama-shaped, Mistral's and Qwen2's alike) and of its linear layers, as
`module_names` reads them (the layers' indices aside); a test builds each preset to hold them to it."""


def module_names(config: ModelConfig) -> tuple[frozenset[str], list[str]]:
    """The last names of an architecture's modules, and of its linear layers (GPT-2's Conv1D counted: peft adapts
    it), from the model built on the meta device (no memory, no weights)."""
    # Deferred: torch and the model classes take seconds to import, needed for a model that is not a preset.
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    return names_of(model)


def names_of(model: Any) -> tuple[frozenset[str], list[str]]:
    """A built model's module names (the last part of each) and its linear layers' (GPT-2's Conv1D counted)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    last = [(name.rsplit(".", 1)[-1], m) for name, m in model.named_modules() if name]
    return (frozenset(n for n, _ in last),
            sorted({n for n, m in last if isinstance(m, (torch.nn.Linear, Conv1D))}))


def _read_json(path: Path, flag: str) -> ModelConfig:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{flag}: cannot read {path} as a model config.json ({e}).") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise UsageError(
            f"{flag}: {path} is not a transformers config.json (it has no 'model_type')."
        )
    _check_model_type(str(data["model_type"]), path, flag, remote_code="auto_map" in data)
    if "auto_map" not in data:
        aliases = _check_fields(data, path, flag)
        # GPT-2's n_embd, n_layer, n_positions: the shape and the positions are read by transformers' names
        data = {**{name: data[key] for name, key in aliases.items() if name not in data and key in data}, **data}
    return data


def _check_fields(data: ModelConfig, path: Path, flag: str) -> dict[str, str]:
    """Build the config the way the probe will, so a mistyped field is a usage error now
    rather than a crash in every probe; the config class's `attribute_map` (transformers' field names, each
    to the name this architecture stores it under)."""
    empty = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads")
             if isinstance(data.get(k), int) and data[k] < 1]
    if empty:
        raise UsageError(f"{flag}: {path} gives {', '.join(f'{k}={data[k]}' for k in empty)}; a model to "
                         "fine-tune needs at least one of each. Fix the config.json, or use a preset "
                         f"({', '.join(PRESETS)}).")
    # Deferred: the config classes import torch (about two seconds), needed only for a config from a file.
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    # its notes on a config (a token id it would drop) are the probe's to log
    hf_logging.set_verbosity(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            built = AutoConfig.for_model(**data)
    except (StrictDataclassError, TypeError, ValueError, KeyError, AttributeError, ArithmeticError) as e:
        # transformers' configs are strict dataclasses: the validation error's text names the field (a
        # ZeroDivisionError: a head count of 0)
        reason = " ".join(str(e).split()) or type(e).__name__
        raise UsageError(f"{flag}: transformers cannot build a config from {path}: {reason}. "
                         "Fix that field in the config.json, or use a preset "
                         f"({', '.join(PRESETS)}).") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    aliases = getattr(type(built), "attribute_map", None)
    return {str(k): str(v) for k, v in aliases.items()} if isinstance(aliases, dict) else {}


def known_model_types() -> frozenset[str] | None:
    """The `model_type`s the installed transformers knows (None where it cannot be read)."""
    # Deferred: importing transformers takes about a second, needed only for a config from a file.
    # auto_mappings is its generated table, importable without torch (configuration_auto imports torch).
    try:
        from transformers.models.auto.auto_mappings import CONFIG_MAPPING_NAMES
    except ImportError:
        return None
    return frozenset(CONFIG_MAPPING_NAMES)


def causal_model_types() -> frozenset[str] | None:
    """The `model_type`s AutoModelForCausalLM builds (None where it cannot be read). Imports torch: only for a
    config from a file, which the probe builds the same way."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return None
    return frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _check_model_type(model_type: str, path: Path, flag: str, remote_code: bool) -> None:
    known = known_model_types()
    if remote_code or known is None:
        return
    if model_type in known:
        causal = causal_model_types()
        if causal is None or model_type in causal:
            return
        raise UsageError(f"{flag}: {path} is a {model_type!r} model, which transformers does not build as a causal "
                         "language model (AutoModelForCausalLM): autofit fine-tunes causal LMs. Give a decoder "
                         f"model's config (llama, mistral, qwen2, ...) or a preset ({', '.join(PRESETS)}).")
    close = difflib.get_close_matches(model_type, sorted(known), n=3)
    hint = f" (close: {', '.join(close)})" if close else ""
    raise UsageError(f"{flag}: {path} has model_type {model_type!r}, which the installed transformers does "
                     f"not know{hint}; fix the config.json or use a preset ({', '.join(PRESETS)}).")


def _looks_like_path(text: str) -> bool:
    return text.startswith((".", "/", "~")) or os.sep in text.rstrip(os.sep) and text.count("/") > 1


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf")
"""Files that hold a saved model's weights (shards and their index files included)."""


def resolve_model(text: str, flag: str = "--model", weights: bool = True) -> ModelSource:
    """Turn what the user typed into a ModelSource, or raise a UsageError that says what to do.
    `weights`: a local folder must hold them (training does; `autofit data` needs only the tokenizer)."""
    if text in PRESETS:
        return ModelSource("preset", text, dict(PRESETS[text]))
    path = Path(text).expanduser()
    # a FIFO or a device (a read that may never end), a symlink loop, a name too long: said before any read
    paths.source(path, flag, "Give a model folder, a config.json, a hub id or a preset "
                             f"({', '.join(PRESETS)}).")
    if path.is_dir():
        cfg = path / "config.json"
        if not cfg.is_file():
            raise UsageError(
                f"{flag}: folder {text} has no config.json; give a folder saved with "
                "save_pretrained, a config.json, a hub id, or a preset "
                f"({', '.join(PRESETS)})."
            )
        config = _read_json(cfg, flag)  # a damaged config.json is said first, not after a hint to give it
        if weights and not any(f.suffix in WEIGHT_SUFFIXES for f in path.iterdir() if f.is_file()):
            raise UsageError(
                f"{flag}: folder {text} has a config.json but no weights (no .safetensors or .bin file); "
                f"give {cfg} to measure the architecture with random weights (the same memory and speed), or "
                "the folder the weights were saved to."
            )
        return ModelSource("local", str(path.resolve()), config)
    if path.is_file():
        return ModelSource("config", str(path.resolve()), _read_json(path, flag))
    if _looks_like_path(text) or text.endswith(".json"):
        raise UsageError(
            f"{flag}: no such file or folder: {text}. Give an existing model folder, a "
            f"config.json, a hub id, or a preset ({', '.join(PRESETS)})."
        )
    if text.count("/") == 1 and all(text.split("/")):
        return ModelSource("hub", text, _hub_config(text, flag))
    raise UsageError(
        f"{flag}: {text!r} is not a preset, a folder, a config.json or a hub id (owner/name). "
        f"Presets: {', '.join(PRESETS)}; `autofit probe --help` describes them."
    )


def _hub_config(repo_id: str, flag: str) -> ModelConfig:
    """config.json of a hub model: from the local cache, or downloaded when online."""
    # deferred: huggingface_hub takes a second to import and only a hub id needs it
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    cached = try_to_load_from_cache(repo_id, "config.json")
    if isinstance(cached, str):  # no network needed (and none asked: an offline machine answers at once)
        return _read_json(Path(cached), flag)
    advice = (f"Download it once with `hf download {repo_id}` or give a local folder or a preset "
              f"({', '.join(PRESETS)}).")
    host = urlparse(constants.ENDPOINT).hostname or constants.ENDPOINT
    try:  # a host that does not resolve fails now, not after huggingface_hub's retries (~25 s)
        socket.getaddrinfo(host, 443)
    except OSError as e:
        raise UsageError(f"{flag}: hub model {repo_id!r} is not in the local cache, and {host} cannot be "
                         f"reached from here ({e.strerror or e}). {advice}") from None
    try:
        path = hf_hub_download(repo_id, "config.json")
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"{flag}: hub model {repo_id!r} is not in the local cache and could not be "
                         f"downloaded ({first}). {advice}") from None
    return _read_json(Path(path), flag)

