"""The child-process entry point, where training happens.

`python -m autofit.probe --standby` imports torch, transformers and peft, says it is
ready, and waits for one request on stdin (JSON). It then runs that probe through
transformers Trainer, exactly as the exported recipe will, writes one `ProbeResult` as
JSON to the request's `result_path` and exits. One process, one probe: the memory it
reports is a fresh process's. CUDA is not touched before the request arrives, so a
standby process holds no GPU memory while another probe runs.

The protocol (DESIGN.md): `model.train()`, `use_cache=False`, checkpointing verified per
layer; every sequence is `max_length` tokens; warm-up optimizer steps, then timed steps
with `synchronize()` at the boundaries; median and spread of non-padding tokens/s; peak =
reserved + memory outside the allocator; per-phase peaks; growth flagged; non-finite loss
is `unstable`.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

from . import recipe
from .envinfo import package_versions
from .models import ModelSource
from .protocol import READY
from .result import Outcome, ProbeResult
from .signatures import classify_text, oom_shortfall
from .spec import TrialConfig



class Unsupported(Exception):
    """The configuration cannot run on this machine (not the user's mistake)."""

    def __init__(self, why: str) -> None:
        super().__init__(f"autofit: unsupported: {why}")


class MemoryLimitExceeded(Exception):
    """The CPU probe grew past its memory limit."""


# ----------------------------------------------------------------------------- memory


class Memory:
    """Memory figures for one probe: device allocator, NVML (GPU) or RSS (CPU).

    A sampling thread keeps the running peak of what the allocator cannot see (NVML on
    a GPU, resident set size on the CPU); `phase()` returns and resets the peak of the
    phase that just ended.
    """

    def __init__(self, device: str, nvml_index: int | None, limit: int | None) -> None:
        import psutil

        self.device = device
        self.limit = limit
        self.proc = psutil.Process()
        self.nvml = None
        self.baseline = 0
        self.sampled_peak = 0
        self._phase_peak = 0
        self.over_limit = False
        self.runaway: Any = None
        """Called from the sampling thread when the CPU probe runs far past its limit."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if device == "cuda" and nvml_index is not None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self.nvml = pynvml.nvmlDeviceGetHandleByIndex(nvml_index)
            except Exception:  # no NVML in this container: allocator figures only
                self.nvml = None
        self.baseline = self._raw()

    def _raw(self) -> int:
        """Device memory used (GPU, whole device) or this process's RSS (CPU)."""
        if self.device == "cpu":
            return int(self.proc.memory_info().rss)
        if self.nvml is None:
            return 0
        import pynvml

        return int(pynvml.nvmlDeviceGetMemoryInfo(self.nvml).used)

    def process_used(self) -> int | None:
        """This process's GPU memory by NVML, when the driver reports it (often not in containers)."""
        if self.nvml is None:
            return None
        import pynvml

        try:
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(self.nvml):
                if p.pid == os.getpid() and p.usedGpuMemory:
                    return int(p.usedGpuMemory)
        except Exception:
            return None
        return None

    def added(self) -> int:
        """Memory this process added since the baseline (device-level on a GPU)."""
        return max(0, self._raw() - self.baseline)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.01 if self.device == "cpu" else 0.02):
            now = self.added()
            self.sampled_peak = max(self.sampled_peak, now)
            self._phase_peak = max(self._phase_peak, now)
            if self.device == "cpu" and self.limit and now > self.limit:
                self.over_limit = True
                if now > 2 * self.limit + 2**30 and self.runaway is not None:
                    self.runaway(now)  # far past the limit between two checks: stop here

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=1)

    def phase(self) -> tuple[int, int]:
        """(peak allocated, peak reserved) since the last call; resets the peaks."""
        if self.device == "cuda":
            import torch

            out = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
            torch.cuda.reset_peak_memory_stats()
            return out
        now = self.added()
        peak = max(self._phase_peak, now)
        self._phase_peak = now
        self.sampled_peak = max(self.sampled_peak, peak)
        return peak, peak

    def allocator_now(self) -> tuple[int, int]:
        if self.device == "cuda":
            import torch

            return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        now = self.added()
        return now, now


# ----------------------------------------------------------------------------- model


