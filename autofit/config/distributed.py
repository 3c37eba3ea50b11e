"""Probes spanning several GPUs: the engines' settings as plain data, and what a machine can run.

A config with `gpus` > 1 is one probe launched with torchrun: every rank trains its share of the
global batch (accumulation = ceil(global_batch / (micro_batch_size x gpus))), memory is the largest
rank's peak and tokens/s the whole group's. `engine` says how the ranks split the model:

- `none`: plain data parallel (Trainer's DDP): every rank holds the whole model;
- `fsdp2`: PyTorch FSDP2 through Trainer's `fsdp` / `fsdp_config` (transformers 5.x builds accelerate's
  FSDP plugin from it): parameters, gradients and optimizer state sharded over the ranks, each decoder
  layer (the model's `_no_split_modules`) a unit; `reshard_after_forward`, `cpu_offload` and FSDP's own
  `activation_checkpointing` (instead of Trainer's, which would all-gather twice);
- `zero2` / `zero3`: DeepSpeed ZeRO stage 2 (gradients and optimizer sharded) or 3 (parameters too)
  through a generated DeepSpeed JSON (`deepspeed_config`), where deepspeed is installed.

No torch import here: the exporters and the search read these dicts.
"""

from __future__ import annotations

import importlib.util
import os

from autofit.config.spec import TrialConfig


def training_arguments(cfg: TrialConfig) -> dict[str, object]:
    """TrainingArguments keys (transformers 5.24) for the engine; empty for one rank without an engine."""
    if cfg.engine == "fsdp2":
        options = fsdp_options(cfg)
        offload = options.pop("offload_params")
        return {
            "fsdp": True,
            "fsdp_config": {"version": 2, **options, "cpu_offload": offload},
            # FSDP's activation_checkpointing replaces Trainer's (which would all-gather a second time)
            "activation_checkpointing": False,
        }
    if cfg.engine in ("zero2", "zero3"):
        return {"deepspeed": deepspeed_config(cfg)}
    return {}


def deepspeed_config(cfg: TrialConfig) -> dict[str, object]:
    """The DeepSpeed JSON for a ZeRO engine; "auto" values are filled by Trainer from its arguments."""
    stage = 2 if cfg.engine == "zero2" else 3
    zero: dict[str, object] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    if cfg.cpu_offload in ("optimizer", "all"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if cfg.cpu_offload == "all":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    out: dict[str, object] = {}
    if cfg.cpu_offload != "off":
        # ZeRO-Offload refuses a client optimizer (zero_force_ds_cpu_optimizer): DeepSpeed's own AdamW,
        # its CPU Adam, steps on the host; Trainer fills the "auto" values from its arguments
        out["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                        "weight_decay": "auto"}}
    return {
        **out,
        "zero_optimization": zero,
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
    }


def fsdp_options(cfg: TrialConfig) -> dict[str, object]:
    """FSDP2's settings for the config, in the names axolotl's fsdp_config uses (Trainer's fsdp_config says
    `cpu_offload` for `offload_params`; accelerate's config file prefixes each with `fsdp_`)."""
    return {"offload_params": cfg.cpu_offload == "all", "state_dict_type": "FULL_STATE_DICT",
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",  # the model's _no_split_modules: decoder layers
            "reshard_after_forward": cfg.reshard_after_forward,
            "activation_checkpointing": cfg.checkpoint_every > 0}


def support(cfg: TrialConfig, device: str, attached: int = 1, dataset: bool = False) -> str | None:
    """None when this worker can run the config's engine and GPUs, else why not (an `unsupported`
    outcome); `attached`: the GPUs the worker has (on the CPU ranks are processes: any number)."""
    if cfg.engine in ("zero2", "zero3"):
        if importlib.util.find_spec("deepspeed") is None:
            return (f"engine={cfg.engine}: deepspeed is not installed (pip install deepspeed); "
                    "engine=fsdp2 shards the same state with PyTorch alone")
        if device != "cuda":
            return f"engine={cfg.engine}: DeepSpeed ZeRO trains on GPUs only"
    if cfg.cpu_offload != "off" and device != "cuda":
        return f"cpu_offload={cfg.cpu_offload}: on --device cpu there is no device memory to offload from"
    if device == "cuda" and cfg.gpus > attached:
        return (f"gpus={cfg.gpus}: this worker has {attached} GPU(s) attached; "
                f"give --gpus {cfg.gpus} with enough GPUs in --gpu")
    if cfg.gpus > 1 and dataset:
        return (f"gpus={cfg.gpus} with --dataset: each rank's share of the dataset's micro-batches is not "
                "measured yet; search the data with gpus=1")
    return None


def fsdp_on_cpu() -> None:
    """Lets accelerate shard with FSDP2 on a CPU too (torchrun's gloo processes: how autofit's probes and
    its exported recipes are tested without GPUs).

    accelerate takes its FSDP path only for accelerator device types: on the CPU (DistributedType.MULTI_CPU)
    Trainer would silently train plain data parallel instead. Called after TrainingArguments (which sets the
    distributed state up) and before Trainer; on a GPU accelerate's own path is taken and this does nothing.
    The probe calls it; the exported Python recipes carry its source.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = PartialState()
    if state.distributed_type == DistributedType.MULTI_CPU:
        state.distributed_type = DistributedType.MULTI_GPU


def launched(cfg: TrialConfig) -> bool:
    """Does the config run under torchrun? Several ranks, or an engine on one (FSDP2 or ZeRO with host
    offload on one GPU: world size 1, still a process group)."""
    return cfg.gpus > 1 or cfg.engine != "none"


def launch_command(cfg: TrialConfig, script: str, args: str = "") -> str:
    """How to start an exported script: python for one plain rank, torchrun otherwise. With host offload
    each rank gets its share of the cores for the optimizer step on the CPU (torchrun's default is
    OMP_NUM_THREADS=1 a rank, which leaves the offloaded step on one core)."""
    tail = f" {args}" if args else ""
    if launched(cfg):
        threads = f"OMP_NUM_THREADS=$(( $(nproc) / {cfg.gpus} )) " if cfg.cpu_offload != "off" else ""
        return f"{threads}torchrun --standalone --nproc-per-node {cfg.gpus} {script}{tail}"
    return f"python {script}{tail}"


def rank_threads(nproc: int) -> int:
    """CPU threads a rank of `nproc` gets: its share of this process's cores (at least one)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(nproc, 1))


def describe(cfg: TrialConfig) -> str:
    """`2 GPUs, fsdp2 (reshard after forward, offload all)` for reports; '' for one GPU, no engine."""
    if cfg.gpus == 1 and cfg.engine == "none":
        return ""
    parts = [f"{cfg.gpus} GPU{'s' if cfg.gpus > 1 else ''}",
             "data parallel" if cfg.engine == "none" else cfg.engine]
    extra = []
    if cfg.engine == "fsdp2":
        extra.append("reshard after forward" if cfg.reshard_after_forward else "no reshard after forward")
    if cfg.cpu_offload != "off":
        extra.append(f"offload {cfg.cpu_offload}")
    return ", ".join(parts) + (f" ({', '.join(extra)})" if extra else "")
