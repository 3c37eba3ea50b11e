"""Runs an exported Python recipe's own main(), unchanged, with its Throughput callback also printing every
step's trained tokens and seconds (`recipe-steps {...}`), so that bench/export_bench.py can compare the
run's second half, past its first steps' allocations, with the probe's steady figure. For a DPO recipe that
precomputes the reference's log-probabilities, TRL's pass is timed too (`recipe-precompute {...}`: its seconds
and pairs; `recipe-precompute-hash {...}`: the hash of the weights that keys its cache), so that its cost per pair
is compared as the probe counts it. At the end, the allocator's own peaks
(`recipe-allocator {...}`: allocated and reserved), which tell fragmentation from what the run held.
With RECIPE_STOP_AFTER=SECONDS set, training stops at the first step's end past that many seconds from this
process's start, as at --max-steps (the figures then cover the steps run): a GPU call's time limit kept.

    python bench/recipe_steps.py train.py --dataset DATA --max-steps 120 ...   # the recipe's own arguments
"""

import importlib.util
import json
import os
import sys
import time
from typing import Any

STARTED = time.monotonic()
STOP_AFTER = float(os.environ.get("RECIPE_STOP_AFTER") or 0)

script = sys.argv[1]
sys.argv = [script, *sys.argv[2:]]
spec = importlib.util.spec_from_file_location("recipe", script)
assert spec is not None and spec.loader is not None, script
recipe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(recipe)  # defines; its `if __name__ == "__main__"` does not run


Throughput: Any = recipe.__dict__["Throughput"]


class Steps(Throughput):  # type: ignore[misc]
    def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        super().on_step_end(args, state, control, **kw)
        if STOP_AFTER and time.monotonic() - STARTED > STOP_AFTER and not control.should_training_stop:
            control.should_training_stop = True
            print("recipe-stopped " + json.dumps({"after_steps": state.global_step, "stop_after_s": STOP_AFTER}),
                  flush=True)

    def on_train_end(self, args, state, control, model=None, **kw):  # type: ignore[no-untyped-def]
        super().on_train_end(args, state, control, model=model, **kw)
        print("recipe-steps " + json.dumps({"tokens": self.tokens, "seconds": self.times}), flush=True)
        import torch

        if torch.cuda.is_available():
            print("recipe-allocator " + json.dumps({"max_memory_allocated": torch.cuda.max_memory_allocated(),
                                                    "max_memory_reserved": torch.cuda.max_memory_reserved()}),
                  flush=True)


def time_precompute() -> None:
    """Wrap TRL's pass over the data (DPOTrainer._precompute_ref_logps, run in the trainer's constructor) and the
    hash of the reference's weights that keys its cache (`hash_module`, in the same constructor)."""
    import trl.trainer.dpo_trainer as dpo_trainer
    from trl.trainer.dpo_trainer import DPOTrainer

    names = vars(dpo_trainer)
    hash_module = names["hash_module"]

    def hashed(module: Any) -> str:
        t0 = time.perf_counter()
        out = hash_module(module)
        print("recipe-precompute-hash " + json.dumps({"seconds": time.perf_counter() - t0}), flush=True)
        return str(out)

    names["hash_module"] = hashed
    original = DPOTrainer._precompute_ref_logps

    def timed(self: Any, dataset: Any, name: str, batch_size: int) -> Any:
        t0 = time.perf_counter()
        out = original(self, dataset, name, batch_size)
        print("recipe-precompute " + json.dumps({"seconds": time.perf_counter() - t0, "pairs": len(dataset),
                                                 "batch_size": batch_size, "name": name}), flush=True)
        return out

    DPOTrainer._precompute_ref_logps = timed  # type: ignore[method-assign]


if "DPOTrainer" in recipe.__dict__:
    time_precompute()
recipe.__dict__["Throughput"] = Steps  # main() builds its callback from the module's globals
recipe.__dict__["main"]()
