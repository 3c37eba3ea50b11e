"""One declaration per dimension (`config/spec.py`): every key is classified, everything that lists keys derives
from the declaration, and every export format spells every value other than the default or lists it as not
kept."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from autofit.config.kernels import gate_key, needs_gate
from autofit.config.space import load_space, shipped_spaces
from autofit.config.spec import KEYS, LATE_KEYS, Dimension, Memory, TrialConfig, brief
from autofit.core.errors import UsageError
from autofit.data.correctness import boundary_key
from autofit.estimate import effects
from autofit.estimate.memory import MODELED, NO_MEMORY
from autofit.export import FORMATS, export_run
from runs import write_run

OTHER: dict[str, Any] = {
    "method": "full", "max_length": 4096, "micro_batch_size": 4, "global_batch": 32, "precision": "fp16",
    "gradient_checkpointing": "every_2", "quantization": "nf4", "optimizer": "paged_adamw_8bit",
    "attn_implementation": "eager", "liger": True, "torch_compile": True, "expandable_segments": True, "lora_r": 64,
    "lora_alpha": 128, "lora_targets": "all-linear", "lora_dropout": "0.05", "batching": "packed", "gpus": 2,
    "engine": "fsdp2", "reshard_after_forward": False, "cpu_offload": "all",
}
"""A value other than the default for each key, valid beside the defaults of the others (or the context below)."""
CONTEXT: dict[str, dict[str, Any]] = {
    "engine": {"gpus": 2}, "reshard_after_forward": {"gpus": 2, "engine": "fsdp2"},
    "cpu_offload": {"gpus": 2, "engine": "fsdp2"},
    "precompute_ref_log_probs": {"trainer": "dpo", "batching": "pad_longest"},
    "dpo_reference": {"trainer": "dpo", "batching": "pad_longest"},
}
"""What a value of OTHER needs beside it (an engine needs several GPUs, resharding and offload an engine, the DPO
knobs the DPO trainer, which pads to the longest pair)."""


def other(name: str) -> Any:
    """A value of `name` other than its default: OTHER's, else the first allowed one that is not the default."""
    d = KEYS[name]
    if name in OTHER:
        return OTHER[name]
    if d.allowed:
        return next(v for v in d.allowed if v != d.default)
    return {bool: not d.default, int: (d.default or 0) + 1}[d.type]  # a dimension added since OTHER was written


def test_every_key_is_declared_and_classified() -> None:
    assert list(KEYS) == [f.name for f in dataclasses.fields(TrialConfig)]  # TrialConfig.key()'s order
    for name, d in KEYS.items():
        assert isinstance(d, Dimension) and d.help and isinstance(d.memory, Memory), name
        assert d.problem(d.default) is None, f"{name}: its default is not one of its own values"
        assert d.problem(other(name)) is None, f"{name}: the value the tests use is not allowed"
        assert d.speed is None or d.default in d.speed, f"{name}: speed factors are relative to the default"
    searched = {k for s in shipped_spaces() for k in load_space(s).dimensions}
    unlabelled = sorted(k for k in searched if KEYS[k].label is None)
    assert not unlabelled, f"searched by a shipped space but never shown in the live table: {unlabelled}"
    places = [d.label_at for d in KEYS.values() if d.label is not None]
    assert len(places) == len(set(places)), "two labels in one place"


def test_the_lists_of_keys_derive_from_the_declaration() -> None:
    """What used to be written out by hand, in the order stored studies hold (their keys must not change)."""
    cfg = TrialConfig(liger=True, attn_implementation="flex_attention", gradient_checkpointing="every_2")
    assert gate_key(cfg) == ("liger=True;torch_compile=False;attn_implementation=flex_attention;precision=bf16;"
                             "quantization=none;method=lora;lora_targets=q_proj,v_proj;gradient_checkpointing=every_2")
    assert boundary_key(cfg) == "batching=pad_max;attn_implementation=flex_attention;precision=bf16;liger=True"
    assert needs_gate(cfg) and needs_gate(TrialConfig(torch_compile=True)) and not needs_gate(TrialConfig())
    assert not needs_gate(TrialConfig(attn_implementation="eager"))
    assert LATE_KEYS >= {"liger", "torch_compile", "batching", "gpus", "engine", "reshard_after_forward",
                         "cpu_offload"}
    assert MODELED >= {"method", "max_length", "micro_batch_size", "precision", "quantization", "lora_r"}
    assert NO_MEMORY == {k for k, d in KEYS.items() if d.memory is Memory.NONE} >= {"global_batch", "lora_alpha"}
    assert set(effects.SPEED) == {k for k, d in KEYS.items() if d.speed}
    one = TrialConfig.from_dict({**OTHER, "method": "lora", "gpus": 1, "engine": "none", "cpu_offload": "off",
                                 "reshard_after_forward": True})
    assert (
        brief(one) == "L=4096 mb=4 fp16 ckpt=every_2 nf4 paged_adamw_8bit eager liger torch_compile expandable "
        "packed"
    )
    two = TrialConfig(method="full", gpus=2, engine="fsdp2", reshard_after_forward=False, cpu_offload="all")
    assert brief(two) == "L=2048 mb=1 ga=8 bf16 ckpt=off adamw_torch_fused full gpus=2 fsdp2 no-reshard offload=all"
    # a packed config's accumulation comes from the data (its step's figures), not ceil(global_batch / micro-batch)
    assert "ga=" not in brief(TrialConfig(batching="packed")) and "ga=16" in brief(TrialConfig(batching="pad_max"))


def test_a_key_stored_before_it_existed_keeps_the_stored_key() -> None:
    cfg = TrialConfig()
    assert all(f"{k}=" not in cfg.key() for k in LATE_KEYS)
    assert "liger=True" in cfg.replace(liger=True).key()


def _pair(name: str) -> tuple[TrialConfig, TrialConfig]:
    """A winner with `name` at its default and the same with another value (in the context the value needs)."""
    context = CONTEXT.get(name, {})
    return (
        TrialConfig.from_dict({**context, name: KEYS[name].default}),
        TrialConfig.from_dict({**context, name: other(name)}),
    )


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_format_spells_every_other_value_or_says_it_is_not_kept(tmp_path: Path, fmt: str) -> None:
    """A winner with one key away from its default renders differently from the winner beside it with the
    key at its default, or the format lists that key among what it cannot express."""
    silent = []
    for name in KEYS:
        texts = []
        for i, cfg in enumerate(_pair(name)):
            run = write_run(tmp_path / f"{name}-{i}", config=cfg.to_dict())
            if fmt == "hf-trainer" and cfg.trainer == "dpo":  # refused, naming the format that trains it
                with pytest.raises(UsageError, match="export it with --format trl"):
                    export_run(run, fmt)
                texts.append(("refused", [f"{name}=refused"]))
                continue
            r = export_run(run, fmt)
            texts.append((r.text, r.unexpressed))
        spelled = texts[0][0] != texts[1][0]
        listed = any(u.startswith(f"{name}=") for u in texts[1][1])
        if not (spelled or listed):
            silent.append(name)
    assert not silent, f"{fmt} neither spells nor lists as not kept: {silent}"
