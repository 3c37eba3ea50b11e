"""The training recipe as plain data: one source for the probe and every exporter.

The probe builds `TrainingArguments`, `LoraConfig` and `BitsAndBytesConfig` from these
dicts; the exporters write the same dicts into the recipes. What is measured is what runs.
No torch import here: the exporters run in the search process.
"""

from __future__ import annotations

from typing import Any

from autofit.config import distributed, kernels
from autofit.config.spec import TrialConfig, training_argument_values

Arguments = dict[str, Any]
"""Keyword arguments of a library's constructor (TrainingArguments, LoraConfig, BitsAndBytesConfig) as plain
data: values of many types, which the library checks; the exporters write the same dict as text."""

DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def weights_dtype(cfg: TrialConfig) -> str:
    """torch dtype name the base weights are loaded in.

    LoRA: the frozen base in the training precision (peft keeps adapters in fp32).
    Full fine-tuning: bf16 trains bf16 weights directly; fp16 keeps fp32 master weights
    under fp16 autocast (a GradScaler cannot unscale fp16 parameters).
    """
    if cfg.method == "full" and cfg.precision == "fp16":
        return "float32"
    return DTYPE_NAMES[cfg.precision]


def learning_rate(cfg: TrialConfig) -> float:
    return 2e-4 if cfg.method == "lora" else 2e-5


def training_arguments(
    cfg: TrialConfig, *, on_cpu: bool, max_steps: int, gradient_accumulation_steps: int | None = None
) -> Arguments:
    """Keyword arguments of `transformers.TrainingArguments` (output_dir aside)."""
    every, offload = cfg.checkpoint_every, cfg.checkpoint_offload
    args: Arguments = {
        "per_device_train_batch_size": cfg.micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps or cfg.gradient_accumulation_steps,
        "max_steps": max_steps,
        "learning_rate": learning_rate(cfg),
        "bf16": cfg.precision == "bf16",
        "fp16": cfg.precision == "fp16",
        "optim": cfg.optimizer,
        "activation_checkpointing": every > 0,
        "report_to": "none",
        "save_strategy": "no",
        "remove_unused_columns": False,
        "use_cpu": on_cpu,
        "seed": 0,
        # Pinned: with torch_compile and bf16, TrainingArguments turns TF32 matmuls on by itself
        # (tf32=None), so compiled configs would run in another precision than stock ones.
        "tf32": False,
    }
    args.update(kernels.training_arguments(cfg))  # use_liger_kernel, torch_compile (+ backend)
    args.update(distributed.training_arguments(cfg))  # fsdp / fsdp_config or deepspeed
    args.update(training_argument_values(cfg))  # the dimensions declared with a TrainingArguments field
    if every > 0 and args["activation_checkpointing"]:
        args["activation_checkpointing_kwargs"] = {
            "use_reentrant": False,  # needed for every_n_layers and with frozen inputs
            "every_n_layers": every,  # 1 = every decoder layer
            "offload": offload,  # saved layer inputs in pinned host memory
        }
    return args


def lora_arguments(cfg: TrialConfig) -> Arguments | None:
    """Keyword arguments of `peft.LoraConfig`, or None for full fine-tuning."""
    if cfg.method != "lora":
        return None
    return {
        "r": cfg.lora_r,
        "lora_alpha": cfg.lora_alpha,
        "lora_dropout": float(cfg.lora_dropout),
        "target_modules": cfg.lora_modules,
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }


def quantization_arguments(cfg: TrialConfig) -> Arguments | None:
    """Keyword arguments of `transformers.BitsAndBytesConfig` (dtype as a name), or None."""
    if cfg.quantization == "nf4":
        return {
            "load_in_4bit": True,
            "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": DTYPE_NAMES[cfg.precision],
        }
    if cfg.quantization == "8bit":
        return {"load_in_8bit": True}
    return None


def kbit_preparation(cfg: TrialConfig) -> Arguments | None:
    """Arguments of `peft.prepare_model_for_kbit_training` for a quantized base.

    peft turns checkpointing on for every layer by default; pass the config's own setting
    so "QLoRA without checkpointing" does not silently checkpoint. Trainer then enables
    the partial or offloaded variant from the TrainingArguments.
    """
    if cfg.quantization == "none":
        return None
    return {"use_gradient_checkpointing": cfg.checkpoint_every > 0,
            "gradient_checkpointing_kwargs": {"use_reentrant": False}}


REGIONAL_COMPILATION = "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"
"""accelerate's switch (TorchDynamoPlugin.use_regional_compilation, read from the environment: Trainer
builds the plugin without it): torch.compile each repeated decoder block and the other leaf children, not
the model's top-level forward. autofit compiles this way: the blocks share one compiled graph (the CPU
probe's compile time halved: 21 s to 11.5 s for tiny-llama), and the loss stays eager, Liger's fused
linear cross-entropy included (Liger-Kernel issue 916: compiled with the whole model it crashed on an
H200; axolotl keeps it out of compile too)."""


def process_env(cfg: TrialConfig) -> dict[str, str]:
    """Environment the training process needs before CUDA and accelerate start: the allocator setting,
    and regional compilation for compiled configs."""
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} if cfg.expandable_segments else {}
    if cfg.torch_compile:
        env[REGIONAL_COMPILATION] = "1"
    return env
