"""Kernels: can Liger, torch.compile and an attention kernel run here, and do they train the same model.

What the search and the probe share about the kernel dimensions (`liger`, `torch_compile`,
`attn_implementation`), without importing torch:

- `kernel_support(cfg, device)`: None when the requested kernels can run on this machine, else
  the reason for an `unsupported` outcome (package metadata only);
- `needs_gate(cfg)` / `gate_key(cfg)`: which configs must pass the correctness gate, and which
  settings one verdict covers (the gate itself runs in the probe child: `probe/child/kernels.py`);
- `training_arguments(cfg)`: the TrainingArguments keys the kernels map to;
- `amortised_tokens_per_s(...)`: throughput over a whole job once compile time is paid.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil

from packaging.version import InvalidVersion, Version

from autofit.config.spec import KEYS, keyed

LIGER_MIN_VERSION = "0.8.5"
"""The version measured on the H200 (SCENARIOS.md); transformers itself accepts >= 0.3.0."""
FLASH_ATTN_2_MIN_VERSION = "2.3.3"
"""transformers 5.24 `is_flash_attn_2_available`: older flash-attn is refused."""
GATE_SEED = 0
"""Seed set before each forward of the gate (dropout masks alike in both runs)."""


# ----------------------------------------------------------------------------- support


def _version(dist: str) -> str | None:
    """Installed version of a distribution, or None (metadata only: nothing is imported)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _at_least(found: str, wanted: str) -> bool:
    try:
        return Version(found) >= Version(wanted)
    except InvalidVersion:
        return False


def liger_problem(device: str) -> str | None:
    """Why Liger cannot run here, or None."""
    if device != "cuda":
        return "liger=on: Liger's kernels are Triton GPU kernels and this probe runs on the CPU"
    found = _version("liger-kernel")
    if found is None:
        return f"liger=on: liger-kernel is not installed (pip install 'liger-kernel>={LIGER_MIN_VERSION}')"
    if not _at_least(found, LIGER_MIN_VERSION):
        return (f"liger=on: liger-kernel {found} is older than {LIGER_MIN_VERSION}, the version autofit "
                "measured")
    if _version("triton") is None and importlib.util.find_spec("triton") is None:
        return "liger=on: triton is not installed (Liger's kernels are written in Triton)"
    return None


def compile_problem(device: str) -> str | None:
    """Why torch.compile (inductor) cannot run here, or None."""
    if device == "cuda":
        if importlib.util.find_spec("triton") is None:
            return "torch_compile=on: inductor generates Triton kernels on a GPU and triton is not installed"
        return None
    cxx = os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None and shutil.which("c++") is None:
        return f"torch_compile=on: inductor needs a C++ compiler on the CPU ({cxx} not found)"
    return None


def _flash_problem(impl: str, device: str) -> str | None:
    """transformers 5.24's rule: the flash-attn package, else a hub kernel through `kernels`."""
    version = impl.rsplit("_", 1)[-1]
    dist = "flash-attn" if version == "2" else "flash-attn-3"
    found = _version(dist)
    if device == "cuda" and found is not None and (version != "2"
                                                   or _at_least(found, FLASH_ATTN_2_MIN_VERSION)):
        return None
    if device == "cuda" and _kernels_package_usable():
        return None  # transformers falls back to kernels-community/flash-attn{version} (needs the hub cache)
    where = "it needs a CUDA GPU" if device != "cuda" else f"{dist} is not installed"
    return (f"attn_implementation={impl}: {where}; transformers raises ImportError "
            f"\"FlashAttention{version} has been toggled on, but it cannot be used\"")


def _kernels_package_usable() -> bool:
    found = _version("kernels")
    if found is None:
        return False
    from transformers.utils.import_utils import KERNELS_MAX_VERSION, KERNELS_MIN_VERSION  # no torch import

    return _at_least(found, KERNELS_MIN_VERSION) and not _at_least(found, KERNELS_MAX_VERSION)


