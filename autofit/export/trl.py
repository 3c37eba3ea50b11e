"""`--format trl`: the same recipe through TRL's SFTTrainer and SFTConfig (`script.render_script`).

TRL's defaults differ from Trainer's (checkpointing on, learning rate 2e-5, length 1024, packing strategy
`bfd`): every setting is written.
"""

from __future__ import annotations

from autofit.core.errors import UsageError
from autofit.export.common import ExportRun, Rendered
from autofit.export.dpo import render_dpo, training
from autofit.export.fields import trl_installed, versions
from autofit.export.hf_trainer import check_names
from autofit.export.multi_gpu import script_launch
from autofit.export.script import render_script, sampling_fields, sft_fields
from autofit.export.winner import Winner, describe


def differences(w: Winner, version: str) -> list[str]:
    """What TRL trains otherwise than the probe's run: settings it cannot keep, written as comments and warned
    about. Liger is one for SFT: the probe's Trainer ran Liger's fused cross-entropy, which SFTTrainer replaces by
    its own fused LM head (a DPO probe ran DPOTrainer, which the recipe runs too)."""
    out = []
    if w.config.liger and w.trainer == "sft":
        out.append(f"liger=on: trl {version} SFTTrainer applies Liger's layer kernels only (use_liger_kernel is "
                   "deprecated there) and its own fused LM head instead of Liger's fused cross-entropy: speed and "
                   "peak differ from the probe's Trainer run")
    elif w.trainer == "sft":  # on the CPU (its PyTorch fallback) a tiny-llama recipe ran 1.2-1.3x slower
        out.append(f"the loss: trl {version} SFTTrainer computes it through its own fused LM head (log-probabilities, "
                   "entropy and token accuracy in tiles), where the probe's Trainer ran the model's: speed and peak "
                   "were not measured for this recipe; --format hf-trainer is the one measured")
    if w.quantization:
        out.append(f"quantization={w.config.quantization}: trl {version} casts the adapter's weights to bf16 on a "
                   "quantized base (the probe trained fp32 adapters): adapter and optimizer memory are smaller")
    return out


def render(r: ExportRun) -> Rendered:
    if not trl_installed():
        raise UsageError("--format trl: TRL is not installed; `pip install 'autofit[trl]'` (or `pip install "
                         "trl`) and export again.")
    w = describe(r)
    if w.trainer == "dpo":  # TRL's DPOTrainer: every DPO setting is DPOConfig's, nothing to list as not kept
        check_names(w, set(training(w)), "DPOConfig")
        differs = [x for x in differences(w, versions()["trl"]) if not x.startswith("batching=")]
        differs += w.not_kept("trl")
        return Rendered(render_dpo(r, w, differs), differs)
    check_names(w, set(w.training_for("trl")) | set(sampling_fields(w)) | set(sft_fields(w)), "SFTConfig")
    differs = differences(w, versions()["trl"]) + w.not_kept("trl")
    return Rendered(render_script(r, w, "trl", "train_trl.py", differs), differs, launch=script_launch(w.config))
