"""`--format llama-factory`: a LLaMA-Factory training YAML."""

from __future__ import annotations

import json

from autofit.config.recipe import REGIONAL_COMPILATION
from autofit.config.spec import ALL_LINEAR
from autofit.export.common import ExportRun, Rendered, data_form, with_engine
from autofit.export.data_yaml import llama_factory_batching
from autofit.export.multi_gpu import ACCELERATE_FSDP, yaml_intro
from autofit.export.multi_gpu import llama_factory as engine_keys
from autofit.export.winner import Winner, describe, pair_form
from autofit.export.yaml_targets import LLAMA_FACTORY, yaml_recipe

CHAT_FORMAT = ("the chat format as measured: LLaMA-Factory renders chats with its own `template`, not with the "
               "tokenizer's chat template the search used (or, where the tokenizer had none, its plain <|role|> "
               "lines): set `template` to your model's LLaMA-Factory template name (empty adds no role markers)")
"""What a chat run's recipe cannot keep: the rendering is LLaMA-Factory's choice."""


def render(r: ExportRun) -> Rendered:
    w = describe(r)  # what the search decided, as every format reads it
    cfg = w.config
    lost: list[str] = []
    out: dict[str, object] = {
        "model_name_or_path": r.weights_ref,
        "stage": "sft" if w.preference is None else "dpo",
        **({"pref_beta": w.preference.beta, "pref_loss": w.preference.loss} if w.preference is not None else {}),
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
    if w.preference is not None:
        missing, register = preference_keys(r, w, out)
        lost += missing
    elif r.dataset is not None:  # searched with --dataset: the measured batching, on the measured rows
        form = data_form(r.dataset)
        batching, missing = llama_factory_batching(cfg, pretraining=not form.chat)
        out.update(batching)
        lost += missing
        lost += [form.note] if form.note else []
        if form.chat:
            entry = {"file_name": r.dataset.path, "formatting": "sharegpt",
                     "columns": {"messages": r.dataset.messages_field},
                     "tags": {"role_tag": form.role, "content_tag": form.content,
                              "user_tag": "human" if "human" in form.roles else "user",
                              "assistant_tag": "gpt" if "gpt" in form.roles else "assistant",
                              "system_tag": "system"}}
            lost.append(CHAT_FORMAT)
            out["train_on_prompt"] = True  # every token trained, as measured (SFT masks the prompt otherwise)
        else:  # text trained on every token, as measured: LLaMA-Factory's pre-training stage and format
            out["stage"] = "pt"
            entry = {"file_name": r.dataset.path, "columns": {"prompt": r.dataset.text_field}}
        register = f"Register it in data/dataset_info.json first: \"my_dataset\": {json.dumps(entry)}"
    else:  # measured on full max_length rows: the pre-training stage joins the texts and cuts them into such blocks
        out.update({"stage": "pt", "cutoff_len": w.max_length + 1})  # packing takes one off cutoff_len
        entry = {"file_name": "data.jsonl", "columns": {"prompt": "text"}}
        register = f"Register your text file in data/dataset_info.json first: \"my_dataset\": {json.dumps(entry)}"
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


def preference_keys(r: ExportRun, w: Winner, out: dict[str, object]) -> tuple[list[str], str]:
    """A DPO winner's keys beside `stage: dpo` (the reference, the padding), in `out`; (what LLaMA-Factory cannot
    keep, the line that registers the preference file in data/dataset_info.json: a `ranking` entry)."""
    cfg, pref, version = w.config, w.preference, LLAMA_FACTORY["version"]
    assert pref is not None
    batching, lost = llama_factory_batching(cfg)  # pad_longest or pad_max: its collator pads to the longest
    out.update(batching)
    lost += [f"max_length={w.max_length}: LLaMA-Factory cuts a pair longer than cutoff_len in its prompt and its "
             "completions both (in proportion, infer_seqlen) where TRL keeps the start: long pairs train other "
             "tokens",
             f"trainer=dpo: LLaMA-Factory {version}'s DPO trainer holds each row's full logits in fp32 (TRL's fused "
             "LM head, which the probe ran, holds log-probabilities in tiles): more memory than measured"]
    if pref.precompute_ref_log_probs:
        lost.append(f"precompute_ref_log_probs=True: LLaMA-Factory {version}'s DPO trainer never precomputes "
                    "them: the reference runs a forward every step, slower and with more memory than measured")
    if cfg.method == "lora" and pref.reference == "copy":  # else the base with the adapter disabled
        out["ref_model"] = r.weights_ref
        if cfg.quantization != "none":  # the copy loaded as the policy's base was
            out["ref_model_quantization_bit"] = out["quantization_bit"]
    if cfg.method == "full" and pref.reference == "shared":
        lost.append(f"dpo_reference=shared with method=full: LLaMA-Factory {version} loads a reference copy "
                    "for full fine-tuning: more memory than measured")
    form = pair_form(r.dataset)
    path = r.dataset.path if r.dataset is not None else "prefs.jsonl"
    prompt = "messages" if form.conversational else "prompt"  # sharegpt: the conversation before the replies
    entry: dict[str, object] = {"file_name": path, "ranking": True,
                                "columns": {prompt: "prompt", "chosen": "chosen", "rejected": "rejected"}}
    if form.conversational:
        entry.update({"formatting": "sharegpt", "tags": {"role_tag": "role", "content_tag": "content",
                                                         "user_tag": "user", "assistant_tag": "assistant",
                                                         "system_tag": "system"}})
        lost += ["conversations: LLaMA-Factory's sharegpt preference rows hold chosen and rejected as one "
                 "{role, content} message each, TRL's as lists of messages: give each row its completion's last "
                 "message" + (", and the messages chosen and rejected share as a 'prompt' list" if form.implicit
                              else ""),
                 CHAT_FORMAT]
    elif form.implicit:
        lost.append("the rows have no 'prompt' (TRL took the shared start of chosen and rejected as it); "
                    "LLaMA-Factory's ranking rows need one: add a 'prompt' field holding that start and cut it "
                    "from chosen and rejected")
    lost += [form.note] if form.note else []
    return lost, f"Register it in data/dataset_info.json first: \"my_dataset\": {json.dumps(entry)}"
