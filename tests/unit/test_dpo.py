"""Preference tuning's decisions, in-process: the trainer key's rules, the memory model's DPO terms, the
preference reader's pairs (checked against TRL's own prompt extraction) and the objective's pairs/s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autofit.config.models import resolve_model
from autofit.config.space import load_space
from autofit.config.spec import TrialConfig
from autofit.core.errors import UsageError
from autofit.data.preference import (
    cut,
    looks_like_preferences,
    pair_lengths,
    read_preferences,
)
from autofit.estimate.memory import MemoryModel, Shape, loaded_bytes, prior, weights_floor
from autofit.protocol.result import Outcome, ProbeResult
from autofit.search.objective import pairs_per_s

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
SHAPE = Shape.from_config(resolve_model("llama2-7b").config)
DPO = TrialConfig(trainer="dpo", micro_batch_size=2)


def test_a_pair_is_two_rows_in_one_forward() -> None:
    sft = TrialConfig(micro_batch_size=2)
    assert DPO.tokens_per_micro_batch == 2 * sft.tokens_per_micro_batch
    assert prior(DPO, SHAPE).activations == 2 * prior(sft, SHAPE).activations
    # TRL's fused LM head: log-probabilities in tiles, never the (rows x length x vocab) logits
    assert prior(DPO, SHAPE).logits < prior(sft, SHAPE).logits


def test_the_reference_costs_its_forward_or_its_copy_and_nothing_when_precomputed() -> None:
    shared = prior(DPO, SHAPE).reference
    assert 0 < shared < prior(DPO, SHAPE).activations  # one layer at a time under no_grad, not every layer
    assert prior(DPO.replace(precompute_ref_log_probs=True), SHAPE).reference == 0
    copy = prior(DPO.replace(dpo_reference="copy"), SHAPE).reference
    assert copy - shared == prior(DPO, SHAPE).weights  # a second bf16 base
    assert prior(TrialConfig(), SHAPE).reference == 0
    assert "DPO reference" in " ".join(prior(DPO, SHAPE).as_dict())


def test_a_reference_copy_is_loaded_before_the_first_step() -> None:
    """A load-time out-of-memory of a `dpo_reference=copy` config is bounded by both models' weights: what the
    policy reads as loaded (and the floor below which nothing fits) counts the copy."""
    shared, copy = loaded_bytes(DPO, SHAPE), loaded_bytes(DPO.replace(dpo_reference="copy"), SHAPE)
    assert copy - shared == prior(DPO, SHAPE).weights  # a second bf16 base, loaded as the policy's is
    assert weights_floor(DPO.replace(dpo_reference="copy"), SHAPE) > weights_floor(DPO, SHAPE)
    assert loaded_bytes(TrialConfig(), SHAPE) == shared  # a shared reference loads nothing more than SFT


def test_precomputing_can_save_the_reference_forward_against_an_oom() -> None:
    model = MemoryModel(SHAPE)
    saving = model.max_saving(DPO, DPO.replace(precompute_ref_log_probs=True))
    assert saving is not None and saving >= prior(DPO, SHAPE).reference
    assert model.max_saving(DPO.replace(precompute_ref_log_probs=True), DPO) == 0


def test_a_dpo_fit_teaches_its_own_group_in_tokens_of_both_rows() -> None:
    model = MemoryModel(SHAPE)
    model.observe(DPO.replace(micro_batch_size=1), 20 * 2**30)
    model.observe(DPO, 24 * 2**30)
    assert model.predict(DPO.replace(micro_batch_size=3)) == 28 * 2**30
    assert model.predict(TrialConfig(micro_batch_size=3)) != 28 * 2**30  # an SFT config is another group


@pytest.mark.parametrize("values, said", [
    ({"precompute_ref_log_probs": True}, "needs trainer=dpo"),
    ({"dpo_reference": "copy"}, "needs trainer=dpo"),
    ({"trainer": "dpo", "batching": "padding_free"}, "padding_free falls back to padding"),
    ({"trainer": "dpo", "method": "full"}, "no adapter to disable"),
    ({"trainer": "dpo", "gpus": 2}, "one GPU"),
])
def test_what_dpo_cannot_run_is_a_usage_error(values: dict[str, object], said: str) -> None:
    with pytest.raises(UsageError, match=said):
        TrialConfig.from_mapping(values)
    TrialConfig(trainer="dpo", method="full", precompute_ref_log_probs=True)  # the policy before training


def test_the_dpo_spaces_search_dpo_only() -> None:
    for space in (load_space("dpo"), load_space(DATA / "dpo-space.yaml")):
        cands = space.candidates()
        assert cands and all(c.trainer == "dpo" for c in cands)
        assert {c.precompute_ref_log_probs for c in cands} == {False, True}


def test_the_implicit_prompt_is_the_one_trl_extracts() -> None:
    from trl.data_utils import extract_prompt

    prefs = read_preferences(DATA / "prefs-chat.jsonl")
    assert prefs.implicit and prefs.conversational and len(prefs) == 12
    rows = [line for line in (DATA / "prefs-chat.jsonl").read_text().splitlines()]
    import json

    for pair, line in zip(prefs.pairs, rows, strict=True):
        trl = extract_prompt(json.loads(line))
        assert pair.to_row() == {k: trl[k] for k in ("prompt", "chosen", "rejected")}


def test_lengths_and_what_a_max_length_drops() -> None:
    from autofit.data.preference import PairLengths

    lengths = [PairLengths(10, 5, 3), PairLengths(40, 20, 30), PairLengths(3, 1, 1)]
    c = cut(lengths, 32)
    assert (c.dropped, c.truncated) == (1, 0)  # the 40-token prompt fills 32: TRL drops the pair
    assert cut(lengths, 64).truncated == 1 and cut(lengths, 64).dropped == 0
    assert pair_lengths([([1, 2], [3], [4, 5, 6])]) == [PairLengths(2, 1, 3)]
    assert looks_like_preferences(DATA / "prefs.jsonl") and not looks_like_preferences(DATA / "dpo-space.yaml")


def test_a_preference_file_is_told_from_samples_whatever_its_first_line(tmp_path: Path) -> None:
    """`autofit data`, probe and an SFT space's check decide by the sniff: an indented JSON array of pairs, a
    first row longer than 64 KiB and a first line that is not JSON are still pairs; samples stay samples."""
    pair = {"prompt": "What is 2 + 2?", "chosen": " 4.", "rejected": " 5."}
    files = {
        "pretty.json": json.dumps([pair, pair], indent=2),
        "long-first.jsonl": "".join(json.dumps(r) + "\n" for r in [{**pair, "prompt": "word " * 30_000}, pair]),
        "bad-first.jsonl": "not json\n" + json.dumps(pair) + "\n",
        "samples.jsonl": json.dumps({"text": "the word \"chosen\" in a sample"}) + "\n",
        "samples-bad-first.jsonl": "{oops\n" + json.dumps({"text": "a"}) + "\n",
        "samples-array.json": json.dumps([{"text": "a"}, {"text": "b"}], indent=2),
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert [n for n in files if looks_like_preferences(tmp_path / n)] == ["pretty.json", "long-first.jsonl",
                                                                         "bad-first.jsonl"]
    assert len(read_preferences(tmp_path / "pretty.json")) == 2
    with pytest.raises(UsageError, match="row at line 1: not valid JSON; expected a JSON object with"):
        read_preferences(tmp_path / "bad-first.jsonl")


def test_a_max_length_that_drops_every_pair_is_left_out_of_the_search(tmp_path: Path) -> None:
    """TRL drops a pair whose prompt fills max_length: of --max-length 16,512 on prompts of ~60 tokens the search
    keeps 512 and says why 16 went (all of them dropped: a usage error, tests/e2e/test_faults_dpo.py)."""
    from autofit.run.session import SearchRequest, preference_data_space

    data = tmp_path / "prefs.jsonl"
    data.write_text((json.dumps({"prompt": "Explain this. " * 20, "chosen": " Yes.", "rejected": " No."}) + "\n") * 3)
    space = load_space(DATA / "dpo-space.yaml").replaced(max_length=[512, 16])
    kept, _, notes = preference_data_space(space, resolve_model("tiny-llama"),
                                           SearchRequest(dataset=str(data), max_length="512,16"))
    assert kept.lengths == [512]
    assert any(n.startswith("--max-length 16 left out: every pair's prompt fills it") for n in notes)


def test_a_dpo_space_is_told_to_quantize_its_own_copy_and_counts_pairs_per_step() -> None:
    """The qlora space trains SFT: the 4-bit saving of a DPO space names nf4 in a copy of that space, and a DPO
    step is counted in pairs."""
    from autofit.data.batching import unit
    from autofit.estimate.memory import four_bit

    dpo = load_space(ROOT / "search_spaces" / "dpo.yaml").candidates()
    saving = four_bit(dpo, SHAPE, 6 * 2**30)
    assert saving is not None and "quantization nf4 in a copy of the space" in saving.describe()
    sft = load_space(ROOT / "search_spaces" / "lora.yaml").candidates()
    assert "--space qlora" in four_bit(sft, SHAPE, 6 * 2**30).describe()  # type: ignore[union-attr]
    assert (unit(dpo[0]), unit(sft[0])) == ("pairs", "samples")


def test_the_data_s_lengths_replacing_the_space_s_are_said() -> None:
    """With --dataset the data's max_length candidates replace a space's own (cpu-demo lists 512 and 256 for random
    tokens): the search says so and how to keep them, for samples and for pairs alike."""
    from autofit.run.session import SearchRequest, data_space

    model = resolve_model("tiny-llama")
    space = load_space(ROOT / "search_spaces" / "cpu-demo.yaml")
    searched, _, notes = data_space(space, model, SearchRequest(dataset=str(DATA / "d2-slice.jsonl")))
    assert searched.lengths != space.lengths
    said = "from the data replaces the space's 512, 256; --max-length 512,256 keeps the space's"
    assert any(said in n for n in notes), notes
    pairs = load_space(DATA / "dpo-space.yaml")
    searched, _, notes = data_space(pairs, model, SearchRequest(dataset=str(DATA / "prefs.jsonl")))
    assert any("from the data replaces the space's 128" in n for n in notes), notes
    kept, _, notes = data_space(space, model, SearchRequest(dataset=str(DATA / "d2-slice.jsonl"),
                                                            max_length="512,256"))
    assert not any("replaces the space's" in n for n in notes)


def test_pairs_per_s_is_tokens_per_s_over_the_tokens_of_a_pair() -> None:
    res = ProbeResult(Outcome.FIT, DPO, tokens_per_s=1000.0, extra={"tokens_per_pair": 250.0})
    assert pairs_per_s(res) == 4.0
    assert pairs_per_s(ProbeResult(Outcome.FIT, TrialConfig(), tokens_per_s=1000.0)) is None


def test_the_precomputed_pass_costs_its_batches_past_the_first_two_per_pair() -> None:
    """S7's probe spread its first forwards (~2.5 s over 48 pairs) over each pair; a run's pass over its whole
    dataset pays them once. Only a pass of two batches or fewer counts them all."""
    from autofit.probe.child.dpo import Timed

    timed = Timed()
    timed.batches = [(1, 2.0), (1, 0.5), (2, 0.2), (2, 0.2), (1, 0.1)]
    assert timed.seconds_per_pair() == pytest.approx(0.5 / 5)
    timed.batches = [(2, 1.0), (2, 0.6)]
    assert timed.seconds_per_pair() == pytest.approx(1.6 / 4)
    timed.batches = []
    assert timed.seconds_per_pair() == 0.0


def test_a_dpo_window_is_brought_to_the_mean_pair_by_its_own_time_model() -> None:
    """S7's forum recipe on an H100 (bench/results/dpo-bench-s7.json, its third fresh process): the last five
    steps' mean micro-batch (tensor tokens of a pair's two rows) and seconds per micro-batch. A DPO micro-step
    of a 7B at micro-batch 1 is mostly fixed cost; scaled by HALF_TOKENS' shape (512 tokens of it) the steps
    spread 1.43x, where the window's own fit leaves them within 1.10x of each other."""
    from autofit.estimate.effects import HALF_TOKENS
    from autofit.probe.child.timing import micro_batch_time_model

    xs = [832.0, 1471.0, 1381.5, 1773.5, 1002.5]
    us = [0.40937, 0.42505, 0.42499, 0.48752, 0.39308]
    mean = 1178.63
    a, b = micro_batch_time_model(xs, us)
    assert a / b > 4 * HALF_TOKENS  # the fixed cost of a micro-step, in tokens' worth
    fitted = [u - b * (x - mean) for x, u in zip(xs, us, strict=True)]
    shaped = [u * (mean + HALF_TOKENS) / (x + HALF_TOKENS) for x, u in zip(xs, us, strict=True)]
    assert max(fitted) / min(fitted) < 1.10 < 1.40 < max(shaped) / min(shaped)
    # steps of one length (random pairs at max_length): nothing to fit, HALF_TOKENS' shape through the mean
    a, b = micro_batch_time_model([4096.0] * 5, [0.5] * 5)
    assert b == pytest.approx(0.5 / (4096 + HALF_TOKENS)) and a == pytest.approx(b * HALF_TOKENS)


