"""Shared by the benchmark scripts: where results go and what every result file records."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autofit.core.envinfo import collect  # noqa: E402
from autofit.core.files import write_json  # noqa: E402

GIB = 2**30
REPO = Path(__file__).resolve().parent.parent
SMALL_FIXED = """\
# --small: tiny-llama on the CPU, short rows (the dimensions follow)
method: lora
fixed:
  max_length: 128
  global_batch: 4
  lora_r: 8
  lora_alpha: 16
  lora_targets: q_proj,v_proj
  precision: fp32
  optimizer: adamw_torch
dimensions:"""


PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
"""The wheels the GPU machine (x86-64 Linux) can load."""


def pack_site(name: str, wheels: Sequence[str], drop: Sequence[str] = (), python: str = "3.12",
              small: bool = False) -> Path:
    """Wheels for the GPU machine's Python installed (no dependencies: name each) into a folder `.{name}`, the
    paths matching the globs in `drop` removed, packed as .whl/{name}.tgz, or with `small` its shared libraries'
    symbols stripped (`strip --strip-unneeded`: the dynamic ones stay) and packed with xz as .whl/{name}.txz.
    On the GPU machine bench/gpu_env.sh unpacks it under /tmp/site-packages (a path that holds
    "site-packages": dill, which `datasets` hashes with, pickles modules from elsewhere by value)."""
    import shutil

    staging = Path(tempfile.mkdtemp(prefix=f"{name}-")) / f".{name}"
    plat = [x for p in PLATFORMS for x in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--only-binary=:all:",
                    "--python-version", python, "--implementation", "cp", *plat, "--target", str(staging), *wheels],
                   check=True)
    for pattern in (*drop, "**/__pycache__"):
        for path in list(staging.glob(pattern)):
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)
    if small:
        libraries = [str(f) for f in staging.rglob("*.so*") if f.is_file() and not f.is_symlink()]
        subprocess.run(["strip", "--strip-unneeded", *libraries], check=True)
    out = REPO / ".whl" / f"{name}.{'txz' if small else 'tgz'}"
    out.parent.mkdir(exist_ok=True)
    archive = shutil.make_archive(str(out.with_suffix("")), "xztar" if small else "gztar", staging.parent,
                                  staging.name)
    Path(archive).replace(out)
    shutil.rmtree(staging.parent)
    print(f"wrote {repo_relative(out)} ({out.stat().st_size / 2**20:.1f} MiB); carry .whl/ to the GPU machine and "
          f"start its command with `source bench/gpu_env.sh &&` (it unpacks /tmp/site-packages/.{name})")
    return out


def repo_relative(path: str | Path) -> str:
    """A path inside this checkout as the results store it (relative: no machine's folders in them);
    one outside it as given."""
    full = Path(path).resolve()
    return full.relative_to(REPO).as_posix() if full.is_relative_to(REPO) else str(path)


def in_repo(path: str | Path) -> Path:
    """A stored path back to a file: relative ones are this checkout's."""
    return Path(path) if Path(path).is_absolute() else REPO / path


def bench_env(gpu: int | None = None) -> dict[str, str]:
    """Environment of a subprocess: this checkout's autofit whatever the working directory (the caller's
    PYTHONPATH kept: the GPU machine's extra packages travel there), and only `gpu` visible (None: as
    this process)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    if gpu is not None:
        env.update(CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=str(gpu))
    return env


def autofit_cli(*args: str, timeout: float, interrupt_after: float | None = None) -> subprocess.CompletedProcess:
    """`python -m autofit ARGS` as a user runs it, output captured. With `interrupt_after` (seconds), a command
    still running then gets SIGINT, as Ctrl-C sends it (a search saves its study and writes its outputs), and
    `timeout` counts from there."""
    cmd = [sys.executable, "-m", "autofit", *args]
    if interrupt_after is None:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, env=bench_env())
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=bench_env()) as proc:
        try:
            out, err = proc.communicate(timeout=max(interrupt_after, 1))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=timeout)
            err += f"\n(bench: interrupted after {interrupt_after:.0f} s)"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def out_dir() -> Path:
    """$OUT on the GPU machine (fetched back), else bench/results/."""
    d = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
    d.mkdir(parents=True, exist_ok=True)
    return d


def save(name: str, figures: dict[str, Any]) -> Path:
    env = collect()
    gpu = env["gpus"][0]["name"] if env["gpus"] else "cpu"
    payload = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu,
        "driver": env.get("driver"),
        "cuda_driver": env.get("cuda_driver"),
        "torch_cuda_build": env.get("torch_cuda_build"),
        "versions": env["packages"],
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        **figures,
    }
    path = out_dir() / f"{name}.json"
    write_json(path, payload)
    print(f"wrote {path}")
    return path


def read_trials(run_dir: Path) -> list[dict[str, Any]]:
    """A run folder's probe rows (trials.jsonl), one dict per probe."""
    return [json.loads(x) for x in (run_dir / "trials.jsonl").read_text().splitlines() if x.strip()]


def brief(res: Any) -> dict[str, Any]:
    """The figures of a ProbeResult worth keeping in a benchmark file."""
    d = res.to_dict()
    keep = ("outcome", "reason", "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max",
            "peak_memory_bytes", "max_memory_reserved", "max_memory_allocated",
            "memory_outside_allocator", "memory_after_load", "phase_peaks", "num_alloc_retries",
            "memory_growth_bytes", "oom_shortfall_bytes", "checkpointed_layers", "wall_seconds",
            "train_seconds", "probe_accumulation", "step_times", "device")
    out = {k: d[k] for k in keep}
    out["config"] = {k: d["config"][k] for k in ("max_length", "micro_batch_size", "global_batch",
                                                 "gradient_accumulation_steps", "precision",
                                                 "gradient_checkpointing", "quantization", "optimizer")}
    out["peak_gib"] = round(d["peak_memory_bytes"] / GIB, 2) if d["peak_memory_bytes"] else None
    return out


STEP_KEYS = ("gradient_accumulation_steps", "samples_per_step", "trained_tokens_per_step", "keeps_global_batch")
"""What one optimizer step of a probed config trains (`extra`, from `data.batching.StepShape`)."""


def step_of(res: dict[str, Any]) -> dict[str, Any]:
    """A probe result's step figures: accumulation, samples and trained tokens per optimizer step, and
    whether that is the asked global batch (within 10%)."""
    extra = res.get("extra") or {}
    return {k: extra.get(k) for k in STEP_KEYS}


def spread_figure(values: list[float], digits: int = 1) -> dict[str, Any]:
    """A headline figure: every run, their median, and the spread (max / min) around it; None where
    nothing was measured. `digits`: decimals kept (pairs/s of a 7B are a few a second: 3)."""
    if not values:
        return {"runs": [], "median": None, "min": None, "max": None, "spread": None}
    return {"runs": [round(v, digits) for v in values], "median": round(statistics.median(values), digits),
            "min": round(min(values), digits), "max": round(max(values), digits),
            "spread": round(max(values) / min(values), 4)}


def ratio_of_medians(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    """median(a) / median(b) of two `spread_figure`s measured in the same session (None if one is missing)."""
    return round(a["median"] / b["median"], 4) if a.get("median") and b.get("median") else None


def interleaved(target: Any, model: Any, configs: dict[str, Any], n: int, keep: Callable[[str, Any], None], *,
                max_acc: int | None, dataset: dict[str, Any] | None = None, data_cache: Path | None = None,
                prefix: str = "after", timeout: float = 600) -> None:
    """Each config (label -> TrialConfig) measured n times, each run a fresh probe process (one standby
    importing ahead, held while a probe times its steps), in the order a, b, b, a, a, b, ... so that a
    steady drift of the machine over the minutes falls on every config alike. `keep(label, result)` gets
    each ProbeResult as it comes: an interrupted pass keeps what it measured."""
    from autofit.probe.runner import Runner
    from autofit.run.report.lines import config_brief

    order = list(configs.items())
    with Runner(target, Path(tempfile.mkdtemp(prefix="bench-runs-")), standby=1, max_probe_accumulation=max_acc,
                dataset=dataset, data_cache=data_cache) as runner:
        runner.warm_up()
        for i in range(n):
            for label, cfg in (order if i % 2 == 0 else order[::-1]):
                res = runner.run(cfg, model, name=f"{prefix}-{label}-{i}", timeout=timeout)
                print(f"{prefix} {label} {i}: {config_brief(res.config)}  {res.tokens_per_s or 0:,.0f} tok/s "
                      f"({res.outcome.value})", flush=True)
                keep(label, res)


def best_fits(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A run folder's fastest fit of each batching strategy (trials.jsonl rows)."""
    best: dict[str, dict[str, Any]] = {}
    for r in rows:
        b = r["config"].get("batching", "pad_max")
        if r["outcome"] == "fit" and (r.get("tokens_per_s") or 0) > best.get(b, {}).get("tokens_per_s", 0):
            best[b] = r
    return best


def figure_row(cfg: dict[str, Any]) -> dict[str, Any]:
    """A config's entry in a headline table, before its runs: filled by `keep_run`."""
    from autofit.run.report.lines import config_brief

    return {"config": cfg, "brief": config_brief(cfg), "runs": [], "figure": spread_figure([])}


def keep_run(row: dict[str, Any], res: Any) -> None:
    """One more fresh-process run of the row's config: its brief, and the figure over the fits so far."""
    row["runs"].append(run_brief(res))
    row["figure"] = spread_figure([r["tokens_per_s"] for r in row["runs"]
                                   if r["outcome"] == "fit" and r["tokens_per_s"]])


def run_brief(res: Any) -> dict[str, Any]:
    """One fresh-process run as a headline keeps it: outcome, tokens/s, peak, step figures, noise, and on data
    the time model and the window's own figure; the host's share of its steps."""
    d = res.to_dict()
    extra = d.get("extra") or {}
    return {"outcome": d["outcome"], "tokens_per_s": d.get("tokens_per_s"), "noisy": d.get("noisy"),
            **({"pairs_per_s": d["pairs_per_s"]} if d.get("pairs_per_s") else {}),  # a DPO probe's objective
            "reason": (d.get("reason") or "")[:300],
            "peak_gib": round(d["peak_memory_bytes"] / GIB, 2) if d.get("peak_memory_bytes") else None,
            "oom_shortfall_gib": round(d["oom_shortfall_bytes"] / GIB, 2) if d.get("oom_shortfall_bytes") else None,
            "step": step_of(d), "step_times": d.get("step_times"), "micro_step_s": d.get("micro_step_s"),
            "time_model": extra.get("time_model"), "window_tokens_per_s": extra.get("window_tokens_per_s"),
            "host": host_share(extra.get("host_per_step") or {})}


def host_share(host: dict[str, list[Any]]) -> dict[str, Any]:
    """Medians over a probe's timed steps: all threads' CPU time over the step's wall time (near 1: some
    thread was on a CPU the whole step) and the GPU's power; a launch-bound step draws less power."""
    steps, cpu, power = host.get("step_s") or [], host.get("process_cpu_s") or [], host.get("power_w") or []
    shares = [c / t for c, t in zip(cpu, steps, strict=False) if c is not None and t]
    watts = [w for w in power if w is not None]
    return {"process_cpu_over_step": round(statistics.median(shares), 3) if shares else None,
            "power_w": round(statistics.median(watts), 1) if watts else None,
            # where the training thread ended its steps: a slow process and a fast one told apart by place
            "cpus": sorted({c for c in host.get("cpu") or [] if c is not None}),
            "numa_nodes": sorted({n for n in host.get("numa_node") or [] if n is not None})}
