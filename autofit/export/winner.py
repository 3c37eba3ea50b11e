"""What the search decided, described once for every export format.

`describe(run)` turns the run's winner into plain data in the libraries' own terms (the model and its
loading, LoRA, quantization, the TrainingArguments fields, the process environment, the batching, the
accumulation the probe trained): the Python recipes write these values as their constants, the YAML
formats translate the same values into their keys. Each dimension of `config.spec.KEYS` is placed in one
field of the description (`CARRIED`, or `training` for a dimension declared with a TrainingArguments field):
a dimension added without a place fails `describe`, so no format can silently leave it out.
"""

from __future__ import annotations

from dataclasses import dataclass

from autofit.config import recipe
from autofit.config.recipe import Arguments
from autofit.config.spec import KEYS, TrialConfig, not_kept, training_argument_values
from autofit.core.errors import UsageError
from autofit.data import DatasetRef
from autofit.data.preference import read_preferences
from autofit.export.common import ExportRun

CARRIED: dict[str, str] = {
    "method": "lora", "max_length": "max_length", "micro_batch_size": "training", "global_batch": "accumulation",
    "precision": "training", "gradient_checkpointing": "training", "quantization": "quantization",
    "optimizer": "training", "attn_implementation": "attention", "liger": "training", "torch_compile": "training",
    "expandable_segments": "environment", "lora_r": "lora", "lora_alpha": "lora", "lora_targets": "lora",
    "lora_dropout": "lora", "batching": "batching", "gpus": "training", "engine": "training",
    "reshard_after_forward": "training", "cpu_offload": "training", "trainer": "trainer",
    "dpo_reference": "preference",
}
"""The field of `Winner` that carries each dimension; a dimension declared with a TrainingArguments field
(`Dimension.training_argument`) is carried by `training` without being listed here."""

LOGGING_STEPS = 10
PREFERENCE_KEYS = tuple(k for k in ("trainer", "precompute_ref_log_probs", "dpo_reference") if k in KEYS)
"""The dimensions of preference tuning (named: `config.spec.KEYS` holds them), which an SFT recipe cannot take."""
DPO_BETA = 0.1
DPO_LOSS = "sigmoid"
"""TRL 1.16 DPOConfig's `beta` and `loss_type` defaults: the DPO probe sets neither, so it trained these; the YAML
formats write them (their own defaults could differ)."""


@dataclass(frozen=True)
class Preference:
    """What a DPO winner trains beside the SFT settings: the loss, and where the reference's log-probs come from."""

    beta: float
    loss: str
    precompute_ref_log_probs: bool
    reference: str
    """`shared`: no second copy of the weights (a LoRA policy with its adapter disabled); `copy`: a separate
    reference model of the same weights."""


@dataclass(frozen=True)
class PairForm:
    """What the run's preference rows are, for the YAML trainers' dataset entries (their keys differ by form)."""

    conversational: bool = False
    implicit: bool = False
    """Rows of chosen and rejected alone: TRL took their shared start as the prompt."""
    long_completions: int = 0
    """Conversation pairs whose chosen or rejected completion is more than one message."""
    note: str = ""
    """What was assumed where the file cannot be read here."""


