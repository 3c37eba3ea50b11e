"""Issue 2's GPU evidence: S1 (Llama-2-7B shape, LoRA r=16 q/v, length 2048, 40 GiB limit).

- micro-batch 2 without checkpointing fits; 3 is an OOM; 1 with checkpointing fits; the
  throughput ratio of the first to the last (SCENARIOS.md measured 1.89; target >= 1.6);
- nf4 with checkpointing on every layer: peak at micro-batch 2 minus micro-batch 1 < 3 GiB;
- fresh process vs standby (pre-imported) process: overhead (wall - training time) and peak.

Run on the GPU machine:  python bench/probe_evidence.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import GIB, brief, save

from autofit.config.models import resolve_model
from autofit.config.spec import TrialConfig
from autofit.config.target import Target
from autofit.core.envinfo import gpus
from autofit.probe.runner import Runner


def main() -> None:
    g = gpus()[0]
    target = Target("cuda", 0, g.name, 40 * GIB, 0.05)
    model = resolve_model("llama2-7b")
    logs = Path(tempfile.mkdtemp())
    base = dict(max_length=2048, global_batch=16)
    cfgs = {
        "mb2_off": TrialConfig.from_mapping({**base, "micro_batch_size": 2}),
        "mb3_off": TrialConfig.from_mapping({**base, "micro_batch_size": 3}),
        "mb1_on": TrialConfig.from_mapping({**base, "micro_batch_size": 1, "gradient_checkpointing": "on"}),
        "nf4_mb1_on": TrialConfig.from_mapping({**base, "micro_batch_size": 1, "gradient_checkpointing": "on",
                                                "quantization": "nf4"}),
        "nf4_mb2_on": TrialConfig.from_mapping({**base, "micro_batch_size": 2, "gradient_checkpointing": "on",
                                                "quantization": "nf4"}),
    }
    results: dict[str, dict] = {}
    with Runner(target, logs, standby=2) as runner:
        runner.warm_up()
        time.sleep(25)  # let the standby processes finish importing: this measures steady state
        for name, cfg in cfgs.items():
            res = runner.run(cfg, model, name=f"standby-{name}", timeout=600)
            results[name] = brief(res)
            print(name, res.outcome.value, res.tokens_per_s, res.peak_memory_bytes, res.wall_seconds,
                  res.train_seconds, res.reason[:200], flush=True)
            if res.outcome.value == "crash":
                print(res.error_tail[-3000:])
    fresh: dict[str, dict] = {}
    with Runner(target, logs, standby=0) as runner:
        for name in ("mb2_off", "mb1_on"):
            res = runner.run(cfgs[name], model, name=f"fresh-{name}", timeout=600)
            fresh[name] = brief(res)
            print("fresh", name, res.outcome.value, res.tokens_per_s, res.peak_memory_bytes,
                  res.wall_seconds, res.train_seconds, flush=True)

    # a standby process that has imported everything holds no GPU memory
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    before = pynvml.nvmlDeviceGetMemoryInfo(h).used
    with Runner(target, logs, standby=2) as runner:
        runner.warm_up()
        time.sleep(30)
        during = pynvml.nvmlDeviceGetMemoryInfo(h).used
        ready = sum(s.ready.is_set() for s in runner._pool)

    def ok(name: str) -> bool:
        return results[name]["outcome"] == "fit"

    tps = lambda n: results[n]["tokens_per_s"] or 0  # noqa: E731
    overhead_standby = [results[n]["wall_seconds"] - results[n]["train_seconds"]
                        for n in results if results[n]["train_seconds"]]
    overhead_fresh = [fresh[n]["wall_seconds"] - fresh[n]["train_seconds"] for n in fresh
                      if fresh[n]["train_seconds"]]
    figures = {
        "scenario": "S1: llama2-7b shape, LoRA r=16 q_proj,v_proj, length 2048, global batch 16, "
                    "40 GiB limit, 5% headroom",
        "results_standby": results,
        "results_fresh": fresh,
        "checks": {
            "mb2_off_fits": ok("mb2_off"),
            "mb3_off_is_oom": results["mb3_off"]["outcome"] == "oom",
            "mb1_on_fits": ok("mb1_on"),
            "ratio_mb2_off_over_mb1_on": tps("mb2_off") / tps("mb1_on") if tps("mb1_on") else None,
            "ratio_target": 1.6,
            "nf4_peak_mb2_minus_mb1_gib": ((results["nf4_mb2_on"]["peak_memory_bytes"] or 0)
                                           - (results["nf4_mb1_on"]["peak_memory_bytes"] or 0)) / GIB,
            "nf4_target_gib": 3.0,
            "overhead_standby_median_s": statistics.median(overhead_standby) if overhead_standby else None,
            "overhead_fresh_median_s": statistics.median(overhead_fresh) if overhead_fresh else None,
            "overhead_target_s": 3.0,
            "peak_fresh_vs_standby_rel": {
                n: (results[n]["peak_memory_bytes"] - fresh[n]["peak_memory_bytes"]) / fresh[n]["peak_memory_bytes"]
                for n in fresh if fresh[n]["peak_memory_bytes"] and results[n]["peak_memory_bytes"]},
            "standby_processes_ready": ready,
            "gpu_memory_used_by_2_ready_standbys_bytes": int(during - before),
        },
    }
    save("probe-evidence-s1-h200", figures)
    print(figures["checks"])


if __name__ == "__main__":
    sys.exit(main())