def test_trl_s_reference_forward_leaves_the_checkpointing_it_found() -> None:
    """DPOTrainer runs the reference's forward inside `disable_gradient_checkpointing` (TRL 1.16 turns it back on
    with every layer checkpointed and none offloaded); with `keep_checkpointing_as_asked` it comes back with the
    layers and the host offload that were asked for, as Trainer turned them on."""
    import torch
    import trl.trainer.dpo_trainer as dpo_trainer
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from autofit.config.dpo import keep_checkpointing_as_asked, needs_checkpointing_kept
    from autofit.config.recipe import training_arguments
    from autofit.probe.child.build import checkpointed_layers, decoder_layers

    cfg = TrialConfig(trainer="dpo", gradient_checkpointing="every_2+offload")
    assert needs_checkpointing_kept(cfg) and not needs_checkpointing_kept(TrialConfig(trainer="dpo"))
    kwargs = training_arguments(cfg, on_cpu=True, max_steps=1)["activation_checkpointing_kwargs"]
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model(**resolve_model("tiny-llama").config))
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    asked = {k: v for k, v in kwargs.items() if k not in ("every_n_layers", "offload")}
    model.gradient_checkpointing_enable(asked, every_n_layers=kwargs["every_n_layers"], offload=kwargs["offload"])

    def state() -> tuple[list[int], list[bool]]:  # the layers, and whether each saves its inputs on the host
        return checkpointed_layers(model), [layer._gradient_checkpointing_func.func is not torch.utils.checkpoint
                                            .checkpoint for layer in decoder_layers(model)]

    before = state()
    assert before == ([0, 2], [True] * 4)
    original = dpo_trainer.disable_gradient_checkpointing
    try:
        keep_checkpointing_as_asked()
        with torch.no_grad(), dpo_trainer.disable_gradient_checkpointing(model, kwargs):
            assert checkpointed_layers(model) == []  # the reference's forward runs without checkpointing
            model(input_ids=torch.ones(1, 8, dtype=torch.long))
        assert state() == before
    finally:
        dpo_trainer.disable_gradient_checkpointing = original