def _cache_dir() -> str:
    return os.environ.get("AUTOFIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "autofit")


def _random_weights_folder(src: ModelSource, dtype: Any, device: str) -> str:
    """A preset saved once with random weights, so that a quantized load has weights to quantize."""
    import hashlib

    from transformers import AutoConfig, AutoModelForCausalLM

    digest = hashlib.sha1(json.dumps(src.config, sort_keys=True).encode()).hexdigest()[:10]
    folder = os.path.join(_cache_dir(), "weights", f"{src.name}-{digest}-{str(dtype).split('.')[-1]}")
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    cfg = AutoConfig.for_model(**src.config)
    import torch

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(folder))
    model.save_pretrained(tmp)
    del model
    try:
        os.rename(tmp, folder)
    except OSError:  # another probe saved it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    if device == "cuda":
        torch.cuda.empty_cache()
    return folder


def weights_path(cfg: TrialConfig, src: ModelSource, device: str) -> str:
    """Where from_pretrained reads weights: the source, or saved random weights for a quantized preset."""
    if cfg.quantization == "none" or not src.random_weights:
        return src.ref
    import torch

    return _random_weights_folder(src, getattr(torch, recipe.weights_dtype(cfg)), device)


def build_model(cfg: TrialConfig, src: ModelSource, device: str, path: str) -> Any:
    """The base model, on `device`, in the config's dtype and quantization."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    dtype = getattr(torch, recipe.weights_dtype(cfg))
    quant = recipe.quantization_arguments(cfg)
    if quant is not None:
        quant = dict(quant)
        if "bnb_4bit_compute_dtype" in quant:
            quant["bnb_4bit_compute_dtype"] = getattr(torch, quant["bnb_4bit_compute_dtype"])
        return AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=cfg.attn_implementation,
            quantization_config=BitsAndBytesConfig(**quant), device_map={"": 0 if device == "cuda" else "cpu"},
        )
    if src.random_weights:
        config = AutoConfig.for_model(**src.config)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation=cfg.attn_implementation
            )
    return AutoModelForCausalLM.from_pretrained(
        src.ref, dtype=dtype, attn_implementation=cfg.attn_implementation,
        device_map={"": 0 if device == "cuda" else "cpu"},
    )


def decoder_layers(model: Any) -> list[Any]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def checkpointed_layers(model: Any) -> list[int]:
    return [i for i, m in enumerate(decoder_layers(model)) if getattr(m, "gradient_checkpointing", False)]


def expected_checkpointed(cfg: TrialConfig, n_layers: int) -> list[int]:
    every = cfg.checkpoint_every
    return [i for i in range(n_layers) if every and i % every == 0]


class RandomTokens:
    """`n` sequences of `length` random token ids: every sequence at max_length, no padding."""

    def __init__(self, n: int, length: int, vocab: int, seed: int = 0) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        ids = self.ids[i]
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


# ----------------------------------------------------------------------------- timing


def make_callback(mem: Memory, cfg: TrialConfig, sync: Any) -> Any:
    from transformers import TrainerCallback

    class ProbeCallback(TrainerCallback):
        """Times optimizer steps, micro-steps and the optimizer; records per-phase peaks."""

        def __init__(self) -> None:
            self.steps: list[dict[str, Any]] = []
            self.phase_peaks = {"forward": 0, "backward": 0, "optimizer": 0}
            self.max_allocated = 0
            self.max_reserved = 0
            self.losses: list[float] = []
            self.skipped_steps = 0
            self.checkpointed: list[int] | None = None
            self.trainer: Any = None
            self._t0 = self._opt0 = self._opt = 0.0
            self._step_reserved = 0

        def note(self, phase: str) -> None:
            alloc, reserved = mem.phase()
            self.phase_peaks[phase] = max(self.phase_peaks[phase], alloc)
            self.max_allocated = max(self.max_allocated, alloc)
            self.max_reserved = max(self.max_reserved, reserved)
            self._step_reserved = max(self._step_reserved, reserved)
            if mem.over_limit:
                raise MemoryLimitExceeded(
                    f"autofit: memory limit exceeded: the CPU probe added {mem.sampled_peak} bytes "
                    f"over its baseline, above the {mem.limit}-byte limit"
                )

        def forward_hook(self, module: Any, args: Any, output: Any) -> None:
            loss = getattr(output, "loss", None)
            if loss is not None:
                self.losses.append(float(loss.detach().float()))
            self.note("forward")

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            self.checkpointed = checkpointed_layers(model)

        def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            if model is not None and not model.training:
                raise RuntimeError("autofit: the model is in eval mode during training")
            sync()
            self._t0 = time.perf_counter()
            self._step_reserved = 0

        # Micro-steps are not synchronised one by one: that would stop the CPU from queueing the
        # next micro-step while the GPU works, and measure a slower loop than the real one. The
        # clock is read (after synchronize) only around the optimizer step.
        def on_substep_end(self, *a: Any, **kw: Any) -> None:
            self.note("backward")

        def on_pre_optimizer_step(self, *a: Any, **kw: Any) -> None:
            self.note("backward")
            sync()
            self._opt0 = time.perf_counter()

        def on_optimizer_step(self, *a: Any, **kw: Any) -> None:
            sync()
            self._opt = time.perf_counter() - self._opt0
            self.note("optimizer")

        def on_step_end(self, args: Any, *a: Any, **kw: Any) -> None:
            sync()
            acc = getattr(self.trainer, "accelerator", None)
            if acc is not None and getattr(acc, "optimizer_step_was_skipped", False):
                self.skipped_steps += 1
            micro = (self._opt0 - self._t0) / args.gradient_accumulation_steps
            self.steps.append({"seconds": time.perf_counter() - self._t0, "micro": micro,
                               "optimizer": self._opt, "reserved": self._step_reserved})

    return ProbeCallback()


# ----------------------------------------------------------------------------- the probe


def run_probe(req: dict[str, Any], partial: dict[str, Any]) -> ProbeResult:
    """Run the probe a request describes. `partial` collects figures as they come, for failures."""
    cfg = TrialConfig.from_dict(req["config"])
    src = ModelSource.from_dict(req["model"])
    device = req["device"]
    limit = req.get("memory_limit_bytes")
    warmup, timed = int(req.get("warmup_steps", 2)), int(req.get("timed_steps", 5))
    probe_ga = min(cfg.gradient_accumulation_steps, int(req.get("max_probe_accumulation") or 10**9))
    os.environ.update(recipe.allocator_env(cfg))
    t_start = time.perf_counter()

    import torch

    mem = Memory(device, req.get("nvml_index"), limit if device == "cpu" else None)
    partial["mem"] = mem

    def runaway(now: int) -> None:
        res = ProbeResult(Outcome.OOM, cfg.to_dict(), peak_memory_bytes=now,
                          oom_shortfall_bytes=now - (limit or 0),
                          reason="autofit: memory limit exceeded: stopped far past the CPU limit")
        res = judge_limit(res, limit, float(req.get("headroom", 0.05)))
        res.device, res.model = req["device_label"], src.ref
        write_json_atomic(req["result_path"], res.to_dict())
        os._exit(0)

    mem.runaway = runaway
    if device == "cuda":
        if not torch.cuda.is_available():
            raise Unsupported("CUDA was asked for but torch sees no GPU")
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # create the context now, so it is measured as overhead
        if cfg.precision == "bf16" and not torch.cuda.is_bf16_supported():
            raise Unsupported(f"bf16 is not supported on {torch.cuda.get_device_name()}")
        if limit:
            # The cap covers the PyTorch allocator only: take off what lives outside it (the
            # CUDA context now; cuBLAS/NCCL handles are counted in the peak afterwards).
            total = torch.cuda.get_device_properties(0).total_memory
            outside = max(mem.added() - torch.cuda.memory_reserved(), 0)
            torch.cuda.set_per_process_memory_fraction(max(limit - outside, 1) / total)
            partial["outside_at_start"] = outside
        torch.cuda.reset_peak_memory_stats()
        sync = torch.cuda.synchronize
    else:
        if cfg.precision == "fp16":
            raise Unsupported("fp16 mixed precision needs a GPU (Trainer refuses it on the CPU)")
        mem.baseline = mem._raw()
        sync = lambda: None  # noqa: E731

    # Random weights for a quantized preset are saved once, before anything is measured.
    path = weights_path(cfg, src, device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    mem.start()
    torch.manual_seed(0)
    model = build_model(cfg, src, device, path)
    model.config.use_cache = False
    kbit = recipe.kbit_preparation(cfg)
    lora = recipe.lora_arguments(cfg)
    if kbit is not None:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, **kbit)
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**lora))
    partial["memory_after_load"] = mem.allocator_now()[1]
    mem.phase()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total_params = sum(p.numel() for p in model.parameters())
    n_layers = len(decoder_layers(model))

    from transformers import Trainer, TrainingArguments

    steps = warmup + timed
    data = RandomTokens(steps * probe_ga * cfg.micro_batch_size, cfg.max_length,
                        int(src.config.get("vocab_size", 32000)))
    cb = make_callback(mem, cfg, sync)
    partial["callback"] = cb
    hook = model.register_forward_hook(cb.forward_hook)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, logging_steps=1, disable_tqdm=True,
            **recipe.training_arguments(cfg, on_cpu=device == "cpu", max_steps=steps,
                                        gradient_accumulation_steps=probe_ga),
        )
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])
        cb.trainer = trainer
        trainer.train()
    hook.remove()
    sync()
    train_seconds = time.perf_counter() - t_start
    mem.stop()

    expected = expected_checkpointed(cfg, n_layers)
    if cb.checkpointed != expected:
        raise RuntimeError(
            f"autofit: checkpointing is on layers {cb.checkpointed}, but the config asks for {expected}"
        )

    # Speed: the timed optimizer steps, extended to the config's accumulation where the probe
    # ran fewer micro-steps (each extra micro-step costs the mean micro-step of its step:
    # the time from the step's start to its optimizer call over the micro-steps it ran).
    timed_steps = cb.steps[warmup:]
    tokens_per_step = cfg.effective_batch * cfg.max_length
    extra = cfg.gradient_accumulation_steps - probe_ga
    real = [s["seconds"] + extra * s["micro"] for s in timed_steps]
    tps = [tokens_per_step / t for t in real]
    micro_all = [s["micro"] for s in timed_steps]

    # Memory: the allocator's reserved peak plus what lives outside it (context, cuBLAS
    # workspaces, bitsandbytes paged memory), or NVML's sampled peak if that is higher.
    if device == "cuda":
        _, reserved_now = mem.allocator_now()
        used_now = mem.process_used()
        outside = max((used_now if used_now is not None else mem.added()) - reserved_now, 0)
        peak = max(cb.max_reserved + outside, mem.sampled_peak)
        retries = int(torch.cuda.memory_stats().get("num_alloc_retries", 0))
    else:
        outside, retries = 0, None
        peak = max(mem.sampled_peak, cb.max_reserved)
    growth = 0
    if len(timed_steps) >= 2:
        growth = max(0, timed_steps[-1]["reserved"] - timed_steps[0]["reserved"])

    res = ProbeResult(
        outcome=Outcome.FIT,
        config=cfg.to_dict(),
        tokens_per_s=statistics.median(tps),
        tokens_per_s_min=min(tps),
        tokens_per_s_max=max(tps),
        peak_memory_bytes=int(peak),
        max_memory_allocated=int(cb.max_allocated),
        max_memory_reserved=int(cb.max_reserved),
        memory_outside_allocator=int(outside),
        memory_after_load=int(partial["memory_after_load"]),
        phase_peaks={k: int(v) for k, v in cb.phase_peaks.items()},
        num_alloc_retries=retries,
        memory_growth_bytes=int(growth),
        step_times=[round(t, 5) for t in real],
        micro_step_s=statistics.median(micro_all) if micro_all else None,
        optimizer_step_s=statistics.median(s["optimizer"] for s in timed_steps),
        probe_accumulation=probe_ga,
        checkpointed_layers=cb.checkpointed,
        n_layers=n_layers,
        trainable_params=int(trainable),
        total_params=int(total_params),
        loss=cb.losses[-1] if cb.losses else None,
        train_seconds=train_seconds,
    )
    if growth > max(64 * 2**20, 0.01 * peak):
        res.reason = f"peak reserved memory grew by {growth} bytes over the timed steps"
    bad = sum(1 for x in cb.losses if not math.isfinite(x))
    if cb.losses and bad * 2 > len(cb.losses):
        res.outcome, res.reason = Outcome.UNSTABLE, f"non-finite loss on {bad} of {len(cb.losses)} micro-steps"
    elif cb.skipped_steps * 2 > steps:
        res.outcome, res.reason = Outcome.UNSTABLE, f"fp16 loss scaler skipped {cb.skipped_steps} of {steps} steps"
    return res


def judge_limit(res: ProbeResult, limit: int | None, headroom: float) -> ProbeResult:
    """A probe whose peak falls inside the headroom below the limit does not fit."""
    res.memory_limit_bytes = limit
    if not limit or res.peak_memory_bytes is None:
        return res
    res.headroom_bytes = int(limit * headroom)
    usable = limit - res.headroom_bytes
    if res.outcome is Outcome.FIT and res.peak_memory_bytes > usable:
        over_limit = res.peak_memory_bytes > limit
        res.outcome = Outcome.OOM
        res.oom_shortfall_bytes = res.peak_memory_bytes - usable
        res.reason = ("limit: peak above the memory limit" if over_limit else
                      f"headroom: peak inside the {headroom:.0%} headroom below the limit")
    return res


def failure_result(req: dict[str, Any], exc: BaseException, partial: dict[str, Any]) -> ProbeResult:
    """Turn what the probe raised into an outcome, keeping the figures measured so far."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    text = f"{type(exc).__module__}.{type(exc).__name__}: {exc}\n{tb}"
    outcome = classify_text(text) or Outcome.CRASH
    if isinstance(exc, MemoryError):
        outcome = Outcome.HOST_OOM
    if isinstance(exc, Unsupported):
        outcome = Outcome.UNSUPPORTED
    res = ProbeResult(outcome=outcome, config=req["config"], error_tail=tb[-4000:],
                      reason=str(exc).strip().splitlines()[0][:500] if str(exc).strip() else type(exc).__name__)
    mem: Memory | None = partial.get("mem")
    cb = partial.get("callback")
    if mem is not None:
        mem.stop()
        if outcome is Outcome.OOM and mem.device == "cuda":
            import torch

            reserved = max(torch.cuda.max_memory_reserved(), getattr(cb, "max_reserved", 0))
            res.max_memory_reserved = int(reserved)
            res.peak_memory_bytes = int(reserved + partial.get("outside_at_start", 0))
            short = oom_shortfall(text)
            res.oom_shortfall_bytes = short
        elif outcome is Outcome.OOM:  # the CPU limit
            res.peak_memory_bytes = int(mem.sampled_peak)
            if mem.limit:
                res.oom_shortfall_bytes = max(int(mem.sampled_peak - mem.limit), 0)
    if "memory_after_load" in partial:
        res.memory_after_load = int(partial["memory_after_load"])
    return res


