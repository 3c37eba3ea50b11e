"""A preference-tuning winner's YAML exports (issue 32): axolotl writes `rl: dpo` and LLaMA-Factory `stage: dpo`, each
with the preference file's dataset entry for its rows (text or conversations, explicit or implicit prompt), the loss,
the reference and precomputed log-probabilities in its own keys, and lists what it cannot keep (in-process: the
decision is the rendering)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from autofit.export import export_run
from autofit.export.common import Rendered
from autofit.export.winner import DPO_BETA, DPO_LOSS
from runs import PREFS, PREFS_CHAT, dpo_run

REGISTER = '# Register it in data/dataset_info.json first: "my_dataset": '


def exported(run: Path, fmt: str) -> tuple[dict[str, object], Rendered]:
    r = export_run(run, fmt)
    return yaml.safe_load(r.text), r


def entry(r: Rendered) -> dict[str, object]:
    """The dataset_info.json entry the LLaMA-Factory recipe says to register."""
    (line,) = [ln for ln in r.text.splitlines() if ln.startswith(REGISTER)]
    registered = json.loads(line.removeprefix(REGISTER))
    assert isinstance(registered, dict)
    return registered


def rows_file(tmp_path: Path, name: str, rows: list[dict[str, object]]) -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def turn(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def test_axolotl_writes_rl_dpo_with_the_dataset_type_of_the_rows(tmp_path: Path) -> None:
    text, r = exported(dpo_run(tmp_path, PREFS), "axolotl")
    assert (text["rl"], text["rl_beta"], text["dpo_loss_type"], text["precompute_ref_log_probs"]) == (
        "dpo", DPO_BETA, [DPO_LOSS], False)
    # TRL cuts a long row keeping its start (axolotl would drop the pair); no packing, no SFT padding key
    assert text["excess_length_strategy"] == "truncate" and text["sample_packing"] is False
    assert "pad_to_sequence_len" not in text and text["sequence_len"] == 128 and text["micro_batch_size"] == 2
    assert text["datasets"] == [{"path": str(PREFS.resolve()), "type": {
        "field_prompt": "prompt", "field_chosen": "chosen", "field_rejected": "rejected"}}]
    assert r.unexpressed == []  # text rows with their prompt: nothing lost
    chat, r = exported(dpo_run(tmp_path, PREFS_CHAT), "axolotl")
    assert chat["rl"] == "dpo" and chat["chat_template"] == "tokenizer_default"
    assert chat["datasets"] == [{"path": str(PREFS_CHAT.resolve()), "type": "chat_template.argilla_chat"}]
    assert any("axolotl renders the prompt" in u for u in r.unexpressed)
    explicit = rows_file(tmp_path, "explicit.jsonl", [
        {"prompt": [turn("user", f"Q{i}?")], "chosen": [turn("assistant", "Yes.")],
         "rejected": [turn("assistant", "No."), turn("user", "Sure?"), turn("assistant", "No!")]}
        for i in range(4)])
    chat, r = exported(dpo_run(tmp_path, explicit), "axolotl")
    assert chat["datasets"] == [{"path": str(explicit.resolve()), "type": "chat_template.default",
                                 "field_messages": "prompt"}]
    assert any(u.startswith("4 pair(s) have a completion of several messages") for u in r.unexpressed)
    implicit = rows_file(tmp_path, "implicit.jsonl", [{"chosen": f"Q{i}: yes", "rejected": f"Q{i}: no"}
                                                      for i in range(4)])
    _, r = exported(dpo_run(tmp_path, implicit), "axolotl")
    assert any("the rows have no 'prompt'" in u for u in r.unexpressed)


def test_llama_factory_writes_stage_dpo_with_a_ranking_entry_for_the_rows(tmp_path: Path) -> None:
    text, r = exported(dpo_run(tmp_path, PREFS), "llama-factory")
    assert (text["stage"], text["pref_beta"], text["pref_loss"], text["packing"]) == ("dpo", DPO_BETA, DPO_LOSS,
                                                                                       False)
    assert text["template"] == "empty" and "ref_model" not in text  # LoRA: the base, adapter disabled
    assert entry(r) == {"file_name": str(PREFS.resolve()), "ranking": True,
                        "columns": {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}}
    assert not any("conversations" in u for u in r.unexpressed)
    chat, r = exported(dpo_run(tmp_path, PREFS_CHAT), "llama-factory")
    assert chat["stage"] == "dpo"
    assert entry(r) == {"file_name": str(PREFS_CHAT.resolve()), "ranking": True, "formatting": "sharegpt",
                        "columns": {"messages": "prompt", "chosen": "chosen", "rejected": "rejected"},
                        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                                 "assistant_tag": "assistant", "system_tag": "system"}}
    # TRL's rows hold lists of messages, LLaMA-Factory's one message: said, with the implicit prompt to add
    assert any(u.startswith("conversations:") and "as a 'prompt' list" in u for u in r.unexpressed)


def test_the_reference_and_precomputed_log_probs_in_each_formats_keys(tmp_path: Path) -> None:
    copy = dpo_run(tmp_path / "copy", dpo_reference="copy", precompute_ref_log_probs=True, quantization="nf4")
    axolotl, r = exported(copy, "axolotl")
    assert axolotl["precompute_ref_log_probs"] is True and axolotl["adapter"] == "qlora"
    assert any(u.startswith("dpo_reference=copy:") for u in r.unexpressed)  # axolotl shares the base under LoRA
    factory, r = exported(copy, "llama-factory")
    assert (factory["ref_model"], factory["ref_model_quantization_bit"]) == ("PATH/TO/MODEL", 4)
    assert any(u.startswith("precompute_ref_log_probs=True:") for u in r.unexpressed)
    full = dpo_run(tmp_path / "full", method="full", precompute_ref_log_probs=True)
    for fmt in ("axolotl", "llama-factory"):  # both load a reference copy for a full fine-tune
        assert any(u.startswith("dpo_reference=shared with method=full") for u in export_run(full, fmt).unexpressed)


def test_a_dpo_winners_liger_is_dpo_configs_in_axolotl_and_trl(tmp_path: Path) -> None:
    """The DPO probe set DPOConfig's use_liger_kernel (TRL's layer kernels, its own fused LM head kept): axolotl's
    dpo_use_liger_kernel passes the same, where the plugin's fused cross-entropy would replace TRL's LM head; the
    trl recipe runs the probe's DPOTrainer, so SFTTrainer's Liger difference is not said of it."""
    run = dpo_run(tmp_path, liger=True)
    axolotl, _ = exported(run, "axolotl")
    assert axolotl["dpo_use_liger_kernel"] is True and "plugins" not in axolotl
    assert not any(u.startswith("liger=") for u in export_run(run, "trl").unexpressed)


def test_the_loss_written_is_the_one_the_probe_trained() -> None:
    """The DPO probe leaves DPOConfig's beta and loss at TRL's defaults: the YAML formats write those values."""
    import dataclasses

    from trl.trainer.dpo_config import DPOConfig

    fields = {f.name: f for f in dataclasses.fields(DPOConfig)}
    loss = fields["loss_type"].default_factory()  # type: ignore[operator]
    assert (fields["beta"].default, loss) == (DPO_BETA, [DPO_LOSS])
