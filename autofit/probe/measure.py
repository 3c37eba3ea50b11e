"""The measured run: one configuration trained for warm-up and timed steps through Trainer."""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from typing import Any

from .. import recipe
from ..models import ModelSource
from ..result import Outcome, ProbeResult
from ..spec import TrialConfig
from .build import RandomTokens, build_model, decoder_layers, expected_checkpointed, weights_path
from .child_io import write_json_atomic
from .errors import Unsupported
from .judge import judge_limit
from .sampler import Memory
from .timing import make_callback


def run_probe(req: dict[str, Any], partial: dict[str, Any]) -> ProbeResult:
    """Run the probe a request describes. `partial` collects figures as they come, for failures."""
    cfg = TrialConfig.from_dict(req["config"])
    src = ModelSource.from_dict(req["model"])
    device = req["device"]
    limit = req.get("memory_limit_bytes")
    warmup, timed = int(req.get("warmup_steps", 2)), int(req.get("timed_steps", 5))
    probe_ga = min(cfg.gradient_accumulation_steps, int(req.get("max_probe_accumulation") or 10**9))
    os.environ.update(recipe.allocator_env(cfg))
    t_start = time.perf_counter()

    import torch

    mem = Memory(device, req.get("nvml_index"), limit if device == "cpu" else None)
    partial["mem"] = mem

    def runaway(now: int) -> None:
        res = ProbeResult(Outcome.OOM, cfg.to_dict(), peak_memory_bytes=now,
                          oom_shortfall_bytes=now - (limit or 0),
                          reason="autofit: memory limit exceeded: stopped far past the CPU limit")
        res = judge_limit(res, limit, float(req.get("headroom", 0.05)))
        res.device, res.model = req["device_label"], src.ref
        write_json_atomic(req["result_path"], res.to_dict())
        os._exit(0)

    mem.runaway = runaway
    if device == "cuda":
        if not torch.cuda.is_available():
            raise Unsupported("CUDA was asked for but torch sees no GPU")
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # create the context now, so it is measured as overhead
        if cfg.precision == "bf16" and not torch.cuda.is_bf16_supported():
            raise Unsupported(f"bf16 is not supported on {torch.cuda.get_device_name()}")
        if limit:
            # The cap covers the PyTorch allocator only: take off what lives outside it (the
            # CUDA context now; cuBLAS/NCCL handles are counted in the peak afterwards).
            total = torch.cuda.get_device_properties(0).total_memory
            outside = max(mem.added() - torch.cuda.memory_reserved(), 0)
            torch.cuda.set_per_process_memory_fraction(max(limit - outside, 1) / total)
            partial["outside_at_start"] = outside
        torch.cuda.reset_peak_memory_stats()
        sync = torch.cuda.synchronize
    else:
        if cfg.precision == "fp16":
            raise Unsupported("fp16 mixed precision needs a GPU (Trainer refuses it on the CPU)")
        mem.baseline = mem._raw()
        sync = lambda: None

    # Random weights for a quantized preset are saved once, before anything is measured.
    path = weights_path(cfg, src, device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    mem.start()
    torch.manual_seed(0)
    model = build_model(cfg, src, device, path)
    model.config.use_cache = False
    kbit = recipe.kbit_preparation(cfg)
    lora = recipe.lora_arguments(cfg)
    if kbit is not None:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, **kbit)
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**lora))
    partial["memory_after_load"] = mem.allocator_now()[1]
    mem.phase()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total_params = sum(p.numel() for p in model.parameters())
    n_layers = len(decoder_layers(model))

    from transformers import Trainer, TrainingArguments

    steps = warmup + timed
    data = RandomTokens(steps * probe_ga * cfg.micro_batch_size, cfg.max_length,
                        int(src.config.get("vocab_size", 32000)))
    cb = make_callback(mem, cfg, sync)
    partial["callback"] = cb
    hook = model.register_forward_hook(cb.forward_hook)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, logging_steps=1, disable_tqdm=True,
            **recipe.training_arguments(cfg, on_cpu=device == "cpu", max_steps=steps,
                                        gradient_accumulation_steps=probe_ga),
        )
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])
        cb.trainer = trainer
        trainer.train()
    hook.remove()
    sync()
    train_seconds = time.perf_counter() - t_start
    mem.stop()

    expected = expected_checkpointed(cfg, n_layers)
    if cb.checkpointed != expected:
        raise RuntimeError(
            f"autofit: checkpointing is on layers {cb.checkpointed}, but the config asks for {expected}"
        )

    # Speed: the timed optimizer steps, extended to the config's accumulation where the probe
    # ran fewer micro-steps (each extra micro-step costs the mean micro-step of its step:
    # the time from the step's start to its optimizer call over the micro-steps it ran).
    timed_steps = cb.steps[warmup:]
    tokens_per_step = cfg.effective_batch * cfg.max_length
    extra = cfg.gradient_accumulation_steps - probe_ga
    real = [s["seconds"] + extra * s["micro"] for s in timed_steps]
    tps = [tokens_per_step / t for t in real]
    micro_all = [s["micro"] for s in timed_steps]

    # Memory: the allocator's reserved peak plus what lives outside it (context, cuBLAS
    # workspaces, bitsandbytes paged memory), or NVML's sampled peak if that is higher.
    if device == "cuda":
        _, reserved_now = mem.allocator_now()
        used_now = mem.process_used()
        outside = max((used_now if used_now is not None else mem.added()) - reserved_now, 0)
        peak = max(cb.max_reserved + outside, mem.sampled_peak)
        retries = int(torch.cuda.memory_stats().get("num_alloc_retries", 0))
    else:
        outside, retries = 0, None
        peak = max(mem.sampled_peak, cb.max_reserved)
    growth = 0
    if len(timed_steps) >= 2:
        growth = max(0, timed_steps[-1]["reserved"] - timed_steps[0]["reserved"])

    res = ProbeResult(
        outcome=Outcome.FIT,
        config=cfg.to_dict(),
        tokens_per_s=statistics.median(tps),
        tokens_per_s_min=min(tps),
        tokens_per_s_max=max(tps),
        peak_memory_bytes=int(peak),
        max_memory_allocated=int(cb.max_allocated),
        max_memory_reserved=int(cb.max_reserved),
        memory_outside_allocator=int(outside),
        memory_after_load=int(partial["memory_after_load"]),
        phase_peaks={k: int(v) for k, v in cb.phase_peaks.items()},
        num_alloc_retries=retries,
        memory_growth_bytes=int(growth),
        step_times=[round(t, 5) for t in real],
        micro_step_s=statistics.median(micro_all) if micro_all else None,
        optimizer_step_s=statistics.median(s["optimizer"] for s in timed_steps),
        probe_accumulation=probe_ga,
        checkpointed_layers=cb.checkpointed,
        n_layers=n_layers,
        trainable_params=int(trainable),
        total_params=int(total_params),
        loss=cb.losses[-1] if cb.losses else None,
        train_seconds=train_seconds,
    )
    if growth > max(64 * 2**20, 0.01 * peak):
        res.reason = f"peak reserved memory grew by {growth} bytes over the timed steps"
    bad = sum(1 for x in cb.losses if not math.isfinite(x))
    if cb.losses and bad * 2 > len(cb.losses):
        res.outcome, res.reason = Outcome.UNSTABLE, f"non-finite loss on {bad} of {len(cb.losses)} micro-steps"
    elif cb.skipped_steps * 2 > steps:
        res.outcome, res.reason = Outcome.UNSTABLE, f"fp16 loss scaler skipped {cb.skipped_steps} of {steps} steps"
    return res
