"""`--format hf-trainer`: a standalone transformers Trainer + peft script."""

from __future__ import annotations

from .common import ExportRun, Rendered, check_fields, quiet_bitsandbytes
from .data_script import DATA_HELPERS, HF_DATA_MAIN, data_header, data_settings
from .script_parts import HELPERS, TAIL, checked_names, header, settings

MAIN = '''

def main():
    from transformers import Trainer, TrainingArguments

    a, tokenizer, blocks, model = prepare()
    data = [{"input_ids": b, "labels": list(b), "attention_mask": [1] * len(b)} for b in blocks]
    args = TrainingArguments(output_dir=a.output_dir, **{**TRAINING_ARGS, "max_steps": a.max_steps})
    tokens_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * MAX_LENGTH
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[throughput_callback(tokens_per_step)])
'''


def render(r: ExportRun) -> Rendered:
    quiet_bitsandbytes()
    # Deferred: transformers and peft import torch (seconds); only this check needs them.
    import peft
    import transformers

    names = checked_names(r)
    check_fields(transformers.TrainingArguments, names["training"], f"transformers {transformers.__version__} "
                 "TrainingArguments")
    check_fields(peft.LoraConfig, names["lora"], f"peft {peft.__version__} LoraConfig")
    check_fields(transformers.BitsAndBytesConfig, names["quant"], "transformers BitsAndBytesConfig")
    check_fields(peft.prepare_model_for_kbit_training, names["kbit"], "peft prepare_model_for_kbit_training")
    if r.dataset is not None:  # searched with --dataset: the measured batching, samples truncated
        cfg = r.config
        return Rendered(data_header(header(r, "train.py"), cfg.batching) + settings(r)
                        + data_settings(cfg.batching, cfg.micro_batch_size, r.dataset) + HELPERS + DATA_HELPERS
                        + HF_DATA_MAIN + TAIL)
    return Rendered(header(r, "train.py") + settings(r) + HELPERS + MAIN + TAIL)
