"""`autofit probe`: real training steps on tiny-llama in real child processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, fake_env, probe_json, run_cli

SHORT = ["--set", "max_length=128", "--set", "global_batch=4"]


@pytest.fixture(scope="module")
def short_fit(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One real probe of tiny-llama (micro-batch 2), read by the tests of a fit's figures."""
    return probe_json(*SHORT, "--set", "micro_batch_size=2", cwd=tmp_path_factory.mktemp("fit"))


def test_tiny_llama_fits_and_reports_figures(short_fit: dict) -> None:
    r = short_fit
    assert r["outcome"] == "fit"
    assert r["tokens_per_s"] > 0 and r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"]
    # 5 timed steps, more (at most 5) while they spread above the bound
    assert 5 <= len(r["step_times"]) <= 10
    assert r["spread"] == round(r["tokens_per_s_max"] / r["tokens_per_s_min"], 4)
    assert r["noisy"] == (r["spread"] > 1.10)
    assert r["peak_memory_bytes"] > 0
    assert r["device"].startswith("cpu")
    assert r["config"]["micro_batch_size"] == 2
    assert r["config"]["gradient_accumulation_steps"] == 2 and r["config"]["effective_batch"] == 4
    assert r["config"]["precision"] == "bf16" and r["config"]["lora_r"] == 16  # defaults included
    assert set(r["phase_peaks"]) == {"forward", "backward", "optimizer"}
    assert r["trainable_params"] < r["total_params"]
    # the step's mean loss, ~ln(1024) = 6.93 for random weights on random tokens, at any accumulation (it gave a
    # micro-step's share: 3.47 at accumulation 2, 1.74 at 4)
    assert 5.5 < r["loss"] < 8.5
    assert Path(r["log_path"]).is_file()
    # tiny-llama's 1M parameters and their adapter: peft 0.22's first get_peft_model imported bitsandbytes' dispatch
    # after the baseline and read 60 MiB (the standby warms it up; 11-14 MiB with peft 0.21 and 0.22)
    assert r["memory_after_load"] < 30 * 2**20


def test_each_timed_step_reports_the_hosts_share(short_fit: dict) -> None:
    """Beside each timed step's time, the training thread's CPU time, its wait for a CPU and the
    hypervisor's steal (Linux counters): what tells a busy host from a slow config."""
    host, times = short_fit["extra"]["host_per_step"], short_fit["step_times"]
    assert set(host) == {"step_s", "thread_cpu_s", "process_cpu_s", "run_wait_s", "steal_cpu_s", "cpu", "numa_node",
                         "sm_clock_mhz", "power_w", "clock_events"}
    assert all(len(v) == len(times) for v in host.values())
    assert host["sm_clock_mhz"] == host["power_w"] == [None] * len(times)  # no GPU, no NVML figures
    assert all(0 < ran <= t for ran, t in zip(host["step_s"], times, strict=True))  # extended, never shortened
    # the training thread's CPU time lies inside the step as it ran and within the process's; the threads'
    # wait for a CPU is summed over them; on a CPU probe the process computes or waits for a core nearly
    # the whole step (busy test machines: mostly waiting)
    for ran, cpu, proc, wait in zip(host["step_s"], host["thread_cpu_s"], host["process_cpu_s"], host["run_wait_s"],
                                    strict=True):
        assert 0 < cpu <= ran + 0.01 and cpu <= proc + 0.01 and wait >= 0
    assert sum(host["thread_cpu_s"]) + sum(host["run_wait_s"]) > 0.5 * sum(host["step_s"])
    assert all(w is not None and w >= 0 for w in host["steal_cpu_s"])
    # where the training thread ended each step: one of the CPUs this machine has, on a NUMA node of its own
    assert all(c is not None and 0 <= c < (os.cpu_count() or 1) for c in host["cpu"])
    assert all(n is None or n >= 0 for n in host["numa_node"])