def handle(req: dict[str, Any]) -> ProbeResult:
    partial: dict[str, Any] = {}
    try:
        res = run_probe(req, partial)
    except BaseException as exc:  # every failure becomes an outcome; the runner judges the rest
        if isinstance(exc, KeyboardInterrupt):
            raise
        res = failure_result(req, exc, partial)
    res = judge_limit(res, req.get("memory_limit_bytes"), float(req.get("headroom", 0.05)))
    res.device = req["device_label"]
    res.model = req["model"]["ref"]
    res.versions = package_versions()
    return res


def write_json_atomic(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def standby() -> int:
    """Import, announce readiness, serve one request."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything the libraries print goes to the log, not the protocol pipe
    import torch  # noqa: F401  the expensive part, done before a request arrives
    import transformers  # noqa: F401
    import peft  # noqa: F401
    from transformers import Trainer, TrainingArguments  # noqa: F401

    proto.write(READY + "\n")
    proto.flush()
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    req = json.loads(line)
    print(f"autofit probe: {json.dumps(req['config'])}", file=sys.stderr, flush=True)
    res = handle(req)
    write_json_atomic(req["result_path"], res.to_dict())
    print(f"autofit probe: {res.outcome.value} {res.reason}", file=sys.stderr, flush=True)
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: the result is written, the runner is waiting


if __name__ == "__main__":
    if sys.argv[1:] != ["--standby"]:
        print("usage: python -m autofit.probe --standby (started by the runner)", file=sys.stderr)
        sys.exit(2)
    sys.exit(standby())
