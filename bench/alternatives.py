"""What a user can do today without autofit: transformers Trainer's `auto_find_batch_size`.

Starting from micro-batch 16 (accelerate multiplies it by 0.9 after each OOM), with
checkpointing on and off, under each memory limit: the time it takes to settle (from
`train()` to the first optimizer step at the batch size it keeps), the batch sizes it tried,
the one it keeps, its tokens/s over the steps after that, the peak of its pick (reserved +
outside the allocator, counted from the start of the attempt it keeps, so the failed attempts'
memory does not count against it) and whether that peak keeps the 5% headroom. It changes
the effective batch (no accumulation is added back), which changes what is learned. One
process; the model is rebuilt for every run.

    python bench/alternatives.py --limits 40GiB,24GiB
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import tempfile
import time

from common import GIB, save

from autofit.config.models import PRESETS
from autofit.core.units import parse_size


class RandomTokens:
    """`n` sequences of `length` random token ids (the probe's data, rebuilt here: this script measures
    another method in its own process and uses no probe internals)."""

    def __init__(self, n: int, length: int, vocab: int, seed: int = 0) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        import torch

        ids = self.ids[i]
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def one_run(model_name: str, limit: int, ckpt: bool, steps: int, start_batch: int, headroom: float) -> dict:
    # deferred: torch and the training stack load only where a measurement runs (not for --help)
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    total = torch.cuda.get_device_properties(0).total_memory
    outside = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0] - torch.cuda.memory_reserved()
    outside = max(outside, 0)
    torch.cuda.set_per_process_memory_fraction((limit - outside) / total)
    cfg = AutoConfig.for_model(**PRESETS[model_name])
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"],
                                             task_type="CAUSAL_LM"))
    marks: list[tuple[float, int]] = []
    tried: list[int] = []  # accelerate restarts the training loop with a smaller batch after each OOM
    process_peak = [0]  # the whole process, failed attempts included

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            tried.append(state.train_batch_size or args.per_device_train_batch_size)
            process_peak[0] = max(process_peak[0], torch.cuda.max_memory_reserved())
            torch.cuda.reset_peak_memory_stats()  # the pick's own peak from here

        def on_step_end(self, args, state, control, **kw):
            torch.cuda.synchronize()
            marks.append((time.perf_counter(), state.train_batch_size))

    data = RandomTokens(start_batch * (steps + 2), 2048, cfg.vocab_size)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=start_batch, auto_find_batch_size=True,
                                 max_steps=steps, bf16=True, optim="adamw_torch_fused", learning_rate=2e-4,
                                 activation_checkpointing=ckpt,
                                 activation_checkpointing_kwargs={"use_reentrant": False} if ckpt else None,
                                 report_to="none", save_strategy="no", logging_steps=1000, disable_tqdm=True,
                                 remove_unused_columns=False)
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Clock()])
        t0 = time.perf_counter()
        trainer.train()
    final = marks[-1][1]
    mine = [t for t, b in marks if b == final]
    settle = mine[0] - t0
    times = [b - a for a, b in itertools.pairwise(mine)][2:]  # after two warm-up steps at the final size
    tps = statistics.median(final * 2048 / t for t in times) if times else None
    peak = torch.cuda.max_memory_reserved() + outside
    process_peak[0] = max(process_peak[0] + outside, peak)
    del trainer, model
    gc.collect()
    torch.cuda.empty_cache()
    return {"checkpointing": ckpt, "limit_gib": limit / GIB, "start_batch": start_batch,
            "batches_tried": tried, "settled_batch": final, "settle_seconds": settle, "tokens_per_s": tps,
            "peak_memory_bytes": int(peak), "peak_gib": round(peak / GIB, 2),
            "process_peak_gib": round(process_peak[0] / GIB, 2),
            "keeps_headroom": peak <= limit * (1 - headroom),
            "effective_batch": final, "note": "effective batch = settled micro-batch (no accumulation)"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama2-7b")
    p.add_argument("--limits", default="40GiB,24GiB")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--start-batch", type=int, default=16)
    p.add_argument("--name", default="alternatives-s1-s2")
    a = p.parse_args()
    runs = []
    for lim in a.limits.split(","):
        for ckpt in (True, False):
            try:
                r = one_run(a.model, parse_size(lim), ckpt, a.steps, a.start_batch, 0.05)
            except Exception as e:  # noqa: BLE001  (recorded, and the other runs still happen)
                r = {"checkpointing": ckpt, "limit_gib": parse_size(lim) / GIB, "start_batch": a.start_batch,
                     "error": f"{type(e).__name__}: {e}"[:2000], "tokens_per_s": None, "keeps_headroom": False}
            print(r, flush=True)
            runs.append(r)
            save(a.name, {"model": a.model, "runs": runs})  # after each run: a cut-off keeps the rest


if __name__ == "__main__":
    main()
