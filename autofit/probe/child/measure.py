"""The measured run: one configuration trained for warm-up and timed steps through Trainer.

`run_probe` follows the protocol of docs/DESIGN.md ("The probe") step by step: the device
and its memory cap, the model as the recipe builds it, the steps through Trainer (warm-up,
then timed), checkpointing verified per layer, then the figures.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autofit.config import distributed, recipe
from autofit.config.models import names_of
from autofit.data.batching import Batching, step_shape
from autofit.data.collate import Batch
from autofit.probe.child import allocator, hostclock
from autofit.probe.child.batches import (
    RealBatches,
    boundary_verdict,
    check_boundaries,
    mismatch,
    real_batches,
)
from autofit.probe.child.build import (
    Model,
    RandomTokens,
    build_model,
    decoder_layers,
    expected_checkpointed,
    weights_path,
)
from autofit.probe.child.errors import Unsupported
from autofit.probe.child.gate import (
    check_architecture,
    check_support,
    forget_check_peaks,
    kernel_figures,
    mismatch_result,
    run_gate,
)
from autofit.probe.child.judge import judge_limit, noisy_reason
from autofit.probe.child.quiet import CONTROLS, enabled, freeze_built_objects, pin_to_gpu
from autofit.probe.child.sampler import Memory
from autofit.probe.child.state import ProbeState
from autofit.probe.child.timing import ProbeCallback, TimingPlan, make_callback, spread
from autofit.protocol.request import SPREAD_BOUND, ProbeRequest, write_json_atomic
from autofit.protocol.result import Outcome, ProbeResult

if TYPE_CHECKING:
    import torch
    from transformers import Trainer


@dataclass(frozen=True)
class Trained:
    """What the training steps left: the model's sizes and the time they took."""

    trainable: int
    total: int
    n_layers: int
    train_seconds: float
    optimizer: dict[str, object]
    """What Trainer really stepped: its class, bits and state dtypes (bitsandbytes keeps 32-bit state
    for tensors under its min_8bit_size, e.g. tiny-llama's LoRA matrices), paged or not."""
    bnb_modules: int
    """Modules of the trained model that are bitsandbytes layers (quantized linears)."""
    engine: dict[str, object]
    """What Trainer really ran where it matters: its distributed type and FSDP modules (a group, or an
    engine), the compiled regions (torch_compile)."""
    loss: float | None = None
    """The last step's loss as Trainer logged it: the mean over the step's tokens, whatever the accumulation
    (a micro-step's own loss is its share of the step where the model takes `num_items_in_batch`)."""


def run_probe(req: ProbeRequest, state: ProbeState, announce: Callable[[str], None]) -> ProbeResult:
    """Run the probe `req` describes; `state` collects figures as they come, for failures."""
    allocator.apply(req)  # the config's allocator and environment, before the device is touched
    check_support(req)  # kernels that cannot run here: unsupported before the device is touched
    state.mem = Memory(req.device, req.nvml_index, req.memory_limit_bytes if req.device == "cpu" else None)
    state.mem.runaway = lambda now: _stop_runaway(req, state, now)
    check_architecture(req)  # before the device: an unsupported architecture builds nothing
    sync = prepare_device(req, state)
    model = load_model(req, state)
    state.stage = "check"  # forward passes with activations and logits: not a load-only failure
    gate = run_gate(req, state, model)
    if gate is not None and not gate.ok:
        return mismatch_result(req, gate)
    batches = real_batches(req)  # None without --dataset: random tokens
    if batches is not None:  # the data decides a packed step's accumulation (one effective batch)
        req = dataclasses.replace(req, accumulation=batches.step.accumulation)
    check = None
    if batches is not None and req.boundaries:  # False: the study holds a passing verdict
        check = check_boundaries(model, batches, req.config.precision)
        if not check.ok:
            return mismatch(req, check)
        forget_check_peaks(req, state)
    state.stage = "setup"
    trained = train(req, state, model, sync, announce, batches)
    verify_checkpointing(req, state.callback, trained.n_layers)
    ran = allocator.verify(req)
    res = kernel_figures(figures(req, state, trained, batches), req, state, gate)
    res.extra.update(ran)
    if check is not None:
        res.extra.update(boundary_verdict(req, check))
    return res


def _stop_runaway(req: ProbeRequest, state: ProbeState, now: int) -> None:
    """From the sampling thread: the CPU probe is far past its limit; write the OOM and end here."""
    limit = req.memory_limit_bytes or 0
    res = ProbeResult(Outcome.OOM, req.config, peak_memory_bytes=now, oom_shortfall_bytes=now - limit,
                      oom_phase=state.phase, oom_in_use_bytes=now,
                      reason="autofit: memory limit exceeded: stopped far past the CPU limit")
    res = judge_limit(res, req.memory_limit_bytes, req.headroom)
    res.device, res.model = req.device_label, req.model.ref
    write_json_atomic(req.result_path, res.to_dict())
    os._exit(1 if "RANK" in os.environ else 0)  # a rank: torchrun stops the others now


