"""The kernel keys wired through autofit (issue 12): keys, recipe, probe, runner, objective.

The gate's power on its own is tested in test_kernels.py; here it runs inside a real probe child,
with a deliberately wrong kernel injected at the process boundary (`TEST_LOSS_SCALE_ENV`).
"""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from conftest import ROOT

from autofit.cli import main
from autofit.config import kernels, recipe
from autofit.config.models import PRESETS, resolve_model
from autofit.config.spec import KEYS, TrialConfig
from autofit.config.target import Target
from autofit.core.errors import UsageError
from autofit.estimate.memory import Shape, group_key, prior
from autofit.export import export_run
from autofit.probe.child.errors import Unsupported
from autofit.probe.child.measure import run_probe
from autofit.probe.child.state import ProbeState
from autofit.probe.runner import Runner
from autofit.protocol.request import Checks, ProbeRequest
from autofit.protocol.result import Outcome, ProbeResult
from autofit.run.report.markdown import prediction_errors
from autofit.run.rundir import ProbeSettings, RunSpec
from autofit.search.objective import best_of, speed
from runs import write_run

SHORT = {"max_length": 128, "global_batch": 4}

# TrialConfig().key() before the kernel keys existed: stored studies look configs up by it.
OLD_DEFAULT_KEY = ("method=lora;max_length=2048;micro_batch_size=1;global_batch=16;precision=bf16;"
                   "gradient_checkpointing=off;quantization=none;optimizer=adamw_torch_fused;"
                   "attn_implementation=sdpa;expandable_segments=False;lora_r=16;lora_alpha=32;"
                   "lora_targets=q_proj,v_proj;lora_dropout=0.0")


def test_kernel_keys_parse_and_bad_values_name_the_key() -> None:
    cfg = TrialConfig.from_mapping({"liger": "on", "torch_compile": "off"})
    assert cfg.liger is True and cfg.torch_compile is False
    assert KEYS["liger"].default is False and KEYS["torch_compile"].default is False
    assert "Liger" in KEYS["liger"].help and "--train-tokens" in KEYS["torch_compile"].help
    with pytest.raises(UsageError) as e:
        TrialConfig.from_mapping({"liger": "maybe"})
    assert "liger='maybe'" in str(e.value.problems)


def test_older_studies_keep_their_config_keys() -> None:
    assert TrialConfig().key() == OLD_DEFAULT_KEY
    assert TrialConfig.from_dict({k: v for k, v in TrialConfig().to_dict().items()
                                  if k not in ("liger", "torch_compile")}) == TrialConfig()
    on = TrialConfig(liger=True, torch_compile=True)
    assert "liger=True" in on.key() and "torch_compile=True" in on.key() and on.key() != OLD_DEFAULT_KEY


def test_recipe_carries_the_kernels_and_pins_tf32() -> None:
    stock = recipe.training_arguments(TrialConfig(), on_cpu=False, max_steps=5)
    assert stock["tf32"] is False and "use_liger_kernel" not in stock and "torch_compile" not in stock
    both = recipe.training_arguments(TrialConfig(liger=True, torch_compile=True), on_cpu=False, max_steps=5)
    assert both["use_liger_kernel"] is True and both["torch_compile"] is True
    assert both["torch_compile_backend"] == "inductor" and both["tf32"] is False


def test_the_probe_child_refuses_liger_here_before_building_anything(tmp_path) -> None:
    req = ProbeRequest(TrialConfig(liger=True, **SHORT), resolve_model("tiny-llama"), str(tmp_path / "r.json"))
    state = ProbeState()
    with pytest.raises(Unsupported, match="Triton GPU kernels"):
        run_probe(req, state, lambda _event: None)
    assert state.mem is None  # nothing was measured


def test_the_runner_records_unsupported_kernels_without_a_child(tmp_path) -> None:
    cfg = TrialConfig(liger=True, attn_implementation="flex_attention", **SHORT)
    with Runner(Target(), tmp_path, standby=0) as runner:
        res = runner.run(cfg, resolve_model("tiny-llama"), name="p1")
    assert res.outcome is Outcome.UNSUPPORTED
    assert "liger=on" in res.reason and "flex_attention" in res.reason
    assert not list(tmp_path.glob("*.log"))  # no process was started


