"""`TrialConfig`: one fine-tuning configuration, every setting explicit, each declared once.

A dimension is a field of `TrialConfig` declared with `dim(...)` (a `Dimension`): its type, default, allowed
values and help, whether it changes what is learned, whether it came after studies were stored, how it moves
memory and speed, which correctness keys and cost classes it enters, its label in the live table. Everything
that lists the keys (`--set` and the search spaces, `TrialConfig.key()`, the report, the live table, the gate
and loss-check keys, the probe-time estimate, the speed effects, the memory groups, `--help`, the docs' key
table) derives it from `KEYS`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

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
TRAINERS = ("sft", "dpo")
"""What a probe trains: supervised fine-tuning (transformers Trainer on sequences) or preference tuning (TRL's
DPOTrainer on pairs of a prompt with a chosen and a rejected completion)."""
DPO_REFERENCES = ("shared", "copy")
"""Where DPO's reference log-probabilities come from: `shared`, no second copy of the weights (LoRA: the base
with the adapter disabled, TRL's default for a PEFT model; full fine-tuning: the policy before training, which
only precomputed log-probabilities allow), or `copy`, a separate reference model held beside the policy."""
DPO_BATCHINGS = ("pad_max", "pad_longest")
"""The batchings TRL 1.16's DPOTrainer runs: its DataCollatorForPreference pads chosen and rejected rows to the
longest of the micro-batch (`pad_longest`; `pad_max`: padded to max_length with pad_to_multiple_of). Its
`padding_free=True` warns and falls back to padding since TRL's DPO refactor, and it packs nothing."""
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


class Memory(enum.Enum):
    """How a dimension moves the peak (the memory model reads it)."""

    TOKENS = "tokens"
    """Through the tokens of a micro-batch: the fitted groups are affine in them."""
    MODELED = "modeled"
    """The prior's terms say what each value costs (weights, adapter, optimizer state, activations, ...)."""
    ALLOCATOR = "allocator"
    """The allocator's fragmentation, not the peak's terms: a saving of at most the reserved-but-unallocated
    memory."""
    NONE = "none"
    """No effect on the peak (accumulation, a scale factor)."""
    UNMODELED = "unmodeled"
    """Moves the peak in a way the prior does not model: each value is its own group, never pruned by a
    shortfall."""


Value = str | int | bool
"""A dimension's value: every TrialConfig field is a str, an int or a bool."""
V = TypeVar("V", str, int, bool)

Label = Callable[["TrialConfig"], "str | None"]
"""A dimension's short label for the live table and the probe lines, from the whole config (None: not
shown)."""


