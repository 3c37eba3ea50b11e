"""Nightly re-measurement of a stored run: did anything get slower, heavier, or stop fitting?

The baseline is what `RUN/best.json` records (the winner and its runners-up). Each config is
re-probed on the same GPU with the stored settings and limit; a figure outside tolerance is
measured again before it counts, so noise alone does not fail the job. Every check is
appended to `RUN/regress-history.jsonl`.
"""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from .envinfo import collect
from .errors import UsageError
from .models import ModelSource
from .result import ProbeResult
from .runner import Runner
from .target import Target
from .spec import TrialConfig

HISTORY = "regress-history.jsonl"


@dataclass
class Check:
    """One re-probed configuration against its baseline."""

    name: str
    config: dict[str, Any]
    baseline_tokens_per_s: float
    baseline_peak_bytes: int
    tokens_per_s: float | None = None
    peak_bytes: int | None = None
    outcome: str = ""
    attempts: int = 0
    status: str = "ok"
    """ok | slower | heavier | no_longer_fits | faster"""
    messages: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.status in ("slower", "heavier", "no_longer_fits")


def version_diff(before: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    """(what, baseline, now, changed) for GPU, driver, CUDA and each package."""
    def gpu(env: dict[str, Any]) -> str:
        return ", ".join(sorted({g["name"] for g in env.get("gpus", [])})) or "none"

    rows = [("GPU", gpu(before), gpu(now)), ("driver", str(before.get("driver")), str(now.get("driver"))),
            ("CUDA (driver)", str(before.get("cuda_driver")), str(now.get("cuda_driver"))),
            ("torch CUDA build", str(before.get("torch_cuda_build")), str(now.get("torch_cuda_build")))]
    pk_b, pk_n = before.get("packages", {}), now.get("packages", {})
    for pkg in sorted(set(pk_b) | set(pk_n)):
        rows.append((pkg, pk_b.get(pkg, "-"), pk_n.get(pkg, "-")))
    return [(w, b, n, b != n) for w, b, n in rows]


def judge(check: Check, res: ProbeResult, tol: float, mem_tol: float) -> str:
    if not res.outcome.is_fit():
        return "no_longer_fits"
    tps, peak = res.tokens_per_s or 0.0, res.peak_memory_bytes or 0
    if tps < check.baseline_tokens_per_s * (1 - tol):
        return "slower"
    if peak > check.baseline_peak_bytes * (1 + mem_tol):
        return "heavier"
    if tps > check.baseline_tokens_per_s * (1 + tol):
        return "faster"
    return "ok"


def run_checks(configs: list[tuple[str, dict[str, Any]]], model: ModelSource, target: Target, log_dir: Path,
               probe: dict[str, Any], tol: float, mem_tol: float,
               on_check: Callable[[Check], None] | None = None) -> list[Check]:
    """Re-probe each baseline config; repeat once before calling a figure a regression."""
    checks = []
    with Runner(target, log_dir, standby=1 if len(configs) > 1 else 0,
                warmup_steps=probe.get("warmup_steps", 2), timed_steps=probe.get("timed_steps", 5),
                max_probe_accumulation=probe.get("max_probe_accumulation", 4)) as runner:
        for i, (name, best) in enumerate(configs):
            cfg = TrialConfig.from_dict(best["config"])
            c = Check(name, cfg.to_dict(), float(best["tokens_per_s"]), int(best["peak_memory_bytes"]))
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
            results = []
            for attempt in (1, 2):
                res = runner.run(cfg, model, name=f"regress-{stamp}-{i}-{attempt}",
                                 timeout=probe.get("timeout_s", 900))
                results.append(res)
                status = judge(c, res, tol, mem_tol)
                if status in ("ok", "no_longer_fits"):  # an OOM is a failure at once
                    break
            fits = [r for r in results if r.outcome.is_fit()]
            final = fits[-1] if len(fits) == len(results) else results[-1]
            if len(fits) == 2:  # the better of two measurements, each figure on its own
                final.tokens_per_s = max(r.tokens_per_s or 0 for r in fits)
                final.peak_memory_bytes = min(r.peak_memory_bytes or 0 for r in fits)
            c.attempts = len(results)
            c.outcome = final.outcome.value
            c.tokens_per_s, c.peak_bytes = final.tokens_per_s, final.peak_memory_bytes
            c.status = judge(c, final, tol, mem_tol)
            c.messages = describe(c, final, tol, mem_tol)
            checks.append(c)
            if on_check:
                on_check(c)
    return checks


def describe(c: Check, res: ProbeResult, tol: float, mem_tol: float) -> list[str]:
    gib = 2**30
    if c.status == "no_longer_fits":
        return [f"{c.name} no longer fits: outcome {res.outcome.value} ({res.reason}); baseline "
                f"{c.baseline_tokens_per_s:,.0f} tokens/s at {c.baseline_peak_bytes / gib:.2f} GiB"]
    out = []
    dt = (c.tokens_per_s or 0) / c.baseline_tokens_per_s - 1
    dm = (c.peak_bytes or 0) / c.baseline_peak_bytes - 1
    line = (f"{c.name}: {c.tokens_per_s:,.0f} tokens/s vs baseline {c.baseline_tokens_per_s:,.0f} ({dt:+.1%}, "
            f"tolerance {tol:.0%}); peak {(c.peak_bytes or 0) / gib:.2f} GiB vs {c.baseline_peak_bytes / gib:.2f} "
            f"GiB ({dm:+.1%}, tolerance {mem_tol:.0%}); {c.attempts} measurement(s)")
    out.append(line)
    if c.status == "faster":
        out.append(f"{c.name} is faster than its baseline beyond tolerance: re-baseline with "
                   "`autofit regress RUN --update-baseline`")
    return out


def append_history(run_dir: Path, checks: list[Check], env: dict[str, Any], limit: int | None) -> dict[str, Any]:
    entry = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
             "gpu": ", ".join(g["name"] for g in env.get("gpus", [])) or "cpu",
             "driver": env.get("driver"), "packages": env.get("packages"), "memory_limit_bytes": limit,
             "checks": [asdict(c) for c in checks]}
    with open(run_dir / HISTORY, "a") as f:
        f.write(json.dumps(entry) + "\n")
    return entry