def test_stock_configs_ask_for_no_gate(tmp_path) -> None:
    runner = Runner(Target(), tmp_path, standby=0)
    model = resolve_model("tiny-llama")
    assert runner.request(TrialConfig(**SHORT), model, tmp_path / "a.json").gate is False
    compiled = TrialConfig(torch_compile=True, **SHORT)
    assert runner.request(compiled, model, tmp_path / "b.json").gate is True
    passed = Checks(gate=False)  # the study holds a passing verdict for the key (test_knowledge.py)
    assert runner.request(compiled.replace(micro_batch_size=2), model, tmp_path / "c.json", passed).gate is False


def fit(tps: float, compile_s: float | None = None, train_tokens: int | None = None, **cfg: object) -> ProbeResult:
    return ProbeResult(Outcome.FIT, TrialConfig(**SHORT, **cfg).to_dict(), tokens_per_s=tps,
                       compile_seconds=compile_s, train_tokens=train_tokens)


def test_compile_time_is_amortised_over_the_planned_training() -> None:
    stock, compiled = fit(1000.0), fit(1100.0, compile_s=90.0, train_tokens=50_000_000, torch_compile=True)
    assert speed(compiled) == pytest.approx(50e6 / (50e6 / 1100 + 90))
    assert best_of([stock, compiled]) is compiled  # 10% faster pays a 90 s compile over 50M tokens
    short = fit(1100.0, compile_s=90.0, train_tokens=500_000, torch_compile=True)
    assert best_of([stock, short]) is stock  # ... but not over a 500k-token job
    assert speed(fit(1100.0, compile_s=90.0)) == 1100.0  # no planned length: raw speed


S4 = Shape(hidden=3584, layers=28, intermediate=18944, vocab=152064, heads=28, kv_heads=4, tied=False)
"""Qwen2.5-7B's shape: the large-vocabulary scenario."""


def test_the_fused_loss_removes_the_logits_term_from_the_prior() -> None:
    stock, liger = prior(TrialConfig(), S4), prior(TrialConfig(liger=True), S4)
    assert stock.logits == 2048 * 152064 * 10  # logits, fp32 upcast, its gradient
    assert liger.logits < stock.logits / 20  # chunks of the logits only
    assert liger.activations < stock.activations  # SwiGLU keeps gate and up only
    compiled = prior(TrialConfig(torch_compile=True), S4)
    assert compiled.activations == int(stock.activations * 0.75) and compiled.logits == stock.logits
    ckpt = TrialConfig(torch_compile=True, gradient_checkpointing="on")
    assert prior(ckpt, S4).activations == prior(ckpt.replace(torch_compile=False), S4).activations


def test_each_kernel_combination_is_its_own_memory_group() -> None:
    keys = {group_key(TrialConfig(liger=a, torch_compile=b)) for a in (False, True) for b in (False, True)}
    assert len(keys) == 4
    assert group_key(TrialConfig(liger=True)) == group_key(TrialConfig(liger=True, micro_batch_size=4))


def test_the_report_gives_the_prediction_error_per_kernel_combination() -> None:
    def row(peak: int, predicted: int, **cfg: object) -> tuple[dict, ProbeResult]:
        r = ProbeResult(Outcome.FIT, TrialConfig(**cfg).to_dict(), tokens_per_s=1.0, peak_memory_bytes=peak)
        return {"predicted_peak": predicted}, r

    pairs = [row(100, 110), row(100, 90), row(100, 150, liger=True)]
    spec = RunSpec.from_dict({"run_id": "r", "created": "20260101T000000Z", "budget_s": 60.0, "seed": 0,
                              "model": {"ref": "tiny-llama", "kind": "preset", "config": PRESETS["tiny-llama"]},
                              "space": {"name": "s", "fixed": {}, "dimensions": {}}, "storage": "sqlite:///r.db",
                              "study_name": "autofit-r", "targets": [{"device": "cuda"}]})
    lines = prediction_errors(spec, [p[0] for p in pairs], [p[1] for p in pairs])
    assert "| liger=off, torch_compile=off, attn=sdpa | 10% | 10% | 2 |" in lines
    assert "| liger=on, torch_compile=off, attn=sdpa | 50% | 50% | 1 |" in lines
    # three measured peaks checked the model: its margin is 1.5 x the largest error, and it is said
    assert lines[-2] == ("At the end of the search: memory model margin 75% from 3 measured peak(s) and "
                         "0 out-of-memory bound(s).")


