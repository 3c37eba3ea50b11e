"""Kernels: the `unsupported` reasons match what is installed, and the correctness gate catches wrong kernels.

The gate runs real forward and backward passes of tiny-llama with LoRA on the CPU. The "wrong
kernels" are test-only patches applied where a kernel would act: the model's forward (a loss
scaled by 1.5 or 1.05) and one adapter's gradient (scaled, or dropped as a fused kernel that
bypasses an adapter would).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, TrainingArguments

from autofit.config import kernels, recipe
from autofit.config.models import PRESETS
from autofit.config.spec import TrialConfig
from autofit.probe.child import kernels as child_kernels

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build(attn: str = "sdpa", precision: str = "fp32") -> object:
    """tiny-llama from its preset, random weights (seed 0), LoRA as the default TrialConfig asks."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(**PRESETS["tiny-llama"])
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[precision], attn_implementation=attn)
    model.config.use_cache = False
    return get_peft_model(model, LoraConfig(**recipe.lora_arguments(TrialConfig())))


@pytest.fixture(scope="module")
def batch() -> dict[str, torch.Tensor]:
    return child_kernels.gate_batch(PRESETS["tiny-llama"]["vocab_size"], 32)


def gate(batch: dict, with_kernels, precision: str = "fp32") -> child_kernels.GateResult:
    return child_kernels.correctness_gate(lambda: build(precision=precision), with_kernels, batch,
                                    precision=precision, device="cpu")


def scale_loss(factor: float):
    """A wrong kernel: the model's forward returns the loss times `factor`."""
    def patch(model):
        forward = model.forward

        def scaled(*args, **kw):
            out = forward(*args, **kw)
            out.loss = out.loss * factor
            return out

        model.forward = scaled
        return model
    return patch


def scale_grad(factor: float, name: str = "layers.0.self_attn.q_proj.lora_B"):
    """A wrong kernel: one adapter's gradient times `factor` (0: the adapter bypassed)."""
    def patch(model):
        params = [p for n, p in model.named_parameters() if name in n]
        assert len(params) == 1, [n for n, _ in model.named_parameters()]
        params[0].register_hook(lambda g: g * factor)
        return model
    return patch


# ----------------------------------------------------------------------------- the gate


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gate_passes_identical_kernels(batch, precision):
    res = gate(batch, lambda m: m, precision)
    assert res.ok, res.reason
    assert res.loss_rel_err == 0.0 and res.grad_rel_err == 0.0  # same weights, same ops: bit-identical
    assert 5.0 < res.loss_ref < 9.0  # ~ln(1024) = 6.93 for random tokens and random weights
    assert res.grad_ref > 0 and res.reason == ""


def test_gate_passes_a_legitimately_different_kernel(batch):
    """eager attention against sdpa: different code, same maths; bf16 rounding inside the tolerance."""
    res = child_kernels.correctness_gate(lambda: build(precision="bf16"), lambda m: build("eager", "bf16"), batch,
                                   precision="bf16", device="cpu")
    assert res.ok, res.reason
    assert 0 < res.loss_rel_err < res.tolerance.loss_rel / 10  # it did differ, by far less than allowed


@pytest.mark.parametrize("factor", [1.5, 1.05])
def test_gate_catches_a_scaled_loss(batch, factor):
    res = gate(batch, scale_loss(factor), "bf16")
    assert not res.ok
    assert res.loss_rel_err == pytest.approx(factor - 1, rel=1e-2)
    assert res.reason.startswith("mismatch: loss")


def test_gate_catches_one_perturbed_gradient(batch):
    res = gate(batch, scale_grad(1.5))
    assert not res.ok
    assert res.loss_rel_err == 0.0  # the loss is right: only the gradient check can see it
    assert res.reason.startswith("mismatch: a trainable tensor's gradient norm differs")


def test_gate_catches_a_bypassed_adapter(batch):
    """An adapter whose gradient never arrives (a fused kernel reading the base weight directly)."""
    res = gate(batch, scale_grad(0.0), "bf16")
    assert not res.ok and res.grad_rel_err > res.tolerance.grad_rel and res.loss_rel_err == 0.0
    assert sum(g == 0.0 for g in res.grad_norms_k) == sum(g == 0.0 for g in res.grad_norms_ref) + 1


