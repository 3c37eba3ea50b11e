"""Which attention implementations honour sample boundaries for each strategy, found by running
the correctness check on a tiny model, never assumed. An unsupported pair carries its reason.

`boundary_support` builds a model from a config dict (the tiny-llama preset by default) once per
attention implementation and checks the first micro-batch of each strategy on a fixed synthetic
set of variable lengths. torch and transformers are imported inside (probe child and tests).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

from autofit.config.kernels import attention_problem
from autofit.config.models import PRESETS, ModelConfig
from autofit.data.batching import Batching, plan
from autofit.data.correctness import BoundaryCheck
from autofit.probe.child.boundaries import boundary_batch, check_batch
from autofit.probe.child.build import Model

CHECK_SAMPLES = 24
CHECK_MAX_LENGTH = 64
CHECK_MICRO_BATCH = 4


@dataclass(frozen=True)
class Support:
    strategy: Batching
    attn_implementation: str
    supported: bool
    reason: str = ""
    max_loss_diff: float | None = None


def check_lengths(seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(3, 40) for _ in range(CHECK_SAMPLES)]


def boundary_support(attns: Iterable[str], strategies: Iterable[Batching] = tuple(Batching),
                     config: ModelConfig | None = None, precision: str = "fp32",
                     device: str = "cpu") -> list[Support]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config or PRESETS["tiny-llama"])
    rng = random.Random(1)
    lengths = check_lengths()
    ids = [[rng.randrange(2, cfg["vocab_size"]) for _ in range(n)] for n in lengths]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    out: list[Support] = []
    for attn in attns:
        # a flash kernel that cannot run here is said as the probe says it; flex runs its forward
        # passes on the CPU too (only its backward needs a GPU), so it is checked, not assumed
        why = attention_problem(attn, device) if attn.startswith("flash_attention_") else None
        if why:
            out += [Support(s, attn, False, why) for s in strategies]
            continue
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=dtype,
                                                     attn_implementation=attn)
        out += [_one(model, s, attn, lengths, ids, precision) for s in strategies]
    return out


def _one(model: Model, strategy: Batching, attn: str, lengths: list[int], ids: list[list[int]],
         precision: str) -> Support:
    batch = boundary_batch(plan(strategy, lengths, CHECK_MAX_LENGTH, CHECK_MICRO_BATCH, seed=0).batches)
    try:
        res: BoundaryCheck = check_batch(model, strategy, batch, ids, 0, CHECK_MAX_LENGTH, precision)
    except Exception as e:  # noqa: BLE001 - any failure to run the pair is why it is unsupported
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        return Support(strategy, attn, False, f"{attn} with {strategy.value} failed to run: "
                       f"{type(e).__name__}: {first}")
    return Support(strategy, attn, res.ok, res.reason, res.max_loss_diff)
