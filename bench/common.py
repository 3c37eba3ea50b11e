"""Shared by the benchmark scripts: where results go and what every result file records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autofit.envinfo import collect  # noqa: E402

GIB = 2**30
REPO = Path(__file__).resolve().parent.parent


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


def autofit_cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """`python -m autofit ARGS` as a user runs it, output captured."""
    return subprocess.run([sys.executable, "-m", "autofit", *args], capture_output=True, text=True,
                          timeout=timeout, check=False, env=bench_env())


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
    path.write_text(json.dumps(payload, indent=1) + "\n")
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
