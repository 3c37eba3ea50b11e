"""`TrialConfig`: one fine-tuning configuration, every setting explicit.

The keys are data (`KEYS`): their type, default, allowed values, help and whether
they change what is learned. `autofit probe --set KEY=VALUE`, the search spaces
and the exporters all read them from here.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autofit.core.errors import UsageError

PRECISIONS = ("bf16", "fp16", "fp32")
QUANTIZATIONS = ("none", "8bit", "nf4")
METHODS = ("lora", "full")
ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
BATCHINGS = ("pad_max", "pad_longest", "group_by_length", "padding_free", "packed")
"""How samples become micro-batches (`autofit.data.Batching`; a test checks they agree). Other than
pad_max only with `--dataset`: random tokens have no lengths to batch by."""
# TrainingArguments `optim` names autofit knows how to measure. A test checks each one
# against transformers' `OptimizerNames`, so a rename there fails the suite, not a user.
OPTIMIZERS = (
    "adamw_torch",
    "adamw_torch_fused",
    "adamw_8bit",
    "paged_adamw_8bit",
    "paged_adamw_32bit",
    "adamw_bnb_8bit",
    "adafactor",
    "sgd",
    "lion_8bit",
    "paged_lion_8bit",
)
ENGINES = ("none", "fsdp2", "zero2", "zero3")
"""How a probe spanning several GPUs (`gpus`) splits the work: none (plain data parallel, DDP, one
whole replica per GPU), fsdp2 (PyTorch FSDP2 through Trainer's fsdp_config), zero2 / zero3
(DeepSpeed ZeRO stage 2 / 3 through a generated DeepSpeed JSON, where deepspeed is installed)."""
CPU_OFFLOADS = ("off", "optimizer", "all")
"""What the engine keeps in host memory: the optimizer state (ZeRO), or parameters, gradients and
optimizer state (FSDP2's CPUOffloadPolicy, ZeRO-3's offload_param)."""
OFFLOADS_BY_ENGINE = {"none": ("off",), "fsdp2": ("off", "all"), "zero2": ("off", "optimizer"),
                      "zero3": ("off", "optimizer", "all")}
_CKPT_RE = re.compile(r"^(off|on|every_([1-9][0-9]*))(\+offload)?$")


def parse_checkpointing(value: str) -> tuple[int, bool]:
    """`off` -> (0, False); `on` -> (1, False); `every_2+offload` -> (2, True).

    The first number is transformers' `every_n_layers` (0 = checkpointing off).
    """
    m = _CKPT_RE.match(value)
    if not m or value == "off+offload":
        raise ValueError(value)
    if m.group(1) == "off":
        return 0, False
    every = int(m.group(2)) if m.group(2) else 1
    return every, bool(m.group(3))


def _check_ckpt(value: str) -> bool:
    try:
        parse_checkpointing(value)
        return True
    except ValueError:
        return False


@dataclass(frozen=True)
class Key:
    """One setting of a TrialConfig."""

    name: str
    type: type
    help: str
    allowed: tuple[Any, ...] | None = None
    check: Callable[[Any], bool] | None = None
    expected: str = ""
    changes_learning: bool = False
    """True where the value changes what is learned (truncation, quantization, ...)."""

    @property
    def default(self) -> Any:
        """TrialConfig's field default: each default is stated once, there."""
        return _DEFAULTS[self.name]

    def parse(self, text: str) -> Any:
        """A `--set` string to a value of this key's type (no range check)."""
        if self.type is bool:
            low = text.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if self.type is int:
            return int(text)
        return text.strip()

    def problem(self, value: Any) -> str | None:
        """A message if `value` is not allowed for this key, else None."""
        want = self.expected or (
            "one of " + ", ".join(map(str, self.allowed)) if self.allowed else self.type.__name__
        )
        ok = isinstance(value, self.type) and not (self.type is int and isinstance(value, bool))
        if ok and self.allowed is not None:
            ok = value in self.allowed
        if ok and self.check is not None:
            ok = self.check(value)
        return None if ok else f"{self.name}={value!r} is not allowed; expected {want}"


def _positive(v: int) -> bool:
    return v >= 1


ALL_LINEAR = "all-linear"
"""lora_targets for every linear layer but the output head (peft's own spelling)."""


@dataclass(frozen=True)
class TrialConfig:
    """One fine-tuning configuration. Build it with `TrialConfig.from_mapping`."""

    method: str = "lora"
    max_length: int = 2048
    micro_batch_size: int = 1
    global_batch: int = 16
    precision: str = "bf16"
    gradient_checkpointing: str = "off"
    quantization: str = "none"
    optimizer: str = "adamw_torch_fused"
    attn_implementation: str = "sdpa"
    liger: bool = False
    torch_compile: bool = False
    expandable_segments: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_targets: str = "q_proj,v_proj"
    lora_dropout: str = "0.0"
    batching: str = "pad_max"
    gpus: int = 1
    engine: str = "none"
    reshard_after_forward: bool = True
    cpu_offload: str = "off"

    def __post_init__(self) -> None:
        problems = [p for k in KEYS.values() if (p := k.problem(getattr(self, k.name)))]
        problems += self._engine_problems() if not problems else []
        if self.quantization != "none" and self.method == "full":
            problems.append(
                f"quantization={self.quantization} needs method=lora: a quantized base cannot be "
                "fully fine-tuned; set quantization=none or method=lora"
            )
        if problems:
            raise UsageError(problems)

    def _engine_problems(self) -> list[str]:
        """The distributed settings' rules (each combination the engines cannot run)."""
        out = []
        if self.cpu_offload not in OFFLOADS_BY_ENGINE[self.engine]:
            out.append(f"cpu_offload={self.cpu_offload} is not available with engine={self.engine} (it allows "
                       f"{', '.join(OFFLOADS_BY_ENGINE[self.engine])})")
        if not self.reshard_after_forward and self.engine != "fsdp2":
            out.append("reshard_after_forward=off is an FSDP2 setting; it needs engine=fsdp2")
        if self.engine == "fsdp2" and self.gradient_checkpointing not in ("off", "on"):
            out.append(f"gradient_checkpointing={self.gradient_checkpointing} with engine=fsdp2: FSDP's own "
                       "activation_checkpointing wraps every layer; use off or on")
        if self.engine in ("zero2", "zero3") and self.cpu_offload != "off" and not self.optimizer.startswith("adamw"):
            out.append(f"optimizer={self.optimizer} with engine={self.engine} and cpu_offload={self.cpu_offload}: "
                       "ZeRO-Offload steps DeepSpeed's own CPU AdamW; use an adamw optimizer or cpu_offload=off")
        if self.engine != "none" and self.quantization != "none":
            out.append(f"quantization={self.quantization} with engine={self.engine}: a quantized base is not "
                       "sharded by autofit; use engine=none (plain data parallel) or quantization=none")
        return out

    @classmethod
    def from_mapping(cls, values: dict[str, Any], source: str = "--set") -> TrialConfig:
        """Build from typed or string values, collecting every problem into one UsageError."""
        problems: list[str] = []
        typed: dict[str, Any] = {}
        for name, value in values.items():
            key = KEYS.get(name)
            if key is None:
                problems.append(
                    f"{source}: unknown key {name!r}; known keys: {', '.join(KEYS)}"
                )
                continue
            if isinstance(value, str) and key.type is not str:
                try:
                    value = key.parse(value)
                except ValueError:
                    problems.append(f"{source}: {key.problem(value)}")
                    continue
            if isinstance(value, float) and key.name == "lora_dropout":
                value = repr(value)
            typed[name] = value
        try:
            cfg = cls(**typed)
        except UsageError as e:
            problems += [f"{source}: {p}" for p in e.problems]
        if problems:
            raise UsageError(problems)
        return cfg

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-steps per optimizer step on each GPU: the global batch is kept across the `gpus` ranks."""
        return math.ceil(self.global_batch / (self.micro_batch_size * self.gpus))

    @property
    def micro_step_sequences(self) -> int:
        """Sequences one micro-step trains over every rank: more than `global_batch` trains more per
        optimizer step than asked, so such a micro-batch is never a candidate (`Space.allowed`)."""
        return self.micro_batch_size * self.gpus

    @property
    def lora_modules(self) -> list[str] | str:
        """peft's `target_modules`: the names listed, or its "all-linear" (every linear layer but the head)."""
        return ALL_LINEAR if self.lora_targets == ALL_LINEAR else self.lora_targets.split(",")

    @property
    def effective_batch(self) -> int:
        """Sequences per optimizer step actually trained, over every rank (>= global_batch)."""
        return self.gradient_accumulation_steps * self.micro_batch_size * self.gpus

    @property
    def rank_batch(self) -> int:
        """Sequences per optimizer step on one rank (its share of `effective_batch`)."""
        return self.gradient_accumulation_steps * self.micro_batch_size

    @property
    def checkpoint_every(self) -> int:
        return parse_checkpointing(self.gradient_checkpointing)[0]

    @property
    def checkpoint_offload(self) -> bool:
        return parse_checkpointing(self.gradient_checkpointing)[1]

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch_size * self.max_length

    def differing_keys(self, other: TrialConfig) -> set[str]:
        """The keys (not the derived figures) in which two configs differ."""
        return {f.name for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)}

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["gradient_accumulation_steps"] = self.gradient_accumulation_steps
        d["effective_batch"] = self.effective_batch
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrialConfig:
        return cls(**{k: v for k, v in d.items() if k in KEYS})

    def key(self) -> str:
        """A stable identity: two configs with the same key are the same measurement.

        Keys added after runs were stored (`LATE_KEYS`) are left out at their default, so a
        config of an older study keeps its key and a resumed study still finds it."""
        return ";".join(f"{k}={getattr(self, k)}" for k in KEYS
                        if not (k in LATE_KEYS and getattr(self, k) == KEYS[k].default))

    def replace(self, **changes: Any) -> TrialConfig:
        return dataclasses.replace(self, **changes)


