"""`--format axolotl`: an axolotl YAML config."""

from __future__ import annotations

from autofit.config.recipe import REGIONAL_COMPILATION
from autofit.config.spec import ALL_LINEAR, TrialConfig
from autofit.export.common import ExportRun, Rendered, data_form, with_engine
from autofit.export.data_yaml import axolotl_batching
from autofit.export.multi_gpu import axolotl as engine_keys
from autofit.export.multi_gpu import yaml_intro
from autofit.export.winner import Winner, describe, pair_form
from autofit.export.yaml_targets import AXOLOTL, AXOLOTL_LIGER_PLUGIN, yaml_recipe


def render(r: ExportRun) -> Rendered:
    w = describe(r)  # what the search decided, as every format reads it
    cfg = w.config
    lost: list[str] = []
    out: dict[str, object] = {
        "base_model": r.weights_ref,
        "model_type": "AutoModelForCausalLM",
        **({"rl": "dpo"} if w.preference is not None else {}),  # preference pairs: TRL's DPOTrainer under axolotl
        "load_in_8bit": cfg.quantization == "8bit",
        "load_in_4bit": cfg.quantization == "nf4",
    }
    if cfg.method == "lora":
        out.update({"adapter": "qlora" if cfg.quantization == "nf4" else "lora", "lora_r": cfg.lora_r,
                    "lora_alpha": cfg.lora_alpha, "lora_dropout": float(cfg.lora_dropout),
                    **({"lora_target_linear": True} if cfg.lora_modules == ALL_LINEAR
                       else {"lora_target_modules": cfg.lora_modules})})
    if cfg.quantization == "nf4":
        out["bnb_config_kwargs"] = {"bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}
    out.update({
        "sequence_len": w.max_length,
        "sample_packing": True,  # full max_length blocks, as measured
        "pad_to_sequence_len": True,
        "micro_batch_size": w.micro_batch_size,
        "gradient_accumulation_steps": w.accumulation,
        "max_steps": 1000,
        "optimizer": w.training["optim"],
        "learning_rate": w.training["learning_rate"],
        "bf16": w.training["bf16"],
        "fp16": w.training["fp16"],
        "tf32": False,
    })
    every, offload = cfg.checkpoint_every, cfg.checkpoint_offload
    if every == 0:
        out["gradient_checkpointing"] = False
    elif offload:
        out["gradient_checkpointing"] = "offload"
    else:
        out["gradient_checkpointing"] = True
        out["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    if every > 1:
        lost.append(f"gradient_checkpointing={cfg.gradient_checkpointing}: axolotl {AXOLOTL['version']} "
                    "checkpoints every layer or none; written as every layer (more memory headroom, slower "
                    "than measured)")
    attn = {"sdpa": "sdp_attention", "flash_attention_2": "flash_attention", "eager": "eager_attention",
            "flex_attention": "flex_attention"}
    out.update(kernel_keys(cfg))
    if cfg.attn_implementation in attn:
        out[attn[cfg.attn_implementation]] = True
    else:
        lost.append(f"attn_implementation={cfg.attn_implementation}: no axolotl {AXOLOTL['version']} key")
    if cfg.expandable_segments:
        lost.append("expandable_segments=True: not an axolotl key; export "
                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before `axolotl train`")
    if cfg.torch_compile:
        lost.append("torch_compile=on was measured compiled per decoder block (regional compilation, the "
                    f"loss eager): not an axolotl key; export {REGIONAL_COMPILATION}=1 before `axolotl "
                    "train`")
    if w.preference is not None:
        lost += preference_keys(r, w, out)
    else:
        out["datasets"] = [{"path": "data.jsonl", "type": "completion"}]
        if r.dataset is not None:  # searched with --dataset: the measured batching on the measured file
            batching, missing = axolotl_batching(cfg)
            out.update(batching)
            lost += missing
            form = data_form(r.dataset)
            if form.chat:  # rendered with the tokenizer's own chat template, as the probe measured
                out["datasets"] = [{"path": r.dataset.path, "type": "chat_template",
                                    "field_messages": r.dataset.messages_field,
                                    "message_property_mappings": {"role": form.role, "content": form.content}}]
                out["chat_template"] = "tokenizer_default"
                out["train_on_inputs"] = True  # every turn trained, as measured (the assistant's alone otherwise)
            else:
                out["datasets"] = [{"path": r.dataset.path, "type": "completion",
                                    "field": r.dataset.text_field}]
            lost += [form.note] if form.note else []
    out["output_dir"] = "./autofit-out"
    return with_gpus(r, out, lost)


def with_gpus(r: ExportRun, out: dict[str, object], lost: list[str]) -> Rendered:
    """The recipe with its multi-GPU keys, the files they name, and how to launch it."""
    cfg = r.config
    engine, companions, launch = engine_keys(cfg)
    if cfg.engine == "fsdp2":  # FSDP's activation_checkpointing (in fsdp_config) replaces axolotl's
        out["gradient_checkpointing"] = False
        out.pop("gradient_checkpointing_kwargs", None)
    out.update(engine)
    fsdp = out.get("fsdp_config", {})
    # the versioned key list moves with this
    assert isinstance(fsdp, dict) and set(fsdp) <= AXOLOTL["fsdp_config"]
    run = launch.format(recipe="this.yaml") if launch else "axolotl train this.yaml"
    keys = f"keys of axolotl {AXOLOTL['version']}" + (f", DPO keys of {AXOLOTL['dpo_version']}" if "rl" in out
                                                       else "")
    intro = [f"axolotl config ({keys}). Run: {run}",
             *yaml_intro(cfg, companions)]
    return with_engine(yaml_recipe(r, out, AXOLOTL["keys"] | AXOLOTL["dpo_keys"], intro, lost, "axolotl"),
                       companions, launch)


def preference_keys(r: ExportRun, w: Winner, out: dict[str, object]) -> list[str]:
    """A DPO winner's keys (`rl: dpo` runs TRL's DPOTrainer): its loss, the reference, the length rule and the
    preference file's dataset entry, in `out`; what axolotl cannot keep, returned."""
    cfg, pref, version = w.config, w.preference, AXOLOTL["dpo_version"]
    assert pref is not None
    lost: list[str] = []
    out.pop("pad_to_sequence_len", None)  # a supervised fine-tuning collator's key
    out.update({"rl_beta": pref.beta, "dpo_loss_type": [pref.loss],
                "precompute_ref_log_probs": pref.precompute_ref_log_probs,
                # TRL cuts a longer row at max_length keeping the start; axolotl's default drops the pair
                "excess_length_strategy": "truncate", "sample_packing": False})
    if cfg.batching == "pad_max":
        lost.append(f"batching=pad_max: axolotl {version}'s DPO pad_to_multiple_of pads the prompt and each "
                    "completion apart, not each row to sequence_len; written as dynamic padding (pad_longest), "
                    "which uses less memory than measured")
    if cfg.method == "lora" and pref.reference == "copy":
        lost.append(f"dpo_reference=copy: axolotl {version} takes the base with the adapter disabled as the "
                    "reference under LoRA (rl_adapter_ref_model is not in its config schema: validation drops "
                    "it); written as shared, which uses less memory than measured")
    if cfg.method == "full" and pref.reference == "shared":
        lost.append(f"dpo_reference=shared with method=full: axolotl {version} loads a reference copy whenever "
                    "there is no adapter, precomputed log-probabilities or not: more memory than measured")
    form = pair_form(r.dataset)
    path = r.dataset.path if r.dataset is not None else "prefs.jsonl"
    if form.conversational:  # axolotl's chat_template types; the tokenizer's template, as the probe's
        out["datasets"] = [{"path": path, "type": "chat_template.argilla_chat"} if form.implicit else
                           {"path": path, "type": "chat_template.default", "field_messages": "prompt"}]
        out["chat_template"] = "tokenizer_default"
        lost.append("conversations were measured as TRL renders them with the tokenizer's chat template; "
                    "axolotl renders the prompt with the generation prompt and each completion's last message "
                    "from the content on, trailing whitespace stripped: a few tokens a row may differ")
        if form.long_completions:
            lost.append(f"{form.long_completions} pair(s) have a completion of several messages: axolotl's "
                        "chat_template types train the last message of each and take the messages before the "
                        "chosen one's last as the prompt")
    else:  # user_defined: the fields as they are, the prompt and completions as written
        out["datasets"] = [{"path": path, "type": {"field_prompt": "prompt", "field_chosen": "chosen",
                                                   "field_rejected": "rejected"}}]
        if form.implicit:
            lost.append("the rows have no 'prompt' (TRL took the shared start of chosen and rejected as it); "
                        "axolotl's DPO datasets need one: add a 'prompt' field holding that start and cut it from "
                        "chosen and rejected")
    return lost + ([form.note] if form.note else [])

def kernel_keys(cfg: TrialConfig) -> dict[str, object]:
    """Liger through axolotl's plugin, the kernels Trainer's `use_liger_kernel` applies by default
    (rope, rms_norm, glu, fused linear cross-entropy; the plain cross-entropy off); torch.compile. A DPO winner's
    Liger is DPOConfig's `use_liger_kernel` as the probe set it (`dpo_use_liger_kernel`): TRL applies the layer
    kernels and keeps its own fused LM head, which the plugin's fused cross-entropy would replace."""
    out: dict[str, object] = {}
    if cfg.liger and cfg.trainer == "dpo":
        out["dpo_use_liger_kernel"] = True
    elif cfg.liger:
        out.update({"plugins": [AXOLOTL_LIGER_PLUGIN], "liger_rope": True, "liger_rms_norm": True,
                    "liger_glu_activation": True, "liger_fused_linear_cross_entropy": True,
                    "liger_cross_entropy": False})
    if cfg.torch_compile:
        out.update({"torch_compile": True, "torch_compile_backend": "inductor"})
    return out