def test_tiny_limit_is_an_oom(tmp_path: Path) -> None:
    r = probe_json(*SHORT, "--memory-limit", "2MiB", cwd=tmp_path)
    assert r["outcome"] == "oom"
    assert r["oom_shortfall_bytes"] > 0
    assert r["memory_limit_bytes"] == 2 * 2**20
    # loading the model crosses 2 MiB; the limit is checked as the first forward ends
    assert r["oom_phase"] == "forward", r["reason"]
    assert r["oom_in_use_bytes"] == r["peak_memory_bytes"] > 2 * 2**20
    assert r["oom_shortfall_bytes"] == r["oom_in_use_bytes"] - 2 * 2**20
    assert r["oom_request_bytes"] is None


def test_peak_inside_headroom_is_an_oom(short_fit: dict, tmp_path: Path) -> None:
    # the measured peak at 75% of the limit, with 45% kept free: a peak from 55% to 100% of the
    # limit (0.73x to 1.33x this one) lands inside the headroom, below the limit itself
    limit = int(short_fit["peak_memory_bytes"] / 0.75)
    r = probe_json(*SHORT, "--set", "micro_batch_size=2", "--memory-limit", f"{limit}B", "--headroom", "0.45",
                   cwd=tmp_path)
    assert r["outcome"] == "oom", r["reason"]
    assert r["reason"].startswith("headroom"), r["reason"]
    assert int(limit * 0.55) < r["peak_memory_bytes"] <= limit
    assert r["oom_shortfall_bytes"] == r["peak_memory_bytes"] - (limit - r["headroom_bytes"])


@pytest.mark.parametrize("sets, expected", [
    (["gradient_checkpointing=every_2"], [0, 2]),  # (on: every_1, the same code path)
    (["gradient_checkpointing=off", "quantization=nf4"], []),  # peft's default would checkpoint all
    (["gradient_checkpointing=every_3", "quantization=nf4"], [0, 3]),
])
def test_checkpointing_exactly_on_the_layers_asked(tmp_path: Path, sets: list[str], expected: list[int]) -> None:
    args = [x for s in sets for x in ("--set", s)]
    r = probe_json(*SHORT, *args, cwd=tmp_path)
    assert r["outcome"] == "fit", r["error_tail"]
    assert r["checkpointed_layers"] == expected
    assert r["n_layers"] == 4


@pytest.mark.parametrize("expandable, inherited", [(True, None), (False, "expandable_segments:True")])
def test_the_allocator_runs_the_configs_setting(tmp_path: Path, expandable: bool, inherited: str | None) -> None:
    """torch's allocator reads PYTORCH_CUDA_ALLOC_CONF once (a CUDA build before the probe's request comes), so the
    variable set from the request left the allocator as the parent had it; on this CPU build a parent's
    expandable_segments:True held over a config's false. The probe gives the setting to torch itself, over what
    the parent set, and says what ran."""
    env = {"PYTORCH_CUDA_ALLOC_CONF": inherited} if inherited else {}
    r = probe_json(*SHORT, "--set", f"expandable_segments={expandable}", cwd=tmp_path, env=env)
    assert r["outcome"] == "fit", r["error_tail"]
    assert r["extra"]["expandable_segments_ran"] is expandable
    assert r["extra"]["allocator_settings"].endswith(f"expandable_segments:{expandable}")


@pytest.mark.parametrize("sets, bnb_optimizer, paged, bnb_layers", [
    (["quantization=8bit", "optimizer=paged_adamw_8bit"], True, True, True),  # both in one probe
    (["optimizer=adamw_8bit"], True, False, False),
])
def test_bitsandbytes_runs_for_real_on_the_cpu(tmp_path: Path, sets: list[str], bnb_optimizer: bool,
                                               paged: bool, bnb_layers: bool) -> None:
    args = [x for s in sets for x in ("--set", s)]
    r = probe_json(*SHORT, *args, cwd=tmp_path)
    assert r["outcome"] == "fit", r["error_tail"]
    # what really ran: bitsandbytes' 8-bit optimizer, paged or not (its state stays 32-bit for
    # tensors under its min_8bit_size: all of tiny-llama's LoRA matrices); its quantized layers
    x = r["extra"]
    assert x["optimizer_class"].startswith("bitsandbytes.optim.") == bnb_optimizer, x
    assert x["optimizer_bits"] == (8 if bnb_optimizer else None), x
    assert x["optimizer_paged"] == paged
    assert (x["bnb_modules"] > 0) == bnb_layers
    assert r["loss"] is not None and r["loss"] > 0