@dataclass(frozen=True)
class Dimension:
    """One setting of a TrialConfig, declared once: everything else (`--set` parsing and its errors, the
    stored key, the report's marks, the live table, the kernel gate's and the loss check's keys, the probe
    cost classes, the declared speed effects, the memory model's groups, `--help`, the docs' key table)
    reads it from here."""

    name: str
    type: type
    help: str
    allowed: tuple[Value, ...] | None = None
    check: Callable[[Any], bool] | None = None
    """Whether a value is allowed (each dimension's check takes a value of its own type)."""
    expected: str = ""
    learning: bool = False
    """A value other than the default changes what is learned (truncation, quantization, ...): the report
    says so beside such a winner (`changes_learning_at`)."""
    learns_as_default: tuple[Value, ...] = ()
    """Other values that train as the default does (adamw_torch: the fused optimizer's update, unfused)."""
    late: bool = False
    """Added after studies were stored: `TrialConfig.key()` leaves it out at its default, so an older study's
    configs keep their keys and `--resume` finds them."""
    memory: Memory = Memory.MODELED
    relief: Callable[[Any], float] | None = None
    """An allocator dimension: how much of the reserved-but-unallocated memory a value hands back, relatively
    (higher: more). A change to more relief can save at most that memory against an out-of-memory probe."""
    speed: Mapping[Value, float] | None = None
    """Declared relative tokens/s of each value against the first, the rest of the config equal (rough, from
    H200 measurements; only for choosing what to probe next: a measured fit replaces it). None: neutral."""
    gate: int = 0
    """Its place in the kernel gate's key (`config.kernels.gate_key`; 0: not in it): it changes the numbers a
    kernel computes. The places keep the keys that studies stored."""
    stock: tuple[Value, ...] | None = None
    """A kernel dimension's stock values: any other value must pass the correctness gate before it can win."""
    boundary: int = 0
    """Its place in the per-sample loss check's key (`data.correctness.boundary_key`; 0: not in it)."""
    cost: bool = False
    """Enters the probe-time estimate's cost class (a quantized load, a compile, recomputation)."""
    fixed_cost: bool = False
    """A value other than the default pays a one-off cost per probe (a quantized load, a compile, kernel
    builds)."""
    label: Label | None = None
    label_at: int = 0
    """Its place in the live table's line (`brief`)."""
    training_argument: str | None = None
    """The TrainingArguments field the value maps to (None: the recipe maps it in code). The probe and the
    Python recipes pass it where the value is not the default, and so do the YAML formats in `kept_by`."""
    argument: Callable[[Any], Any] | None = None
    """The value as `training_argument` takes it (None: as it is)."""
    kept_by: tuple[str, ...] = ("hf-trainer", "trl", "llama-factory")
    """The export formats that take `training_argument` by its name (LLaMA-Factory reads TrainingArguments'
    fields); the others list the value as not kept."""
    default: Value | None = None
    """TrialConfig's field default (filled in from the field)."""

    def parse(self, text: str) -> Value:
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

    def problem(self, value: object) -> str | None:
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

    @property
    def changes_learning(self) -> bool:
        """Some value of this key changes what is learned (the key table's column)."""
        return self.learning

    def changes_learning_at(self, value: Value, reference: Value | None = None) -> bool:
        """Whether `value` trains otherwise than `reference` (default: the key's default; for max_length the
        report passes the longest length the space allows, the user's own)."""
        ref = self.default if reference is None else reference
        return self.learning and value != ref and value not in self.learns_as_default



def dim(default: V, help: str, **declared: object) -> V:  # noqa: A002 - the field's help text
    """A TrialConfig field and its declaration (`Dimension`), in the style of a documented dataclass field."""
    return field(default=default, metadata={"dimension": (help, declared)})


def _positive(v: int) -> bool:
    return v >= 1


def _engaged(cfg: TrialConfig) -> bool:
    """A probe that spans several GPUs or runs an engine: its distributed settings are shown."""
    return cfg.gpus > 1 or cfg.engine != "none"


ALL_LINEAR = "all-linear"
"""lora_targets for every linear layer but the output head (peft's own spelling)."""


