"""Kernels inside the probe: unsupported before anything is built, the correctness gate, compile time.

Order (docs/DESIGN.md, "The probe"): `check_support` before the device is touched; the gate on the
built model before Trainer sees it (the reference must be taken before Liger patches anything:
Liger also patches module-level functions such as RoPE for the whole process); the compile seconds
after the steps. The gate's own peak memory is forgotten before the measured steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

from autofit.config import kernels, recipe
from autofit.config.kernels import GATE_SEED
from autofit.data.collate import Batch
from autofit.probe.child import kernels as child_kernels
from autofit.probe.child.build import Model
from autofit.probe.child.errors import Unsupported
from autofit.probe.child.state import ProbeState
from autofit.protocol.request import ProbeRequest
from autofit.protocol.result import Outcome, ProbeResult

TEST_LOSS_SCALE_ENV = "AUTOFIT_TEST_KERNEL_LOSS_SCALE"
"""Tests only: a factor the gate's kernel model multiplies its loss by (a deliberately wrong kernel,
injected at the process boundary so the real probe's gate must catch it). Never set it otherwise."""

GATE_LENGTH = 256
"""Tokens of the gate's one-row batch: small beside any measured micro-batch (the stock reference
holds the full logits without checkpointing)."""


def check_support(req: ProbeRequest) -> None:
    """`unsupported` with the reason when the kernels the config asks for cannot run here."""
    why = kernels.kernel_support(req.config, req.device)
    if why:
        raise Unsupported(why)


def check_architecture(req: ProbeRequest) -> None:
    """Liger patches nothing, silently, for an architecture it does not know: unsupported."""
    if req.config.liger:
        why = kernels.liger_architecture_problem(str(req.model.config.get("model_type", "")))
        if why:
            raise Unsupported(why)


def _test_loss_scale(model: Model) -> Model:
    factor = float(os.environ.get(TEST_LOSS_SCALE_ENV, "") or 1.0)
    if factor != 1.0:
        model.register_forward_hook(lambda _m, _a, out: out.__setitem__("loss", out["loss"] * factor))
    return model