def prepare_device(req: ProbeRequest, state: ProbeState) -> Callable[[], object]:
    """Check the device can run the config; on a GPU create the context and cap the allocator."""
    import torch  # the probe child's heavy import, after the standby's own

    cfg, mem = req.config, state.mem
    assert mem is not None
    if req.device != "cuda":
        if cfg.precision == "fp16":
            raise Unsupported("fp16 mixed precision needs a GPU (Trainer refuses it on the CPU)")
        state.weights = weights_path(cfg, req.model, req.device)
        mem.rebase()
        return lambda: None
    if not torch.cuda.is_available():
        raise Unsupported("CUDA was asked for but torch sees no GPU")
    state.pinned_cpus = pin_to_gpu(req.nvml_index)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # a rank of a group: its own GPU
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # create the context now, so it is measured as overhead
    if cfg.precision == "bf16" and not torch.cuda.is_bf16_supported():
        raise Unsupported(f"bf16 is not supported on {torch.cuda.get_device_name()}")
    state.weights = weights_path(cfg, req.model, req.device)  # before the cap: saving them is not the probe
    if req.memory_limit_bytes:
        # The cap covers the PyTorch allocator only: take off what lives outside it (the
        # CUDA context now; cuBLAS/NCCL handles are counted in the peak afterwards).
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        state.outside_at_start = max(mem.added() - torch.cuda.memory_reserved(), 0)
        torch.cuda.set_per_process_memory_fraction(
            max(req.memory_limit_bytes - state.outside_at_start, 1) / total)
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.synchronize


def load_model(req: ProbeRequest, state: ProbeState) -> Model:
    """The model as the recipe builds it (dtype, quantization, k-bit preparation, LoRA), measured."""
    start_loading(req, state)
    model = base_model(req, state)
    lora = recipe.lora_arguments(req.config)
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        check_lora_targets(model, lora["target_modules"])
        model = get_peft_model(model, LoraConfig(**lora))
    loaded(state)
    return model


def start_loading(req: ProbeRequest, state: ProbeState) -> None:
    """The load phase's measurement starts: CUDA's peak counters reset, the memory sampler running."""
    import torch

    assert state.mem is not None
    if req.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    state.mem.start()


def base_model(req: ProbeRequest, state: ProbeState) -> Model:
    """The base as the recipe builds it: dtype, quantization, no KV cache, k-bit preparation; the same random
    weights on every call (a DPO reference copy equals its policy)."""
    import torch

    cfg = req.config
    torch.manual_seed(0)
    model = build_model(cfg, req.model, req.device, state.weights or req.model.ref)
    model.config.use_cache = False
    kbit = recipe.kbit_preparation(cfg)
    if kbit is not None:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, **kbit)
    return model


def loaded(state: ProbeState) -> None:
    """The load phase ends: what it left allocated is kept, the sampler's next phase begins, and the built
    objects leave the garbage collector's scans."""
    assert state.mem is not None
    state.memory_after_load = state.mem.allocator_now()[1]
    state.mem.phase()
    freeze_built_objects()


def check_lora_targets(model: Model, targets: list[str] | str) -> None:
    """Every lora_targets name must name a module: peft drops a misspelt one silently when another
    matches, and the adapter would then train fewer layers than the config says (the parent refuses what it can
    see before a probe: `ModelSource.check_targets`; a config with remote code is known here only)."""
    if isinstance(targets, str):  # peft's own forms ("all-linear", a regex) are peft's to check
        return
    names, linear = names_of(model)
    missing = [t for t in targets if t not in names]
    if missing:
        raise ValueError(f"lora_targets: {', '.join(missing)} names no module of {type(model).__name__}; "
                         f"its linear layers are {', '.join(linear)} (all-linear adapts each but lm_head): "
                         f"--set lora_targets={','.join(n for n in linear if n != 'lm_head')} (probe) or "
                         "lora_targets in a --space file")