@dataclass(frozen=True)
class TrialConfig:
    """One fine-tuning configuration, every setting explicit. Build it with `TrialConfig.from_mapping`.

    Each field is a dimension, declared once with `dim`: its help, allowed values and what it changes."""

    method: str = dim("lora", "lora (adapters on a frozen base) or full fine-tuning", allowed=METHODS, gate=6,
                      label=lambda c: "full" if c.method == "full" else None, label_at=12)
    max_length: int = dim(2048, "tokens per sequence; every probed sequence is this long",
                          check=lambda v: v >= 8, expected="an integer >= 8", learning=True,
                          memory=Memory.TOKENS, label=lambda c: f"L={c.max_length}", label_at=1)
    micro_batch_size: int = dim(1, "sequences per forward/backward pass", check=_positive,
                                expected="an integer >= 1", memory=Memory.TOKENS,
                                label=lambda c: f"mb={c.micro_batch_size}", label_at=2)
    global_batch: int = dim(
        16, "samples per optimizer step, as in Trainer; accumulation = ceil(global_batch / "
        "micro_batch_size), or for packed rows the data's samples per micro-batch into it (a step more than "
        "10% off it is marked as changing what is learned)", check=_positive, expected="an integer >= 1",
        memory=Memory.NONE, label_at=3,  # packed rows: the accumulation comes from the data (the step's figures)
        label=lambda c: "" if c.batching == "packed" else f"ga={c.gradient_accumulation_steps}")
    precision: str = dim("bf16", "bf16, fp16 (with loss scaling) or fp32", allowed=PRECISIONS, learning=True,
                         speed={"bf16": 1.0, "fp16": 1.0, "fp32": 0.35}, gate=4, boundary=3,
                         label=lambda c: c.precision, label_at=4)
    gradient_checkpointing: str = dim(
        "off", "off | on (every layer) | every_N (every N-th layer), optionally +offload (saved activations "
        "in host memory)", check=_check_ckpt,
        expected="off, on, every_N or on+offload / every_N+offload (for example every_2)",
        # more recomputation is slower: every layer re-runs its forward (~1/3 of a step)
        speed={"off": 1.0, "every_4": 0.93, "every_3": 0.91, "every_2": 0.86, "on": 0.75,
               "every_4+offload": 0.85, "every_2+offload": 0.77, "on+offload": 0.65},
        gate=8, cost=True, label=lambda c: f"ckpt={c.gradient_checkpointing}", label_at=5)
    quantization: str = dim("none", "base weights: none, 8bit (LLM.int8) or nf4 (QLoRA)",
                            allowed=QUANTIZATIONS, learning=True,
                            speed={"none": 1.0, "nf4": 0.8, "8bit": 0.55},  # dequantised per product
                            gate=5, cost=True, fixed_cost=True, label_at=6,
                            label=lambda c: c.quantization if c.quantization != "none" else None)
    optimizer: str = dim("adamw_torch_fused", "TrainingArguments `optim` name", allowed=OPTIMIZERS,
                         learning=True, learns_as_default=("adamw_torch",),
                         speed={"adamw_torch_fused": 1.0, "adamw_torch": 0.99, "paged_adamw_8bit": 0.98,
                                "adamw_8bit": 0.99},
                         label=lambda c: c.optimizer, label_at=7)
    attn_implementation: str = dim(
        "sdpa", "attention kernel: sdpa, eager, flex_attention (compiled; GPU only for training), "
        "flash_attention_2/3 (where flash-attn is installed); others are `unsupported` here",
        allowed=ATTENTION, memory=Memory.UNMODELED,
        speed={"sdpa": 1.0, "eager": 0.8, "flash_attention_2": 1.05, "flash_attention_3": 1.05,
               "flex_attention": 1.0},
        gate=3, stock=("sdpa", "eager"), boundary=2, label_at=8,
        label=lambda c: c.attn_implementation if c.attn_implementation != "sdpa" else None)
    liger: bool = dim(
        False, "Liger Triton kernels: RMSNorm, RoPE, SwiGLU and the fused linear cross-entropy (the logits "
        "are never held in memory); GPU with triton and liger-kernel>=0.8.5; checked against stock kernels",
        late=True, speed={False: 1.0, True: 1.2}, gate=1, stock=(False,), boundary=4, cost=True,
        fixed_cost=True, label=lambda c: "liger" if c.liger else None, label_at=9)
    torch_compile: bool = dim(
        False, "torch.compile (inductor) of each decoder block (regional: the loss stays eager); compile "
        "time is measured apart and amortised over --train-tokens (or --train-steps); checked against stock "
        "kernels",
        late=True, speed={False: 1.0, True: 1.05}, gate=2, stock=(False,), cost=True, fixed_cost=True,
        label=lambda c: "torch_compile" if c.torch_compile else None, label_at=10)
    expandable_segments: bool = dim(
        False, "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less fragmentation)",
        memory=Memory.ALLOCATOR, relief=float,
        speed={False: 1.0, True: 1.0},  # the allocator's segments move memory, not the step's work
        label=lambda c: "expandable" if c.expandable_segments else None, label_at=11)
    lora_r: int = dim(16, "LoRA rank (higher: more capacity, more memory)", check=_positive,
                      expected="an integer >= 1")
    lora_alpha: int = dim(32, "LoRA scaling numerator", check=_positive, expected="an integer >= 1",
                          memory=Memory.NONE)
    lora_targets: str = dim(
        "q_proj,v_proj", "comma-separated module names for adapters, or all-linear (peft's: every linear "
        "layer but the output head)",
        check=lambda v: v == ALL_LINEAR or bool(re.fullmatch(r"[A-Za-z0-9_.]+(,[A-Za-z0-9_.]+)*", v)),
        expected="comma-separated module names such as q_proj,v_proj, or all-linear", gate=7)
    lora_dropout: str = dim("0.0", "dropout on the adapter input",
                            check=lambda v: re.fullmatch(r"0(\.[0-9]+)?", v) is not None,
                            expected="a number in [0, 1) such as 0.05", memory=Memory.UNMODELED)
    batching: str = dim(
        "pad_max", "with --dataset: pad_max, pad_longest, group_by_length (sample order grouped by length), "
        "padding_free (the micro-batch's samples flattened into one row) or packed (best-fit decreasing rows "
        "of max_length, boundaries kept)", allowed=BATCHINGS, late=True, memory=Memory.UNMODELED, boundary=1,
        label=lambda c: c.batching if c.batching != "pad_max" else None, label_at=13)
    gpus: int = dim(
        1, "GPUs one probe spans (ranks launched with torchrun; on --device cpu: processes with the gloo "
        "backend); the global batch is kept: accumulation = ceil(global_batch / (micro_batch_size x gpus))",
        check=_positive, expected="an integer >= 1", late=True,
        # the group's tokens/s grows a little under linearly with the ranks (rough, from the engines'
        # published scaling on one NVLink host; not yet measured by autofit)
        speed={1: 1.0, 2: 1.9, 4: 3.7, 8: 7.2},
        label=lambda c: f"gpus={c.gpus}" if _engaged(c) else None, label_at=14)
    engine: str = dim(
        "none", "with gpus > 1: none (plain data parallel), fsdp2 (Trainer fsdp_config, fsdp_version 2), "
        "zero2 or zero3 (DeepSpeed ZeRO, where deepspeed is installed)", allowed=ENGINES, late=True,
        speed={"none": 1.0, "zero2": 0.95, "fsdp2": 0.92, "zero3": 0.88},  # sharding adds all-gathers
        label=lambda c: c.engine if _engaged(c) else None, label_at=15)
    reshard_after_forward: bool = dim(
        True, "engine=fsdp2: free each layer's gathered parameters after its forward (off: keep them to the "
        "backward, more memory, fewer all-gathers)", late=True, speed={True: 1.0, False: 1.04},
        label=lambda c: "no-reshard" if _engaged(c) and not c.reshard_after_forward else None, label_at=16)
    cpu_offload: str = dim(
        "off", "engine state in host memory: off, optimizer (ZeRO) or all (parameters, gradients and "
        "optimizer: FSDP2's CPUOffloadPolicy, ZeRO-3 offload_param)", allowed=CPU_OFFLOADS, late=True,
        speed={"off": 1.0, "optimizer": 0.6, "all": 0.35},  # the optimizer step (and weights) across PCIe
        label=lambda c: f"offload={c.cpu_offload}" if _engaged(c) and c.cpu_offload != "off" else None,
        label_at=17)

    empty_cache_steps: int = dim(
        0, "hand the allocator's cached memory back every N optimizer steps (TrainingArguments "
        "torch_empty_cache_steps; 0: never): less fragmentation near the limit, up to ~10% slower",
        check=lambda v: v >= 0, expected="an integer >= 0 (0: never)", late=True, memory=Memory.ALLOCATOR,
        relief=lambda v: 1 / v if v else 0.0,  # every step hands back the most
        speed={0: 1.0, 1: 0.9, 2: 0.95, 4: 0.97, 8: 0.99},  # transformers: "~10% slower" when every step
        training_argument="torch_empty_cache_steps", argument=lambda v: v or None,
        kept_by=("hf-trainer", "trl", "llama-factory"),
        label=lambda c: f"empty_cache={c.empty_cache_steps}" if c.empty_cache_steps else None, label_at=18)

    trainer: str = dim(
        "sft", "sft (supervised fine-tuning, transformers Trainer) or dpo (preference tuning on prompt/chosen/"
        "rejected pairs, TRL's DPOTrainer: chosen and rejected in one forward, a reference forward without saved "
        "activations); the workload, fixed by a space, so every config of a search shares it",
        allowed=TRAINERS, late=True, label=lambda c: c.trainer if c.trainer != "sft" else None, label_at=19)
    precompute_ref_log_probs: bool = dim(
        False, "trainer=dpo: the reference log-probabilities computed once over the data before training "
        "(DPOConfig precompute_ref_log_probs): no reference forward in a step, that pass paid before training "
        "(counted for one epoch)", late=True,
        # Slower by itself over one epoch: the pass is the same reference forward moved before training, at
        # TRL's default batch (the micro-batch), where one pair's forward is host-bound, and TRL hashes every
        # weight first. S7 on an H100 at micro-batch 1 (bench/results/dpo-bench-s7.json,
        # dpo-probe-s7-precompute.json): 0.86x the live reference; the pass 0.19 s a pair against ~0.06 s in
        # the step, the hash 54 s. What it buys is memory: a step without the reference's working set, which
        # can let a larger micro-batch fit.
        speed={False: 1.0, True: 0.8}, fixed_cost=True, training_argument="precompute_ref_log_probs",
        kept_by=("trl",), label=lambda c: "precompute_ref" if c.precompute_ref_log_probs else None, label_at=20)
    dpo_reference: str = dim(
        "shared", "trainer=dpo: the reference model: shared (no second copy: LoRA disables the adapter, TRL's "
        "default; full fine-tuning only with precompute_ref_log_probs) or copy (a separate reference model in "
        "memory, as full fine-tuning without precomputed log-probabilities needs)", allowed=DPO_REFERENCES,
        late=True, speed={"shared": 1.0, "copy": 1.0},  # the same reference forward, other weights
        label=lambda c: "ref=copy" if c.dpo_reference == "copy" else None, label_at=21)

    def __post_init__(self) -> None:
        problems = [p for k in KEYS.values() if (p := k.problem(getattr(self, k.name)))]
        problems += self._engine_problems() if not problems else []
        problems += self._trainer_problems() if not problems else []
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
            out.append(f"cpu_offload={self.cpu_offload} is not available with engine={self.engine} (it "
                       f"allows {', '.join(OFFLOADS_BY_ENGINE[self.engine])})")
        if not self.reshard_after_forward and self.engine != "fsdp2":
            out.append("reshard_after_forward=off is an FSDP2 setting; it needs engine=fsdp2")
        if self.engine == "fsdp2" and self.gradient_checkpointing not in ("off", "on"):
            out.append(f"gradient_checkpointing={self.gradient_checkpointing} with engine=fsdp2: FSDP's own "
                       "activation_checkpointing wraps every layer; use off or on")
        zero = self.engine in ("zero2", "zero3")
        if zero and self.cpu_offload != "off" and not self.optimizer.startswith("adamw"):
            out.append(f"optimizer={self.optimizer} with engine={self.engine} and "
                       f"cpu_offload={self.cpu_offload}: ZeRO-Offload steps DeepSpeed's own CPU AdamW; use "
                       "an adamw optimizer or cpu_offload=off")
        if self.engine != "none" and self.quantization != "none":
            out.append(f"quantization={self.quantization} with engine={self.engine}: a quantized base is not "
                       "sharded by autofit; use engine=none (plain data parallel) or quantization=none")
        return out

    def _trainer_problems(self) -> list[str]:
        """The preference-tuning rules: its knobs need trainer=dpo; what TRL's DPOTrainer cannot run."""
        if self.trainer != "dpo":
            return [f"{k}={getattr(self, k)} is a preference-tuning setting; it needs trainer=dpo"
                    for k in ("precompute_ref_log_probs", "dpo_reference") if getattr(self, k) != KEYS[k].default]
        out = []
        if self.batching not in DPO_BATCHINGS:
            out.append(f"batching={self.batching} with trainer=dpo: TRL's DPOTrainer pads each micro-batch's "
                       f"chosen and rejected rows (its padding_free falls back to padding); use "
                       f"{' or '.join(DPO_BATCHINGS)}")
        if self.method == "full" and self.dpo_reference == "shared" and not self.precompute_ref_log_probs:
            out.append("dpo_reference=shared with method=full: a fully fine-tuned policy has no adapter to disable; "
                       "use dpo_reference=copy or precompute_ref_log_probs=true")
        if self.gpus > 1 or self.engine != "none":
            out.append("trainer=dpo is measured on one GPU by autofit; use gpus=1 and engine=none")
        return out

    @property
    def rows_per_item(self) -> int:
        """Sequences one sample puts through the forward: a preference pair is two (prompt + chosen and prompt
        + rejected, concatenated along the batch in one forward by TRL's DPOTrainer)."""
        return 2 if self.trainer == "dpo" else 1

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
        """peft's `target_modules`: the names listed, or its "all-linear" (every linear layer but the
        head)."""
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
        """Tokens of one forward at max_length: a DPO micro-batch of n pairs is 2n rows (chosen and rejected)."""
        return self.micro_batch_size * self.rows_per_item * self.max_length

    def differing_keys(self, other: TrialConfig) -> set[str]:
        """The keys (not the derived figures) in which two configs differ."""
        return {f.name for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)}

    def to_dict(self) -> dict[str, Value]:
        d: dict[str, Value] = dataclasses.asdict(self)
        d["gradient_accumulation_steps"] = self.gradient_accumulation_steps
        d["effective_batch"] = self.effective_batch
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | TrialConfig) -> TrialConfig:
        """A config stored as JSON (`to_dict`; keys it does not know are left out, keys added since are their
        defaults). A TrialConfig comes back as it is: `ProbeResult.config`, a dict in older callers' days."""
        if isinstance(d, TrialConfig):
            return d
        return cls(**{k: v for k, v in d.items() if k in KEYS})

    def key(self) -> str:
        """A stable identity: two configs with the same key are the same measurement.

        Keys added after runs were stored (`LATE_KEYS`) are left out at their default, so a
        config of an older study keeps its key and a resumed study still finds it."""
        return ";".join(f"{k}={getattr(self, k)}" for k in KEYS
                        if not (k in LATE_KEYS and getattr(self, k) == KEYS[k].default))

    def replace(self, **changes: Any) -> TrialConfig:
        return dataclasses.replace(self, **changes)