# ----------------------------------------------------------------------------- export

KERNELS = TrialConfig(liger=True, torch_compile=True, **SHORT)


def test_every_format_carries_the_kernels_validated_against_the_installed_libraries(tmp_path) -> None:
    run = write_run(tmp_path / "run", config=KERNELS.to_dict())
    for fmt in ("hf-trainer", "trl"):
        text = export_run(run, fmt).text
        for field in ("'use_liger_kernel': True", "'torch_compile': True", "'torch_compile_backend': 'inductor'",
                      "'tf32': False"):
            assert field in text, (fmt, field)
    assert any("fused LM head" in n for n in export_run(run, "trl").unexpressed)
    axolotl = yaml.safe_load(export_run(run, "axolotl").text)
    assert axolotl["plugins"] == ["axolotl.integrations.liger.LigerPlugin"]
    assert axolotl["liger_fused_linear_cross_entropy"] is True and axolotl["liger_cross_entropy"] is False
    assert axolotl["liger_rms_norm"] and axolotl["liger_rope"] and axolotl["liger_glu_activation"]
    assert axolotl["torch_compile"] is True and axolotl["torch_compile_backend"] == "inductor"
    factory = yaml.safe_load(export_run(run, "llama-factory").text)
    assert factory["enable_liger_kernel"] is True and factory["torch_compile"] is True
    stock = yaml.safe_load(export_run(write_run(tmp_path / "stock"), "axolotl").text)
    assert "plugins" not in stock and "torch_compile" not in stock


def test_train_tokens_is_a_search_flag_with_its_default_stated(capsys, tmp_path) -> None:
    assert main(["search", "--model", "tiny-llama", "--device", "cpu", "--train-tokens", "0",
                 "--out", str(tmp_path)]) == 2
    assert "--train-tokens: a positive number of tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["search", "--help"])
    assert "default 50,000,000" in " ".join(capsys.readouterr().out.split())
    assert ProbeSettings().train_tokens == 50_000_000


def test_train_steps_amortise_over_each_configs_own_tokens_per_step(capsys, tmp_path) -> None:
    from autofit.cli import build_parser
    from autofit.cli.common import probe_settings
    from autofit.probe.runner import planned_tokens

    cfg = TrialConfig(max_length=2048, global_batch=16, micro_batch_size=3)  # 6 x 3 = 18 sequences a step
    assert planned_tokens(cfg, 50_000_000, None) == 50_000_000
    assert planned_tokens(cfg, 50_000_000, 1000) == 1000 * 18 * 2048
    args = build_parser().parse_args(["search", "--model", "tiny-llama", "--train-steps", "1000"])
    settings = probe_settings(args)
    assert (settings.train_steps, settings.train_tokens) == (1000, 50_000_000)
    assert ProbeSettings.from_dict(dataclasses.asdict(settings)) == settings
    assert main(["search", "--model", "tiny-llama", "--device", "cpu", "--train-steps", "1000", "--train-tokens",
                 "5000000", "--out", str(tmp_path)]) == 2
    assert "give one" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_the_gate_reference_runs_stock_attention_on_the_same_weights() -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from autofit.config.models import PRESETS
    from autofit.probe.child.gate import with_attention

    base = AutoModelForCausalLM.from_config(AutoConfig.for_model(**PRESETS["tiny-llama"]), attn_implementation="eager")
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    weights = next(model.parameters()).data_ptr()
    assert with_attention(model, "sdpa") is model and base.config._attn_implementation == "sdpa"
    with_attention(model, "eager")
    assert base.config._attn_implementation == "eager" and next(model.parameters()).data_ptr() == weights


def test_liger_is_an_optional_extra_at_the_version_autofit_measured() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert f"liger-kernel>={kernels.LIGER_MIN_VERSION}" in project["optional-dependencies"]["kernels"]
    assert not any(d.startswith("liger") for d in project["dependencies"])  # it requires triton: not for CPU installs
