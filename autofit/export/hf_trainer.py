"""`--format hf-trainer`: a standalone transformers Trainer + peft script."""

from __future__ import annotations

from autofit.export.common import ExportRun, Rendered, check_fields
from autofit.export.data_script import DATA_HELPERS, HF_DATA_MAIN, data_header, data_settings
from autofit.export.fields import installed_fields, versions
from autofit.export.multi_gpu import script_launch, script_main
from autofit.export.script_parts import (
    BLOCK_HELPERS,
    HELPERS,
    TAIL,
    check_fsdp_fields,
    checked_names,
    header,
    settings,
)

MAIN = '''

def main():
    a, tokenizer, blocks, model = prepare()  # first: a bad argument or dataset is said before the imports
    from transformers import Trainer, TrainingArguments

    data = [{"input_ids": b, "labels": list(b), "attention_mask": [1] * len(b)} for b in blocks]
    args = TrainingArguments(output_dir=a.output_dir, **{**TRAINING_ARGS, "max_steps": a.max_steps})
    short = below_one_step(len(blocks), args.per_device_train_batch_size * args.gradient_accumulation_steps
                           * args.world_size, "block")
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[throughput_callback(token_counter(model, trained=False), short)])
'''


def render(r: ExportRun) -> Rendered:
    names, have, v = checked_names(r), installed_fields(), versions()
    check_fields(have["TrainingArguments"], names["training"],
                 f"transformers {v['transformers']} TrainingArguments")
    check_fsdp_fields(names, have)
    check_fields(have["LoraConfig"], names["lora"], f"peft {v['peft']} LoraConfig")
    check_fields(have["BitsAndBytesConfig"], names["quant"],
                 f"transformers {v['transformers']} BitsAndBytesConfig")
    check_fields(have["prepare_model_for_kbit_training"], names["kbit"],
                 f"peft {v['peft']} prepare_model_for_kbit_training")
    cfg = r.config
    if r.dataset is not None:  # searched with --dataset: the measured batching, samples truncated
        return Rendered(data_header(header(r, "train.py"), cfg.batching, r.dataset) + settings(r)
                        + data_settings(cfg.batching, cfg.micro_batch_size, r.dataset) + HELPERS
                        + DATA_HELPERS
                        + script_main(HF_DATA_MAIN, cfg) + TAIL, launch=script_launch(cfg))
    return Rendered(header(r, "train.py") + settings(r) + HELPERS + BLOCK_HELPERS + script_main(MAIN, cfg)
                    + TAIL,
                    launch=script_launch(cfg))