_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(TrialConfig)}

KEYS: dict[str, Key] = {
    k.name: k
    for k in [
        Key("method", str, "lora (adapters on a frozen base) or full fine-tuning", METHODS),
        Key("max_length", int, "tokens per sequence; every probed sequence is this long",
            check=lambda v: v >= 8, expected="an integer >= 8", changes_learning=True),
        Key("micro_batch_size", int, "sequences per forward/backward pass",
            check=_positive, expected="an integer >= 1"),
        Key("global_batch", int,
            "samples per optimizer step, as in Trainer; accumulation = ceil(global_batch / micro_batch_size), "
            "or for packed rows the data's samples per micro-batch into it (a step more than 10% off it is "
            "marked as changing what is learned)",
            check=_positive, expected="an integer >= 1"),
        Key("precision", str, "bf16, fp16 (with loss scaling) or fp32", PRECISIONS,
            changes_learning=True),
        Key("gradient_checkpointing", str,
            "off | on (every layer) | every_N (every N-th layer), optionally +offload "
            "(saved activations in host memory)", check=_check_ckpt,
            expected="off, on, every_N or on+offload / every_N+offload (for example every_2)"),
        Key("quantization", str, "base weights: none, 8bit (LLM.int8) or nf4 (QLoRA)",
            QUANTIZATIONS, changes_learning=True),
        Key("optimizer", str, "TrainingArguments `optim` name", OPTIMIZERS,
            changes_learning=True),
        Key("attn_implementation", str,
            "attention kernel: sdpa, eager, flex_attention (compiled; GPU only for training), "
            "flash_attention_2/3 (where flash-attn is installed); others are `unsupported` here", ATTENTION),
        Key("liger", bool,
            "Liger Triton kernels: RMSNorm, RoPE, SwiGLU and the fused linear cross-entropy (the logits "
            "are never held in memory); GPU with triton and liger-kernel>=0.8.5; checked against stock kernels"),
        Key("torch_compile", bool,
            "torch.compile (inductor) of each decoder block (regional: the loss stays eager); compile time is "
            "measured apart and amortised over --train-tokens (or --train-steps); checked against stock kernels"),
        Key("expandable_segments", bool,
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less fragmentation)"),
        Key("lora_r", int, "LoRA rank (higher: more capacity, more memory)", check=_positive,
            expected="an integer >= 1"),
        Key("lora_alpha", int, "LoRA scaling numerator", check=_positive,
            expected="an integer >= 1"),
        Key("lora_targets", str, "comma-separated module names for adapters, or all-linear (peft's: every "
            "linear layer but the output head)",
            check=lambda v: v == ALL_LINEAR or bool(re.fullmatch(r"[A-Za-z0-9_.]+(,[A-Za-z0-9_.]+)*", v)),
            expected="comma-separated module names such as q_proj,v_proj, or all-linear"),
        Key("lora_dropout", str, "dropout on the adapter input",
            check=lambda v: re.fullmatch(r"0(\.[0-9]+)?", v) is not None,
            expected="a number in [0, 1) such as 0.05"),
        Key("batching", str, "with --dataset: pad_max, pad_longest, group_by_length (sample order grouped "
            "by length), padding_free (the micro-batch's samples flattened into one row) or packed (best-fit "
            "decreasing rows of max_length, boundaries kept)", BATCHINGS),
        Key("gpus", int, "GPUs one probe spans (ranks launched with torchrun; on --device cpu: processes "
            "with the gloo backend); the global batch is kept: accumulation = ceil(global_batch / "
            "(micro_batch_size x gpus))", check=_positive, expected="an integer >= 1"),
        Key("engine", str, "with gpus > 1: none (plain data parallel), fsdp2 (Trainer fsdp_config, "
            "fsdp_version 2), zero2 or zero3 (DeepSpeed ZeRO, where deepspeed is installed)", ENGINES),
        Key("reshard_after_forward", bool, "engine=fsdp2: free each layer's gathered parameters after its "
            "forward (off: keep them to the backward, more memory, fewer all-gathers)"),
        Key("cpu_offload", str, "engine state in host memory: off, optimizer (ZeRO) or all (parameters, "
            "gradients and optimizer: FSDP2's CPUOffloadPolicy, ZeRO-3 offload_param)", CPU_OFFLOADS),
    ]
}

LATE_KEYS = frozenset({"liger", "torch_compile", "batching", "gpus", "engine", "reshard_after_forward",
                       "cpu_offload"})
"""Keys added after studies were stored: `TrialConfig.key()` omits them at their default."""


def parse_sets(pairs: list[str]) -> dict[str, str]:
    """`["precision=bf16", ...]` -> dict; malformed pairs are usage errors."""
    out: dict[str, str] = {}
    bad = [p for p in pairs if "=" not in p]
    if bad:
        raise UsageError(
            [f"--set: {p!r} is not KEY=VALUE; for example --set micro_batch_size=2" for p in bad]
        )
    twice = []
    for p in pairs:
        k, v = p.split("=", 1)
        if k.strip() in out and out[k.strip()] != v:
            twice.append(f"--set: {k.strip()} is given twice ({out[k.strip()]} and {v}); give it once.")
        out[k.strip()] = v
    if twice:
        raise UsageError(twice)
    return out