def test_gate_calls_a_non_finite_loss_a_mismatch(batch):
    res = gate(batch, scale_loss(float("nan")))
    assert not res.ok and "loss nan" in res.reason


def test_gate_batch_masks_part_of_the_labels(batch):
    masked = batch["labels"] == child_kernels.IGNORE_INDEX
    assert masked[:, :8].all() and not masked[:, 8:].any()  # a quarter of 32 positions, at the start
    assert torch.equal(batch["input_ids"], child_kernels.gate_batch(1024, 32)["input_ids"])  # fixed: same seed


def test_compare_needs_the_same_trainable_tensors():
    ref = child_kernels.Pass(loss=2.0, grad_norms=[1.0, 1.0])
    res = child_kernels.compare(ref, child_kernels.Pass(loss=2.0, grad_norms=[1.0]), child_kernels.TOLERANCES["fp32"])
    assert not res.ok and "gradient" in res.reason


def test_gate_passes_checkpointing_every_2_layers(batch):
    """Checkpointing enabled as Trainer does it (every 2nd layer) recomputes the same numbers."""
    ckpt = recipe.training_arguments(TrialConfig(gradient_checkpointing="every_2"), on_cpu=True, max_steps=1)
    seen = {}

    def with_kernels(model):
        out = child_kernels.apply_kernels(model, SimpleNamespace(), ckpt["activation_checkpointing_kwargs"])
        layers = model.get_base_model().model.layers
        seen["checkpointed"] = [i for i, m in enumerate(layers) if getattr(m, "gradient_checkpointing", False)]
        return out

    res = gate(batch, with_kernels)
    assert seen["checkpointed"] == [0, 2]  # the 4-layer tiny-llama, every 2nd layer
    assert res.ok and res.loss_rel_err < 1e-6, res.reason


# ----------------------------------------------------------------------------- support


def installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def fake_distribution(root: Path, name: str, version: str) -> None:
    """A minimal installed distribution (what `pip install` leaves behind for the metadata lookup)."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_liger_is_unsupported_on_the_cpu():
    why = kernels.kernel_support(SimpleNamespace(liger=True), "cpu")
    assert why is not None and "Triton GPU kernels" in why and "CPU" in why


def test_liger_reason_names_what_is_missing_here():
    """On this machine: no GPU; whatever is installed, the reason names the first missing piece."""
    why = kernels.liger_problem("cuda")
    if not installed("liger-kernel"):
        assert "liger-kernel is not installed" in why
    elif importlib.util.find_spec("triton") is None:
        assert "triton is not installed" in why
    else:
        assert why is None


def test_liger_reasons_follow_the_installed_versions(tmp_path, monkeypatch):
    """The first distribution on sys.path is the one Python sees: an old and a current liger-kernel."""
    fake_distribution(tmp_path / "old", "liger-kernel", "0.5.0")
    monkeypatch.syspath_prepend(str(tmp_path / "old"))
    assert "liger-kernel 0.5.0 is older than 0.8.5" in kernels.liger_problem("cuda")
    monkeypatch.undo()
    fake_distribution(tmp_path / "new", "liger-kernel", "0.8.5")
    monkeypatch.syspath_prepend(str(tmp_path / "new"))
    why = kernels.liger_problem("cuda")
    assert (why is None) == (importlib.util.find_spec("triton") is not None)
    assert why is None or "triton is not installed" in why


def test_liger_installed_without_triton_fails_cleanly():
    """liger-kernel installed with --no-deps: its transformers integration cannot import, and we say so."""
    if not installed("liger-kernel") or importlib.util.find_spec("triton") is not None:
        pytest.skip("needs liger-kernel installed without triton (pip install --no-deps liger-kernel)")
    assert "triton is not installed" in kernels.liger_problem("cuda")
    why = kernels.liger_architecture_problem("llama")
    assert why is not None and "triton" in why and why.startswith("liger=on: importing")


def test_compile_needs_a_cxx_compiler_on_the_cpu(monkeypatch):
    assert kernels.compile_problem("cpu") is None  # g++ is here: the CPU inductor can run
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("PATH", "")
    assert "C++ compiler" in kernels.compile_problem("cpu")


def test_compile_on_a_gpu_needs_triton():
    why = kernels.compile_problem("cuda")
    assert (why is None) == (importlib.util.find_spec("triton") is not None)


@pytest.mark.parametrize("impl", ["flash_attention_2", "flash_attention_3"])
def test_flash_attention_reason_matches_what_transformers_does(impl):
    why = kernels.attention_problem(impl, "cpu")
    assert why is not None and impl in why
    if installed("flash-attn") or installed("kernels"):
        return
    with pytest.raises(ImportError, match="has been toggled on, but it cannot be used"):
        build(impl)


def test_flex_attention_cannot_train_on_the_cpu():
    """The reason is true of the installed torch: flex_attention's backward raises on the CPU."""
    assert "no backward on the CPU" in kernels.attention_problem("flex_attention", "cpu")
    model = build("flex_attention")
    ids = torch.randint(0, 1024, (1, 16))
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        model(input_ids=ids, labels=ids).loss.backward()


