"""Every numeric path of the policy and the memory model at the extremes, as properties (hypothesis): a card
of 1 byte and of 10 TiB, a model of 1 or 1,000 layers with tiny or huge widths and vocabularies, out-of-memory
shortfalls of 0 and of petabytes, probe times of 0, a year or not a number. Each answer is a finite number in
its range: probabilities in [0, 1], byte counts of at least 0, nothing NaN, no exception. In-process, no probe
runs; example counts are kept small so the file takes seconds."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from stored import probe_trial

from autofit.config.models import PRESETS
from autofit.config.space import CKPT_COST, load_space
from autofit.config.spec import OFFLOADS_BY_ENGINE, OPTIMIZERS, TrialConfig
from autofit.core.errors import UsageError
from autofit.estimate.memory import (
    TERMS,
    MemoryModel,
    Shape,
    beyond_reach,
    loaded_bytes,
    prior,
    reach,
    weights_floor,
)
from autofit.protocol.result import Outcome, ProbeResult
from autofit.search.knowledge import Knowledge, Verdict
from autofit.search.policy import (
    cost_weight,
    edge_chooser,
    expected_improvement,
    expected_speed,
    fit_probability,
    logistic,
    measured,
    score,
)

TIB = 2**40
GIB = 2**30
EXAMPLES = settings(max_examples=40, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
"""Few examples (the file takes seconds), no example database written into the checkout."""
USABLE = st.one_of(st.just(1), st.just(10 * TIB), st.integers(1, 10 * TIB))
"""A card of 1 byte, of 10 TiB, or anything between."""
BYTES = st.one_of(st.just(0), st.just(2**60), st.integers(0, 2**60))
"""A peak, a request or a bound: 0, an exabyte, or anything between."""
ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True)

shapes = st.builds(Shape, hidden=st.integers(0, 65_536), layers=st.integers(0, 1000),
                   intermediate=st.integers(0, 262_144), vocab=st.integers(0, 1_000_000),
                   heads=st.integers(0, 128), kv_heads=st.integers(0, 128), tied=st.booleans())
"""Any shape a config.json can give, a missing key as 0 (Shape.from_config)."""


@st.composite
def configs(draw: st.DrawFn) -> TrialConfig:
    """Any valid config: every key that moves memory at its extremes."""
    method = draw(st.sampled_from(["lora", "full"]))
    engine = draw(st.sampled_from(["none", "fsdp2", "zero2", "zero3"]))
    quant = "none" if method == "full" or engine != "none" else draw(st.sampled_from(["none", "nf4", "8bit"]))
    ckpt = draw(st.sampled_from(["off", "on"] if engine == "fsdp2" else list(CKPT_COST)))
    try:
        return TrialConfig(
            method=method, quantization=quant, engine=engine, gradient_checkpointing=ckpt,
            cpu_offload=draw(st.sampled_from(OFFLOADS_BY_ENGINE[engine])),
            reshard_after_forward=engine != "fsdp2" or draw(st.booleans()),
            optimizer=draw(st.sampled_from(OPTIMIZERS)), precision=draw(st.sampled_from(["bf16", "fp16", "fp32"])),
            max_length=draw(st.integers(8, 1_048_576)), micro_batch_size=draw(st.integers(1, 1024)),
            global_batch=draw(st.integers(1, 4096)), gpus=draw(st.integers(1, 1024)),
            lora_r=draw(st.integers(1, 4096)), lora_targets=draw(st.sampled_from(["q_proj,v_proj", "all-linear"])),
            liger=draw(st.booleans()), torch_compile=draw(st.booleans()),
            expandable_segments=draw(st.booleans()))
    except UsageError:  # a combination the engines cannot run (ZeRO-Offload with a non-Adam optimizer)
        assume(False)
        raise


def taught(shape: Shape, points: list[tuple[TrialConfig, int, int]], bounds: list[tuple[TrialConfig, int, int]],
           on_gpu: bool = True) -> MemoryModel:
    """A memory model that saw these peaks and out-of-memory bounds, each with a prediction made before it."""
    model = MemoryModel(shape, on_gpu=on_gpu)
    for c, peak, predicted in points:
        model.observe(c, peak, predicted)
    for c, bound, predicted in bounds:
        model.observe_bound(c, bound, predicted)
    return model


def a_probability(p: float) -> bool:
    return math.isfinite(p) and 0.0 <= p <= 1.0


# ----------------------------------------------------------------------------- the policy's numbers


@EXAMPLES
@given(ANY_FLOAT)
def test_the_logistic_is_a_probability_for_any_number(x: float) -> None:
    assert a_probability(logistic(x))


@EXAMPLES
@given(shapes, configs(), USABLE, st.lists(st.tuples(configs(), BYTES, BYTES), max_size=3),
       st.lists(st.tuples(configs(), BYTES, BYTES), max_size=2), st.booleans())
def test_fit_probability_is_a_probability_for_any_card_model_and_evidence(
        shape: Shape, cfg: TrialConfig, usable: int, points: list, bounds: list, on_gpu: bool) -> None:
    know = Knowledge(usable, taught(shape, points, bounds, on_gpu))
    assert a_probability(fit_probability(know, cfg))


@EXAMPLES
@given(st.floats(0, 1e12), st.floats(0, 1e12), st.floats(0, 1e12))
@example(0.0, 1.0, 8.3)  # 8.3 spreads below the best: 1 + erf(z) cancels, and the gain came out negative
def test_expected_improvement_is_finite_and_at_least_the_sure_gain(mu: float, sigma: float, best: float) -> None:
    ei = expected_improvement(mu, sigma, best)
    assert math.isfinite(ei) and ei >= 0.0
    assert ei >= max(mu - best, 0.0) * (1 - 1e-9) - 1e-6  # E[max(X - best, 0)] >= max(E[X] - best, 0)


@EXAMPLES
@given(ANY_FLOAT, ANY_FLOAT, ANY_FLOAT)
@example(math.nan, 1.0, 0.0)
@example(1e308, 1e-308, -1e308)
def test_expected_improvement_of_any_floats_is_finite(mu: float, sigma: float, best: float) -> None:
    ei = expected_improvement(mu, sigma, best)
    assert math.isfinite(ei) and ei >= 0.0


@EXAMPLES
@given(st.one_of(st.none(), ANY_FLOAT), ANY_FLOAT)
def test_cost_weight_is_a_weight_for_any_time(typical: float | None, left: float) -> None:
    assert a_probability(cost_weight(typical, left))


@EXAMPLES
@given(shapes, configs(), USABLE, st.lists(st.tuples(configs(), st.floats(0, 1e9)), max_size=3),
       st.one_of(st.none(), st.floats(0, 1e9)), st.one_of(st.none(), ANY_FLOAT), ANY_FLOAT)
def test_a_score_is_finite_for_any_fits_times_and_card(shape: Shape, cfg: TrialConfig, usable: int,
                                                        fits: list, best: float | None, seconds: float | None,
                                                        left: float) -> None:
    know = Knowledge(usable, MemoryModel(shape))
    s = score(know, cfg, seconds, cost_weight(seconds, left), fits, best)
    assert a_probability(s.p_fit)
    assert all(math.isfinite(x) and x >= 0 for x in (s.gain, s.value)), s


# ----------------------------------------------------------------------------- the memory model's numbers


@EXAMPLES
@given(shapes, configs(), st.booleans())
def test_the_prior_is_bytes_for_any_shape(shape: Shape, cfg: TrialConfig, on_gpu: bool) -> None:
    b = prior(cfg, shape, on_gpu)
    assert all(isinstance(getattr(b, t), int) and getattr(b, t) >= 0 for t in (*TERMS, "allocator", "outside"))
    assert b.total() >= b.allocated() >= 0
    assert loaded_bytes(cfg, shape) >= weights_floor(cfg, shape) >= 0  # the floor is never above the prior


@EXAMPLES
@given(shapes, configs(), st.lists(st.tuples(configs(), BYTES, BYTES), max_size=4),
       st.lists(st.tuples(configs(), BYTES, BYTES), max_size=3), USABLE)
def test_the_fitted_model_predicts_bytes_with_a_finite_margin(shape: Shape, cfg: TrialConfig, points: list,
                                                              bounds: list, usable: int) -> None:
    model = taught(shape, points, bounds)
    assert isinstance(model.predict(cfg), int) and model.predict(cfg) >= 0
    assert math.isfinite(model.margin(cfg)) and model.margin(cfg) >= 0.05
    assert isinstance(model.hopeless(cfg, usable), bool) and model.describe()


@EXAMPLES
@given(shapes, configs(), configs(), st.one_of(st.none(), BYTES), st.booleans(),
       st.lists(st.tuples(configs(), BYTES, BYTES), max_size=2))
def test_max_saving_is_none_or_bytes(shape: Shape, oom: TrialConfig, cfg: TrialConfig, reserved_free: int | None,
                                     loading: bool, points: list) -> None:
    saving = taught(shape, points, []).max_saving(oom, cfg, reserved_free, loading)
    assert saving is None or (isinstance(saving, int) and saving >= 0)


SPACE = load_space("lora")
LLAMA = Shape.from_config(PRESETS["llama2-7b"])


@EXAMPLES
@given(st.sampled_from(SPACE.candidates()), BYTES, BYTES, st.sampled_from([None, "load", "forward"]), USABLE,
       st.booleans())
def test_an_out_of_memory_shortfall_of_zero_or_petabytes_prunes_without_error(
        failed: TrialConfig, in_use: int, request: int, phase: str | None, usable: int, on_gpu: bool) -> None:
    res = ProbeResult(Outcome.OOM, failed.to_dict(), memory_limit_bytes=usable, headroom_bytes=0,
                      oom_in_use_bytes=in_use, oom_request_bytes=request, oom_phase=phase, wall_seconds=1.0)
    know = Knowledge.build([probe_trial(SPACE.dimensions, res, 0)], LLAMA, on_gpu=on_gpu, usable=usable)
    assert know.shortfall(res) >= 1
    candidates = SPACE.candidates()[:12]
    verdicts = [know.verdict(c)[0] for c in candidates]
    assert all(isinstance(v, Verdict) for v in verdicts)
    viable = [c for c, v in zip(candidates, verdicts) if v.probes()]
    if viable:
        assert edge_chooser(know, lambda c: 30.0, 600.0)(viable) in viable


@EXAMPLES
@given(st.lists(st.tuples(st.sampled_from(SPACE.candidates()), st.floats(0, 1e12), st.floats(0, 1e9),
                          st.floats(0, 1e9)), min_size=1, max_size=4), st.sampled_from(SPACE.candidates()),
       st.integers(1, 10**6), st.one_of(st.none(), st.integers(1, 10**6)))
def test_speed_and_time_estimates_from_fits_of_any_speed_and_duration(
        fits: list, cfg: TrialConfig, steps: int, max_acc: int | None) -> None:
    """Fits measured at 0 to 10**12 tokens/s over 0 to 10**9 seconds: the learned fixed cost of a micro-step,
    the expected speed and a probe's estimated time stay finite (None: no time known)."""
    results = [ProbeResult(Outcome.FIT, c.to_dict(), tokens_per_s=tps, peak_memory_bytes=GIB, wall_seconds=wall,
                           train_seconds=train) for c, tps, wall, train in fits]
    know = Knowledge.build([probe_trial(SPACE.dimensions, r, i) for i, r in enumerate(results)], LLAMA,
                           on_gpu=True, usable=20 * GIB)
    assert math.isfinite(know.half_tokens(cfg)) and know.half_tokens(cfg) >= 0
    mu, sigma = expected_speed(measured(know), cfg, None, know.half_tokens)
    assert math.isfinite(mu) and math.isfinite(sigma) and mu >= 0
    seconds = know.estimate_seconds(cfg, steps, max_acc)
    assert seconds is None or (math.isfinite(seconds) and seconds >= 0)


