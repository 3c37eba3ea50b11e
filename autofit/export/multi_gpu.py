"""A winner that spans several GPUs (`gpus` > 1 and/or an `engine`) in each format's own terms.

- hf-trainer / trl: Trainer's `fsdp` / `fsdp_config` or the DeepSpeed dict come with TRAINING_ARGS
  (`recipe.training_arguments`); the DeepSpeed JSON is embedded there, not a file beside the script:
  Trainer takes the dict itself, the script stays one file (also when exported to stdout), and it is
  the very dict the probe passed. The script starts with torchrun, and an FSDP2 script carries
  `fsdp_on_cpu()`: accelerate takes its FSDP path only for accelerator device types, so on a CPU
  (gloo ranks, where the recipe is tested) Trainer would silently train plain DDP.
- axolotl 0.12: `fsdp_version: 2` + `fsdp_config` (docs/multi-gpu.qmd's FSDP2 keys) or `deepspeed: FILE`,
  launched with `axolotl train ... --launcher torchrun -- --nproc_per_node=N` (docs/cli.qmd).
- LLaMA-Factory: `deepspeed: FILE` launched with `FORCE_TORCHRUN=1 NPROC_PER_NODE=N llamafactory-cli train`
  (examples/README.md); FSDP2 through an accelerate config file and `accelerate launch --config_file ...`
  (examples/accelerate/fsdp2_config.yaml, LLaMA-Factory 0.9.4 and later).
Companion files are named bare and written beside the recipe (`Rendered.companions`).
"""

from __future__ import annotations

import json

import yaml

from autofit.config import distributed
from autofit.config.spec import TrialConfig
from autofit.export.yaml_targets import ACCELERATE

DEEPSPEED_JSON = "ds_config.json"
ACCELERATE_FSDP = "accelerate_fsdp.yaml"

RANK_HELPERS = '''

def distributed_type():
    """What Trainer really ran: FSDP, DEEPSPEED, MULTI_GPU (DDP), NO, ..."""
    from accelerate.state import AcceleratorState

    return str(AcceleratorState().distributed_type.value)


def sharded_parameters(model):
    """How many of the model's parameters are shards (DTensor, as FSDP2 leaves them) on this rank."""
    from torch.distributed.tensor import DTensor

    return sum(isinstance(p, DTensor) for p in model.parameters()) if model is not None else 0
'''
"""What a recipe launched on several ranks adds to its summary (`script.throughput`)."""


def script_doc(cfg: TrialConfig) -> str:
    """The paragraph of a Python recipe's docstring on its GPUs and engine ('' for one plain GPU)."""
    if not distributed.launched(cfg):
        return ""
    lines = [f"{distributed.describe(cfg)}: one process per GPU, started by the command above; each rank",
             f"trains {cfg.rank_batch} of the {cfg.effective_batch} sequences of an optimizer step "
             "(micro-batch x accumulation)."]
    if cfg.engine == "fsdp2":
        lines += ["FSDP2 through Trainer's fsdp / fsdp_config (TRAINING_ARGS): parameters, gradients and",
                  "optimizer state sharded over the ranks, each decoder layer a unit; FSDP's own",
                  "activation_checkpointing replaces Trainer's. Without GPUs torchrun starts gloo processes",
                  "and fsdp_on_cpu() lets accelerate shard there too (a test of the recipe, not its speed)."]
    elif cfg.engine in ("zero2", "zero3"):
        lines += [f"DeepSpeed ZeRO stage {cfg.engine[-1]} (pip install deepspeed): its JSON is embedded as",
                  "TRAINING_ARGS['deepspeed'] (Trainer takes the dict and fills its \"auto\" values from the",
                  "other arguments); save it to a file to reuse it elsewhere."]
    else:
        lines += ["Plain data parallel (Trainer's DDP): every rank holds the whole model."]
    return "\n" + "\n".join(lines) + "\n"