def test_missing_attention_kernel_is_unsupported(tmp_path: Path) -> None:
    r = probe_json(*SHORT, "--set", "attn_implementation=flash_attention_2", cwd=tmp_path)
    assert r["outcome"] == "unsupported"
    assert "flash" in r["reason"].lower()


def test_crash_keeps_its_traceback_tail(tmp_path: Path, saved_tiny: Path) -> None:
    """A real crash in the child: weights cut short, which only from_pretrained finds (a bad lora_targets, the
    crash this test used, is refused before any probe now)."""
    broken = tmp_path / "broken"
    shutil.copytree(saved_tiny, broken)
    weights = next(broken.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:4096])
    r = probe_json(*SHORT, cwd=tmp_path, model=str(broken))
    assert r["outcome"] == "crash"
    assert "Traceback" in r["error_tail"] and "safetensors" in r["error_tail"].lower(), r["error_tail"][-2000:]


def test_all_linear_adapts_every_linear_layer_the_memory_model_counts(tmp_path: Path, short_fit: dict) -> None:
    """lora_targets=all-linear is peft's own form: every linear layer of a block (not the head), and the
    memory model's adapter count is the probe's trainable parameters, for the names and for all-linear."""
    from autofit.config.models import PRESETS
    from autofit.config.spec import TrialConfig
    from autofit.estimate.memory import Shape, adapter_params

    shape = Shape.from_config(PRESETS["tiny-llama"])
    every = probe_json(*SHORT, "--set", "lora_targets=all-linear", cwd=tmp_path)
    for r in (every, short_fit):  # short_fit: the default q_proj,v_proj
        targets = r["config"]["lora_targets"]
        assert r["outcome"] == "fit" and r["trainable_params"] == adapter_params(TrialConfig(lora_targets=targets),
                                                                                 shape), targets
    assert every["config"]["lora_targets"] == "all-linear" and short_fit["config"]["lora_targets"] == "q_proj,v_proj"


def test_real_cuda_oom_text_is_an_oom_with_shortfall(tmp_path: Path) -> None:
    r = probe_json(*SHORT, env=fake_env("cuda_oom"), cwd=tmp_path)
    assert r["outcome"] == "oom"
    assert r["oom_shortfall_bytes"] == int(0.5 * 2**30)  # tried 2.00 GiB, 1.50 GiB free
    assert "CUDA out of memory" in r["error_tail"]
    # the figures of the child's message, read by the parent (the phase is the child's to know)
    assert r["oom_request_bytes"] == 2 * 2**30
    assert r["oom_in_use_bytes"] == int(37.86 * 2**30)
    assert r["oom_reserved_unallocated_bytes"] == int(1.91 * 2**30)
    assert r["oom_phase"] is None


def test_hang_is_a_timeout_and_its_group_is_stopped(tmp_path: Path) -> None:
    t0 = time.monotonic()
    r = probe_json(*SHORT, "--timeout", "3", "--log-dir", str(tmp_path), env=fake_env("hang"), cwd=tmp_path)
    assert r["outcome"] == "timeout"
    assert time.monotonic() - t0 < 60
    # who and what, as every other outcome says (they were "" and {}), and kept beside its log
    assert r["model"] == "tiny-llama" and r["versions"]["torch"]
    (kept,) = tmp_path.glob("probe-*.result.json")
    assert json.loads(kept.read_text())["outcome"] == "timeout"
    pid = int((tmp_path / "fake-child.pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.parametrize("mode, outcome, reason", [
    # a SIGKILL the runner did not send, with no sign of the OOM killer: says nothing about the config
    ("sigkill", "crash", "killed by SIGKILL from outside autofit"),
    ("host_oom_text", "host_oom", ""),
    ("segfault", "crash", "SIGSEGV"),
    ("garbage", "crash", "unreadable result"),  # garbage on stdout and in the result file
])
def test_what_a_child_leaves_behind_is_judged(tmp_path: Path, mode: str, outcome: str, reason: str) -> None:
    r = probe_json(*SHORT, env=fake_env(mode), cwd=tmp_path)
    assert r["outcome"] == outcome
    assert reason in r["reason"]
    assert r["retryable"] == (mode == "sigkill")


