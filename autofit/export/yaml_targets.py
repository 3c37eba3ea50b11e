"""Key lists of the YAML-configured trainers, kept with the exporter and versioned.

axolotl and LLaMA-Factory are not dependencies of autofit: these are the keys of the
versions named, checked by the tests against what the exporters write.
"""

from __future__ import annotations

from typing import TypedDict

import yaml

from autofit.config.spec import training_argument_values
from autofit.export.common import ExportRun, Rendered, comment_block
from autofit.export.winner import describe


class Axolotl(TypedDict):
    version: str
    keys: set[str]
    dpo_version: str
    dpo_keys: set[str]
    """`rl: dpo`'s keys, of `dpo_version` (precompute_ref_log_probs is 0.16's, truncating a preference row 0.17's)."""
    fsdp_config: set[str]
    optimizers: set[str]


class LlamaFactory(TypedDict):
    version: str
    keys: set[str]
    flash_attn: dict[str, str]
    """LLaMA-Factory's `flash_attn` value for each attn_implementation it can say."""


class Accelerate(TypedDict):
    version: str
    keys: set[str]
    fsdp_config: set[str]


AXOLOTL_LIGER_PLUGIN = "axolotl.integrations.liger.LigerPlugin"

AXOLOTL: Axolotl = {
    "version": "0.12",
    "keys": {
        "base_model", "model_type", "tokenizer_type", "load_in_8bit", "load_in_4bit", "adapter",
        "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_linear", "sequence_len",
        "sample_packing",
        "pad_to_sequence_len", "micro_batch_size", "gradient_accumulation_steps", "max_steps",
        "num_epochs", "optimizer", "learning_rate", "lr_scheduler", "bf16", "fp16", "tf32",
        "gradient_checkpointing", "gradient_checkpointing_kwargs", "sdp_attention", "flash_attention",
        "eager_attention", "datasets", "output_dir", "logging_steps", "seed", "bnb_config_kwargs",
        # integrations/liger/args.py (LigerArgs) with the plugin; schemas/config.py (torch_compile*,
        # flex_attention)
        "plugins", "liger_rope", "liger_rms_norm", "liger_glu_activation", "liger_fused_linear_cross_entropy",
        "liger_cross_entropy", "torch_compile", "torch_compile_backend", "flex_attention",
        "group_by_length", "batch_flattening", "chat_template",
        # schemas/config.py; prompt_strategies/chat_template.py trains a turn where train_on_inputs or its role is
        # in roles_to_train (["assistant"] by default)
        "train_on_inputs",
        # docs/multi-gpu.qmd: DeepSpeed (a JSON path) and FSDP2 (schemas/fsdp.py FSDPConfig below)
        "deepspeed", "fsdp_version", "fsdp_config",
    },
    # schemas/config.py (rl, rl_beta, dpo_loss_type, precompute_ref_log_probs, dpo_use_liger_kernel,
    # excess_length_strategy); utils/data/rl.py truncates a preference row under excess_length_strategy: truncate;
    # the dataset types are prompt_strategies/dpo/ (user_defined, chat_template.default/argilla_chat)
    "dpo_version": "0.17",
    "dpo_keys": {"rl", "rl_beta", "dpo_loss_type", "precompute_ref_log_probs", "dpo_use_liger_kernel",
                 "excess_length_strategy"},
    "fsdp_config": {"offload_params", "state_dict_type", "auto_wrap_policy", "reshard_after_forward",
                    "activation_checkpointing", "transformer_layer_cls_to_wrap", "cpu_ram_efficient_loading"},
    "optimizers": {"adamw_torch", "adamw_torch_fused", "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit",
                   "paged_adamw_32bit", "adafactor", "sgd", "lion_8bit", "paged_lion_8bit"},
}

LLAMA_FACTORY: LlamaFactory = {
    "version": "0.9.3",
    "keys": {
        "model_name_or_path", "stage", "do_train", "finetuning_type", "lora_rank", "lora_alpha",
        "lora_dropout", "lora_target", "quantization_bit", "quantization_method", "double_quantization",
        "quantization_type", "dataset", "template", "cutoff_len", "packing", "per_device_train_batch_size",
        "gradient_accumulation_steps", "learning_rate", "max_steps", "bf16", "fp16", "pure_bf16", "optim",
        "output_dir", "flash_attn", "disable_gradient_checkpointing", "logging_steps", "seed",
        "lr_scheduler_type", "report_to", "overwrite_output_dir", "neat_packing", "group_by_length",
        # hparams/model_args.py (enable_liger_kernel); torch_compile is a Seq2SeqTrainingArguments field
        "enable_liger_kernel", "torch_compile",
        # a Seq2SeqTrainingArguments field: the DeepSpeed JSON's path (examples/deepspeed/)
        "deepspeed",
        # hparams/finetuning_args.py (stage: dpo, examples/train_lora/llama3_lora_dpo.yaml); the preference file
        # is a `ranking` entry of data/dataset_info.json (data/README.md)
        "pref_beta", "pref_loss", "ref_model", "ref_model_quantization_bit",
        # hparams/data_args.py: the prompt's tokens trained too (SFT only; hparams/parser.py refuses it elsewhere)
        "train_on_prompt",
    },
    "flash_attn": {"sdpa": "sdpa", "eager": "disabled", "flash_attention_2": "fa2"},
}

ACCELERATE: Accelerate = {
    "version": "1.16",
    # commands/config/config_args.py ClusterConfig (the config file), commands/launch.py (its fsdp_* options)
    "keys": {"compute_environment", "distributed_type", "fsdp_config", "mixed_precision", "machine_rank",
             "num_machines", "num_processes", "rdzv_backend", "same_network", "use_cpu"},
    "fsdp_config": {"fsdp_version", "fsdp_auto_wrap_policy", "fsdp_reshard_after_forward",
                    "fsdp_offload_params", "fsdp_activation_checkpointing", "fsdp_state_dict_type"},
}
"""The accelerate config file LLaMA-Factory's FSDP2 recipe is launched with."""


def yaml_recipe(r: ExportRun, body: dict[str, object], allowed: set[str], intro: list[str],
                lost: list[str], fmt: str) -> Rendered:
    """A YAML config: provenance and intro as comments, the keys, what could not be expressed. The dimensions
    declared with a TrialConfig field that `fmt` takes by name are written as that field; the others it lists
    as not expressed (`config.spec.training_argument_values`, `not_kept`)."""
    w = describe(r)
    declared = {k: v for k, v in training_argument_values(r.config, fmt).items() if k in w.training_for(fmt)}
    body, lost = {**body, **declared}, [*lost, *w.not_kept(fmt)]
    unknown = set(body) - allowed - set(declared)
    assert not unknown, unknown  # the versioned key list and the exporter move together
    tail = comment_block([f"NOT EXPRESSED: {x}" for x in lost]) + "\n" if lost else ""
    text = comment_block(r.provenance() + intro) + "\n" + yaml.safe_dump(body, sort_keys=False) + tail
    return Rendered(text, lost)
