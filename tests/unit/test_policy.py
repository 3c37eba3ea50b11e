"""The search policy in-process: what an out-of-memory probe proves (shortfall dominance, no false
prune), the memory model learning from fits and failures, and the edge order. Knowledge is built
from results as a GPU search would store them (a Llama-2-7B shape at 24 GiB), the out-of-memory
ones from torch's own error text; no probe runs."""

from __future__ import annotations

import pytest
from conftest import ROOT
from stored import probe_trial

from autofit.config.models import PRESETS
from autofit.config.space import Space, load_space
from autofit.config.spec import TrialConfig
from autofit.config.target import usable_bytes
from autofit.estimate import effects
from autofit.estimate.memory import (
    Change,
    MemoryModel,
    Shape,
    beyond_reach,
    loaded_bytes,
    prior,
    reach,
    scaled,
    shorter_length,
    weights_floor,
)
from autofit.protocol.result import Outcome, ProbeResult
from autofit.protocol.signatures import oom_figures
from autofit.search.knowledge import Knowledge, ProbeTime, Verdict
from autofit.search.policy import edge_chooser, expected_improvement, expected_speed, fit_probability
from autofit.search.replay import Landscape

GIB = 2**30
SHAPE = Shape.from_config(PRESETS["llama2-7b"])
LIMIT = 24 * GIB
USABLE = usable_bytes(LIMIT)
SPACE = Space("s2", {"method": "lora", "max_length": 2048, "global_batch": 16, "optimizer": "adamw_torch_fused"},
              {"micro_batch_size": [1, 2, 3, 4, 6, 8], "gradient_checkpointing": ["off", "every_4", "every_2", "on"],
               "expandable_segments": [False, True]})
# torch's CUDA caching allocator, word for word (c10/cuda/CUDACachingAllocator.cpp), at micro-batch 4
OOM_TEXT = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
            "of 139.80 GiB of which 116.52 GiB is free. Including non-PyTorch memory, this process has 22.70 GiB "
            "memory in use. Of the allocated memory 20.86 GiB is allocated by PyTorch, and 1.10 GiB is reserved "
            "by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


def cfg(mb: int = 1, ckpt: str = "on", **kw: object) -> TrialConfig:
    return SPACE.config({"micro_batch_size": mb, "gradient_checkpointing": ckpt, **kw})


def fit(c: TrialConfig, tps: float, peak_gib: float, wall: float = 15.0) -> ProbeResult:
    peak = int(peak_gib * GIB)
    return ProbeResult(Outcome.FIT, c.to_dict(), tokens_per_s=tps, peak_memory_bytes=peak,
                       max_memory_reserved=peak - GIB, max_memory_allocated=peak - int(1.5 * GIB),
                       memory_limit_bytes=LIMIT, wall_seconds=wall, train_seconds=wall - 5)


def oom(c: TrialConfig, text: str = OOM_TEXT) -> ProbeResult:
    f = oom_figures(text)
    return ProbeResult(Outcome.OOM, c.to_dict(), memory_limit_bytes=LIMIT, headroom_bytes=LIMIT - USABLE,
                       oom_request_bytes=f.request, oom_in_use_bytes=f.in_use_with(),
                       oom_reserved_unallocated_bytes=f.reserved_unallocated, wall_seconds=4.0)


def know(*results: ProbeResult) -> Knowledge:
    trials = [probe_trial(SPACE.dimensions, r, i) for i, r in enumerate(results)]
    return Knowledge.build(trials, SHAPE, on_gpu=True, usable=USABLE)


def test_the_shortfall_of_real_error_text_is_a_lower_bound_on_the_peak() -> None:
    r = oom(cfg(4, "off"))
    assert r.peak_lower_bound() == int(22.70 * GIB) + 2 * GIB
    assert know(r).shortfall(r) == r.peak_lower_bound() - USABLE
    assert know(r).shortfall(r) > GIB  # short by more than a gibibyte at 24 GiB


def test_variants_that_save_less_than_the_shortfall_are_dominated_with_the_numbers() -> None:
    k = know(fit(cfg(1, "on"), 6800, 15.2), oom(cfg(4, "off")))
    for variant in (cfg(4, "off", expandable_segments=True), cfg(4, "off", optimizer="paged_adamw_8bit"),
                    cfg(4, "off", expandable_segments=True, optimizer="paged_adamw_8bit"), cfg(6, "off")):
        verdict, detail = k.verdict(variant)
        assert verdict is Verdict.DOMINATED, (variant.key(), detail)
    verdict, detail = k.verdict(cfg(4, "off", expandable_segments=True))
    assert "short by >= 1.9 GiB" in detail and "save at most 1.1" in detail