def read_history(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / HISTORY
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def plot_trend(run_dir: Path, history: list[dict[str, Any]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = run_dir / "regress-trend.png"
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7.5, 5.2), sharex=True)
    names = sorted({c["name"] for h in history for c in h["checks"]})
    for name in names:
        xs, tps, peaks = [], [], []
        base_t = base_p = None
        for i, h in enumerate(history):
            for c in h["checks"]:
                if c["name"] == name:
                    xs.append(i)
                    tps.append(c["tokens_per_s"] or 0)
                    peaks.append((c["peak_bytes"] or 0) / 2**30)
                    base_t, base_p = c["baseline_tokens_per_s"], c["baseline_peak_bytes"] / 2**30
        a1.plot(xs, tps, marker="o", label=name)
        a2.plot(xs, peaks, marker="o", label=name)
        if base_t:
            a1.axhline(base_t, linestyle=":", color="gray")
            a2.axhline(base_p, linestyle=":", color="gray")
    a1.set_ylabel("tokens/s")
    a2.set_ylabel("peak GiB")
    a2.set_xlabel("check (oldest first); dotted: baseline")
    a2.set_xticks(range(len(history)), [h["date"][:10] for h in history], rotation=30, fontsize=7)
    a1.legend(fontsize=7)
    a1.grid(alpha=0.3)
    a2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def junit_xml(checks: list[Check], suite: str) -> str:
    root = ET.Element("testsuite", name=suite, tests=str(len(checks)),
                      failures=str(sum(c.failed for c in checks)), errors="0")
    for c in checks:
        case = ET.SubElement(root, "testcase", classname="autofit.regress", name=c.name)
        if c.failed:
            fail = ET.SubElement(case, "failure", message=f"{c.status}: " + "; ".join(c.messages)[:500],
                                 type=c.status)
            fail.text = json.dumps(asdict(c), indent=1)
        else:
            ET.SubElement(case, "system-out").text = "; ".join(c.messages)
    return ET.tostring(root, encoding="unicode", xml_declaration=True)


def update_baseline(run_dir: Path, checks: list[Check], env: dict[str, Any]) -> Path:
    """Rewrite best.json (and env.json) with the new figures; keep the previous ones beside them."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    best_path = run_dir / "best.json"
    kept = run_dir / f"best.previous-{stamp}.json"
    shutil.copy2(best_path, kept)
    if (run_dir / "env.json").is_file():
        shutil.copy2(run_dir / "env.json", run_dir / f"env.previous-{stamp}.json")
    best = json.loads(best_path.read_text())
    entries = [best, *best.get("runners_up", [])]
    for entry, c in zip(entries, checks):
        if c.status != "no_longer_fits":
            entry["tokens_per_s"], entry["peak_memory_bytes"] = c.tokens_per_s, c.peak_bytes
    best["baseline_updated"] = stamp
    best_path.write_text(json.dumps(best, indent=1) + "\n")
    (run_dir / "env.json").write_text(json.dumps(env, indent=1) + "\n")
    return kept


def baseline_configs(best: dict[str, Any], top: int) -> list[tuple[str, dict[str, Any]]]:
    entries = [best, *best.get("runners_up", [])][:top]
    return [("winner" if i == 0 else f"runner-up {i}", e) for i, e in enumerate(entries)]


def check_gpu(baseline_target: dict[str, Any], target: Target, allow_change: bool) -> None:
    was = baseline_target.get("gpu_name") if baseline_target.get("device") == "cuda" else "cpu"
    now = target.gpu_name if target.device == "cuda" else "cpu"
    if was != now and not allow_change:
        raise UsageError(f"the baseline was measured on {was}, this check would run on {now}: figures from "
                         "different GPUs are not comparable. Run on the baseline's GPU model, or pass "
                         "--allow-gpu-change (and then --update-baseline) to start a new baseline.")


def now_env() -> dict[str, Any]:
    return collect()