def train(req: ProbeRequest, state: ProbeState, model: Model, sync: Callable[[], object],
          announce: Callable[[str], None], batches: RealBatches | None = None) -> Trained:
    """Warm-up and timed optimizer steps through Trainer, on random tokens at max_length (or on the
    dataset's micro-batches, the heaviest first)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    cfg, ga = req.config, req.probe_accumulation
    assert state.mem is not None
    plan = TimingPlan(req.warmup_steps, req.timed_steps, req.extra_timed_steps,
                      req.config_accumulation - ga, announce)
    data: RandomTokens | list[Batch]
    if batches is None:
        data = RandomTokens(plan.most_steps * ga * cfg.micro_batch_size, cfg.max_length,
                            int(req.model.config.get("vocab_size", 32000)))
    else:
        data = batches.dataset()
    cb = state.callback = make_callback(state.mem, sync, plan)
    if not isinstance(cb, TrainerCallback):  # make_callback's class is one: Trainer takes it
        raise TypeError(f"autofit: the timing callback {type(cb).__name__} is not a TrainerCallback")
    if batches is not None:
        cb.step_cost = lambda step: batches.step_cost(step, ga)
    hook = model.register_forward_hook(cb.forward_hook)
    with tempfile.TemporaryDirectory() as out:
        kw = recipe.training_arguments(cfg, on_cpu=req.device == "cpu", max_steps=plan.most_steps,
                                       gradient_accumulation_steps=ga)
        kw.update(batches.trainer_arguments() if batches is not None else {})
        args = TrainingArguments(output_dir=out, logging_steps=1, disable_tqdm=True, **kw)
        if cfg.engine == "fsdp2" and req.device == "cpu":
            distributed.fsdp_on_cpu()
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb],
                          data_collator=batches.collator if batches is not None else None)
        cb.trainer = trainer
        trainer.train()
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # inside accelerate's wrapper
        engine = engine_figures(trainer) if distributed.launched(cfg) else {}
        if cfg.torch_compile:
            engine.update(compiled_figures(trainer.model_wrapped))
    cb.stop_timing()
    hook.remove()
    sync()
    state.mem.stop()
    return Trained(trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
                   total=sum(p.numel() for p in model.parameters()), n_layers=len(decoder_layers(model)),
                   train_seconds=time.perf_counter() - state.t_start,
                   optimizer=describe_optimizer(optimizer), engine=engine,
                   bnb_modules=sum(type(m).__module__.startswith("bitsandbytes") for m in model.modules()),
                   loss=logged_loss(trainer))


def logged_loss(trainer: Trainer) -> float | None:
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return float(logged[-1]) if logged else None


def engine_figures(trainer: Trainer) -> dict[str, object]:
    """What Trainer really ran: accelerate's distributed type and how many modules FSDP sharded."""
    wrapped = trainer.model_wrapped
    fsdp = sum(type(m).__name__.startswith("FSDP") for m in wrapped.modules())
    return {"distributed_type": str(getattr(trainer.accelerator.distributed_type, "value", "")),
            "wrapped_class": type(wrapped).__name__, "fsdp_modules": fsdp}


