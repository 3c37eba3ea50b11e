"""`--format hf-trainer`: a standalone transformers Trainer + peft script (`script.render_script`)."""

from __future__ import annotations

from autofit.core.errors import UsageError
from autofit.export.common import ExportRun, Rendered, check_fields
from autofit.export.fields import installed_fields, versions
from autofit.export.multi_gpu import script_launch
from autofit.export.script import render_script, sampling_fields
from autofit.export.winner import Winner, describe


def check_names(w: Winner, training: set[str], trainer: str = "TrainingArguments") -> None:
    """The constructors' argument names the recipe writes, against the installed libraries (both formats):
    `trainer`'s fields (TrainingArguments, or TRL's SFTConfig), its fsdp_config keys, LoraConfig,
    BitsAndBytesConfig and prepare_model_for_kbit_training."""
    have, v = installed_fields(), versions()
    library = f"trl {v['trl']}" if trainer in ("SFTConfig", "DPOConfig") else f"transformers {v['transformers']}"
    check_fields(have[trainer], training, f"{library} {trainer}")
    check_fields(have["fsdp_config"], w.training.get("fsdp_config", {}),
                 f"transformers {v['transformers']} TrainingArguments fsdp_config (its documented keys)")
    check_fields(have["LoraConfig"], w.lora or {}, f"peft {v['peft']} LoraConfig")
    check_fields(have["BitsAndBytesConfig"], w.quantization or {},
                 f"transformers {v['transformers']} BitsAndBytesConfig")
    check_fields(have["prepare_model_for_kbit_training"], w.kbit or {},
                 f"peft {v['peft']} prepare_model_for_kbit_training")


def render(r: ExportRun) -> Rendered:
    w = describe(r)
    if w.trainer == "dpo":
        raise UsageError("--format hf-trainer: the winner trains preference pairs (trainer=dpo), which "
                         "transformers' Trainer does not; export it with --format trl (TRL's DPOTrainer).")
    check_names(w, set(w.training_for("hf-trainer")) | set(sampling_fields(w)))
    notes = []
    if w.batching == "packed":
        notes.append("batching=packed: the hf-trainer recipe packs with TRL's pack_dataset (best-fit decreasing, "
                     "as measured): it needs trl installed")
    lost = w.not_kept("hf-trainer")
    return Rendered(render_script(r, w, "hf-trainer", "train.py", lost), lost, notes=notes,
                    launch=script_launch(w.config))
