"""What TRL's DPOTrainer needs besides DPOConfig's fields to train the config as asked: one source for the DPO
probe (`probe/child/dpo.py`) and the TRL recipe (`export/dpo.py` carries the function's source).

No torch or TRL import at module level: the exporters run in the search process.
"""

from __future__ import annotations

from autofit.config.spec import TrialConfig


def needs_checkpointing_kept(cfg: TrialConfig) -> bool:
    """Does TRL's reference forward undo this config's checkpointing (`keep_checkpointing_as_asked`)? Only a
    choice of layers or host offload is lost: every layer, on the GPU, is what TRL turns back on anyway."""
    return cfg.checkpoint_every > 1 or cfg.checkpoint_offload


def keep_checkpointing_as_asked() -> None:
    """Makes TRL's DPOTrainer turn checkpointing back on, after each reference forward, as it was asked for.

    TRL (1.16) runs the reference's forward with checkpointing off (`disable_gradient_checkpointing`) and then
    turns it back on with the whole `gradient_checkpointing_kwargs`. It does not take `every_n_layers` and
    `offload` out of them first, as Trainer does, so from the first step on every decoder layer is checkpointed
    and none offloads its saved inputs: another config than the one asked for, slower or larger. This gives
    DPOTrainer a context manager that passes them as Trainer does. Called before DPOTrainer is built.
    """
    import contextlib

    import trl.trainer.dpo_trainer as dpo_trainer

    @contextlib.contextmanager
    def disable_gradient_checkpointing(model, gradient_checkpointing_kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(gradient_checkpointing_kwargs or {})
        every_n_layers, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
        was_enabled = model.is_gradient_checkpointing
        if was_enabled:
            model.gradient_checkpointing_disable()
        try:
            yield
        finally:
            if was_enabled:
                model.gradient_checkpointing_enable(kwargs or None, every_n_layers=every_n_layers, offload=offload)

    dpo_trainer.disable_gradient_checkpointing = disable_gradient_checkpointing  # type: ignore[attr-defined]
