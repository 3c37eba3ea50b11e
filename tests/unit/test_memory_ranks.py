"""The memory model per rank (engine x gpus), the needs-more-GPUs verdict and the report's section on
more GPUs: in-process, numbers from the Llama-2-7B shape, Optuna trials built as test_knowledge does;
no probe runs."""

from __future__ import annotations

from optuna.distributions import CategoricalDistribution
from optuna.trial import FrozenTrial, create_trial

from autofit.config.models import PRESETS
from autofit.config.space import Space
from autofit.config.spec import TrialConfig
from autofit.estimate.memory import (
    ALLOCATOR_SLACK,
    BUFFERS,
    CUDA_CONTEXT,
    GATHERED,
    NCCL_BUFFERS,
    MemoryModel,
    Shape,
    group_key,
    prior,
)
from autofit.protocol.result import Outcome, ProbeResult
from autofit.run.report.markdown import report_markdown
from autofit.run.rundir import RunSpec
from autofit.search.knowledge import Knowledge, Verdict

GIB = 2**30
S7 = Shape.from_config(PRESETS["llama2-7b"])
P7 = S7.total_params()  # 6.74e9
LAYER = S7.linear_params() // S7.layers + 2 * S7.hidden  # one decoder layer: 202e6
USABLE = 38 * GIB  # a 40 GiB card less the 5% headroom


def full(**kw: object) -> TrialConfig:
    """Full fine-tuning of the Llama-2-7B shape at 2048, bf16, AdamW, checkpointing on."""
    return TrialConfig(method="full", max_length=2048, gradient_checkpointing="on", **kw)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- the prior per rank