def test_ctrl_c_exits_130_and_stops_the_child(tmp_path: Path) -> None:
    # this checkout's package (the working directory is elsewhere)
    env = dict(os.environ, **fake_env("hang"), PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "autofit", "probe", "--model", "tiny-llama",
                             "--device", "cpu", "--log-dir", str(tmp_path)], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid_file = tmp_path / "fake-child.pid"
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pid_file.exists()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert "interrupted" in err
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


@pytest.mark.parametrize("args, message", [
    (["--model", "./no/such/folder"], "--model: no such file or folder"),
    (["--model", "llama9-1t"], "is not a preset"),
    (["--model", "tiny-llama", "--set", "frobnicate=1"], "unknown key 'frobnicate'"),
    (["--model", "tiny-llama", "--set", "micro_batch_size=0"], "micro_batch_size=0 is not allowed"),
    (["--model", "tiny-llama", "--set", "precision=fp8"], "precision='fp8' is not allowed"),
    (["--model", "tiny-llama", "--set", "gradient_checkpointing=sometimes"], "gradient_checkpointing"),
    (["--model", "tiny-llama", "--set", "micro_batch_size"], "is not KEY=VALUE"),
    (["--model", "tiny-llama", "--memory-limit", "lots"], "--memory-limit: cannot read 'lots'"),
    (["--model", "tiny-llama", "--gpu", "7"], "--gpu: GPU 7 does not exist"),
    (["--model", "tiny-llama", "--set", "method=full", "--set", "quantization=nf4"], "needs method=lora"),
])
def test_bad_input_exits_2_with_a_clear_message(tmp_path: Path, args: list[str], message: str) -> None:
    proc = run_cli("probe", *args, cwd=tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_several_bad_inputs_are_reported_at_once(tmp_path: Path) -> None:
    proc = run_cli("probe", "--model", "nope", "--set", "precision=fp8", "--set", "micro_batch_size=0",
                   cwd=tmp_path)
    assert proc.returncode == 2
    for part in ("--model", "precision", "micro_batch_size"):
        assert part in proc.stderr


def test_help_lists_presets_and_keys() -> None:
    out = run_cli("probe", "--help").stdout
    for name in ("llama2-7b", "llama3-8b", "mistral-7b", "qwen2.5-7b", "tiny-llama", "max_length",
                 "gradient_checkpointing", "examples:"):
        assert name in out


def test_env_lists_versions() -> None:
    from importlib import metadata

    from autofit.core.envinfo import driver_info

    proc = run_cli("env")
    assert proc.returncode == 0
    shown: dict[str, str] = {}
    for line in proc.stdout.splitlines():  # first word -> the rest ("torch CUDA ..." comes after "torch")
        name, _, value = line.partition(" ")
        shown.setdefault(name, value.strip())
    for pkg in ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "optuna", "trl", "datasets",
                "liger-kernel"):  # datasets and liger were missing: what a recipe and liger=on need
        assert shown[pkg] == metadata.version(pkg), pkg
    for pkg in ("triton", "deepspeed", "flash-attn"):  # said either way
        try:
            assert shown[pkg] == metadata.version(pkg), pkg
        except metadata.PackageNotFoundError:
            assert shown[pkg] == "not installed", pkg
    assert shown["driver"] == (driver_info()["driver"] or "none (no NVIDIA driver)")


# ----------------------------------------------------------------------------- model sources


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-llama saved with save_pretrained: a real local model folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from autofit.config.models import PRESETS

    folder = tmp_path_factory.mktemp("tiny-model")
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**PRESETS["tiny-llama"])).save_pretrained(folder)
    return folder