@dataclass(frozen=True)
class Winner:
    """The winner in the libraries' terms: one description that every format renders."""

    config: TrialConfig
    model: str | None
    """The model to load (a folder or hub id); None for a shape preset, which has no weights to give."""
    dataset: DatasetRef | None
    max_length: int
    batching: str
    dtype: str
    """torch dtype name of the base weights (`recipe.weights_dtype`)."""
    attention: str
    lora: Arguments | None
    quantization: Arguments | None
    """BitsAndBytesConfig arguments, the compute dtype as a name."""
    kbit: Arguments | None
    """prepare_model_for_kbit_training's arguments for a quantized base."""
    training: Arguments
    """TrainingArguments fields as the probe passed them, with the accumulation it trained."""
    environment: dict[str, str]
    accumulation: int
    step_samples: float
    """Samples per optimizer step as the probe counted them (a mean, said so, for packed rows)."""
    step_change: str
    """What a step off the global batch changes (ExportRun.step_change); empty where it is kept."""
    packed_on_average: bool
    """Packed rows on data: a step's samples are the probe's plan's mean (rows hold however many fit)."""
    trainer: str
    """What the winner trains: `sft`, or `dpo` (TRL's DPOTrainer: the trl format's DPO recipe, `export.dpo`)."""
    preference: Preference | None = None
    """A DPO winner's loss and reference (None for SFT)."""

    @property
    def micro_batch_size(self) -> int:
        return int(self.training["per_device_train_batch_size"])

    def training_for(self, fmt: str) -> Arguments:
        """`training` without the declared TrainingArguments fields that `fmt` does not take."""
        dropped = set(training_argument_values(self.config)) - set(training_argument_values(self.config, fmt))
        if self.trainer != "sft":  # a preference-tuning winner's declared fields are its trainer's, not SFT's
            dropped |= set(training_argument_values(self.config)) - set(recipe.training_arguments(
                self.config.replace(**{k: KEYS[k].default for k in self.preference_keys}), on_cpu=False,
                max_steps=1))
        return {k: v for k, v in self.training.items() if k not in dropped}

    @property
    def preference_keys(self) -> list[str]:
        """The dimensions of a preference-tuning winner that an SFT recipe cannot take (their values other
        than the default)."""
        if self.trainer == "sft":
            return []
        return [k for k in sorted(PREFERENCE_KEYS) if getattr(self.config, k) != KEYS[k].default]

    def not_kept(self, fmt: str) -> list[str]:
        """`key=value: why` of what `fmt` cannot keep of the winner, whatever the format's own code adds. The
        preference keys are each DPO renderer's to write or list (`spec.not_kept` knows their TrainingArguments
        field only, and the YAML formats spell them in their own keys)."""
        return [x for x in not_kept(self.config, fmt) if x.split("=", 1)[0] not in self.preference_keys]


def describe(r: ExportRun, max_steps: int = 1000) -> Winner:
    """The run's winner as a `Winner` (every dimension placed: `CARRIED`)."""
    cfg = r.config
    unplaced = sorted(k for k, d in KEYS.items() if k not in CARRIED and not d.training_argument)
    if unplaced:
        raise AssertionError(f"export/winner.py: place {unplaced} in CARRIED (which field of Winner says it)")
    training = recipe.training_arguments(cfg, on_cpu=r.best.target.get("device") == "cpu", max_steps=max_steps,
                                         gradient_accumulation_steps=r.accumulation)
    training["logging_steps"] = LOGGING_STEPS
    return Winner(
        config=cfg, model=None if r.model.random_weights else r.model.ref, dataset=r.dataset,
        max_length=cfg.max_length, batching=cfg.batching if r.dataset is not None else "blocks",
        dtype=recipe.weights_dtype(cfg), attention=cfg.attn_implementation, lora=recipe.lora_arguments(cfg),
        quantization=recipe.quantization_arguments(cfg), kbit=recipe.kbit_preparation(cfg), training=training,
        environment=recipe.process_env(cfg), accumulation=r.accumulation, step_samples=r.step_samples,
        step_change=r.step_change,
        packed_on_average=r.packed_on_average, trainer=cfg.trainer,
        preference=Preference(DPO_BETA, DPO_LOSS, cfg.precompute_ref_log_probs, cfg.dpo_reference)
        if cfg.trainer == "dpo" else None)


def pair_form(dataset: DatasetRef | None) -> PairForm:
    """Read the run's preference file again (where it is) to tell text from conversations and an explicit prompt
    from an implicit one; a run without a dataset is written as text rows with a prompt."""
    if dataset is None:
        return PairForm()
    try:
        prefs = read_preferences(dataset.path)
    except UsageError:
        return PairForm(note=f"the dataset {dataset.path} is not here to read: written as text rows with a "
                        "prompt; export with --dataset PATH to have its form read")
    longer = sum(1 for p in prefs.pairs if p.conversational and max(len(p.chosen), len(p.rejected)) > 1)
    return PairForm(prefs.conversational, prefs.implicit, longer)