def test_a_change_that_could_save_enough_is_still_probed() -> None:
    k = know(fit(cfg(1, "on"), 6800, 15.2), oom(cfg(4, "off")))
    for variant in (cfg(4, "every_2"), cfg(4, "on"), cfg(2, "off"), cfg(3, "off"),
                    cfg(4, "off", attn_implementation="eager")):  # eager: a key the prior does not model
        assert k.verdict(variant)[0] is not Verdict.DOMINATED, variant.key()


# The same allocator message for an OOM while the model was still being built (phase "load"), under the
# probe's cap (the "allowed" clause): seen on the H200 when a 4-bit probe built its 16-bit random weights
# under a 12 GiB cap; here at this module's 24 GiB.
LOAD_OOM_TEXT = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 86.00 MiB. GPU 0 has a total "
                 "capacity of 139.80 GiB of which 115.81 GiB is free. Including non-PyTorch memory, this process "
                 "has 22.98 GiB memory in use. 22.40 GiB allowed; Of the allocated memory 22.39 GiB is allocated by "
                 "PyTorch, and 1.55 MiB is reserved by PyTorch but unallocated.")


def test_an_oom_while_loading_dominates_every_change_made_after_the_load() -> None:
    failed = oom(cfg(4, "off"), LOAD_OOM_TEXT)
    failed.oom_phase = "load"
    k = know(failed)
    assert k.shortfall(failed) > 0
    # micro-batch, checkpointing, optimizer and allocator act after the load: none can save what it lacked
    for variant in (cfg(1, "on"), cfg(1, "on", optimizer="paged_adamw_8bit"), cfg(1, "on", expandable_segments=True)):
        verdict, detail = k.verdict(variant)
        assert verdict is Verdict.DOMINATED, (variant.key(), detail)
        assert "while loading" in detail
    # a 4-bit base is a quarter of the weights: that could fit, so it is still probed
    assert k.verdict(cfg(1, "on", quantization="nf4"))[0] is not Verdict.DOMINATED
    # the same figures from a failure in the forward pass prove nothing about checkpointing at micro-batch 1
    for phase in ("check", "setup", "forward"):  # the checks' forward passes and an engine's set-up hold more
        failed.oom_phase = phase
        assert know(failed).verdict(cfg(1, "on"))[0] is not Verdict.DOMINATED, phase
    # a result written before the check and setup phases existed called a gate's failure "load", but the
    # model had loaded (memory_after_load): not a load-only failure
    failed.oom_phase, failed.memory_after_load = "load", int(13.5 * GIB)
    assert not failed.failed_loading and know(failed).verdict(cfg(1, "on"))[0] is not Verdict.DOMINATED


def test_a_load_failure_under_an_engine_prunes_nothing() -> None:
    """Full fine-tuning with ZeRO-2 on 2 GPUs, out of memory while loading: each rank loads the whole model
    before the engine shards it, and offloading the optimizer, more GPUs or an 8-bit optimizer are the very
    changes that could fix it: none is pruned."""
    base = cfg(1, "on", method="full", gpus=2, engine="zero2")
    failed = oom(base, LOAD_OOM_TEXT)
    failed.oom_phase = "load"
    k = know(failed)
    for variant in (base.replace(cpu_offload="optimizer"), base.replace(gpus=4), base.replace(optimizer="adamw_8bit"),
                    base.replace(micro_batch_size=2)):
        assert k.memory.max_saving(base, variant, None, loading=True) is None
        assert k.verdict(variant)[0] is not Verdict.DOMINATED, variant.key()


def test_a_shorter_length_under_eager_attention_is_never_pruned_by_the_prior() -> None:
    eager = {"attn_implementation": "eager"}
    k = know(fit(cfg(1, "on", **eager), 6800, 15.2), oom(cfg(2, "off", **eager)))
    # twice the micro-batch at half the length: the same tokens, but a quarter of the attention scores
    shorter = cfg(4, "off", max_length=1024, **eager)
    assert k.memory.max_saving(cfg(2, "off", **eager), shorter) is None
    assert k.verdict(shorter)[0] is not Verdict.DOMINATED
    assert k.verdict(cfg(4, "off", **eager))[0] is Verdict.DOMINATED  # same length, more tokens: proved