def test_a_local_folder_loads_with_from_pretrained(tmp_path: Path, saved_tiny: Path) -> None:
    proc = run_cli("probe", "--model", str(saved_tiny), "--device", "cpu", "--json", *SHORT, cwd=tmp_path,
                   env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    import json

    r = json.loads(proc.stdout)
    assert r["outcome"] == "fit", r["error_tail"]
    assert r["model"] == str(saved_tiny.resolve())
    # nf4 from the folder's real weights
    proc = run_cli("probe", "--model", str(saved_tiny), "--device", "cpu", "--json", *SHORT,
                   "--set", "quantization=nf4", cwd=tmp_path)
    assert json.loads(proc.stdout)["outcome"] == "fit"


def test_a_config_json_path_builds_random_weights(tmp_path: Path, saved_tiny: Path) -> None:
    import json

    proc = run_cli("probe", "--model", str(saved_tiny / "config.json"), "--device", "cpu", "--json", *SHORT,
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["outcome"] == "fit"


def test_a_hub_id_not_in_the_cache_offline_is_a_clear_error(tmp_path: Path) -> None:
    proc = run_cli("probe", "--model", "someorg/not-cached-model", "--device", "cpu", cwd=tmp_path,
                   env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert proc.returncode == 2
    assert "not in the local cache" in proc.stderr and "Traceback" not in proc.stderr


def test_a_hub_that_does_not_resolve_is_said_at_once_not_after_retries(tmp_path: Path) -> None:
    """A machine without the hub's name (no network, no DNS): one line naming the host, not ~25 s of
    huggingface_hub's retries first (.invalid never resolves)."""
    proc = run_cli("plan", "--model", "someorg/not-cached-model", "--card", "T4", cwd=tmp_path,
                   env={"HF_ENDPOINT": "https://hub.example.invalid", "HF_HOME": str(tmp_path / "hf")})
    assert proc.returncode == 2, proc.stderr
    assert "hub.example.invalid cannot be reached from here" in proc.stderr and "Retrying" not in proc.stderr


def test_a_hub_id_in_the_local_cache_resolves_offline(tmp_path: Path, saved_tiny: Path) -> None:
    # lay the folder out as the hub cache does (models--owner--name/snapshots/<rev>/ + refs/main)
    cache = tmp_path / "hub"
    repo = cache / "models--someorg--tiny"
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    for f in saved_tiny.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    proc = run_cli("probe", "--model", "someorg/tiny", "--device", "cpu", "--json", *SHORT, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    import json

    assert json.loads(proc.stdout)["outcome"] == "fit"


# ----------------------------------------------------------------------------- the keys


def test_weights_that_make_the_loss_non_finite_are_unstable_not_a_fit(tmp_path: Path) -> None:
    """A diverged checkpoint (a NaN norm weight): real steps, a non-finite loss, outcome unstable."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from autofit.config.models import PRESETS
    from autofit.protocol.result import ProbeResult
    from autofit.run.report.advice import nothing_fits_message

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**PRESETS["tiny-llama"]))
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    model.save_pretrained(tmp_path / "diverged")
    r = probe_json("--set", "max_length=128", "--set", "global_batch=4", cwd=tmp_path,
                   model=str(tmp_path / "diverged"))
    assert r["outcome"] == "unstable"
    assert r["reason"].startswith("non-finite loss on") and r["step_times"]
    # what a search that met only this would tell the user: not "allow more memory"
    msg = nothing_fits_message([ProbeResult.from_dict(r)], 2**30)
    assert "training was unstable" in msg and "non-finite loss" in msg and "Allow next" not in msg


def test_modules_in_the_working_folder_do_not_replace_the_libraries_in_the_children(tmp_path: Path) -> None:
    """`python -m` puts the working folder first on the import path: a `trl.py` there (a recipe exported under
    that name) broke the batching layouts' child with a traceback, a `datasets.py` every probe. The children
    leave the folder off their path (`-P`); the `autofit` command itself never had it there."""
    import json

    for name in ("trl", "datasets"):
        (tmp_path / f"{name}.py").write_text('raise RuntimeError("the working folder\'s own module was imported")\n')
    proc = subprocess.run([str(Path(sys.executable).parent / "autofit"), "probe", "--model", "tiny-llama",
                           "--device", "cpu", "--dataset", str(ROOT / "tests" / "data" / "d1-slice.jsonl"),
                           "--json", *SHORT], check=False, capture_output=True, text=True, cwd=tmp_path,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["outcome"] == "fit", proc.stdout[-2000:]
