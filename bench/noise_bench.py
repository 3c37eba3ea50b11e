"""Issue 10 item 9: one config measured 5 times in one run, standby processes importing beside it.

Modes, each 5 runs in fresh processes:
- "before": the runner lets standby processes import while a probe is timed (the old behaviour,
  `Runner(hold_while_timing=False)`, kept only for this benchmark) and the probe runs without
  its noise controls (`AUTOFIT_NOISE_CONTROLS=none`, autofit/probe/quiet.py);
- "hold": standby imports stopped during every timed phase, no noise controls;
- "after": both (what autofit does). Each probe takes a standby process and the runner starts
the next one at once, so a fresh import runs beside every probe, as in a search;
- "cores": "after" with every probe on the same --cores CPU cores, one hardware thread per physical
core (`AUTOFIT_PROBE_CORES`): is the spread between fresh processes where the scheduler places the
threads that launch the kernels?

GPU (S1: llama2-7b shape, LoRA, 40 GiB limit, length 2048, micro-batch 1, checkpointing on,
global batch 16):   python bench/noise_bench.py
CPU check that it works:   python bench/noise_bench.py --model tiny-llama --device cpu
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import GIB, save

from autofit.config.models import resolve_model
from autofit.config.spec import TrialConfig
from autofit.config.target import HEADROOM, Target
from autofit.core.envinfo import gpus
from autofit.core.units import parse_size
from autofit.probe.child.quiet import CONTROLS_ENV, CORES_ENV, one_thread_per_core
from autofit.probe.runner import Runner
from autofit.probe.standby import HOLD
from autofit.protocol.request import TIMED_STEPS


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama2-7b")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--memory-limit", default="40GiB", help="none: no limit")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--standby", type=int, default=2)
    p.add_argument("--modes", default="before,hold,after")
    p.add_argument("--max-probe-accumulation", type=int, default=4,
                   help="micro-steps timed per optimizer step, the rest extrapolated (0: all)")
    p.add_argument("--timed-steps", type=int, default=TIMED_STEPS,
                   help=f"timed optimizer steps per probe (default {TIMED_STEPS}, the probe's): more say whether "
                        "the spread between processes is per-step noise that a longer window averages out")
    p.add_argument("--cores", type=int, default=4, help="CPU cores of the `cores` mode (default 4)")
    p.add_argument("--name", default=None, help="result file name (default noise-<model>-<device>)")
    return p.parse_args()


MODES = {"before": (False, "none"), "hold": (True, "none"), "after": (True, "all"), "cores": (True, "all")}


def measure(target: Target, cfg: TrialConfig, model: Any, a: argparse.Namespace, mode: str) -> dict[str, Any]:
    hold, controls = MODES[mode]
    os.environ[CONTROLS_ENV] = controls  # read by the probe children this runner starts
    os.environ.pop(CORES_ENV, None)
    if mode == "cores":
        os.environ[CORES_ENV] = str(a.cores)
    runs = []
    with Runner(target, Path(tempfile.mkdtemp()), standby=a.standby, hold_while_timing=hold,
                timed_steps=a.timed_steps, max_probe_accumulation=a.max_probe_accumulation or None) as runner:
        runner.warm_up()
        for i in range(a.runs):
            stops = HOLD.stops
            res = runner.run(cfg, model, name=f"noise-{mode}-{i}", timeout=900)
            runs.append({"outcome": res.outcome.value, "tokens_per_s": res.tokens_per_s, "spread": res.spread,
                         "noisy": res.noisy, "step_times": res.step_times, "reason": res.reason,
                         "peak_gib": round((res.peak_memory_bytes or 0) / GIB, 3),
                         "standby_imports_stopped": HOLD.stops - stops,
                         "pinned_cpus": res.extra.get("pinned_cpus"), "noise_controls": res.extra.get("noise_controls"),
                         # per timed step: thread CPU, run-queue wait, hypervisor steal (autofit/probe/hostclock.py)
                         "host_per_step": res.extra.get("host_per_step")})
            print(mode, i, res.outcome.value, res.tokens_per_s, res.spread,
                  res.step_times, flush=True)
    tps = [r["tokens_per_s"] for r in runs if r["tokens_per_s"]]
    return {"runs": runs, "tokens_per_s": tps,
            "max_over_min": round(max(tps) / min(tps), 4) if tps else None,
            "median_tokens_per_s": statistics.median(tps) if tps else None,
            "host": host_summary(runs)}


def host_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Over every timed step of every run: how the step's time moves with each host counter and the GPU's
    clock and power (Pearson r), and the training thread's CPU share of the step. Steps that slow down
    with the thread's wait or the steal are the host's; with its CPU time at the same share, a slower CPU;
    with a lower SM clock, the GPU's clock management; with none of them, the device's work itself."""
    steps = [(t, h) for r in runs if r.get("host_per_step") for t, h in  # the steps as run, not extended
             zip(r["host_per_step"]["step_s"],
                 zip(*(r["host_per_step"].get(k) or [None] * len(r["host_per_step"]["step_s"]) for k in HOST_KEYS)),
                 strict=False)]
    out: dict[str, Any] = {"steps": len(steps)}
    if len(steps) < 3:
        return out
    times = [t for t, _ in steps]
    for i, key in enumerate(HOST_KEYS):
        vals = [h[i] for _, h in steps]
        if None in vals:
            continue
        out[f"r_step_time_vs_{key}"] = round(statistics.correlation(times, vals), 3) if len(set(vals)) > 1 else None
        out[f"mean_{key}"] = round(statistics.mean(vals), 4)
    out["thread_cpu_share"] = round(sum(h[0] for _, h in steps) / sum(times), 3)
    if all(h[1] is not None for _, h in steps):  # results before process_cpu_s was recorded lack it
        out["process_cpu_share"] = round(sum(h[1] for _, h in steps) / sum(times), 3)
    return out


HOST_KEYS = ("thread_cpu_s", "process_cpu_s", "run_wait_s", "steal_cpu_s", "sm_clock_mhz", "power_w")
"""The host's counters and the GPU's clock and power per step (autofit/probe/hostclock.py)."""


def main() -> int:
    a = parse()
    limit = None if a.memory_limit == "none" else parse_size(a.memory_limit)
    if a.device == "cuda":
        g = gpus()[0]
        target = Target("cuda", g.index, g.name, limit, HEADROOM)
    else:
        target = Target("cpu", None, "", limit, HEADROOM)
    cfg = TrialConfig.from_mapping({"max_length": a.length, "global_batch": a.global_batch, "micro_batch_size": 1,
                                    "gradient_checkpointing": "on"})
    model = resolve_model(a.model)
    modes: dict[str, Any] = {}
    for m in a.modes.split(","):  # saved after each mode: a run cut short keeps what it measured
        modes[m] = measure(target, cfg, model, a, m)
        save(
            a.name or f"noise-{a.model}-{a.device}",
            {
                "scenario": f"{a.model}, LoRA, length {a.length}, micro-batch 1, checkpointing on, global batch "
                f"{a.global_batch}, limit {a.memory_limit}, {a.runs} runs per mode, {a.standby} standby, "
                f"micro-steps timed per step: {a.max_probe_accumulation or 'all'}, timed steps: {a.timed_steps}",
                "target": target.describe(long=True),
                "host_cpus": {
                    "allowed": len(os.sched_getaffinity(0)),
                    "physical_cores": len(one_thread_per_core(os.sched_getaffinity(0))),
                },
                "config": cfg.to_dict(),
                "modes": modes,
            },
        )
    for m, r in modes.items():
        print(m, "max/min across runs:", r["max_over_min"], r["tokens_per_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