def test_a_near_miss_in_the_headroom_is_a_memory_point_and_bounds_its_variants() -> None:
    near = fit(cfg(3, "every_2"), 11000, 23.17)
    near.outcome, near.memory_limit_bytes, near.headroom_bytes = Outcome.OOM, LIMIT, LIMIT - USABLE
    k = know(fit(cfg(1, "on"), 6800, 15.2), near)
    assert near.peak_lower_bound() == near.peak_memory_bytes
    assert k.memory.predict(cfg(3, "every_2")) == pytest.approx(near.peak_memory_bytes, rel=0.01)
    assert k.verdict(cfg(3, "every_2", optimizer="paged_adamw_8bit"))[0] is Verdict.DOMINATED
    # expandable_segments can give back the reserved-but-unallocated gibibyte: more than it missed by
    assert k.verdict(cfg(3, "every_2", expandable_segments=True))[0] is Verdict.PROBE


def test_the_margin_shrinks_as_fits_and_failures_arrive() -> None:
    m = MemoryModel(SHAPE)
    assert m.margin() == m.prior_margin
    one = cfg(1, "on")
    m.observe(one, int(15.2 * GIB), predicted=int(16.0 * GIB))
    m.observe_bound(cfg(4, "off"), int(24.7 * GIB), predicted=int(27.1 * GIB))  # consistent: above
    assert m.margin() == m.prior_margin  # two samples: not yet
    m.observe_bound(cfg(8, "off"), int(25.0 * GIB), predicted=int(40.0 * GIB))
    assert m.margin() < m.prior_margin
    assert "1 measured peak(s) and 2 out-of-memory bound(s)" in m.describe()
    m.observe_bound(cfg(4, "every_4"), int(24.0 * GIB), predicted=int(20.0 * GIB))  # predicted too low
    assert m.margin() > 0.2  # a prediction 17% under a bound: the margin grows again


def test_a_bound_raises_the_predictions_of_larger_micro_batches_of_its_group() -> None:
    m = MemoryModel(SHAPE)
    m.observe(cfg(1, "every_2"), int(12 * GIB))
    m.observe_bound(cfg(4, "every_2"), int(40 * GIB))
    assert m.predict(cfg(6, "every_2")) >= 40 * GIB
    assert m.predict(cfg(2, "every_2")) < 40 * GIB


def test_the_edge_order_starts_under_the_predicted_edge_not_at_the_optimistic_corner() -> None:
    k = know(fit(cfg(1, "on"), 6800, 15.2))
    viable = k.viable(SPACE.candidates())
    time = ProbeTime(steps=7, max_acc=2, confirm=True)
    pick = time.pick(k, viable, 180.0, edge_chooser(k, lambda c: time.estimate(k, c), 180.0))
    promise = time.pick(k, viable, 180.0)
    assert promise is not None and promise.gradient_checkpointing == "off"  # the corner: no recomputation
    assert k.memory.predict(promise) > USABLE
    assert pick is not None and k.memory.predict(pick) <= USABLE, pick.key()
    assert fit_probability(k, pick) > 0.5 > fit_probability(k, promise)


def test_expected_improvement_is_zero_only_for_a_surely_slower_config() -> None:
    assert expected_improvement(900.0, 0.0, 1000.0) == 0.0
    assert 0 < expected_improvement(900.0, 100.0, 1000.0) < expected_improvement(1000.0, 100.0, 1000.0)
    assert expected_improvement(1200.0, 10.0, 1000.0) == pytest.approx(200.0, rel=0.01)


def test_a_key_declared_to_move_speed_little_adds_little_spread() -> None:
    """A variant of the best that differs only in the allocator's segments is not worth a probe for the
    noise alone, where one that differs in checkpointing still is: the spread follows the declared span."""
    best = cfg(2, "every_4")
    fits = [(best, 10_000.0)]
    allocator, ladder = cfg(2, "every_4", expandable_segments=True), cfg(2, "off")
    assert effects.weight("expandable_segments") == effects.MINOR < effects.weight("gradient_checkpointing") == 1.0
    assert effects.differences(best, best) == 0.0
    _, spread_allocator = expected_speed(fits, allocator)
    _, spread_ladder = expected_speed(fits, ladder)
    assert spread_allocator < 0.07 * 10_000 < spread_ladder
    whole = expected_improvement(10_000.0, 10_000.0 * effects.uncertainty(1), 10_000.0)  # counted as a whole key
    assert expected_improvement(*expected_speed(fits, allocator), 10_000.0) < 0.7 * whole
    assert expected_improvement(*expected_speed(fits, ladder), 10_000.0) > whole