def with_attention(model: Model, impl: str) -> Model:
    """The same model (same weights) switched to attention `impl` (transformers' set_attn_implementation):
    the reference runs stock sdpa even where the config asks for flex or flash attention."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if base.config._attn_implementation != impl:
        base.set_attn_implementation(impl)
    return model


def run_gate(req: ProbeRequest, state: ProbeState, model: Model) -> child_kernels.GateResult | None:
    """Stock kernels vs the config's kernels on one fixed batch, on this model's weights (None: not
    gated: stock kernels, or the study already holds a passing verdict for this gate_key)."""
    cfg = req.config
    if not (req.gate and kernels.needs_gate(cfg)):
        return None
    batch = child_kernels.gate_batch(int(req.model.config.get("vocab_size", 32000)),
                               min(cfg.max_length, GATE_LENGTH), rows=1)
    checkpointing = recipe.training_arguments(cfg, on_cpu=req.device == "cpu", max_steps=1).get(
        "activation_checkpointing_kwargs")
    gate = child_kernels.correctness_gate(
        lambda: with_attention(model, kernels.STOCK_ATTENTION[0]),
        lambda m: _test_loss_scale(child_kernels.apply_kernels(with_attention(m, cfg.attn_implementation),
                                                               cfg,
                                                         checkpointing)),
        batch, precision=cfg.precision, device=req.device)
    forget_check_peaks(req, state)
    return gate


def forget_check_peaks(req: ProbeRequest, state: ProbeState) -> None:
    """The measured peak is the training steps', not a correctness check's (the gate's reference logits,
    the batching check's padded and packed forward passes): on a GPU the allocator's cache is emptied and
    its peaks reset. On the CPU the process keeps resident what a check freed (measured: ~25 MiB of
    tiny-llama's ~105 after the batching check), which the peak still counts; `regress` therefore runs
    the checks in its first run of a config only."""
    import gc

    gc.collect()
    if req.device == "cuda":
        import torch

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if state.mem is not None:
        state.mem.reset_peaks()


def mismatch_result(req: ProbeRequest, gate: child_kernels.GateResult) -> ProbeResult:
    return ProbeResult(Outcome.MISMATCH, req.config, reason=gate.reason,
                       extra={"gate": gate.to_dict(), "gate_key": kernels.gate_key(req.config)})


def kernel_figures(res: ProbeResult, req: ProbeRequest, state: ProbeState,
                   gate: child_kernels.GateResult | None) -> ProbeResult:
    """Compile seconds apart from the step time (compiled configs), dynamo's counts, the gate verdict."""
    cfg, cb = req.config, state.callback
    if gate is not None:
        res.extra.update(gate=gate.to_dict(), gate_key=kernels.gate_key(cfg))
    compiled = cfg.torch_compile or cfg.attn_implementation == "flex_attention"
    if compiled and cb is not None and len(cb.steps) > req.warmup_steps:
        ct = child_kernels.compile_time([s["seconds"] for s in cb.steps], req.warmup_steps)
        res.compile_seconds = round(ct.compile_s, 3)
        res.extra.update(first_step_s=round(ct.first_step_s, 4),
                         dynamo=child_kernels.dynamo_stats().to_dict())
    return res


# ----------------------------------------------------------------------------- the DPO gate

DPO_GATE_TOKENS = GATE_LENGTH // 2
"""Tokens of the gate pair's prompt and of each completion at most: two rows of up to 256 tokens."""


def dpo_gate(trainer: Any, with_kernels: Callable[[Model], Model], batch: Batch, *, precision: str, device: str,
             tolerance: child_kernels.Tolerance | None = None) -> child_kernels.GateResult:
    """Does the kernel config train the same DPO step as stock kernels, on one fixed batch of pairs?

    The SFT gate's order and tolerances (`kernels.correctness_gate`): stock first (Liger patches process-wide),
    then `with_kernels(trainer.model)`; what is compared is TRL's own DPO loss (`DPOTrainer.compute_loss`: the
    policy's and the reference's log-probabilities through its fused LM head), the rewards' margin it logs, and
    each trainable tensor's gradient norm. A fresh adapter makes the policy the reference (LoRA B is zero: loss
    log 2, margin 0 whatever the kernels compute), so for the check the adapter's B matrices hold seeded small
    values, restored afterwards; the reference's log-probabilities are computed live even where the run
    precomputes them (the gate's pair is not in the precomputed set)."""
    import torch

    tol = tolerance or child_kernels.TOLERANCES[precision]
    model = trainer.model
    with _moved_adapter(model), _live_reference(trainer):
        ref, ref_margin, scale = _dpo_pass(trainer, model, batch, precision, device)
        kernel_model = with_kernels(model)
        k, k_margin, _ = _dpo_pass(trainer, kernel_model, batch, precision, device)
    if hasattr(kernel_model, "_orig_mod"):  # as the SFT gate: the measured run compiles for its own shapes
        torch._dynamo.reset()
    verdict = child_kernels.compare(ref, k, tol)
    margin_err = abs(k_margin - ref_margin) / max(abs(ref_margin), scale, 1e-12)
    if margin_err <= tol.loss_rel:
        return verdict
    said = (f"rewards/margins {k_margin:.6g} vs {ref_margin:.6g} with stock kernels (error {margin_err:.3g} of "
            f"the log-probabilities' scale > {tol.loss_rel:g})")
    reason = f"{verdict.reason}; {said}" if verdict.reason else f"mismatch: {said}"
    return dataclasses.replace(verdict, ok=False, reason=reason)


def _dpo_pass(trainer: Any, model: Model, batch: Batch, precision: str,
              device: str) -> tuple[child_kernels.Pass, float, float]:
    """One DPO forward and backward through TRL's loss: (loss and gradient norms, the rewards' margin, the scale
    a margin's rounding is judged against: beta x |log-probabilities of chosen|)."""
    import torch

    model.train()
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    for p in trainable:
        p.grad = None
    torch.manual_seed(GATE_SEED)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    inputs = {k: v.to(device) for k, v in batch.items()}
    with torch.autocast(device_type=device, dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = trainer.compute_loss(model, inputs)
    loss.backward()
    norms = [float(p.grad.float().norm()) if p.grad is not None else 0.0 for p in trainable]
    for p in trainable:
        p.grad = None
    logged = trainer._metrics["train"]  # what DPOTrainer logs of this step (TRL 1.16 keeps it here)
    margin, logps = float(logged["rewards/margins"][-1]), float(logged["logps/chosen"][-1])
    logged.clear()
    return child_kernels.Pass(float(loss.detach().float()), norms), margin, float(trainer.args.beta) * abs(logps)


@contextlib.contextmanager
def _moved_adapter(model: Model) -> Iterator[None]:
    """LoRA's B matrices set to seeded small values (the adapter's own init scale) for the gate, then restored."""
    import torch

    saved = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    g = torch.Generator().manual_seed(GATE_SEED)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in saved:
                p.copy_((torch.randn(p.shape, generator=g) * 0.02).to(p.dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in saved:
                    p.copy_(saved[n])


@contextlib.contextmanager
def _live_reference(trainer: Any) -> Iterator[None]:
    precomputed = trainer.precompute_ref_logps
    trainer.precompute_ref_logps = False
    try:
        yield
    finally:
        trainer.precompute_ref_logps = precomputed


def dpo_gate_batch(pair: tuple[list[int], list[int], list[int]], pad_id: int) -> Batch:
    """The gate's one pair (the probe's first, its prompt and completions cut to `DPO_GATE_TOKENS`), collated by
    TRL's DataCollatorForPreference as DPOTrainer collates it (chosen row, then rejected row)."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    prompt, chosen, rejected = (ids[:DPO_GATE_TOKENS] for ids in pair)
    return dict(DataCollatorForPreference(pad_token_id=pad_id)(
        [{"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected}]))


def run_dpo_gate(req: ProbeRequest, state: ProbeState, trainer: Any,
                 pair: tuple[list[int], list[int], list[int]], pad_id: int) -> child_kernels.GateResult | None:
    """Stock DPO vs the config's kernels on the probe's first pair (None: not gated, as `run_gate`)."""
    cfg = req.config
    if not (req.gate and kernels.needs_gate(cfg)):
        return None
    checkpointing = recipe.training_arguments(cfg, on_cpu=req.device == "cpu", max_steps=1).get(
        "activation_checkpointing_kwargs")
    with_attention(trainer.model, kernels.STOCK_ATTENTION[0])
    gate = dpo_gate(trainer, lambda m: child_kernels.apply_kernels(with_attention(m, cfg.attn_implementation), cfg,
                                                                   checkpointing),
                    dpo_gate_batch(pair, pad_id), precision=cfg.precision, device=req.device)
    with_attention(trainer.model, cfg.attn_implementation)
    forget_check_peaks(req, state)
    return gate