def test_stock_kernels_are_supported_and_reasons_are_joined():
    assert kernels.kernel_support(TrialConfig(), "cpu") is None  # a TrialConfig without the new keys
    assert kernels.kernel_support(SimpleNamespace(attn_implementation="eager"), "cpu") is None
    why = kernels.kernel_support(SimpleNamespace(liger=True, attn_implementation="flex_attention"), "cpu")
    assert why.count("; ") == 1 and why.startswith("liger=on") and "flex_attention" in why


def test_which_configs_are_gated_and_by_what():
    assert not kernels.needs_gate(TrialConfig())  # stock: the reference itself
    assert not kernels.needs_gate(TrialConfig(attn_implementation="eager"))
    assert kernels.needs_gate(TrialConfig(attn_implementation="flex_attention"))
    assert kernels.needs_gate(SimpleNamespace(liger=True, attn_implementation="sdpa"))
    liger = TrialConfig(liger=True)
    other_batch = TrialConfig(micro_batch_size=4, liger=True)
    assert kernels.gate_key(liger) == kernels.gate_key(other_batch)  # one verdict covers every micro-batch
    other_ckpt = TrialConfig(gradient_checkpointing="every_2", liger=True)
    assert kernels.gate_key(liger) != kernels.gate_key(other_ckpt)


# ----------------------------------------------------------------------------- TrainingArguments, compile time


def test_training_arguments_are_real_trainer_fields(tmp_path):
    cfg = SimpleNamespace(liger=True, torch_compile=True)
    extra = kernels.training_arguments(cfg)
    assert extra == {"use_liger_kernel": True, "torch_compile": True, "torch_compile_backend": "inductor"}
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **extra)
    assert args.use_liger_kernel and args.torch_compile and args.torch_compile_backend == "inductor"
    assert kernels.training_arguments(TrialConfig()) == {}


def test_compile_time_is_the_warmup_excess_over_steady_state():
    ct = child_kernels.compile_time([31.0, 1.2, 1.0, 1.1, 1.0], warmup=2)
    assert ct.steady_step_s == 1.0 and ct.first_step_s == 31.0
    assert ct.compile_s == pytest.approx(30.2)
    with pytest.raises(ValueError, match="warm-up and timed steps"):
        child_kernels.compile_time([5.0, 1.0], warmup=2)


def test_amortised_throughput_pays_compile_once():
    # 10,000 tokens/s for 6e6 tokens is 600 s; a 90 s compile makes it 690 s.
    assert kernels.amortised_tokens_per_s(10_000, 90, 6_000_000) == pytest.approx(6e6 / 690)
    assert kernels.amortised_tokens_per_s(10_000, 0, 6_000_000) == pytest.approx(10_000)