def test_declared_effects_order_the_ladder() -> None:
    ladder = [effects.factor(cfg(2, c)) for c in ("off", "every_4", "every_2", "on")]
    assert ladder == sorted(ladder, reverse=True)
    assert effects.factor(cfg(4, "on")) > effects.factor(cfg(1, "on"))  # the micro-batch helps, flattening
    gain_1_2 = effects.factor(cfg(2, "on")) / effects.factor(cfg(1, "on"))
    gain_4_8 = effects.factor(cfg(8, "on")) / effects.factor(cfg(4, "on"))
    assert gain_1_2 > gain_4_8 > 1.0


def test_the_policy_flag_is_stored_with_the_run_and_a_bad_one_is_a_usage_error(tmp_path) -> None:
    from autofit.core.errors import UsageError
    from autofit.run.rundir import RunSpec
    from autofit.run.session import SearchRequest, plan, search_settings
    from autofit.search.policy import Policy

    session = plan(SearchRequest(model="tiny-llama", space="cpu-demo", device="cpu", policy="promise", out=tmp_path))
    assert session.spec.to_dict()["policy"] == "promise"
    assert search_settings(session).policy is Policy.PROMISE
    assert RunSpec.from_dict(session.spec.to_dict()) == session.spec
    old = {k: v for k, v in session.spec.to_dict().items() if k != "policy"}  # a run made before the flag
    assert RunSpec.from_dict(old).policy == Policy.EDGE.value
    with pytest.raises(UsageError, match="spec.yaml is not a complete autofit run spec"):
        RunSpec.from_dict({**old, "policy": "nonsense"})


def test_a_kernel_combination_with_its_own_evidence_gets_its_own_margin() -> None:
    m = MemoryModel(SHAPE)
    stock, liger = cfg(1, "on"), cfg(1, "on", liger=True)
    for mb in (1, 2, 4):  # the stock prior checked within 2%
        m.observe(cfg(mb, "on"), int(15 * GIB), predicted=int(15.3 * GIB))
    assert m.margin(stock) == m.margin(liger) == m.margin() == pytest.approx(0.05)  # Liger: the model's
    for mb in (1, 2, 4):  # Liger's terms 20% off
        m.observe(cfg(mb, "on", liger=True), int(10 * GIB), predicted=int(12 * GIB))
    assert m.margin(liger) == pytest.approx(0.3) and m.margin(stock) == pytest.approx(0.05)


# ----------------------------------------------------------------------------- a dataset's shapes

SHORT = [20 + (i * 37) % 120 for i in range(3000)]
"""A chat-like length table: 20-139 tokens, mean ~80 (D1's mean is 59), far below max_length 2048."""
DATA_SPACE = Space("data", {"method": "lora", "max_length": 2048, "global_batch": 16, "gradient_checkpointing": "on",
                            "optimizer": "adamw_torch_fused"},
                   {"micro_batch_size": [1, 2], "batching": ["pad_max", "pad_longest", "padding_free"]})