def compiled_figures(model: Model) -> dict[str, object]:
    """What torch.compile wrapped: regional compilation (`recipe.REGIONAL_COMPILATION`) compiles the
    decoder blocks and the other leaf children, never the top-level forward (where the loss runs)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return {"compiled_regions": sum(isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None)
                                    is not None for m in model.modules()),  # fsdp2 / zero: compiled in place
            "compiled_whole_model": isinstance(model, OptimizedModule)}


def describe_optimizer(opt: torch.optim.Optimizer | None) -> dict[str, object]:
    if opt is None:  # Trainer.train() made one: a Trainer that did not is not the probe's to describe
        raise RuntimeError("autofit: Trainer trained without an optimizer")
    dtypes = {str(v.dtype) for st in opt.state.values() for v in st.values() if hasattr(v, "dtype")}
    return {"optimizer_class": f"{type(opt).__module__}.{type(opt).__qualname__}",
            "optimizer_bits": getattr(getattr(opt, "args", None), "optim_bits", None),  # bitsandbytes only
            "optimizer_state_dtypes": sorted(dtypes),
            "optimizer_paged": bool(getattr(opt, "is_paged", False))}


def verify_checkpointing(req: ProbeRequest, cb: ProbeCallback | None, n_layers: int) -> None:
    """The layers the config asks to checkpoint are those that were, when training began and when it ended."""
    expected = expected_checkpointed(req.config, n_layers)
    checkpointed = cb.checkpointed if cb is not None else None
    if checkpointed != expected:
        raise RuntimeError(
            f"autofit: checkpointing is on layers {checkpointed}, but the config asks for {expected}"
        )
    at_end = cb.checkpointed_at_end if cb is not None else None
    if at_end is not None and at_end != expected:
        raise RuntimeError(
            f"autofit: checkpointing was on layers {expected} when training began and on {at_end} when it "
            "ended: the timed steps did not train the config"
        )


def peak_memory(req: ProbeRequest, state: ProbeState) -> tuple[int, int, int | None]:
    """(peak, memory outside the allocator, allocator retries).

    The allocator's reserved peak plus what lives outside it (context, cuBLAS workspaces,
    bitsandbytes paged memory), or NVML's sampled peak if that is higher.
    """
    mem, cb = state.mem, state.callback
    assert mem is not None and cb is not None
    if req.device != "cuda":
        return max(mem.sampled_peak, cb.max_reserved), 0, None
    import torch

    _, reserved_now = mem.allocator_now()
    used_now = mem.process_used()
    outside = max((used_now if used_now is not None else mem.added()) - reserved_now, 0)
    retries = int(torch.cuda.memory_stats().get("num_alloc_retries", 0))
    return max(cb.max_reserved + outside, mem.sampled_peak), outside, retries


def figures(req: ProbeRequest, state: ProbeState, trained: Trained,
            batches: RealBatches | None = None) -> ProbeResult:
    """The result of a probe that trained: speed over the last timed steps, memory, stability."""
    cfg, cb = req.config, state.callback
    assert cb is not None
    # Speed: each timed step extended to the config's accumulation where the probe ran fewer
    # micro-steps (each extra micro-step costs the mean micro-step of its step).
    real = cb.real_seconds()
    window = real[-req.timed_steps:]
    tps = [cfg.rank_batch * cfg.max_length / t for t in window]  # this rank's share (a group sums them)
    first = len(cb.steps) - len(window)
    if batches is not None:  # trained (label-bearing, non-pad) tokens of the data's mean micro-batch
        tps = batches.tokens_per_s(window, first, req.probe_accumulation, req.config_accumulation)
    timed = cb.timed_steps
    peak, outside, retries = peak_memory(req, state)
    growth = max(0, timed[-1]["reserved"] - timed[0]["reserved"]) if len(timed) >= 2 else 0
    res = ProbeResult(
        outcome=Outcome.FIT, config=cfg,
        tokens_per_s=statistics.median(tps), tokens_per_s_min=min(tps), tokens_per_s_max=max(tps),
        peak_memory_bytes=int(peak), max_memory_allocated=int(cb.max_allocated),
        max_memory_reserved=int(cb.max_reserved), memory_outside_allocator=int(outside),
        memory_after_load=state.memory_after_load,
        phase_peaks={k: int(v) for k, v in cb.phase_peaks.items()},
        num_alloc_retries=retries, memory_growth_bytes=int(growth),
        step_times=[round(t, 5) for t in real],
        micro_step_s=statistics.median(s["micro"] for s in timed) if timed else None,
        optimizer_step_s=statistics.median(s["optimizer"] for s in timed),
        probe_accumulation=req.probe_accumulation, checkpointed_layers=cb.checkpointed,
        n_layers=trained.n_layers, trainable_params=int(trained.trainable), total_params=int(trained.total),
        loss=trained.loss, train_seconds=trained.train_seconds,
        extra={**trained.optimizer, **trained.engine, "bnb_modules": trained.bnb_modules,
               "pinned_cpus": state.pinned_cpus, "noise_controls": [c for c in CONTROLS if enabled(c)],
               # beside step_times' timed steps: the host's share of a slow step (hostclock's docstring)
               "host_per_step": hostclock.per_step(timed),
               **(batches.figures(window, first, req.probe_accumulation, req.config_accumulation)
                  if batches is not None else {}),
               **step_figures(req, batches)},
    )
    notes = []
    if spread(tps) > SPREAD_BOUND:  # max/min of tokens/s: of the times where every step is alike
        res.noisy = True
        notes.append(noisy_reason(spread(tps), len(real)) + hostclock.slowest(
            real, res.extra["host_per_step"], cb.spread_basis() if cb.step_cost is not None else None))
    if growth > max(64 * 2**20, 0.01 * peak):
        notes.append(f"peak reserved memory grew by {growth} bytes over the timed steps")
    res.reason = "; ".join(notes)
    return judge_stability(res, cb, len(cb.steps))


def step_figures(req: ProbeRequest, batches: RealBatches | None) -> dict[str, float | int | bool]:
    """What one optimizer step of this config trains (`data.batching.StepShape`): on the data, from the
    plan; on random tokens, micro_batch_size rows of max_length."""
    if batches is not None:
        return batches.step.to_dict()
    cfg = req.config
    return step_shape(Batching.PAD_MAX, cfg.global_batch, cfg.micro_batch_size, cfg.gpus,
                      cfg.micro_batch_size, cfg.micro_batch_size * cfg.max_length).to_dict()


def judge_stability(res: ProbeResult, cb: ProbeCallback, steps: int) -> ProbeResult:
    """Non-finite loss on most micro-steps, or most steps skipped by the fp16 scaler: unstable."""
    bad = sum(1 for x in cb.losses if not math.isfinite(float(x)))  # device scalars until now: no sync a step
    if cb.losses and bad * 2 > len(cb.losses):
        res.outcome = Outcome.UNSTABLE
        res.reason = f"non-finite loss on {bad} of {len(cb.losses)} micro-steps"
    elif cb.skipped_steps * 2 > steps:
        res.outcome = Outcome.UNSTABLE
        res.reason = f"fp16 loss scaler skipped {cb.skipped_steps} of {steps} steps"
    return res
