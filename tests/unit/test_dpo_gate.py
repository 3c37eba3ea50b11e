"""The DPO correctness gate in-process (tiny-llama, fp32, one fixed pair): a kernel change that computes the same
DPO step passes, one whose log-probabilities are off is a mismatch, and the adapter the check moves is restored."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from autofit.config.models import resolve_model
from autofit.config.spec import TrialConfig
from autofit.data.preference import pair_tokenizer, read_preferences, token_pairs
from autofit.probe.child.build import build_model
from autofit.probe.child.dpo import Pairs, Timed, _dataset, pad_tokenizer, trainer_class
from autofit.probe.child.gate import dpo_gate, dpo_gate_batch, with_attention

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import torch
    from peft import LoraConfig
    from trl.trainer.dpo_config import DPOConfig

    model_src = resolve_model("tiny-llama")
    prefs = read_preferences(DATA / "prefs.jsonl")
    tok = pair_tokenizer(model_src, prefs, tmp_path_factory.mktemp("cache"))
    pairs = Pairs(token_pairs(prefs, tok)[:4], tok.pad_id, 64, False, 0.0, 0.0)
    torch.manual_seed(0)
    cfg = TrialConfig(trainer="dpo", precision="fp32", max_length=64)
    policy = build_model(cfg, model_src, "cpu", model_src.ref)
    args = DPOConfig(output_dir=str(tmp_path_factory.mktemp("out")), use_cpu=True, report_to="none", max_length=64,
                     gradient_checkpointing=False, per_device_train_batch_size=1, max_steps=1)
    t = trainer_class(Timed())(model=policy, args=args, train_dataset=_dataset(pairs),
                               processing_class=pad_tokenizer(pairs.pad_id),
                               peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    t.gate_batch = dpo_gate_batch(pairs.ids[0], pairs.pad_id)
    return t


def test_the_same_dpo_step_passes_and_the_adapter_is_restored(trainer: Any) -> None:
    gate = dpo_gate(trainer, lambda m: with_attention(m, "eager"), trainer.gate_batch, precision="fp32",
                    device="cpu")
    with_attention(trainer.model, "sdpa")
    assert gate.ok, gate.reason
    assert not math.isclose(gate.loss_ref, math.log(2), rel_tol=1e-4)  # the moved adapter: policy != reference
    assert all(float(p.detach().abs().max()) == 0 for n, p in trainer.model.named_parameters() if "lora_B" in n)


def test_a_kernel_whose_log_probabilities_are_off_is_a_mismatch(trainer: Any) -> None:
    def off(model: Any) -> Any:
        def scale(_m: object, _a: object, out: Any) -> Any:
            out["log_probs"] = out["log_probs"] * 1.01  # a 1% error in the policy's log-probabilities
            return out

        handle = model.register_forward_hook(scale)
        trainer.hooks = [handle]
        return model

    try:
        gate = dpo_gate(trainer, off, trainer.gate_batch, precision="fp32", device="cpu")
    finally:
        for h in trainer.hooks:
            h.remove()
    assert not gate.ok and "mismatch" in gate.reason
    assert "rewards/margins" in gate.reason or "loss" in gate.reason