def test_fsdp2_on_four_ranks_halves_the_sharded_terms_of_two_and_not_the_activations() -> None:
    two, four = prior(full(gpus=2, engine="fsdp2"), S7), prior(full(gpus=4, engine="fsdp2"), S7)
    # accelerate upcasts trainable parameters to fp32 under bf16: 4 bytes a parameter of shard, 4 of
    # gradient, 8 of Adam moments, over the ranks
    assert (two.weights, two.trainable) == (P7 * 4 // 2, P7 * 4 // 2 + P7 * 8 // 2)
    assert (four.weights, four.trainable) == (P7 * 4 // 4, P7 * 4 // 4 + P7 * 8 // 4)
    assert round(four.weights / GIB, 2) == 6.28 and round(four.trainable / GIB, 2) == 18.83
    assert (two.activations, two.logits, two.gathered) == (four.activations, four.logits, four.gathered)
    assert four.activations == prior(full(), S7).activations > 0  # per rank: the rank's own micro-batch
    # the root unit (embeddings, head) and two decoder layers in bf16, one layer's gradients
    assert four.gathered == (S7.embedding_params() + S7.hidden + 2 * LAYER) * 2 + P7 // S7.layers * 2
    assert round(four.total() / GIB, 1) == 30.7 and four.total() < USABLE < two.total()


def test_activations_scale_with_the_micro_batch_on_each_rank_not_with_the_ranks() -> None:
    one, two = prior(full(gpus=4, engine="fsdp2"), S7), prior(full(gpus=4, engine="fsdp2", micro_batch_size=2), S7)
    assert two.activations == 2 * one.activations and two.logits == 2 * one.logits
    assert (two.weights, two.trainable, two.gathered) == (one.weights, one.trainable, one.gathered)


def test_zero2_shards_gradients_and_optimizer_but_not_the_weights_and_ddp_holds_everything() -> None:
    single, ddp, z2 = prior(full(), S7), prior(full(gpus=2), S7), prior(full(gpus=2, engine="zero2"), S7)
    assert ddp.weights == z2.weights == single.weights == P7 * 2  # bf16, a whole replica on each rank
    assert ddp.trainable == single.trainable == P7 * (2 + 4)  # bf16 gradients and bf16 moments
    assert ddp.buffers == P7 * 2  # DDP's gradient buckets: one more copy of the gradients
    # DeepSpeed: bf16 gradients and fp32 master weights + fp32 moments, halved; two reduce buckets
    assert z2.trainable == P7 * 2 // 2 + P7 * 12 // 2
    assert z2.buffers == 2 * 500_000_000 * 2
    assert z2.total() < ddp.total() and z2.gathered == ddp.gathered == 0
    z3 = prior(full(gpus=2, engine="zero3"), S7)
    assert z3.weights == z2.weights // 2 and z3.trainable == z2.trainable and z3.gathered > 0


def test_cpu_offload_moves_the_state_off_the_device_and_keeps_a_small_staging_term() -> None:
    off, on = prior(full(gpus=4, engine="fsdp2"), S7), prior(full(gpus=4, engine="fsdp2", cpu_offload="all"), S7)
    assert (on.weights, on.trainable) == (0, 0) and on.gathered == off.gathered
    assert on.buffers == 2 * (S7.linear_params() // S7.layers) * 4 // 4 < GIB // 2  # a unit's fp32 shard in flight
    assert on.total() < off.total() - 20 * GIB
    z3 = prior(full(gpus=4, engine="zero3"), S7)
    z3_opt, z3_all = (prior(full(gpus=4, engine="zero3", cpu_offload=o), S7) for o in ("optimizer", "all"))
    assert z3_opt.trainable == 0 and z3_opt.weights == z3.weights  # ZeRO-Offload: gradients and optimizer
    assert z3_all.weights == 0 and z3_all.total() < z3_opt.total() < z3.total()


def test_no_reshard_after_forward_keeps_every_layer_gathered_until_backward() -> None:
    kept = prior(full(gpus=4, engine="fsdp2", reshard_after_forward=False), S7)
    resharded = prior(full(gpus=4, engine="fsdp2"), S7)
    assert kept.gathered - resharded.gathered == (S7.layers - 2) * LAYER * 2
    assert kept.gathered >= P7 * 2  # ~ the full unsharded bf16 weights
    assert kept.total() > USABLE > resharded.total()


def test_nccl_is_outside_pytorch_on_each_gpu_rank_and_absent_on_the_cpu() -> None:
    assert prior(full(gpus=2, engine="fsdp2"), S7).outside == CUDA_CONTEXT + NCCL_BUFFERS
    assert prior(full(), S7).outside == CUDA_CONTEXT
    assert prior(full(gpus=2, engine="fsdp2"), S7, on_gpu=False).outside == 0


def test_lora_shards_the_frozen_base_under_fsdp2_and_zero3_only() -> None:
    lora = TrialConfig(max_length=2048)
    base = prior(lora, S7).weights
    assert prior(lora.replace(gpus=4, engine="fsdp2"), S7).weights == base // 4
    assert prior(lora.replace(gpus=4, engine="zero3"), S7).weights == base // 4
    assert prior(lora.replace(gpus=4, engine="zero2"), S7).weights == base
    assert prior(lora.replace(gpus=4), S7).buffers < 64 * 2**20  # DDP buckets: the adapter's gradients


def test_one_gpu_keeps_its_six_terms_and_allocator_slack_covers_the_engine_terms() -> None:
    assert list(prior(full(), S7).as_dict()) == [
        "weights", "adapter/trainable params + grads + optimizer", "activations", "logits and loss",
        "allocator overhead", "outside PyTorch"]
    z3 = prior(full(gpus=4, engine="zero3", cpu_offload="optimizer"), S7)
    assert GATHERED in z3.as_dict() and BUFFERS in z3.as_dict()
    allocated = z3.weights + z3.trainable + z3.gathered + z3.buffers + z3.activations + z3.logits
    assert z3.allocator == int(allocated * ALLOCATOR_SLACK)


# ----------------------------------------------------------------------------- learning per group


def test_a_ddp_fit_does_not_teach_an_fsdp2_prediction_nor_two_ranks_four() -> None:
    ddp, fsdp = full(gpus=2), full(gpus=2, engine="fsdp2")
    assert len({group_key(c) for c in (ddp, fsdp, fsdp.replace(gpus=4), fsdp.replace(cpu_offload="all"),
                                       fsdp.replace(reshard_after_forward=False))}) == 5
    m = MemoryModel(S7)
    m.observe(ddp, 60 * GIB)
    m.observe(ddp.replace(micro_batch_size=2), 62 * GIB)
    assert m.predict(ddp.replace(micro_batch_size=4)) == 66 * GIB  # its own group's affine fit
    assert m.predict(fsdp) == int(prior(fsdp, S7).total() * m.scale())  # the prior, not the DDP line
    m.observe(fsdp, 40 * GIB)
    assert m.predict(fsdp.replace(gpus=4)) == int(prior(fsdp.replace(gpus=4), S7).total() * m.scale())


def test_the_most_more_ranks_can_save_is_known() -> None:
    m = MemoryModel(S7)
    oom = full(gpus=2, engine="fsdp2")
    saving = m.max_saving(oom, oom.replace(gpus=4))
    assert saving is not None and saving > 20 * GIB  # half of the shards
    assert m.max_saving(oom, oom.replace(reshard_after_forward=False)) == 0  # keeping layers saves nothing


# ----------------------------------------------------------------------------- the verdict

DIMS = {"micro_batch_size": [1, 2], "gradient_checkpointing": ["off", "on"], "gpus": [1, 2, 4],
        "engine": ["none", "fsdp2"]}
SPACE = Space("mgpu", {"method": "full", "max_length": 2048}, DIMS)
DIST = {k: CategoricalDistribution(v) for k, v in DIMS.items()}


def trial(number: int, res: ProbeResult) -> FrozenTrial:
    c = TrialConfig.from_dict(res.config)
    t = create_trial(params={k: getattr(c, k) for k in DIMS}, distributions=DIST, value=res.tokens_per_s or 0.0,
                     user_attrs={"kind": "probe", "config_key": c.key(), "result": res.to_dict()})
    t.number = number
    return t


def oom(c: TrialConfig) -> ProbeResult:
    return ProbeResult(Outcome.OOM, c.to_dict(), peak_memory_bytes=39 * GIB, device="cuda:0")


def test_a_config_on_more_gpus_than_attached_is_reported_not_probed() -> None:
    k = Knowledge.build([], S7, True, USABLE, ranks=2)
    four = SPACE.config({"gradient_checkpointing": "on", "gpus": 4, "engine": "fsdp2"})
    verdict, detail = k.verdict(four)
    assert verdict is Verdict.NEEDS_GPUS and not verdict.infeasible()
    assert detail == "needs 4 GPUs, 2 attached; predicted per-rank peak 30.7 GiB (fits 38 GiB usable)"
    verdict, detail = Knowledge.build([], S7, True, USABLE, ranks=1).verdict(four.replace(gpus=2))
    assert detail == "needs 2 GPUs, 1 attached; predicted per-rank peak 57 GiB (over 38 GiB usable)"
    assert k.verdict(four.replace(gpus=2))[0] is Verdict.PROBE
    assert k.verdict(four.replace(gpus=1))[0] is Verdict.PROBE
    assert Knowledge.build([], S7, True, None, ranks=1).verdict(four)[1] == (
        "needs 4 GPUs, 1 attached; predicted per-rank peak 30.7 GiB")
    on_cpu = Knowledge.build([], S7, False, USABLE, ranks=2).verdict(four)[1]
    assert on_cpu.startswith("needs 4 ranks (gloo processes), 2 attached")


def test_needing_more_gpus_comes_before_every_other_verdict() -> None:
    one = SPACE.config({"gradient_checkpointing": "off", "gpus": 1, "engine": "none"})
    k = Knowledge.build([trial(0, oom(one))], S7, True, USABLE, ranks=1)
    assert k.verdict(one.replace(micro_batch_size=2))[0] is Verdict.DOMINATED
    assert k.verdict(one.replace(micro_batch_size=2, gpus=2))[0] is Verdict.NEEDS_GPUS


# ----------------------------------------------------------------------------- the report


def spec(ranks: int) -> RunSpec:
    target = {"device": "cuda", "gpu_index": 0, "gpu_name": "NVIDIA H200", "memory_limit_bytes": 40 * GIB,
              "headroom": 0.05, "ranks": ranks, "gpu_indices": list(range(ranks))}
    return RunSpec.from_dict({"run_id": "r", "created": "20260101T000000Z", "seed": 0,
                              "model": {"ref": "llama2-7b", "kind": "preset", "config": PRESETS["llama2-7b"]},
                              "space": SPACE.to_dict(), "budget_s": 600, "targets": [target],
                              "storage": "sqlite:///r.db", "study_name": "autofit-r"})


def test_the_report_says_what_more_gpus_would_fit() -> None:
    failed = [oom(SPACE.config({"gradient_checkpointing": ck, "gpus": 2, "engine": e}))
              for ck, e in (("on", "none"), ("off", "none"), ("on", "fsdp2"))]
    rows = [{"trial": i, **r.to_dict()} for i, r in enumerate(failed)]
    text = report_markdown(spec(2), rows, failed, None, 40 * GIB, USABLE, "no remaining configuration can win")
    section = text.split("## More GPUs", 1)[1].split("\n## ", 1)[0]
    # on 4 GPUs: 8 configs (2 micro-batches x 2 checkpointing x 2 engines); fsdp2 with checkpointing fits
    assert ("need more GPUs than the 2 attached (predicted to fit: the per-rank peak within the usable "
            "38.00 GiB)") in section
    assert "| 4 | 8 | 2 | 30.67 GiB - 32.15 GiB | L=2048 mb=2 ga=2 bf16 ckpt=on adamw_torch_fused full " \
           "gpus=4 fsdp2 |" in section
    # each config out of memory here: the fewest GPUs at which fsdp2 is predicted to fit
    assert "| L=2048 mb=1 ga=8 bf16 ckpt=on adamw_torch_fused full gpus=2 none | 4 GPUs (30.67 GiB per rank) |" \
        in section
    assert "| L=2048 mb=1 ga=8 bf16 ckpt=off adamw_torch_fused full gpus=2 none | 8 GPUs (" in section
    assert "ckpt=on adamw_torch_fused full gpus=2 fsdp2 | 4 GPUs" in section  # its own OOM bounds 2 GPUs


def test_the_report_has_no_gpus_section_when_nothing_needs_more_gpus() -> None:
    fits = ProbeResult(Outcome.FIT, SPACE.config({"gradient_checkpointing": "on", "gpus": 1, "engine": "none"})
                       .to_dict(), tokens_per_s=1000.0, peak_memory_bytes=30 * GIB, device="cuda:0")
    text = report_markdown(spec(4), [{"trial": 0, **fits.to_dict()}], [fits], fits, 40 * GIB, USABLE, "")
    assert "## More GPUs" not in text


def test_without_a_memory_limit_the_report_lists_the_wider_configs_unjudged() -> None:
    failed = [oom(SPACE.config({"gradient_checkpointing": "on", "gpus": 1, "engine": "none"}))]
    text = report_markdown(spec(1), [{"trial": 0, **failed[0].to_dict()}], failed, None, None, None, "")
    section = text.split("## More GPUs", 1)[1].split("\n## ", 1)[0]
    assert "need more GPUs than the 1 attached (no memory limit: whether they fit is not judged)" in section
    assert "| 2 | 8 | - |" in section and "| 4 | 8 | - |" in section
    assert "fsdp2 fits on" not in section  # nothing to fit under