def attention_problem(impl: str, device: str) -> str | None:
    """Why an attention implementation cannot train here, or None."""
    if impl.startswith("flash_attention_"):
        return _flash_problem(impl, device)
    if impl == "flex_attention":
        if device != "cuda":
            # torch 2.13 on the CPU: NotImplementedError "FlexAttention does not support backward on CPU".
            return ("attn_implementation=flex_attention: FlexAttention has no backward on the CPU (torch "
                    "raises)")
        # transformers wraps flex_attention in torch.compile: the same needs as torch_compile.
        why = compile_problem(device)
        return why.replace("torch_compile=on", "attn_implementation=flex_attention") if why else None
    return None


def kernel_support(cfg: object, device: str = "cuda") -> str | None:
    """None when the kernels `cfg` asks for can run on `device` ("cuda" or "cpu"), else the reason.

    `cfg` is a TrialConfig or anything with the attributes `liger`, `torch_compile` (bools,
    off when absent) and `attn_implementation` (sdpa when absent). Every problem is named,
    joined by "; ". Whether Liger supports the model's architecture needs liger imported:
    `liger_architecture_problem` (probe child only).
    """
    problems = []
    if getattr(cfg, "liger", False):
        problems.append(liger_problem(device))
    if getattr(cfg, "torch_compile", False):
        problems.append(compile_problem(device))
    problems.append(attention_problem(getattr(cfg, "attn_implementation", "sdpa"), device))
    found = [p for p in problems if p]
    return "; ".join(found) if found else None


def liger_architecture_problem(model_type: str) -> str | None:
    """Liger patches nothing, silently, for an architecture it does not know: that is unsupported.

    Imports liger (and so triton): call it in the probe child after `kernel_support` said yes.
    """
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except Exception as e:  # noqa: BLE001  a broken install is an unsupported machine, not a crash
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"liger=on: importing liger_kernel.transformers failed ({first[:200]})"
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return (f"liger=on: Liger has no kernels for model_type {model_type!r} (it would silently patch "
                "nothing)")
    return None


# ----------------------------------------------------------------------------- which probes are gated

STOCK_ATTENTION = ("sdpa", "eager")
"""Attention implementations that are the reference: no gate needed on their own."""


def needs_gate(cfg: object) -> bool:
    """A config that uses any non-stock kernel (a value outside a dimension's declared `stock`) must pass the
    gate before it can win."""
    return any(getattr(cfg, d.name, d.default) not in d.stock for d in KEYS.values() if d.stock is not None)


def gate_key(cfg: object) -> str:
    """The settings one gate verdict covers: the kernels and what changes the numbers they compute.

    Micro-batch, accumulation and the allocator do not enter: the gate runs one fixed batch.
    Checkpointing does (compile with checkpointing every N layers is its own combination).
    """
    return keyed(cfg, lambda d: d.gate)  # the dimensions declared with a place in it


# ----------------------------------------------------------------------------- TrainingArguments


def training_arguments(cfg: object) -> dict[str, object]:
    """TrainingArguments keys (transformers 5.24) for the kernel settings; empty for stock kernels.

    `use_liger_kernel`: Trainer.train() calls `apply_liger_kernel(model, liger_kernel_config)`,
    which unwraps a PeftModel to its base model and patches that instance (RMSNorm, SwiGLU, the
    fused linear cross-entropy as the model's forward) and, process-wide, the module's RoPE
    function. `liger_kernel_config=None` keeps Liger's defaults (rope, rms_norm, swiglu,
    fused_linear_cross_entropy on; cross_entropy off).
    `torch_compile`: accelerate compiles the model (backend inductor; mode left at its default until a
    measurement shows another mode pays) regionally, per decoder block, as `recipe.process_env` asks.
    """
    out: dict[str, object] = {}
    if getattr(cfg, "liger", False):
        out["use_liger_kernel"] = True
    if getattr(cfg, "torch_compile", False):
        out["torch_compile"] = True
        out["torch_compile_backend"] = "inductor"
    return out


# ----------------------------------------------------------------------------- compile time


def amortised_tokens_per_s(tokens_per_s: float, compile_s: float, train_tokens: int) -> float:
    """Throughput over a whole job of `train_tokens` tokens once compile time is paid once."""
    return train_tokens / (train_tokens / tokens_per_s + compile_s)