def script_launch(cfg: TrialConfig) -> str:
    """`Rendered.launch` of a Python recipe: torchrun over the recipe's file ('' for one plain GPU)."""
    if not distributed.launched(cfg):
        return ""
    return distributed.launch_command(cfg, "{recipe}", "--dataset data.jsonl --output-dir out")


def deepspeed_json(cfg: TrialConfig) -> str:
    return json.dumps(distributed.deepspeed_config(cfg), indent=2) + "\n"


def axolotl(cfg: TrialConfig) -> tuple[dict[str, object], dict[str, str], str]:
    """(axolotl keys, companion files, launch command with `{recipe}`) for the config's engine."""
    if not distributed.launched(cfg):
        return {}, {}, ""
    keys: dict[str, object] = {}
    companions: dict[str, str] = {}
    if cfg.engine == "fsdp2":
        keys = {"fsdp_version": 2, "fsdp_config": distributed.fsdp_options(cfg)}
    elif cfg.engine in ("zero2", "zero3"):
        keys = {"deepspeed": DEEPSPEED_JSON}
        companions = {DEEPSPEED_JSON: deepspeed_json(cfg)}
    launch = f"axolotl train {{recipe}} --launcher torchrun -- --nproc_per_node={cfg.gpus} --nnodes=1"
    return keys, companions, launch


def llama_factory(cfg: TrialConfig) -> tuple[dict[str, object], dict[str, str], str]:
    """(LLaMA-Factory keys, companion files, launch command with `{recipe}`) for the config's engine."""
    if not distributed.launched(cfg):
        return {}, {}, ""
    if cfg.engine == "fsdp2":  # the activation checkpointing is FSDP's (in the accelerate config)
        # the module llamafactory-cli's torchrun starts; a checkout's src/train.py (the examples' way) is the
        # same
        launch = f"accelerate launch --config_file {ACCELERATE_FSDP} -m llamafactory.launcher {{recipe}}"
        return {"disable_gradient_checkpointing": True}, {ACCELERATE_FSDP: accelerate_fsdp(cfg)}, launch
    launch = f"FORCE_TORCHRUN=1 NPROC_PER_NODE={cfg.gpus} llamafactory-cli train {{recipe}}"
    if cfg.engine in ("zero2", "zero3"):
        return {"deepspeed": DEEPSPEED_JSON}, {DEEPSPEED_JSON: deepspeed_json(cfg)}, launch
    return {}, {}, launch


def yaml_intro(cfg: TrialConfig, companions: dict[str, str]) -> list[str]:
    """Header lines of a YAML recipe on its GPUs and the files beside it ([] for one plain GPU)."""
    if not distributed.launched(cfg):
        return []
    return [f"Several GPUs: {distributed.describe(cfg)}; the global batch kept: {cfg.rank_batch} sequences "
            f"per rank and optimizer step, {cfg.effective_batch} in all."] + [
        f"{n} (written beside this file by autofit export -o) is named relative to the folder you run in."
        for n in companions]


def accelerate_fsdp(cfg: TrialConfig) -> str:
    """An accelerate config file for FSDP2 (the keys of LLaMA-Factory's
    examples/accelerate/fsdp2_config.yaml)."""
    fsdp_config = {"fsdp_version": 2, **{f"fsdp_{k}": v for k, v in distributed.fsdp_options(cfg).items()}}
    doc = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "fsdp_config": fsdp_config,
        "mixed_precision": {"bf16": "bf16", "fp16": "fp16"}.get(cfg.precision, "no"),
        "machine_rank": 0,
        "num_machines": 1,
        "num_processes": cfg.gpus,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    assert set(doc) <= ACCELERATE["keys"] and set(fsdp_config) <= ACCELERATE["fsdp_config"]
    return (f"# accelerate config for LLaMA-Factory: {distributed.describe(cfg)}, written by autofit "
            "export.\n"
            + yaml.safe_dump(doc, sort_keys=False))
