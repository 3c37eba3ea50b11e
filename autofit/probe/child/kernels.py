"""Kernels in the probe child: the correctness gate (loss and gradient of one fixed batch with stock kernels
and with the kernel config, compared within `TOLERANCES`; outside them the outcome is `mismatch` and the
config can never win), Liger applied to the model, and what torch.compile cost and did.

What the search needs of the kernel dimensions without torch is `config/kernels.py`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from autofit.config.kernels import GATE_SEED
from autofit.data.collate import Batch
from autofit.probe.child.build import Model

# ----------------------------------------------------------------------------- compile time


@dataclass(frozen=True)
class CompileTime:
    """What the first optimizer steps cost above steady state (seconds)."""

    compile_s: float
    """Sum over the warm-up steps of their time above the steady step: compilation and autotuning."""
    first_step_s: float
    steady_step_s: float


def compile_time(step_seconds: list[float], warmup: int) -> CompileTime:
    """Compile seconds from per-step wall times: the warm-up steps' excess over the timed median.

    Inside a Trainer callback: `synchronize()` and read the clock in `on_step_begin` and
    `on_step_end` (the probe's callback already does), then call this with all the steps.
    Dynamo compiles the forward on the first call and AOTAutograd the backward on the first
    backward, both inside step 0; a recompilation (a new shape, a graph break path) shows as
    a later warm-up step above steady state. Needs warmup >= 1 and at least one timed step.
    """
    if warmup < 1 or len(step_seconds) <= warmup:
        raise ValueError(f"compile_time needs warm-up and timed steps, got {len(step_seconds)} for {warmup}")
    steady = statistics.median(step_seconds[warmup:])
    excess = sum(max(0.0, t - steady) for t in step_seconds[:warmup])
    return CompileTime(compile_s=excess, first_step_s=step_seconds[0], steady_step_s=steady)


@dataclass(frozen=True)
class DynamoStats:
    """What torch.compile did in this process (torch._dynamo's counters, torch 2.13)."""

    graphs: int
    """Distinct graphs compiled: 1-2 per frame is a clean compile; more means breaks or recompiles."""
    graph_breaks: int
    frames: int

    def to_dict(self) -> dict[str, int]:
        return {"graphs": self.graphs, "graph_breaks": self.graph_breaks, "frames": self.frames}


def dynamo_stats() -> DynamoStats:
    """Read at the end of a probe: graph breaks (peft's adapter logic) and recompilations.

    Compare a reading after the warm-up steps with one at the end: graphs compiled during the
    timed steps mean the probe timed compilation, not training.
    """
    from torch._dynamo.utils import counters

    return DynamoStats(graphs=int(counters["stats"].get("unique_graphs", 0)),
                       graph_breaks=int(sum(counters["graph_break"].values())),
                       frames=int(counters["frames"].get("total", 0)))


# ----------------------------------------------------------------------------- correctness gate


@dataclass(frozen=True)
class Tolerance:
    """Largest relative differences between kernel and reference that still count as the same."""

    loss_rel: float
    grad_rel: float


# One step, one batch, stock vs kernel on the same weights. bf16/fp16: Liger's own bf16 convergence
# tests compare losses with atol 1e-2, rtol 5e-2 (test/convergence/bf16/test_mini_models.py,
# mini_llama3) over 32 steps; one step in a 7-bit (bf16) mantissa differs by a few ulp (~4e-3) in
# each matmul, and the loss is a mean over thousands of tokens, so 1e-2 relative holds a legitimate
# kernel with room and still catches a loss that is 1.5x or 1.05x off. Gradients pass through every
# layer's backward and the LoRA B matrices' gradients are products of bf16 activations: 5e-2.
# fp32: summation order is the only legitimate difference (~1e-6 relative); 1e-4 / 1e-3.
TOLERANCES: dict[str, Tolerance] = {
    "bf16": Tolerance(loss_rel=1e-2, grad_rel=5e-2),
    "fp16": Tolerance(loss_rel=1e-2, grad_rel=5e-2),
    "fp32": Tolerance(loss_rel=1e-4, grad_rel=1e-3),
}


@dataclass(frozen=True)
class GateResult:
    """The correctness gate's verdict on one kernel combination."""

    ok: bool
    loss_ref: float
    loss_k: float
    grad_ref: float
    """Global L2 norm of the trainable parameters' gradients, reference kernels."""
    grad_k: float
    loss_rel_err: float
    grad_rel_err: float
    """Largest relative error of a trainable tensor's gradient norm (`grad_error`)."""
    tolerance: Tolerance
    reason: str = ""
    """Empty when ok; else what differed, for the `mismatch` outcome."""
    grad_norms_ref: list[float] = field(default_factory=list, repr=False)
    grad_norms_k: list[float] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, object]:
        return {"ok": self.ok, "loss_ref": self.loss_ref, "loss_k": self.loss_k, "grad_ref": self.grad_ref,
                "grad_k": self.grad_k, "loss_rel_err": self.loss_rel_err, "grad_rel_err": self.grad_rel_err,
                "tolerance": {"loss_rel": self.tolerance.loss_rel, "grad_rel": self.tolerance.grad_rel},
                "reason": self.reason}


@dataclass(frozen=True)
class Pass:
    """One forward and backward: the loss and each trainable tensor's gradient norm, in order."""

    loss: float
    grad_norms: list[float]

    @property
    def grad_norm(self) -> float:
        return math.sqrt(sum(g * g for g in self.grad_norms))


def loss_and_grads(model: Model, batch: Batch, precision: str, device: str) -> Pass:
    """Train-mode forward and backward of `batch` under the precision's autocast; grads are then freed."""
    import torch

    model.train()
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(GATE_SEED)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    inputs = {k: v.to(device) for k, v in batch.items()}
    with torch.autocast(device_type=device, dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = model(**inputs).loss
    loss.backward()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    norms = [float(p.grad.float().norm()) if p.grad is not None else 0.0 for _, p in trainable]
    for _, p in trainable:
        p.grad = None
    return Pass(loss=float(loss.detach().float()), grad_norms=norms)


def _rel(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-12)


def grad_error(ref: list[float], k: list[float]) -> float:
    """Largest relative error of one tensor's gradient norm.

    Each tensor is judged on its own: a LoRA model's q_proj adapters get ~50x smaller gradients
    than its v_proj adapters, so a bypassed q_proj adapter hardly moves the global norm. A tensor
    whose reference norm is below 1e-3 of the largest is judged against that floor (its bf16
    noise is relatively large); a tensor with no gradient in the reference (LoRA A while B is
    zero) must have none with the kernels either.
    """
    if len(ref) != len(k) or not all(math.isfinite(x) for x in k):
        return math.inf
    floor = max(1e-3 * max(ref, default=0.0), 1e-12)
    return max((abs(b - a) / max(a, floor) for a, b in zip(ref, k)), default=0.0)


def compare(ref: Pass, k: Pass, tol: Tolerance) -> GateResult:
    """The verdict: relative loss error and the largest per-tensor gradient-norm error."""
    loss_err = _rel(k.loss, ref.loss)
    grad_err = grad_error(ref.grad_norms, k.grad_norms)
    problems = []
    if not loss_err <= tol.loss_rel:
        problems.append(f"loss {k.loss:.6g} vs {ref.loss:.6g} with stock kernels "
                        f"(relative error {loss_err:.3g} > {tol.loss_rel:g})")
    if not grad_err <= tol.grad_rel:
        problems.append(f"a trainable tensor's gradient norm differs from stock kernels by {grad_err:.3g} "
                        f"relative (> {tol.grad_rel:g}; global norm {k.grad_norm:.6g} vs "
                        f"{ref.grad_norm:.6g})")
    return GateResult(ok=not problems, loss_ref=ref.loss, loss_k=k.loss, grad_ref=ref.grad_norm,
                      grad_k=k.grad_norm, loss_rel_err=loss_err, grad_rel_err=grad_err, tolerance=tol,
                      reason="mismatch: " + "; ".join(problems) if problems else "",
                      grad_norms_ref=ref.grad_norms, grad_norms_k=k.grad_norms)


IGNORE_INDEX = -100
"""transformers' label for positions without a loss (padding, a masked prompt)."""


def gate_batch(vocab: int, length: int, rows: int = 2, seed: int = 1, ignored: float = 0.25) -> Batch:
    """The gate's fixed batch: random tokens; the first `ignored` share of each row's labels masked.

    Masked labels are part of the check, not decoration: Liger's fused linear cross-entropy
    returned a silently wrong loss under torch.compile whenever some targets were ignore_index
    (linkedin/Liger-Kernel PR #1338); a batch without them passes that bug.
    """
    import torch

    ids = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[:, : int(length * ignored)] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


def correctness_gate(
    build_reference: Callable[[], Model],
    with_kernels: Callable[[Model], Model],
    batch: Batch,
    *,
    precision: str,
    device: str,
    tolerance: Tolerance | None = None,
) -> GateResult:
    """Does the kernel config train the same model as stock kernels, on one fixed batch?

    `build_reference()` returns the model with stock kernels (seeded: `torch.manual_seed(0)`
    before building, as the probe does). The reference loss and gradients are taken first,
    then `with_kernels(reference_model)` returns the kernel model: the same instance patched in
    place (Liger, as Trainer does it), a compiled wrapper of it (torch.compile: same weights by
    construction), or a model rebuilt with the same seed (an attention implementation is chosen
    at build time). The order matters: Liger also patches module-level functions (RoPE) for
    the whole process, so a reference built after Liger would already use Liger's kernels.

    Tolerance (`TOLERANCES`, by precision): loss within `loss_rel` relative to the reference;
    each trainable tensor's gradient norm within `grad_rel` of the reference's (`grad_error`),
    so one wrong tensor (an adapter a fused kernel bypasses) is caught even where the global
    norm hardly moves.
    """
    tol = tolerance or TOLERANCES[precision]
    model = build_reference()
    ref = loss_and_grads(model, batch, precision, device)
    kernel_model = with_kernels(model)
    k = loss_and_grads(kernel_model, batch, precision, device)
    if hasattr(kernel_model, "_orig_mod"):  # compiled for the gate's small batch
        import torch

        # Forget it: the measured run compiles from scratch for its own shapes, as the exported
        # run does; a second shape in the cache would make dynamo recompile with dynamic shapes.
        torch._dynamo.reset()
    return compare(ref, k, tol)


def apply_kernels(model: Model, cfg: object, checkpointing: dict[str, object] | None = None) -> Model:
    """The kernel model the gate compares, built in Trainer.train()'s order (transformers 5.24).

    Liger patched in place (`apply_liger_kernel`, which unwraps a PeftModel), then activation
    checkpointing as Trainer enables it from `activation_checkpointing_kwargs` (`checkpointing`:
    that dict, as `recipe.training_arguments` writes it), then torch.compile as accelerate wraps
    the model. Checkpointing changes no numbers by itself; it is here because compile and
    checkpointing every N layers are a combination to check, not to assume. torch.compile is
    regional (`accelerate.utils.compile_regions`, what accelerate runs under
    `recipe.REGIONAL_COMPILATION`): the decoder blocks compiled, the top-level forward and its loss eager.
    """
    if getattr(cfg, "liger", False):
        from transformers.integrations.liger import apply_liger_kernel

        apply_liger_kernel(model, getattr(cfg, "liger_kernel_config", None))
    if checkpointing:
        kw = dict(checkpointing)
        every, offload = kw.pop("every_n_layers", 1), kw.pop("offload", False)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw or None,
                                              every_n_layers=every, offload=offload)
    if getattr(cfg, "torch_compile", False):
        from accelerate.utils import compile_regions

        model = compile_regions(model, backend="inductor")
    return model