def test_with_a_dataset_the_expected_speed_counts_trained_tokens_and_the_micro_batch_fixed_cost() -> None:
    from autofit.data.shapes import TokenShapes

    shapes = TokenShapes(SHORT)
    c = lambda mb, b: DATA_SPACE.config({"micro_batch_size": mb, "batching": b})  # noqa: E731
    speed = {(mb, b): effects.factor(c(mb, b), shapes) for mb in (1, 2) for b in DATA_SPACE.dimensions["batching"]}
    # packed fills a 2048-token row a micro-batch; micro-batch 1 padded to its one ~80-token sample pays the
    # fixed cost of a micro-batch for ~80 trained tokens; padding-free flattens micro_batch_size samples: at 1
    # the same as pad_longest, at 2 without the padding between them; pad_max trains ~4% of its tensor
    assert effects.factor(c(1, "packed"), shapes) > 5 * speed[(1, "pad_longest")]
    assert speed[(1, "padding_free")] == pytest.approx(speed[(1, "pad_longest")])
    assert speed[(2, "padding_free")] > speed[(2, "pad_longest")]
    assert speed[(2, "pad_longest")] > 1.5 * speed[(1, "pad_longest")]
    assert speed[(1, "pad_longest")] > 4 * speed[(1, "pad_max")]
    trained, tensor = shapes.per_micro_batch("pad_max", 2048, 1)
    assert tensor == 2048 and trained == pytest.approx(sum(n - 1 for n in SHORT) / len(SHORT))
    # without the data every strategy looks alike (full rows of random tokens): the old blindness
    factors = {b: effects.factor(c(1, b)) for b in ("pad_max", "pad_longest", "padding_free")}
    assert len(set(factors.values())) == 1, factors


def test_with_a_dataset_of_short_samples_the_edge_policy_probes_padding_free_next() -> None:
    from autofit.data.shapes import TokenShapes

    first = DATA_SPACE.config({"micro_batch_size": 1, "batching": "pad_max"})
    t = probe_trial(DATA_SPACE.dimensions, fit(first, 300, 15.2), 0)
    rest = [c for c in DATA_SPACE.candidates() if c.key() != first.key()]
    k = Knowledge.build([t], SHAPE, on_gpu=True, usable=USABLE, shapes=TokenShapes(SHORT))
    pick = edge_chooser(k, lambda c: 15.0, left=300)(rest)
    assert (pick.batching, pick.micro_batch_size) == ("padding_free", 2)  # the most trained tokens a micro-batch


def test_with_a_dataset_a_probe_of_short_micro_batches_is_expected_to_be_quick() -> None:
    """The budget's estimate of a probe's time follows the micro-batches it will really train: a
    search on short samples must not stop early believing every probe trains full 2,048-token rows."""
    from autofit.data.shapes import TokenShapes

    first = DATA_SPACE.config({"micro_batch_size": 1, "batching": "pad_max"})
    t = probe_trial(DATA_SPACE.dimensions, fit(first, 300, 15.2, wall=15.0), 0)
    short = DATA_SPACE.config({"micro_batch_size": 1, "batching": "pad_longest"})
    seconds = {}
    for name, shapes in (("blind", None), ("data", TokenShapes(SHORT))):
        k = Knowledge.build([t], SHAPE, on_gpu=True, usable=USABLE, shapes=shapes)
        seconds[name] = (k.estimate_seconds(first, 7, 4), k.estimate_seconds(short, 7, 4))
    # blind, both train full rows: the unmeasured one only by the spread of one differing key
    assert seconds["blind"][0] < seconds["blind"][1] <= 1.1 * seconds["blind"][0]
    assert seconds["data"][0] == pytest.approx(seconds["blind"][0])  # the measured probe speaks for itself
    assert seconds["data"][1] < 0.5 * seconds["data"][0]


def test_the_fixed_cost_of_a_micro_step_is_learned_from_two_micro_batches() -> None:
    """Speeds made by the model itself (H = 20,000 tokens, as with a 4-bit base dequantised on every
    product) give H back, across an optimizer difference whose declared effect is divided out; a
    single micro-batch, or fits of different lengths, say nothing."""
    h = 20_000.0

    def tps(c: TrialConfig) -> float:
        return 1e6 * c.tokens_per_micro_batch / (c.tokens_per_micro_batch + h) * effects.declared(c)

    one, two = cfg(1), cfg(2, optimizer="paged_adamw_8bit")
    assert effects.fitted_half_tokens([(one, tps(one)), (two, tps(two))]) == pytest.approx(h)
    assert effects.fitted_half_tokens([(one, tps(one)), (cfg(1, "off"), tps(cfg(1, "off")))]) is None
    longer = Space("x", {**SPACE.fixed, "max_length": 4096}, SPACE.dimensions).config(
        {"micro_batch_size": 2, "gradient_checkpointing": "on"}
    )
    assert effects.fitted_half_tokens([(one, tps(one)), (longer, tps(longer))]) is None
    # all fixed cost (micro-batch 2 trains twice the tokens in the same time, or a little more within
    # the noise): the largest H the pair can say, a multiple of its tokens, not a crash or infinity
    cap = effects.HALF_TOKENS_CAP * cfg(2).tokens_per_micro_batch
    assert effects.fitted_half_tokens([(one, 1000.0), (cfg(2), 2000.0)]) == cap
    assert effects.fitted_half_tokens([(one, 1000.0), (cfg(2), 1999.0)]) == cap


