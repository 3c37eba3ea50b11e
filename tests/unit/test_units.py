"""Sizes, the model file check and the card a target stands for, at their extremes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autofit.config.models import PRESETS, resolve_model
from autofit.config.target import Target
from autofit.core.errors import UsageError
from autofit.core.units import format_size, parse_size


@pytest.mark.parametrize(("n", "text"), [(None, "-"), (0, "0 B"), (5, "5 B"), (2048, "2 KiB"), (3 * 2**20, "3 MiB"),
                                         (int(1.5 * 2**30), "1.5 GiB"), (40 * 2**30, "40 GiB"),
                                         (10 * 2**40, "10 TiB")])
def test_a_size_reads_in_the_unit_that_fits_it(n: int | None, text: str) -> None:
    assert format_size(n) == text


def test_a_size_beyond_any_memory_is_a_usage_error_not_an_overflow() -> None:
    with pytest.raises(UsageError, match="--memory-limit: .* is larger than any memory"):
        parse_size("9" * 300 + "GiB")
    assert parse_size("1B") == 1 and parse_size("16TiB") == 16 * 2**40


@pytest.mark.parametrize("field", ["num_attention_heads", "num_hidden_layers"])
def test_a_config_json_with_no_heads_or_no_layers_is_a_usage_error(tmp_path: Path, field: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**PRESETS["tiny-llama"], field: 0}))
    with pytest.raises(UsageError, match=f"--model: .*{field}"):
        resolve_model(str(path))


def test_a_real_card_without_a_limit_is_judged_by_its_own_memory() -> None:
    """The users of a 24 GiB card who give no --memory-limit: the search's prior knows the card."""
    card = Target("cuda", 0, "NVIDIA GeForce RTX 4090", None, 0.05, card_bytes=24 * 2**30)
    assert card.usable_bytes == int(24 * 2**30 * 0.95)
    emulated = Target("cuda", 0, "NVIDIA H200", 40 * 2**30, 0.05, card_bytes=140 * 2**30)
    assert emulated.usable_bytes == int(40 * 2**30 * 0.95)  # the limit, not the card
    assert Target("cpu").usable_bytes is None
    assert Target(**{**Target("cuda", 0, "x").__dict__}).card_bytes is None  # an older spec.yaml reads back
