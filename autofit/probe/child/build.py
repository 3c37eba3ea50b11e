"""The model a probe trains: weights, dtype, quantization, and the random token data."""

from __future__ import annotations

import json
import os
import tempfile
from typing import TYPE_CHECKING, Any

from autofit.config import recipe
from autofit.config.models import ModelSource
from autofit.config.spec import TrialConfig
from autofit.core.envinfo import cache_dir
from autofit.data.collate import Batch

if TYPE_CHECKING:
    import torch
    from transformers.modeling_layers import GradientCheckpointingLayer

Model = Any
"""A model as transformers builds it (with LoRA, peft's PeftModel around it): the child side reaches it only
through the libraries' own calls (forward, `modules()`, its `config`), so its type is theirs, not
autofit's."""


def _cache_dir() -> str:
    return str(cache_dir())


def _random_weights_folder(src: ModelSource, dtype: torch.dtype, device: str) -> str:
    """A preset saved once with random weights, so that a quantized load has weights to quantize.

    Built where it fits whole: on the GPU when the device has the unquantized model's bytes free (fast),
    else in host memory. Never under the probe's memory limit: a 4-bit probe on a 12 GiB card must not
    first hold the 13 GiB of 16-bit weights it quantizes (`prepare_device` calls this before the cap)."""
    import hashlib

    from transformers import AutoConfig, AutoModelForCausalLM

    digest = hashlib.sha1(json.dumps(src.config, sort_keys=True).encode()).hexdigest()[:10]
    folder = os.path.join(_cache_dir(), "weights", f"{src.name}-{digest}-{str(dtype).split('.')[-1]}")
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    cfg = AutoConfig.for_model(**src.config)
    import torch

    with torch.device("meta"):
        size = sum(p.numel() * p.element_size()
                   for p in AutoModelForCausalLM.from_config(cfg, dtype=dtype).parameters())
    where = "cuda" if device == "cuda" and torch.cuda.mem_get_info()[0] > 1.25 * size else "cpu"
    with torch.device(where):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(folder))
    model.save_pretrained(tmp)
    del model
    import gc

    gc.collect()  # nothing of the 16-bit model may stay reserved when the probe's cap is set
    try:
        os.rename(tmp, folder)
    except OSError:  # another probe saved it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    if where == "cuda":
        torch.cuda.empty_cache()
    return folder


def weights_path(cfg: TrialConfig, src: ModelSource, device: str) -> str:
    """Where from_pretrained reads weights: the source, or saved random weights for a quantized preset."""
    if cfg.quantization == "none" or not src.random_weights:
        return src.ref
    import torch

    return _random_weights_folder(src, getattr(torch, recipe.weights_dtype(cfg)), device)


def build_model(cfg: TrialConfig, src: ModelSource, device: str, path: str) -> Model:
    """The base model, on `device`, in the config's dtype and quantization."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    dtype = getattr(torch, recipe.weights_dtype(cfg))
    quant = recipe.quantization_arguments(cfg)
    if quant is not None:
        quant = dict(quant)
        if "bnb_4bit_compute_dtype" in quant:
            quant["bnb_4bit_compute_dtype"] = getattr(torch, quant["bnb_4bit_compute_dtype"])
        return AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=cfg.attn_implementation,
            quantization_config=BitsAndBytesConfig(**quant), device_map={"": _device_index(device)},
        )
    if src.random_weights:
        config = AutoConfig.for_model(**src.config)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation=cfg.attn_implementation
            )
    return AutoModelForCausalLM.from_pretrained(
        src.ref, dtype=dtype, attn_implementation=cfg.attn_implementation,
        device_map={"": _device_index(device)},
    )


def _device_index(device: str) -> int | str:
    """Where from_pretrained puts the weights: this rank's GPU (prepare_device set it current), or the CPU."""
    import torch

    return torch.cuda.current_device() if device == "cuda" else "cpu"


def decoder_layers(model: Model) -> list[GradientCheckpointingLayer]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def checkpointed_layers(model: Model) -> list[int]:
    """Decoder layers that recompute in backward: transformers' flag, or wrapped by FSDP's own activation
    checkpointing (engine=fsdp2: a CheckpointWrapper around the layer)."""
    wrapped = {id(m._checkpoint_wrapped_module) for m in model.modules()
               if hasattr(m, "_checkpoint_wrapped_module")}
    return [i for i, m in enumerate(decoder_layers(model))
            if getattr(m, "gradient_checkpointing", False) or id(m) in wrapped]


def expected_checkpointed(cfg: TrialConfig, n_layers: int) -> list[int]:
    every = cfg.checkpoint_every
    return [i for i in range(n_layers) if every and i % every == 0]


class RandomTokens:
    """`n` sequences of `length` random token ids: every sequence at max_length, no padding."""

    def __init__(self, n: int, length: int, vocab: int, seed: int = 0) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Batch:
        import torch

        ids = self.ids[i]
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
