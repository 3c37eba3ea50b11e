"""Kernels inside the probe: unsupported before anything is built, the correctness gate, compile time.

Order (docs/DESIGN.md, "The probe"): `check_support` before the device is touched; the gate on the
built model before Trainer sees it (the reference must be taken before Liger patches anything:
Liger also patches module-level functions such as RoPE for the whole process); the compile seconds
after the steps. The gate's own peak memory is forgotten before the measured steps.
"""

from __future__ import annotations

import os

from autofit.config import kernels, recipe
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
