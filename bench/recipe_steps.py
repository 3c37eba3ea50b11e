"""Runs an exported Python recipe's own main(), unchanged, with its Throughput callback also printing every
step's trained tokens and seconds (`recipe-steps {...}`), so that bench/export_bench.py can compare the
run's second half, past its first steps' allocations, with the probe's steady figure.

    python bench/recipe_steps.py train.py --dataset DATA --max-steps 120 ...   # the recipe's own arguments
"""

import importlib.util
import json
import sys
from typing import Any

script = sys.argv[1]
sys.argv = [script, *sys.argv[2:]]
spec = importlib.util.spec_from_file_location("recipe", script)
assert spec is not None and spec.loader is not None, script
recipe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(recipe)  # defines; its `if __name__ == "__main__"` does not run


Throughput: Any = recipe.__dict__["Throughput"]


class Steps(Throughput):  # type: ignore[misc]
    def on_train_end(self, args, state, control, model=None, **kw):  # type: ignore[no-untyped-def]
        super().on_train_end(args, state, control, model=model, **kw)
        print("recipe-steps " + json.dumps({"tokens": self.tokens, "seconds": self.times}), flush=True)


recipe.__dict__["Throughput"] = Steps  # main() builds its callback from the module's globals
recipe.__dict__["main"]()