# ----------------------------------------------------------------------------- what fits, by the prior


@EXAMPLES
@given(shapes, st.lists(configs(), min_size=1, max_size=3), USABLE, st.booleans())
def test_reach_answers_for_any_card_and_model(shape: Shape, candidates: list[TrialConfig], usable: int,
                                              on_gpu: bool) -> None:
    r = reach(candidates, shape, usable, on_gpu)
    assert r.smallest_peak is not None and r.smallest_peak >= 0
    assert all(n >= 0 for n in r.weights.values()) and isinstance(r.certain, bool)
    assert (r.smallest_peak <= usable) == (r.savings == ())  # savings only where nothing fits
    assert not (r.certain and r.smallest_peak <= usable)  # certain never contradicts the prediction
    assert r.describe()


def test_a_card_of_one_byte_fits_nothing_and_one_of_ten_tebibytes_fits_everything() -> None:
    candidates = SPACE.candidates()
    assert beyond_reach(candidates, LLAMA, 1)
    tiny = reach(candidates, LLAMA, 1)
    assert tiny.certain and not any(s.fits for s in tiny.savings if s.change.startswith("a 4-bit"))
    huge = reach(candidates, LLAMA, 10 * TIB)
    assert not huge.certain and huge.savings == ()
    know = Knowledge(10 * TIB, MemoryModel(LLAMA))
    assert all(fit_probability(know, c) > 0.99 for c in candidates)
    assert all(fit_probability(Knowledge(1, MemoryModel(LLAMA)), c) == 0.0 for c in candidates)
    # no usable memory at all (or less: a headroom past the card) fits nothing; only None means no limit
    assert all(fit_probability(Knowledge(u, MemoryModel(LLAMA)), c) == 0.0 for u in (0, -TIB) for c in candidates)
    assert all(fit_probability(Knowledge(None, MemoryModel(LLAMA)), c) == 1.0 for c in candidates)


def test_a_card_far_too_small_gives_every_config_probability_zero_not_an_overflow() -> None:
    """The reported crash: llama2-7b's LoRA space at 2 GiB put a peak ~90x the usable memory into math.exp."""
    know = Knowledge(int(2 * GIB * 0.95), MemoryModel(LLAMA, on_gpu=False))
    chosen = edge_chooser(know, lambda c: None, 60.0)(SPACE.candidates())
    assert chosen in SPACE.candidates()
    assert max(fit_probability(know, c) for c in SPACE.candidates()) < 1e-3
    assert measured(know) == []