def _declare() -> dict[str, Dimension]:
    out = {}
    for f in dataclasses.fields(TrialConfig):
        help_text, declared = f.metadata["dimension"]
        if f.default is dataclasses.MISSING:
            raise TypeError(f"TrialConfig.{f.name} has no default; declare it with dim(default, help, ...)")
        out[f.name] = Dimension(f.name, _TYPES[str(f.type)], help_text, default=f.default, **declared)
    return out


_TYPES = {"str": str, "int": int, "bool": bool}
"""The fields' annotations, strings under `from __future__ import annotations`."""
KEYS: dict[str, Dimension] = _declare()
"""Every dimension, in TrialConfig's field order (the order of `TrialConfig.key()`: never reorder)."""
LATE_KEYS = frozenset(k for k, d in KEYS.items() if d.late)
"""Keys added after studies were stored: `TrialConfig.key()` omits them at their default."""


def training_argument_values(cfg: TrialConfig, fmt: str | None = None) -> dict[str, object]:
    """The declared TrainingArguments fields of `cfg`'s values other than the default (those of `fmt`'s
    `kept_by` only, where a format is named)."""
    return {d.training_argument: (d.argument or _same)(getattr(cfg, name)) for name, d in KEYS.items()
            if d.training_argument and getattr(cfg, name) != d.default and (fmt is None or fmt in d.kept_by)}


def not_kept(cfg: TrialConfig, fmt: str) -> list[str]:
    """`key=value: ...` of the declared values other than the default that `fmt` cannot take."""
    return [f"{name}={getattr(cfg, name)}: {fmt} takes no {d.training_argument}" for name, d in KEYS.items()
            if d.training_argument and getattr(cfg, name) != d.default and fmt not in d.kept_by]


def _same(value: Value) -> Value:
    return value


def brief(cfg: TrialConfig) -> str:
    """The knobs that usually differ, in one short line: each dimension's label, in its place."""
    shown = sorted((d.label_at, d.label(cfg)) for d in KEYS.values() if d.label is not None)
    return " ".join(text for _, text in shown if text)


def keyed(cfg: object, place: Callable[[Dimension], int]) -> str:
    """`name=value;...` of the dimensions with a place in a key (`Dimension.gate`, `.boundary`), in order."""
    names = sorted((place(d), d.name) for d in KEYS.values() if place(d))
    return ";".join(f"{n}={getattr(cfg, n, None)}" for _, n in names)


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
