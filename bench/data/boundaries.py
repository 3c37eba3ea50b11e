"""Which attention implementations honour sample boundaries, per batching strategy, measured on
this machine (tiny-llama, random weights): `autofit.probe.child.support.boundary_support` for each
precision, PACKED as the probe lays it out: TRL 1.16 `bfd` rows flattened into one row.

    python bench/data/boundaries.py --device cuda --out bench/results/data-boundaries-h200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autofit.probe.child.support import boundary_support

ATTNS = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--attn", default=",".join(ATTNS))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    import torch
    import transformers

    rows = []
    for prec in args.precisions.split(","):
        t0 = time.time()
        for r in boundary_support(args.attn.split(","), precision=prec, device=args.device):
            rows.append({"precision": prec, "strategy": r.strategy.value,
                         "attn_implementation": r.attn_implementation, "supported": r.supported,
                         "max_loss_diff": r.max_loss_diff, "reason": r.reason})
            print(json.dumps(rows[-1]), flush=True)
        print(f"# {prec}: {time.time() - t0:.0f} s", flush=True)
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu"
    meta = {"date": time.strftime("%Y-%m-%d"), "device": args.device, "gpu": gpu, "torch": torch.__version__,
            "transformers": transformers.__version__, "command": " ".join(sys.argv)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