def test_the_policy_and_the_budget_use_the_learned_fixed_cost() -> None:
    """S5's case (a 4-bit base, micro-batch 2 ran 1.93x micro-batch 1): micro-batch 4 is expected near
    2x micro-batch 2's speed and to take about as long to probe, not 4x micro-batch 1's time, which
    kept a 3-minute search from ever probing it."""
    q = {"quantization": "nf4"}
    one, two, four = cfg(1, **q), cfg(2, **q), cfg(4, **q)
    k = know(fit(one, 2417, 7.0, wall=20.0), fit(two, 4667, 8.0, wall=20.0))
    assert k.half_tokens(four) > 10 * effects.HALF_TOKENS
    assert k.half_tokens(cfg(4)) == effects.HALF_TOKENS  # bf16 weights: its own prior, not nf4's finding
    from autofit.search.policy import expected_speed, measured

    mu, _ = expected_speed(measured(k), four, None, k.half_tokens)
    assert 1.6 * 4667 < mu < 2.0 * 4667
    assert k.estimate_seconds(four, 7, 4) < 1.5 * k.estimate_seconds(two, 7, 4)
    assert k.estimate_seconds(two, 7, 4) == pytest.approx(20.0)  # measured: its own time (train + overhead)


def test_a_large_length_table_is_sampled_and_its_means_hold() -> None:
    from autofit.data import Batching, plan
    from autofit.data.shapes import SAMPLE, TokenShapes

    big = [20 + (i * 7919) % 1500 for i in range(5 * SAMPLE)]
    shapes = TokenShapes(big)
    assert len(shapes.lengths) == SAMPLE
    for b in ("pad_longest", "padding_free"):
        p = plan(Batching(b), big, 2048, 2, 0)  # the whole table's plan
        want = (p.trained_tokens / len(p.batches), sum(m.tensor_tokens for m in p.batches) / len(p.batches))
        assert shapes.per_micro_batch(b, 2048, 2) == pytest.approx(want, rel=0.03)


def test_a_search_that_only_met_load_failures_says_the_weights_do_not_fit() -> None:
    from autofit.run.report.advice import nothing_fits_message

    failed = oom(cfg(1, "on"), LOAD_OOM_TEXT)
    failed.oom_phase, failed.peak_memory_bytes = "load", failed.peak_lower_bound()
    msg = nothing_fits_message([failed], LIMIT)
    assert "while the model was loading" in msg and "quantization" in msg and "checkpointing cannot help" in msg
    nf4 = oom(cfg(1, "on", quantization="nf4"), LOAD_OOM_TEXT)  # already 4-bit: quantization is no advice
    nf4.oom_phase, nf4.peak_memory_bytes = "load", nf4.peak_lower_bound()
    assert "quantization" not in nothing_fits_message([nf4], LIMIT).split("Allow next")[1]
    failed.oom_phase = "forward"  # the same figures from a failure in training: the usual advice
    assert "gradient checkpointing with offload (on+offload)" in nothing_fits_message([failed], LIMIT)


def test_nothing_fits_advises_only_the_savings_not_tried() -> None:
    """It advised quantization, a shorter length and checkpointing after probes that had all three."""
    from autofit.run.report.advice import nothing_fits_message

    def advice(*configs: TrialConfig) -> str:
        return nothing_fits_message([oom(c, OOM_TEXT) for c in configs], LIMIT).split("Allow next: ")[1]

    plain = advice(cfg(4, "off", max_length=1024))
    assert plain == (
        "quantization (--space qlora: a 4-bit base), a --max-length shorter than 1024, "
        "micro_batch_size 1 (in a --space file), gradient checkpointing (on, or on+offload), or a larger "
        "--memory-limit."
    )
    tried = advice(cfg(1, "on+offload", quantization="nf4", max_length=512), cfg(2, "on", max_length=1024))
    assert tried == "a --max-length shorter than 512, or a larger --memory-limit."
    assert "with offload (on+offload)" in advice(cfg(1, "every_2", max_length=256))
    # a probe that timed out or crashed ran out of nothing: it takes no saving off the advice
    quiet = [
        ProbeResult(outcome, cfg(1, "on+offload", quantization="nf4", max_length=256).to_dict(), reason="x")
        for outcome in (Outcome.TIMEOUT, Outcome.CRASH, Outcome.CANCELLED)
    ]
    mixed = nothing_fits_message([oom(cfg(4, "off", max_length=1024), OOM_TEXT), *quiet], LIMIT)
    assert mixed.split("Allow next: ")[1] == plain
    none = nothing_fits_message(quiet, LIMIT)  # nothing ran out of memory: no memory advice at all
    assert none.startswith("No configuration fits, and none ran out of memory: 3 probe(s) ended ")
    assert "timeout (1)" in none and "crash (1)" in none and "Allow next" not in none


