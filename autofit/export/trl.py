"""`--format trl`: the same recipe through TRL's SFTTrainer and SFTConfig.

TRL's defaults differ from Trainer's (checkpointing on, learning rate 2e-5, length 1024,
packing off, packing strategy `bfd` which needs FlashAttention): every setting is written.
"""

from __future__ import annotations

from autofit.core.errors import UsageError
from autofit.export.common import ExportRun, Rendered, check_fields, comment_block
from autofit.export.data_script import DATA_HELPERS, TRL_DATA_MAIN, data_header, data_settings, trl_batching
from autofit.export.fields import installed_fields, trl_installed, versions
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

TRL_ARGS = {"max_length", "packing", "packing_strategy", "dataset_text_field", "padding_free"}

MAIN = '''

def main():
    # Tokenized and packed the same way as the Trainer recipe; TRL's own "wrapped" packing then
    # keeps these full MAX_LENGTH blocks as they are.
    a, tokenizer, blocks, model = prepare()  # first: a bad argument or dataset is said before the imports
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    data = Dataset.from_dict({"input_ids": blocks})
    config = SFTConfig(
        output_dir=a.output_dir,
        **{**TRAINING_ARGS, "max_steps": a.max_steps},
        max_length=MAX_LENGTH,
        packing=True,
        packing_strategy="wrapped",  # the default "bfd" needs FlashAttention
        padding_free=False,
        dataset_text_field="text",
    )
    short = below_one_step(len(blocks), config.per_device_train_batch_size * config.gradient_accumulation_steps
                           * config.world_size, "block")
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                         callbacks=[throughput_callback(token_counter(model, trained=False), short)])
'''  # noqa: E501  a recipe's own code, written as it is


def render(r: ExportRun) -> Rendered:
    if not trl_installed():
        raise UsageError("--format trl: TRL is not installed; `pip install 'autofit[trl]'` (or `pip install "
                         "trl`) and export again.")
    names, have, version = checked_names(r), installed_fields(), versions()["trl"]
    check_fields(have["SFTConfig"], set(names["training"]) | TRL_ARGS, f"trl {version} SFTConfig")
    check_fsdp_fields(names, have)
    notes = []
    if r.config.liger:
        notes.append(f"liger=on: trl {version} SFTTrainer applies Liger's layer kernels only "
                     "(use_liger_kernel is deprecated there) and its own fused LM head instead of Liger's "
                     "fused cross-entropy: speed and peak differ from the probe's Trainer run")
    if r.dataset is not None:  # searched with --dataset: the measured batching in SFTConfig's terms
        cfg = r.config
        trl_args, differs = trl_batching(cfg.batching, cfg.micro_batch_size, cfg.max_length)
        check_fields(have["SFTConfig"], set(trl_args), f"trl {version} SFTConfig")
        comment = comment_block([f"DIFFERS FROM THE PROBE: {d}" for d in differs]) + "\n" if differs else ""
        return Rendered(data_header(header(r, "train_trl.py"), cfg.batching, r.dataset) + settings(r)
                        + data_settings(cfg.batching, cfg.micro_batch_size, r.dataset)
                        + f"TRL_BATCHING = {trl_args!r}\n" + comment + HELPERS + DATA_HELPERS
                        + script_main(TRL_DATA_MAIN, cfg) + TAIL, [*differs, *notes],
                        launch=script_launch(cfg))
    return Rendered(header(r, "train_trl.py") + settings(r) + HELPERS + BLOCK_HELPERS
                    + script_main(MAIN, r.config) + TAIL, notes,
                    launch=script_launch(r.config))
