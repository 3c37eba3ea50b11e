"""Issue 29's headline figures: every one the median of >= 3 fresh-process runs, measured in one session.

S1 (Llama-2-7B shape, LoRA r16 on q_proj,v_proj, bf16, sdpa, 40 GiB, length 2048, global batch 16),
each config measured --repeats times (default 3), each run a fresh probe process (one standby importing
ahead, held while a probe times its steps), alternately (a, b, c, c, b, a, ...):
- the forum recipe: micro-batch 1 + checkpointing on every layer;
- autofit's winner: micro-batch 2, no checkpointing (the winner of every S1 search so far), or with
  --search BUDGET the winner of a real `autofit search` over the grid's space run first in this call;
- the kernel winner: micro-batch 3, no checkpointing, Liger, sdpa, expandable_segments (the resumed S1
  kernel search's), against the stock recipe of that config under the same 40 GiB cap: measured once
  first; where it does not fit that is the figure ("does not fit", with its shortfall), and the kernel
  winner is compared with the stock winner instead.
The ratios are medians over medians of this call: winner / forum (the README's 2.0x: 13,531 / 6,784,
measured in different sessions), kernel winner / stock winner (1.35x: 18,466 / 13,685, likewise).

    python bench/like_for_like.py --search 90s --name headline-s1      # on the GPU (~7 minutes)
    python bench/like_for_like.py --scenario S2 --name headline-s2     # 24 GiB: forum recipe vs winner
    python bench/like_for_like.py --small                              # tiny-llama on the CPU, length 128
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import REPO, SMALL_FIXED, autofit_cli, figure_row, interleaved, keep_run, ratio_of_medians, save

from autofit.config.models import resolve_model
from autofit.config.spec import TrialConfig
from autofit.config.target import resolve_targets
from autofit.core.units import parse_duration
from autofit.protocol.request import MAX_PROBE_ACCUMULATION
from autofit.protocol.result import ProbeResult
from autofit.run.report.lines import config_brief

COMMON = {"method": "lora", "max_length": 2048, "global_batch": 16, "lora_r": 16, "lora_alpha": 32,
          "lora_targets": "q_proj,v_proj", "precision": "bf16", "optimizer": "adamw_torch_fused",
          "attn_implementation": "sdpa"}
SMALL_COMMON = {**COMMON, "max_length": 128, "global_batch": 4, "lora_r": 8, "lora_alpha": 16, "precision": "fp32",
                "optimizer": "adamw_torch"}
FORUM = {"micro_batch_size": 1, "gradient_checkpointing": "on"}
SCENARIOS: dict[str, dict[str, Any]] = {
    "S1": {"model": "llama2-7b", "limit": "40GiB", "space": "bench/spaces/s1-grid.yaml", "configs": {
        "forum": FORUM,
        "winner": {"micro_batch_size": 2, "gradient_checkpointing": "off"},
        "kernel_winner": {"micro_batch_size": 3, "gradient_checkpointing": "off", "liger": True,
                          "expandable_segments": True}},
        "published": {"winner_over_forum": {"ratio": 2.0, "figures": "13,531 / 6,784 (README; different sessions)"},
                      "kernel_winner_over_winner": {"ratio": 1.35,
                                                    "figures": "18,466 / 13,685 (README; different sessions)"}}},
    "S2": {"model": "llama2-7b", "limit": "24GiB", "space": "bench/spaces/s1-grid.yaml", "configs": {
        "forum": FORUM,
        "winner": {"micro_batch_size": 1, "gradient_checkpointing": "every_4", "expandable_segments": True}},
        "published": {"winner_over_forum": {"ratio": 1.73, "figures": "11,745 / 6,784 (search run 1; grid)"}}},
}
SMALL = {"model": "tiny-llama", "limit": None, "space": None, "configs": {
    "forum": FORUM, "winner": {"micro_batch_size": 2, "gradient_checkpointing": "off"},
    "kernel_winner": {"micro_batch_size": 2, "gradient_checkpointing": "off", "liger": True}}, "published": {}}
"""--small: the plumbing on the CPU (Liger is `unsupported` there, so the kernel rows say so)."""
SMALL_SPACE = SMALL_FIXED + """\n  micro_batch_size: [1, 2, 4]\n  gradient_checkpointing: ['off', 'on']\n"""


def searched_winner(sc: dict[str, Any], budget: str, device: list[str], work: Path) -> tuple[dict[str, Any], dict]:
    """The real search first (`autofit search`, as a user runs it): its winner's settings and what it did."""
    space = sc["space"]
    if space is None:
        space = str(work / "small-space.yaml")
        Path(space).write_text(SMALL_SPACE)
    t0 = time.monotonic()
    proc = autofit_cli("search", "--model", sc["model"], "--space", str(REPO / space) if sc["space"] else space,
                       "--budget", budget, "--out", str(work / "runs"), "--json", *device,
                       *(["--memory-limit", sc["limit"]] if sc["limit"] else []), timeout=600,
                       interrupt_after=parse_duration(budget) + 90)  # a search that overran stops, saving its best
    try:
        out = json.loads(proc.stdout)
    except json.JSONDecodeError:
        sys.exit(f"like_for_like: the search failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    best_file = Path(out["run_dir"]) / "best.json"
    if not best_file.is_file():  # no fit within the budget: the known winner is measured, and the file says so
        return sc["configs"]["winner"], {"budget": budget, "stop_reason": out.get("stop_reason"),
                                         "probes": out.get("probes"), "winner": None,
                                         "stderr_tail": proc.stderr[-800:]}
    best = json.loads(best_file.read_text())
    keys = ("micro_batch_size", "gradient_checkpointing", "expandable_segments")
    return ({k: best["config"][k] for k in keys},
            {"budget": budget, "wall_seconds": round(time.monotonic() - t0, 1), "stop_reason": out.get("stop_reason"),
             "probes": out.get("probes"),
             "winner": config_brief(best["config"]), "tokens_per_s": best["tokens_per_s"],
             "measurements": (best.get("extra") or {}).get("measurements"), "stderr_tail": proc.stderr[-800:]})


def ratios(rows: dict[str, Any]) -> dict[str, Any]:
    """Medians over medians of the runs so far; the stock recipe at the kernel winner's config said not to fit
    where its first run did not."""
    figs = {label: row["figure"] for label, row in rows.items()}
    stock_first = (rows.get("stock_at_kernel_config", {}).get("runs") or [{}])[0]
    return {
        "winner_over_forum": ratio_of_medians(figs["winner"], figs["forum"]),
        **({"kernel_winner_over_winner": ratio_of_medians(figs["kernel_winner"], figs["winner"]),
            "kernel_winner_over_stock_at_kernel_config": ratio_of_medians(figs["kernel_winner"],
                                                                          figs["stock_at_kernel_config"])
            if stock_first.get("outcome") == "fit" else
            f"the stock recipe at the kernel winner's config does not fit the cap: {stock_first.get('outcome')}"
            f" (short by {stock_first.get('oom_shortfall_gib')} GiB)"}
           if "kernel_winner" in figs else {})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default="S1", choices=sorted(SCENARIOS))
    p.add_argument("--repeats", type=int, default=3, help="fresh-process runs of each config (default 3)")
    p.add_argument("--search", metavar="BUDGET", help="run `autofit search` over the scenario's grid space first "
                                                      "and measure its winner (default: the known winner's config)")
    p.add_argument("--small", action="store_true", help="tiny-llama on the CPU: the plumbing, no GPU figures")
    p.add_argument("--name", help="result file name (default headline-<scenario>, headline-cpu-small)")
    a = p.parse_args()
    sc = SMALL if a.small else SCENARIOS[a.scenario]
    common = SMALL_COMMON if a.small else COMMON
    device = ["--device", "cpu"] if a.small else []
    name = a.name or ("headline-cpu-small" if a.small else f"headline-{a.scenario.lower()}")
    work = Path(tempfile.mkdtemp(prefix="like-for-like-"))
    wanted = {label: dict(v) for label, v in sc["configs"].items()}
    figures: dict[str, Any] = {"scenario": "CPU" if a.small else a.scenario, "model": sc["model"], "limit": sc["limit"],
                               "common": common, "repeats": a.repeats, "configs": {}, "published": sc["published"],
                               "note": "each figure: the median of fresh-process runs measured alternately in this "
                                       "call, spread = max/min; each ratio: median over median, this call"}
    if a.search:
        wanted["winner"], figures["search"] = searched_winner(sc, a.search, device, work)
        save(name, figures)
    target = resolve_targets(None, "cpu" if a.small else None, sc["limit"])[0]
    model = resolve_model(sc["model"])
    configs = {label: TrialConfig.from_mapping({**common, **v}) for label, v in wanted.items()}
    for label, cfg in configs.items():
        figures["configs"][label] = figure_row(cfg.to_dict())

    def keep(label: str, res: ProbeResult) -> None:  # the ratios after every run: a call cut short keeps them
        keep_run(figures["configs"][label], res)
        figures["ratios"] = ratios(figures["configs"])
        save(name, figures)

    measured = dict(configs)
    if "kernel_winner" in configs:  # the stock recipe of the kernel winner's config, under the same cap, first
        stock = TrialConfig.from_mapping({**common, **wanted["kernel_winner"], "liger": False})
        figures["configs"]["stock_at_kernel_config"] = figure_row(stock.to_dict())
        interleaved(target, model, {"stock_at_kernel_config": stock}, 1, keep, max_acc=MAX_PROBE_ACCUMULATION,
                    prefix="first")
        if figures["configs"]["stock_at_kernel_config"]["runs"][0]["outcome"] == "fit":
            measured["stock_at_kernel_config"] = stock
    interleaved(target, model, measured, a.repeats, keep, max_acc=MAX_PROBE_ACCUMULATION, prefix="repeat")
    print(json.dumps({"ratios": figures["ratios"], **{k: v["figure"] for k, v in figures["configs"].items()}},
                     indent=1))


if __name__ == "__main__":
    main()
