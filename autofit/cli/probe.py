"""`autofit probe`: one configuration measured in a child process."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

from autofit.cli.common import (
    Formatter,
    Subcommands,
    add_data_flags,
    add_probe_flags,
    add_target_flags,
    console,
    dataset_ref,
    probe_settings,
)
from autofit.config.models import PRESET_HELP, PRESETS
from autofit.config.spec import KEYS, TrialConfig, parse_sets
from autofit.config.target import resolve_targets
from autofit.core.errors import UsageError, gather
from autofit.core.files import write_json
from autofit.core.paths import output_folder
from autofit.data import DatasetRef
from autofit.probe.runner import Runner, result_file
from autofit.probe.standby import writable_logs
from autofit.run.report.lines import probe_summary
from autofit.run.session import model_source


def cmd_probe(args: argparse.Namespace) -> int:
    spans = {"gpus": args.gpus} if args.gpus > 1 else {}  # --gpus N, unless --set gpus says otherwise

    def config() -> TrialConfig:  # a malformed --set is said with the other flags' problems
        return TrialConfig.from_mapping({**spans, **parse_sets(args.set or [])})

    cfg, model, targets, ref = gather(config,
                                      lambda: model_source(args.model),
                                      lambda: resolve_targets(args.gpu, args.device, args.memory_limit,
                                                              args.headroom, args.gpus),
                                      lambda: dataset_ref(args))
    check_data_kind(cfg, ref)
    if ref is None and cfg.batching != "pad_max":
        raise UsageError(f"--set batching={cfg.batching} needs --dataset PATH: random tokens have no lengths "
                         "to batch by; give a dataset or leave batching at pad_max.")
    if cfg.micro_step_sequences > cfg.global_batch:
        raise UsageError(f"--set micro_batch_size={cfg.micro_batch_size}"
                         f"{f' on {cfg.gpus} GPUs' if cfg.gpus > 1 else ''} is more than global_batch="
                         f"{cfg.global_batch} sequences per optimizer step, so it would train on more than "
                         f"asked; set global_batch={cfg.micro_step_sequences} or more, or a smaller "
                         "micro-batch.")
    sets = parse_sets(args.set or [])
    model.check_lengths([cfg.max_length], "--set max_length" if "max_length" in sets
                        else f"max_length (default {cfg.max_length}; set it with --set max_length=N)")
    if cfg.method == "lora":
        model.check_targets([cfg.lora_targets], "--set lora_targets" if "lora_targets" in sets
                            else f"lora_targets (default {cfg.lora_targets})")
    target, settings = targets[0], probe_settings(args)
    log_dir = Path(args.log_dir) if args.log_dir else Path("runs") / "probes"
    output_folder(log_dir, "--log-dir" if args.log_dir else "runs/probes",
                  "Give the folder the probe's log goes in "
                  "(created if missing) with --log-dir.")
    writable_logs(log_dir.resolve(), "--log-dir" if args.log_dir else "")
    if not args.json:
        print(f"probing {model.ref} on {target.describe()} ...", file=sys.stderr)
    with Runner(target, log_dir, standby=0, warmup_steps=settings.warmup_steps,
                timed_steps=settings.timed_steps, max_probe_accumulation=settings.max_probe_accumulation,
                dataset=ref.to_dict() if ref else None, data_cache=log_dir / "data") as runner:
        name = "probe-" + datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")
        res = runner.run(cfg, model, name=name, timeout=settings.timeout_s)
    kept = result_file(log_dir, name)
    if not kept.exists():  # the parent's judgement (a timeout, a kill): kept beside the log as a child's is
        write_json(kept, res.to_dict())
    if args.json:
        print(json.dumps(res.to_dict(), indent=1))
    else:
        console().print(probe_summary(res))
    return 0


def check_data_kind(cfg: TrialConfig, ref: DatasetRef | None) -> None:
    """A DPO probe trains preference pairs and an SFT probe samples: the other kind is a usage error."""
    if ref is None or ref.preference == (cfg.trainer == "dpo"):
        return
    if ref.preference:
        raise UsageError(f"--dataset: {ref.path} holds preference pairs (rows with chosen/rejected), which "
                         f"trainer={cfg.trainer} cannot train; add --set trainer=dpo.")
    raise UsageError(f"--dataset: {ref.path} holds samples, not preference pairs; trainer=dpo trains rows with "
                     "'chosen' and 'rejected' (and a 'prompt'), as TRL's DPOTrainer reads them.")


PROBE_EPILOG = """\
keys for --set (default in brackets):
{keys}

presets for --model (random weights: same memory and speed as trained ones):
{presets}

examples:
  autofit probe --model tiny-llama --device cpu --set max_length=256
  autofit probe --model llama2-7b --gpu 0 --memory-limit 40GiB --set micro_batch_size=2
  autofit probe --model llama2-7b --memory-limit 24GiB --set gradient_checkpointing=on \\
      --set quantization=nf4 --json
  autofit probe --model ./my-model --set gradient_checkpointing=every_2+offload
  autofit probe --model llama2-7b --gpus 2 --memory-limit 40GiB --set method=full --set engine=fsdp2
  autofit probe --model tiny-llama --device cpu --gpus 2 --set engine=fsdp2   # 2 gloo processes
  autofit probe --model tiny-llama --device cpu --dataset train.jsonl --set max_length=256 \\
      --set batching=padding_free   # trained tokens/s on the data's own micro-batches

exit codes: 0 measured (whatever the outcome), 2 usage error, 130 interrupted
"""


def _keys_help() -> str:
    rows = []
    for k in KEYS.values():
        mark = " *" if k.changes_learning else ""
        rows.append(f"  {k.name:<22} [{k.default}] {k.help}{mark}")
    return "\n".join(rows) + "\n  (* changes what is learned)"


def _presets_help() -> str:
    return "\n".join(f"  {name:<12} {PRESET_HELP[name]}" for name in PRESETS)


def add_parser(sub: Subcommands, fmt: Formatter) -> None:
    pr = sub.add_parser("probe", help="measure one configuration in a child process", formatter_class=fmt,
                        epilog=PROBE_EPILOG.format(keys=_keys_help(), presets=_presets_help()))
    pr.add_argument("--model", required=True, help="preset, local folder, config.json, or hub id")
    pr.add_argument("--set", action="append", metavar="KEY=VALUE", help="a configuration key (repeatable)")
    add_target_flags(pr)
    pr.add_argument("--json", action="store_true", help="print one JSON object")
    add_probe_flags(pr, timeout_flag="--timeout")
    add_data_flags(pr)
    pr.add_argument("--log-dir", help="where the probe's log goes (default runs/probes)")
    pr.set_defaults(func=cmd_probe)