def test_a_search_whose_probes_all_crashed_or_were_unsupported_gives_no_memory_advice() -> None:
    """A misspelt lora target or a kernel the machine lacks crashed every probe; the message advised
    quantization and a larger --memory-limit."""
    from autofit.protocol.result import Outcome, ProbeResult
    from autofit.run.report.advice import nothing_fits_message

    reason = "Target modules {'zzz_proj'} not found in the base model"
    results = [ProbeResult(outcome=Outcome.CRASH, config=cfg(mb, "on").to_dict(), reason=reason) for mb in (1, 2)]
    results.append(ProbeResult(outcome=Outcome.UNSUPPORTED, config=cfg(4, "on").to_dict(), reason="no triton"))
    msg = nothing_fits_message(results, LIMIT)
    assert msg.startswith("No configuration ran") and f"2 of 3 said: {reason}" in msg
    assert "Allow next" not in msg and "memory-limit" not in msg
    assert "Allow next" in nothing_fits_message([*results, oom(cfg(8, "off"), OOM_TEXT)], LIMIT)


# ----------------------------------------------------------------------------- nothing can fit, by the prior

LORA, QLORA = load_space("lora").candidates(), load_space("qlora").candidates()


def test_nothing_can_fit_is_claimed_only_where_the_weights_alone_exceed_the_card_beyond_the_error() -> None:
    """llama2-7b's bf16 weights are 12.6 GiB: at 2 and 6 GiB no config of the LoRA space can fit, whatever the
    prior's error; at 12 GiB every config is predicted over (so the old policy probed them anyway) but the
    weights floor is within the error: probed, never skipped on a guess. With nf4 in the space 6 GiB can fit."""
    for gib in (2, 6):
        assert beyond_reach(LORA, SHAPE, usable_bytes(gib * GIB))
    at_12 = usable_bytes(12 * GIB)
    assert all(prior(c, SHAPE).total() > at_12 for c in LORA)
    assert not beyond_reach(LORA, SHAPE, at_12)
    assert not beyond_reach(QLORA, SHAPE, usable_bytes(6 * GIB))
    assert beyond_reach(QLORA, SHAPE, usable_bytes(2 * GIB))  # even the 4-bit weights: 3.6 GiB


def test_the_weights_floor_is_below_every_measured_peak_of_the_recorded_landscapes() -> None:
    """What makes the claim certain: on every GPU scenario recorded (bench/landscapes), the floor of the weights
    stayed under 64% of the measured peak, and no recorded scenario is called beyond reach."""
    for path in sorted((ROOT / "bench" / "landscapes").glob("*.json")):
        land = Landscape.load(path)
        shape = Shape.from_config(land.model_source().config)
        fits = [ProbeResult.from_dict(p) for p in land.points.values() if p.get("tokens_per_s")]
        assert fits and all(
            weights_floor(TrialConfig.from_dict(r.config), shape) < 0.7 * (r.peak_memory_bytes or 0) for r in fits
        ), path.name
        assert not beyond_reach(land.search_space().candidates(), shape, land.usable_bytes), path.name


