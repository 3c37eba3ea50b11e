"""`--format llama-factory`: a LLaMA-Factory training YAML."""

from __future__ import annotations

import json

from autofit.config.recipe import REGIONAL_COMPILATION
from autofit.config.spec import ALL_LINEAR
from autofit.export.common import ExportRun, Rendered, data_form, with_engine, yaml_recipe
from autofit.export.data_yaml import llama_factory_batching
from autofit.export.multi_gpu import ACCELERATE_FSDP, yaml_intro
from autofit.export.multi_gpu import llama_factory as engine_keys
from autofit.export.winner import describe
from autofit.export.yaml_targets import LLAMA_FACTORY


def render(r: ExportRun) -> Rendered:
    w = describe(r)  # what the search decided, as every format reads it
    cfg = w.config
    lost: list[str] = []
    out: dict[str, object] = {
        "model_name_or_path": r.weights_ref,
        "stage": "sft",
        "do_train": True,
        "finetuning_type": cfg.method,
    }
    if cfg.method == "lora":
        out.update({"lora_rank": cfg.lora_r, "lora_alpha": cfg.lora_alpha,
                    "lora_dropout": float(cfg.lora_dropout),
                    "lora_target": "all" if cfg.lora_targets == ALL_LINEAR else cfg.lora_targets})
    if cfg.quantization != "none":
        out.update({"quantization_bit": 4 if cfg.quantization == "nf4" else 8,
                    "quantization_method": "bitsandbytes"})
        if cfg.quantization == "nf4":
            out.update({"quantization_type": "nf4", "double_quantization": True})
    out.update({
        "dataset": "my_dataset",
        "template": "empty",
        "cutoff_len": w.max_length,
        "packing": True,  # full cutoff_len blocks, as measured
        "per_device_train_batch_size": w.micro_batch_size,
        "gradient_accumulation_steps": w.accumulation,
        "learning_rate": w.training["learning_rate"],
        "max_steps": 1000,
        "bf16": w.training["bf16"],
        "fp16": w.training["fp16"],
        "optim": w.training["optim"],
        # LLaMA-Factory checkpoints every layer unless told not to
        "disable_gradient_checkpointing": cfg.checkpoint_every == 0,
        "output_dir": "./autofit-out",
        "report_to": "none",
    })
    register = "Register my_dataset in data/dataset_info.json first."
    if r.dataset is not None:  # searched with --dataset: the measured batching, on the measured rows
        batching, missing = llama_factory_batching(cfg)
        out.update(batching)
        lost += missing
        form = data_form(r.dataset)
        lost += [form.note] if form.note else []
        if form.chat:
            entry = {"file_name": r.dataset.path, "formatting": "sharegpt",
                     "columns": {"messages": r.dataset.messages_field},
                     "tags": {"role_tag": form.role, "content_tag": form.content,
                              "user_tag": "human" if "human" in form.roles else "user",
                              "assistant_tag": "gpt" if "gpt" in form.roles else "assistant",
                              "system_tag": "system"}}
            lost.append("chats were measured rendered with the tokenizer's own chat template: set `template` "
                        "to your model's LLaMA-Factory template name (empty adds no role markers)")
        else:  # text trained on every token, as measured: LLaMA-Factory's pre-training stage and format
            out["stage"] = "pt"
            entry = {"file_name": r.dataset.path, "columns": {"prompt": r.dataset.text_field}}
        register = f"Register it in data/dataset_info.json first: \"my_dataset\": {json.dumps(entry)}"
    if cfg.checkpoint_every > 1 or cfg.checkpoint_offload:
        lost.append(f"gradient_checkpointing={cfg.gradient_checkpointing}: LLaMA-Factory "
                    f"{LLAMA_FACTORY['version']} checkpoints every layer or none; written as every layer")
    if cfg.liger:
        out["enable_liger_kernel"] = True  # apply_liger_kernel_to_<model_type>() before the model loads
    if cfg.torch_compile:
        out["torch_compile"] = True  # a TrainingArguments field, passed through
    if cfg.method == "full" and cfg.precision == "bf16" and cfg.engine == "zero3":
        lost.append("method=full with precision=bf16 and engine=zero3: LLaMA-Factory "
                    f"{LLAMA_FACTORY['version']} refuses pure_bf16 under ZeRO-3; written without it "
                    "(DeepSpeed's bf16 mode keeps fp32 master weights of its own, as in the probe)")
    elif cfg.method == "full" and cfg.precision == "bf16":
        out["pure_bf16"] = True  # autofit trained bf16 weights directly
    flash = LLAMA_FACTORY["flash_attn"].get(cfg.attn_implementation)
    if flash:
        out["flash_attn"] = flash
    else:
        lost.append(f"attn_implementation={cfg.attn_implementation}: no LLaMA-Factory flash_attn value")
    if cfg.torch_compile:
        lost.append("torch_compile=on was measured compiled per decoder block (regional compilation, the "
                    f"loss eager): not a LLaMA-Factory key; export {REGIONAL_COMPILATION}=1 before "
                    "`llamafactory-cli train`")
    if cfg.expandable_segments:
        lost.append("expandable_segments=True: not a LLaMA-Factory key; export "
                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before `llamafactory-cli train`")
    return with_gpus(r, out, lost, register)


def with_gpus(r: ExportRun, out: dict[str, object], lost: list[str], register: str) -> Rendered:
    """The recipe with its multi-GPU keys, the files they name, and how to launch it."""
    cfg = r.config
    engine, companions, launch = engine_keys(cfg)
    out.update(engine)
    run = launch.format(recipe="this.yaml") if launch else "llamafactory-cli train this.yaml"
    intro = [f"LLaMA-Factory config (keys of LLaMA-Factory {LLAMA_FACTORY['version']}). Run: {run}",
             register, *yaml_intro(cfg, companions)]
    if ACCELERATE_FSDP in companions:
        intro += [f"FSDP2 through accelerate ({ACCELERATE_FSDP}, as LLaMA-Factory 0.9.4's "
                  "examples/accelerate/fsdp2_config.yaml; src/train.py of a checkout runs the same as "
                  "-m llamafactory.launcher); FSDP's activation checkpointing replaces LLaMA-Factory's."]
    return with_engine(yaml_recipe(r, out, LLAMA_FACTORY["keys"], intro, lost, "llama-factory"), companions,
                       launch)
