"""The argument names of the installed libraries that a recipe writes (TrainingArguments, LoraConfig,
BitsAndBytesConfig, prepare_model_for_kbit_training, SFTConfig), so an export fails when a library
renamed one, not the training run an hour later.

Reading them imports transformers, peft and TRL (seconds, most of an export's time), so they are
cached by the libraries' installed versions (`envinfo.cache_dir()/fields-<versions>.json`): a new
version of any of them is read afresh. A cache that cannot be written is only slower.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import re
from collections.abc import Callable
from importlib import util
from pathlib import Path

from autofit.core.envinfo import cache_dir, package_versions
from autofit.core.files import write_json
from autofit.export.common import quiet_bitsandbytes

LIBRARIES = ("transformers", "peft", "trl", "accelerate")
"""Their versions key the cache (accelerate: TrainingArguments' fields depend on it too)."""


READ = ("TrainingArguments", "fsdp_config", "BitsAndBytesConfig", "LoraConfig",
        "prepare_model_for_kbit_training")
"""What `installed_fields` always holds (SFTConfig too where TRL is installed)."""


def versions() -> dict[str, str]:
    installed = package_versions()
    return {lib: installed[lib] for lib in LIBRARIES}


def trl_installed() -> bool:
    return util.find_spec("trl") is not None


def names_of(obj: Callable[..., object]) -> list[str]:
    """The keyword arguments a class or function takes: a class's constructor parameters with its dataclass
    fields (transformers 5.25 made BitsAndBytesConfig's base a dataclass of one field, `quant_method`, while
    its own __init__ takes load_in_4bit and the rest), or a callable's parameters."""
    names = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
    target = obj.__init__ if inspect.isclass(obj) else obj
    skip = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    names |= {n for n, p in inspect.signature(target).parameters.items() if p.kind not in skip
              and n != "self"}
    return sorted(names)


def documented_keys(doc: str, argument: str) -> list[str]:
    """The keys a dict-valued argument documents: the `- name (`type`...)` items under `argument (` in a
    docstring (TrainingArguments' fsdp_config is read with .get: an unknown key would be silently ignored)."""
    lines = doc.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.strip().startswith(f"{argument} (")), None)
    if start is None:
        return []
    indent = len(lines[start]) - len(lines[start].lstrip())
    keys = []
    for ln in lines[start + 1:]:
        if ln.strip() and len(ln) - len(ln.lstrip()) <= indent:
            break
        m = re.match(r"\s+- (\w+) \(`", ln)
        if m:
            keys.append(m.group(1))
    return sorted(keys)


def _read_installed() -> dict[str, list[str]]:
    quiet_bitsandbytes()
    # Deferred: transformers and peft import torch (seconds); only a cache miss needs them.
    import peft
    import transformers

    out = {"TrainingArguments": names_of(transformers.TrainingArguments),
           "fsdp_config": documented_keys(transformers.TrainingArguments.__doc__ or "", "fsdp_config"),
           "BitsAndBytesConfig": names_of(transformers.BitsAndBytesConfig),
           "LoraConfig": names_of(peft.LoraConfig),
           "prepare_model_for_kbit_training": names_of(peft.prepare_model_for_kbit_training)}
    if trl_installed():
        from trl.trainer.dpo_config import DPOConfig
        from trl.trainer.sft_config import SFTConfig

        out["SFTConfig"] = names_of(SFTConfig)
        out["DPOConfig"] = names_of(DPOConfig)
    return out


READER = 3
"""How the names are read (names_of); a cache written by another reader is not used."""


def _cache_file(v: dict[str, str]) -> Path:
    digest = hashlib.sha1(json.dumps({**v, "reader": READER}, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"fields-{digest}.json"


def installed_fields() -> dict[str, set[str]]:
    """Argument names by class or function, for the installed versions (cached)."""
    v = versions()
    path = _cache_file(v)
    try:
        doc = json.loads(path.read_text())
        if doc.get("versions") == v and set(READ) <= set(doc["fields"]):  # a cache of fewer names: read again
            return {k: set(n) for k, n in doc["fields"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    fields = _read_installed()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # whole or not at all: a full disk leaves no scrap
        write_json(path, {"versions": v, "fields": fields})
    except OSError:
        pass  # not cached: the next export reads them again
    return {k: set(n) for k, n in fields.items()}