def test_the_savings_are_computed_and_each_is_the_least_that_fits() -> None:
    """At 7 GiB: a 4-bit base fits by its smallest prediction (S5 measured 6.5 GiB for it, over 6 GiB's usable
    5.7); no length does (the weights alone exceed it); the largest model of the family that fits, and 1% more
    scale does not; the fewest GPUs that shard it under the card, and half as many do not; the card the space
    needs."""
    usable = usable_bytes(7 * GIB)
    r = reach(LORA, SHAPE, usable, on_gpu=True)
    assert r.certain and r.weights == {"bf16 weights + LoRA adapter": min(loaded_bytes(c, SHAPE) for c in LORA)}
    found = {s.kind: s for s in r.savings}
    assert set(found) == set(Change)

    def least(configs: list[TrialConfig], shape: Shape = SHAPE) -> int:
        return min(prior(c, shape).total() for c in configs)

    assert (
        found[Change.QUANTIZE].fits
        and found[Change.QUANTIZE].amount == least([c.replace(quantization="nf4") for c in LORA]) <= usable
    )
    assert not found[Change.LENGTH].fits
    model = found[Change.MODEL]
    assert model.fits and 0.5e9 < (model.amount or 0) < SHAPE.total_params()
    scale = next(s / 1000 for s in range(1000, 0, -1) if scaled(SHAPE, s / 1000).total_params() <= (model.amount or 0))
    assert least(LORA, scaled(SHAPE, scale)) <= usable < least(LORA, scaled(SHAPE, scale * 1.01))
    gpus = found[Change.GPUS].amount or 0

    def sharded(n: int) -> list[TrialConfig]:  # FSDP2 checkpoints every layer or none
        return [c.replace(gpus=n, engine="zero3") for c in LORA] + [
            c.replace(gpus=n, engine="fsdp2") for c in LORA if c.gradient_checkpointing in ("off", "on")
        ]

    assert gpus >= 2 and least(sharded(gpus)) <= usable and (gpus == 2 or least(sharded(gpus // 2)) > usable)
    assert found[Change.CARD].amount == r.smallest_peak == least(LORA)


def test_the_longest_length_that_fits_is_bisected_to_the_edge() -> None:
    """qlora at 4096 on a card where nf4 fits only shorter: the length named fits, 8 tokens more does not."""
    space = load_space("qlora").replaced(max_length=[4096])
    usable = usable_bytes(6 * GIB)
    saving = shorter_length(space.candidates(), SHAPE, usable)
    assert saving is not None and saving.fits
    n = saving.amount or 0

    def least(length: int) -> int:
        return min(prior(c.replace(max_length=length), SHAPE).total() for c in space.candidates())

    assert 8 <= n < 4096 and least(n) <= usable < least(n + 8)


def test_a_precomputed_reference_alone_is_expected_slower_and_a_larger_micro_batch_faster() -> None:
    """Over one epoch the precomputed pass is the step's reference forward moved before training, host-bound at
    TRL's default batch, after a hash of every weight (S7 on an H100: 0.86x at micro-batch 1): the policy expects
    it slower alone, where it expected 1.3x and spent S7's second probe on it, and looks to a larger micro-batch
    first; a precomputed fit's speed, seen from a live reference, is scaled back up."""
    dpo = load_space(ROOT / "search_spaces" / "dpo.yaml").replaced(max_length=[2048], batching=["pad_longest"])
    forum = dpo.config({**dpo.seed(), "micro_batch_size": 1, "gradient_checkpointing": "on"})
    measured_fit = ProbeResult(Outcome.FIT, forum.to_dict(), tokens_per_s=1695.0, pairs_per_s=1.84,
                               peak_memory_bytes=int(15.95 * GIB), memory_limit_bytes=LIMIT, wall_seconds=55.0,
                               train_seconds=38.0)
    k = Knowledge.build([probe_trial(dpo.dimensions, measured_fit, 0)], SHAPE, on_gpu=True, usable=USABLE)
    fits = [(r.config, r.tokens_per_s or 0.0) for r in k.fits()]
    precomputed, _ = expected_speed(fits, forum.replace(precompute_ref_log_probs=True), k.shapes, k.half_tokens)
    mb2 = dpo.config({**dpo.seed(), "micro_batch_size": 2, "gradient_checkpointing": "on"})
    larger, _ = expected_speed(fits, mb2, k.shapes, k.half_tokens)
    assert precomputed == pytest.approx(1695.0 * 0.8)
    assert larger > 1695.0 * 1.03
    seen_from_precomputed, _ = expected_speed([(forum.replace(precompute_ref_log_probs=True), 1356.0)], forum,
                                              k.shapes, k.half_tokens)
    assert seen_from_precomputed == pytest.approx(1356.0 / 0.8)
