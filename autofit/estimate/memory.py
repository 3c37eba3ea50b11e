"""Memory: an analytic prior from the model's shape, and a model fitted from the probes.

The search uses it to skip configurations predicted to exceed the limit by more than the
model's measured error, and the report uses the prior's terms to explain a peak. Within a
group of settings (precision, checkpointing, quantization, optimizer, attention, ...) the
peak is close to affine in tokens per micro-batch, so two fits in a group pin it down.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass, field, replace
from enum import StrEnum

from autofit.config.models import ModelConfig
from autofit.config.spec import ALL_LINEAR, KEYS, Dimension, Memory, TrialConfig, Value
from autofit.core.errors import UsageError
from autofit.core.units import format_size
from autofit.protocol.result import ProbeResult

GIB = 2**30
CUDA_CONTEXT = int(0.75 * GIB)  # measured on an H200 (CUDA 13): context + cuBLAS handles
ALLOCATOR_SLACK = 0.05  # reserved over allocated, typical of the caching allocator
NCCL_BUFFERS = 384 * 2**20
"""Per rank, outside PyTorch, when a probe spans several GPUs: NCCL's communicator (its channels'
send/receive buffers, NCCL_BUFFSIZE 4 MiB each, and kernel workspace). A stated estimate, a few hundred
MiB on a host of NVLink GPUs; the fitted groups absorb the difference."""
PRIOR_MARGIN = 0.25
"""The prior's relative error until probes have checked it (`MemoryModel.margin`): a prediction is called
hopeless only this far over the usable memory, and the weights must exceed it by as much before a space is
called beyond reach (`beyond_reach`)."""
ZERO_BUCKET = 500_000_000
"""DeepSpeed's default reduce_bucket_size in elements (the generated JSON leaves it unset)."""
OPTIMIZER_STATE_BYTES = {  # bytes of optimizer state per fp32 trainable parameter
    "adamw_torch": 8, "adamw_torch_fused": 8,  # two fp32 moments
    "adamw_8bit": 2, "paged_adamw_8bit": 2, "adamw_bnb_8bit": 2,  # two 8-bit moments
    "paged_adamw_32bit": 8,
    "lion_8bit": 1, "paged_lion_8bit": 1,  # one 8-bit moment
    "adafactor": 0, "sgd": 0,  # factored second moment (tiny) / no state
}


@dataclass(frozen=True)
class Shape:
    """What the prior needs from a transformers config.json."""

    hidden: int
    layers: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    tied: bool

    @classmethod
    def from_config(cls, c: ModelConfig) -> Shape:
        heads = int(c.get("num_attention_heads", 1))
        return cls(hidden=int(c.get("hidden_size", 0)), layers=int(c.get("num_hidden_layers", 0)),
                   intermediate=int(c.get("intermediate_size", 4 * int(c.get("hidden_size", 0)))),
                   vocab=int(c.get("vocab_size", 0)), heads=heads,
                   kv_heads=int(c.get("num_key_value_heads") or heads),
                   tied=bool(c.get("tie_word_embeddings", False)))

    def module_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer in one decoder layer."""
        # a config of 0 heads: no division
        h, kv = self.hidden, self.hidden // max(self.heads, 1) * self.kv_heads
        return {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
                "gate_proj": (h, self.intermediate), "up_proj": (h, self.intermediate),
                "down_proj": (self.intermediate, h)}

    def linear_params(self) -> int:
        return self.layers * sum(i * o for i, o in self.module_dims().values())

    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    def total_params(self) -> int:
        return self.linear_params() + self.embedding_params() + (2 * self.layers + 1) * self.hidden


@dataclass
class Breakdown:
    """Where the bytes of one rank's peak go, by the prior (all in bytes)."""

    weights: int
    """The model's parameters this rank holds (its shard under fsdp2 / zero3; none offloaded)."""
    trainable: int
    """Adapter (or all) parameters + gradients + optimizer state (this rank's share, on the device)."""
    activations: int
    logits: int
    allocator: int
    outside: int
    gathered: int = 0
    """fsdp2 / zero3: the unsharded parameters gathered at a time (and one layer's gradients before
    their reduce-scatter)."""
    buffers: int = 0
    """Engine buffers: DDP's gradient buckets, ZeRO's reduce buckets, offload staging."""
    reference: int = 0
    """trainer=dpo: the reference model's share: a separate copy's weights (`dpo_reference=copy`) and the
    working set of its forward under no_grad (one layer's intermediates at a time, held beside the policy's
    saved activations); none in the step with precomputed log-probabilities."""

    def allocated(self) -> int:
        """What PyTorch's allocator hands out (`TERMS`); the allocator's slack and the rest come on top."""
        return sum(getattr(self, t) for t in TERMS)

    def total(self) -> int:
        return self.allocated() + self.allocator + self.outside

    def as_dict(self) -> dict[str, int]:
        """The terms by name for a person; the engine's terms only where there are some (one GPU: none)."""
        out = {"weights": self.weights, "adapter/trainable params + grads + optimizer": self.trainable}
        if self.gathered:
            out[GATHERED] = self.gathered
        if self.buffers:
            out[BUFFERS] = self.buffers
        if self.reference:
            out[REFERENCE] = self.reference
        return {**out, "activations": self.activations, "logits and loss": self.logits,
                "allocator overhead": self.allocator, "outside PyTorch": self.outside}


GATHERED = "gathered layers (FSDP2 / ZeRO-3)"
BUFFERS = "engine buffers (DDP / ZeRO buckets, offload staging)"
REFERENCE = "DPO reference (its forward without saved activations; with dpo_reference=copy, the copy's weights)"
TERMS = ("weights", "trainable", "gathered", "buffers", "activations", "logits", "reference")
"""The allocated terms (allocator and outside are derived from them, or constant)."""


@dataclass(frozen=True)
class RankState:
    """One rank's share of the model's state, in bytes (the terms that the engine and `gpus` split)."""

    weights: int
    trainable: int
    gathered: int
    buffers: int


def compute_bytes(cfg: TrialConfig) -> int:
    return 4 if cfg.precision == "fp32" else 2


def prior(cfg: TrialConfig, shape: Shape, on_gpu: bool = True) -> Breakdown:
    """The analytic estimate of a configuration's peak on its largest rank, term by term. The model's
    state splits by engine and `gpus` (rank_state); activations and logits are per rank and do not
    shrink with more ranks (each trains micro_batch_size x max_length tokens at a time)."""
    b = compute_bytes(cfg)
    st = rank_state(cfg, shape)
    tokens = cfg.tokens_per_micro_batch
    # Kept for backward; Liger's SwiGLU keeps gate and up only (silu(gate) * up recomputed): 2 x I
    # fewer per token (S1 on the H200: stock 33.4 vs Liger 26.6 GiB at mb2, 5.6 GiB of it this term).
    per_layer = tokens * b * (8 * shape.hidden + (2 if cfg.liger else 4) * shape.intermediate)
    per_layer += _nf4_mlp_bytes(cfg, shape, tokens, b)
    boundary = tokens * _stream_bytes(cfg) * shape.hidden  # a checkpointed layer keeps only its input
    every, offload = cfg.checkpoint_every, cfg.checkpoint_offload
    ck = len(range(0, shape.layers, every)) if every else 0
    activations = ((shape.layers - ck) * per_layer + ck * (0 if offload else boundary)
                   + (per_layer if ck else 0))
    if cfg.torch_compile and not every:
        # inductor's partitioner recomputes cheap pointwise ops instead of saving them (S1, H200:
        # about a quarter of the activations). None assumed with checkpointing (pytorch#193193:
        # a compiled backward with checkpointed blocks can hold more, not less).
        activations = int(activations * 0.75)
    if cfg.trainer == "dpo":  # TRL's fused LM head: per-token log-probs in tiles, never the logits
        logits = logprob_tile_bytes(tokens, shape, b)
    elif cfg.liger:
        logits = fused_loss_bytes(tokens, shape, b)
    else:
        logits = tokens * shape.vocab * (b + 4 + 4)
    logits += _nf4_head_copy_bytes(cfg, shape, b)
    outside = (CUDA_CONTEXT + (NCCL_BUFFERS if cfg.gpus > 1 else 0)) if on_gpu else 0
    out = Breakdown(st.weights, st.trainable, activations, logits, 0, outside, st.gathered, st.buffers,
                    reference_bytes(cfg, shape, tokens, b))
    return replace(out, allocator=int(out.allocated() * ALLOCATOR_SLACK))


def rank_state(cfg: TrialConfig, shape: Shape) -> RankState:
    """Parameters, gradients and optimizer state on one rank of `cfg.gpus`, by engine:

    - none (one GPU, or DDP): every rank holds everything; DDP adds its gradient buckets, about one
      more copy of the trainable gradients (Trainer leaves gradient_as_bucket_view off);
    - zero2: gradients and optimizer state / N (DeepSpeed keeps fp32 master weights and fp32 moments
      beside 16-bit weights: 4 + 8 bytes a parameter with Adam), plus two reduce buckets;
    - fsdp2 and zero3: parameters, gradients and optimizer state / N, plus the unsharded layers
      gathered at a time (`gathered`); fsdp2 under bf16/fp16 keeps fp32 trainable shards (accelerate
      upcasts them; the compute copy is gathered in 16 bits);
    - cpu_offload: optimizer (ZeRO-Offload: the optimizer state and the gradient partitions) or all
      (parameters too) leave the device; a unit's fp32 shard in flight is kept as staging."""
    weight_b = 4 if cfg.precision == "fp32" or (cfg.method == "full" and cfg.precision == "fp16") else 2
    lin, emb = shape.linear_params(), shape.embedding_params() + (2 * shape.layers + 1) * shape.hidden
    state = OPTIMIZER_STATE_BYTES.get(cfg.optimizer, 8)
    if cfg.method == "lora":
        frozen, n_train = _base_bytes(cfg, lin, emb, weight_b), adapter_params(cfg, shape)
        param_b, grad_b, opt_b = 4, 4, state  # fp32 adapter weights + fp32 grads + optimizer state
    else:
        # grads in the weights' dtype; torch's AdamW keeps its moments in the parameter dtype
        frozen, n_train = 0, lin + emb
        param_b = grad_b = weight_b
        opt_b = state if state <= 2 else 2 * weight_b
        if cfg.engine == "fsdp2" and weight_b < 4:
            param_b = grad_b = 4
            opt_b = state if state <= 2 else 8
        elif cfg.engine in ("zero2", "zero3") and weight_b < 4:
            opt_b = 4 + (state if state <= 2 else 8)
    n, engine = cfg.gpus, cfg.engine
    p_div = n if engine in ("fsdp2", "zero3") else 1
    s_div = n if engine != "none" else 1
    base, own = frozen // p_div, n_train * param_b // p_div
    grads, opt = n_train * grad_b // s_div, n_train * opt_b // s_div
    if cfg.cpu_offload != "off":
        grads = opt = 0
    if cfg.cpu_offload == "all":
        base = own = 0
    weights, trainable = (base, own + grads + opt) if cfg.method == "lora" else (own, grads + opt)
    return RankState(weights, trainable, _gathered(cfg, shape, n_train),
                     _buffers(cfg, shape, n_train, grad_b))


def adapter_params(cfg: TrialConfig, shape: Shape) -> int:
    """LoRA's trainable parameters: r x (in + out) per targeted linear layer."""
    dims = shape.module_dims()
    targets = dims if cfg.lora_modules == ALL_LINEAR else cfg.lora_modules
    return shape.layers * sum(cfg.lora_r * (dims[t][0] + dims[t][1]) for t in targets if t in dims)


NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
"""Bytes per parameter of a linear layer in nf4 with double quantization (the recipe's
bnb_4bit_use_double_quant): two 4-bit codes a byte, one 8-bit absmax per block of 64 (bitsandbytes' default
blocksize for 4 bits), and one fp32 absmax per 256 of those (the absmax quantized blockwise in 256s):
bitsandbytes functional.quantize_4bit."""
KBIT_UPCAST_BYTES = 4
"""peft's prepare_model_for_kbit_training (the recipe's k-bit preparation) casts every 16-bit parameter that
is not a 4-bit one to fp32: embeddings, lm_head and norms stay in 4 bytes a parameter on a quantized base."""


def _base_bytes(cfg: TrialConfig, lin: int, emb: int, weight_b: int) -> int:
    if cfg.quantization == "nf4":
        return int(lin * NF4_BYTES) + emb * KBIT_UPCAST_BYTES  # packed 4-bit linear layers + their scales
    if cfg.quantization == "8bit":
        return int(lin * 1.02) + emb * KBIT_UPCAST_BYTES  # int8 + per-row scales
    return (lin + emb) * weight_b


def _stream_bytes(cfg: TrialConfig) -> int:
    """Bytes per element of the residual stream between decoder layers (what a checkpointed layer keeps). On
    an nf4 base the embeddings are fp32 (KBIT_UPCAST_BYTES), so is their output, and each layer adds its
    16-bit attention and MLP outputs to it in fp32 (type promotion): the stream stays fp32 whatever the
    compute dtype."""
    return 4 if cfg.quantization == "nf4" else compute_bytes(cfg)


def _nf4_mlp_bytes(cfg: TrialConfig, shape: Shape, tokens: int, b: int) -> int:
    """What an nf4 layer keeps for backward beyond a 16-bit one: bitsandbytes' Linear4bit returns its input's
    dtype (the matmul runs in the compute dtype, the output is cast back), and the MLP's input is the fp32
    stream's norm, so gate_proj's and up_proj's outputs and silu(gate), kept for backward, are fp32, not
    16-bit (Liger's SwiGLU keeps gate and up only). Attention's inputs are cast back to 16 bits by autocast
    before
    sdpa keeps them: no more there."""
    if cfg.quantization != "nf4":
        return 0
    kept = 2 if cfg.liger else 3  # gate, up (and silu(gate) unless Liger recomputes it)
    return tokens * kept * shape.intermediate * (4 - b)  # each in 4 bytes instead of b


def _nf4_head_copy_bytes(cfg: TrialConfig, shape: Shape, b: int) -> int:
    """On an nf4 base lm_head is fp32 (KBIT_UPCAST_BYTES): autocast casts its weight to the compute dtype for
    each forward's product, and the product keeps that copy until backward (its input's gradient needs it); a
    tied head is the same matrix, cast the same way. Stock loss only: Liger's fused loss takes the weight
    itself."""
    if cfg.quantization != "nf4" or cfg.liger:
        return 0
    return shape.vocab * shape.hidden * b  # vocab x hidden, in the compute dtype


def _gathered(cfg: TrialConfig, shape: Shape, n_train: int) -> int:
    """fsdp2 / zero3: the root unit (embeddings, final norm, head: FSDP2 keeps the root gathered from
    forward to backward), two decoder layers (the one computing and the one prefetched), or every layer
    with reshard_after_forward off (kept from forward to backward: ~the full unsharded weights), all in
    the compute dtype; plus one layer's unsharded gradients before their reduce-scatter."""
    if cfg.engine not in ("fsdp2", "zero3") or not shape.layers:
        return 0
    b = compute_bytes(cfg)
    layer = shape.linear_params() // shape.layers + 2 * shape.hidden
    root = shape.embedding_params() + shape.hidden
    units = shape.layers if cfg.engine == "fsdp2" and not cfg.reshard_after_forward else min(2, shape.layers)
    return (root + units * layer) * b + n_train // shape.layers * b


def _buffers(cfg: TrialConfig, shape: Shape, n_train: int, grad_b: int) -> int:
    """DDP's gradient buckets (a copy of the trainable gradients); DeepSpeed's two reduce buckets of
    ZERO_BUCKET elements (overlap_comm); with cpu_offload, a unit's fp32 shard (parameters and
    gradients) in flight between host and device."""
    out = 0
    if cfg.engine == "none" and cfg.gpus > 1:
        out += n_train * grad_b
    elif cfg.engine in ("zero2", "zero3"):
        out += 2 * min(ZERO_BUCKET, n_train) * grad_b
    if cfg.cpu_offload != "off" and shape.layers:
        out += 2 * (shape.linear_params() // shape.layers) * 4 // cfg.gpus
    return out


def fused_loss_bytes(tokens: int, shape: Shape, b: int) -> int:
    """Liger's fused linear cross-entropy: the logits only in chunks of about tokens x hidden / vocab
    rows (liger ops/fused_linear_cross_entropy.py), the input's gradient (tokens x hidden) kept from
    the forward, one fp32 loss per token. Stock: logits, their fp32 upcast and its gradient."""
    if not (tokens and shape.vocab and shape.hidden):
        return 0
    rows = math.ceil(tokens / math.ceil(shape.vocab / shape.hidden))
    chunk = min(tokens, 1 << max(0, math.ceil(math.log2(rows))))
    return chunk * shape.vocab * (b + 4) + tokens * shape.hidden * b + tokens * 4


LOGPROB_TILE_TOKENS = 4096
"""Tokens per tile of TRL's chunked log-probability kernel (trl/kernels/chunked_logprob.py,
TOKEN_CHUNK_SIZE): DPOTrainer's fused LM head projects at most this many tokens onto a vocabulary tile at a
time."""


def logprob_tile_bytes(tokens: int, shape: Shape, b: int) -> int:
    """DPOTrainer's log-probabilities (TRL 1.16, `add_fused_lm_head`): a tile of at most 4,096 tokens by the
    vocabulary (taken whole: the prior's upper bound) in the compute dtype with its fp32 accumulator, the
    hidden states' gradient (tokens x hidden), and a few fp32 figures per token (log-prob, log-sum-exp,
    entropy, top-1)."""
    if not (tokens and shape.vocab and shape.hidden):
        return 0
    tile = min(tokens, LOGPROB_TILE_TOKENS) * shape.vocab * (b + 4)
    return tile + tokens * shape.hidden * b + tokens * 4 * 4


def reference_bytes(cfg: TrialConfig, shape: Shape, tokens: int, b: int) -> int:
    """What DPO's reference adds to the step's peak: with `dpo_reference=copy` a second model's weights (as
    the base is loaded: quantized or not); unless the log-probabilities were precomputed, its forward under
    no_grad over the micro-batch's rows while the policy's activations are held: one layer's working set at
    a time (the hidden stream in and out, q/k/v/o, gate and up) and its log-probability tile."""
    if cfg.trainer != "dpo":
        return 0
    out = reference_copy_bytes(cfg, shape)
    if not cfg.precompute_ref_log_probs:
        # one decoder layer's intermediates under no_grad: 6 hidden-wide (stream in/out, q, k, v, o) and 2
        # intermediate-wide (gate, up) tensors per token, then the log-probability tile
        out += tokens * b * (6 * shape.hidden + 2 * shape.intermediate) + logprob_tile_bytes(tokens, shape, b)
    return out


@functools.lru_cache(maxsize=65536)  # a frozen config: the same key every time (a plan asks ~200k times)
def group_key(cfg: TrialConfig) -> str:
    """Settings that change the peak other than through tokens per micro-batch (every key not popped
    here: the kernel keys liger and torch_compile too, each combination its own fit; gpus, engine,
    reshard_after_forward and cpu_offload too, so a DDP fit never teaches an FSDP2 prediction, nor a
    2-rank fit a 4-rank one)."""
    d = cfg.to_dict()
    # the allocator's settings change fragmentation, not the peak (the H200 grid measured the same peaks with
    # and without expandable_segments), so they share their group's points; so do the keys of no memory
    for k in ("micro_batch_size", "gradient_accumulation_steps", "effective_batch", *ALLOCATOR, *NO_MEMORY):
        d.pop(k)
    if cfg.attn_implementation == "eager":  # eager attention is quadratic in length
        return repr(sorted(d.items()))
    d.pop("max_length")
    return repr(sorted(d.items()))


MODELED = frozenset(k for k, d in KEYS.items()
                    if d.memory in (Memory.TOKENS, Memory.MODELED, Memory.ALLOCATOR))
"""Keys whose effect on the peak the prior's terms model."""
NO_MEMORY = frozenset(k for k, d in KEYS.items() if d.memory is Memory.NONE)
"""Keys that do not change the peak (accumulation steps, a scale factor)."""
ALLOCATOR = frozenset(k for k, d in KEYS.items() if d.memory is Memory.ALLOCATOR)
"""Keys that change the allocator's fragmentation, not the peak's terms."""


@dataclass
class MemoryModel:
    """Prior + per-group affine fits + lower bounds from out-of-memory probes + the measured
    error of its own predictions."""

    shape: Shape
    on_gpu: bool = True
    prior_margin: float = PRIOR_MARGIN
    """Relative margin while the model has not been checked against enough probes."""
    points: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    bounds: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """Per group: (tokens per micro-batch, a peak an out-of-memory probe proved it exceeds)."""
    errors: list[float] = field(default_factory=list)
    fit_errors: int = 0
    """How many of `errors` come from measured peaks (the others: out-of-memory lower bounds)."""
    by_kernels: dict[tuple[bool, bool], list[tuple[float, bool]]] = field(default_factory=dict)
    """The same samples (error, from a measured peak) per kernel combination (liger, torch_compile):
    the prior's kernel terms are the least certain, so a combination's own errors set its margin."""
    ratios: list[float] = field(default_factory=list)

    def observe(self, cfg: TrialConfig, peak: int, predicted: int | None = None) -> None:
        """Record a measured peak (and how far the prediction made before it was off)."""
        self.points.setdefault(group_key(cfg), []).append((cfg.tokens_per_micro_batch, peak))
        self.ratios.append(peak / max(prior(cfg, self.shape, self.on_gpu).total(), 1))
        if predicted:
            self._sample(cfg, abs(predicted - peak) / max(peak, 1), fit=True)

    def observe_bound(self, cfg: TrialConfig, lower_bound: int, predicted: int | None = None) -> None:
        """Record what an out-of-memory probe proved: its peak is at least `lower_bound`. A prediction
        below the bound was wrong by at least the difference (an error sample); one above it is
        consistent with it (an error sample of zero)."""
        self.bounds.setdefault(group_key(cfg), []).append((cfg.tokens_per_micro_batch, lower_bound))
        if predicted:
            self._sample(cfg, max(lower_bound - predicted, 0) / max(lower_bound, 1), fit=False)

    def learn(self, res: ProbeResult, predicted: int | None = None) -> None:
        """What a probe shows about memory: its measured peak (it ran to the end, also one judged over
        the headroom), or a lower bound (it ran out of memory)."""
        cfg = res.config
        if res.tokens_per_s is not None and res.peak_memory_bytes:
            self.observe(cfg, res.peak_memory_bytes, predicted)
        elif res.outcome.is_memory() and (bound := res.peak_lower_bound()):
            self.observe_bound(cfg, bound, predicted)

    def _sample(self, cfg: TrialConfig, error: float, fit: bool) -> None:
        self.errors.append(error)
        self.fit_errors += fit
        self.by_kernels.setdefault(_kernels(cfg), []).append((error, fit))

    def predict(self, cfg: TrialConfig) -> int:
        """The peak: the group's affine fit (two measured peaks), else one peak and the prior's slope,
        else the prior scaled by the measured/prior ratio so far; never below a lower bound that an
        out-of-memory probe of the group with no more tokens per micro-batch proved."""
        t = cfg.tokens_per_micro_batch
        floor = max((b for x, b in self.bounds.get(group_key(cfg), []) if x <= t), default=0)
        return max(self._fitted(cfg), floor, 0)  # two noisy fits can slope down into negative bytes

    def _fitted(self, cfg: TrialConfig) -> int:
        pts = self.points.get(group_key(cfg), [])
        t = cfg.tokens_per_micro_batch
        distinct = sorted({x for x, _ in pts})
        if len(distinct) >= 2:
            xs, ys = [x for x, _ in pts], [y for _, y in pts]
            mx, my = statistics.fmean(xs), statistics.fmean(ys)
            sxx = sum((x - mx) ** 2 for x in xs)
            slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
            return int(my + slope * (t - mx))
        pr = prior(cfg, self.shape, self.on_gpu)
        if pts:
            # one point: its intercept, the prior's slope (activations + logits per token)
            x0, y0 = pts[-1]
            slope = (pr.activations + pr.logits) * (1 + ALLOCATOR_SLACK) / t
            return int(y0 + slope * (t - x0))
        return int(pr.total() * self.scale())

    def scale(self) -> float:
        """Measured peaks over the prior's, the median so far (1 before any)."""
        return statistics.median(self.ratios) if self.ratios else 1.0

    def margin(self, cfg: TrialConfig | None = None) -> float:
        """Relative error to allow before calling a prediction hopeless: 1.5 x the largest of the
        last 8 errors once three samples, one of them a measured peak, checked the model (an
        out-of-memory bound only shows predictions that were too low), else the prior's 25%. For a
        config, its kernel combination's own samples where they are enough, else the model's."""
        own = self.by_kernels.get(_kernels(cfg), []) if cfg is not None else []
        if len(own) >= 3 and any(fit for _, fit in own):
            return max(0.05, 1.5 * max(e for e, _ in own[-8:]))
        if not self.checked():
            return self.prior_margin
        return max(0.05, 1.5 * max(self.errors[-8:]))

    def checked(self) -> bool:
        """Three error samples, one of them a measured peak: the model's own error is known."""
        return len(self.errors) >= 3 and self.fit_errors > 0

    def describe(self) -> str:
        """The margin and its evidence, for a person."""
        bounds = len(self.errors) - self.fit_errors
        if not self.checked():
            return (f"memory model margin {self.margin():.0%} (the prior's: {self.fit_errors} measured "
                    f"peak(s), {bounds} out-of-memory bound(s) checked so far)")
        return (f"memory model margin {self.margin():.0%} from {self.fit_errors} measured peak(s) and "
                f"{bounds} out-of-memory bound(s)")

    def hopeless(self, cfg: TrialConfig, usable: int) -> bool:
        """Predicted over the usable memory by more than the model's error. Until one peak has
        been measured the model is unchecked, and nothing is skipped on its word alone."""
        if not self.ratios:
            return False
        return self.predict(cfg) > usable * (1 + self.margin(cfg))

    def max_saving(self, oom: TrialConfig, cfg: TrialConfig, reserved_free: int | None = None,
                   loading: bool = False) -> int | None:
        """The most memory cfg can save against the out-of-memory config `oom`: each of the prior's
        terms that cfg shrinks, at its full size, scaled by how far measured peaks exceed the prior
        and by the model's margin; an allocator setting (expandable_segments) gives back at most the memory
        reserved but unallocated at the failure. None when they differ in a key the prior does not
        model (attention kernel, batching, dropout), or in length under eager attention: then nothing
        is known. With `loading`, the OOM struck while the model was built (result.failed_loading):
        only what exists by then (the weights and the adapter's own parameters) can save, not
        activations, logits, gradients or optimizer state. Several ranks or an engine: nothing is
        claimed (each rank loads the whole model before an engine shards it; the prior's terms split
        by engine do not say what a rank holds at that moment)."""
        changed = oom.differing_keys(cfg) - NO_MEMORY
        if changed - MODELED or (changed and not self.shape.hidden):
            return None
        if loading and any(c.gpus > 1 or c.engine != "none" for c in (oom, cfg)):
            return None
        if "max_length" in changed and "eager" in (oom.attn_implementation, cfg.attn_implementation):
            return None  # eager attention's scores grow with length squared: a term the prior lacks
        po, pc = prior(oom, self.shape, self.on_gpu), prior(cfg, self.shape, self.on_gpu)
        grow = max(self.scale(), 1.0) * (1 + max(self.margin(oom), self.margin(cfg)))
        if loading:
            saved = max(loaded_bytes(oom, self.shape) - loaded_bytes(cfg, self.shape), 0)
        else:
            saved = sum(max(getattr(po, t) - getattr(pc, t), 0) for t in (*TERMS, "outside"))
        slack = max(po.allocator - pc.allocator, 0) * grow if saved or not loading else 0
        if any(_relieves(KEYS[k], getattr(oom, k), getattr(cfg, k)) for k in changed & ALLOCATOR):
            # an allocator setting that hands more back gives back at most what was reserved but unallocated
            slack = reserved_free if reserved_free is not None else po.allocator * grow
        return int(saved * grow + slack)


def _relieves(d: Dimension, before: Value, after: Value) -> bool:
    """`after` hands more of the allocator's reserved memory back than `before` (`Dimension.relief`)."""
    return d.relief is not None and d.relief(after) > d.relief(before)


def loaded_bytes(cfg: TrialConfig, shape: Shape) -> int:
    """What one rank holds once the model is loaded and wrapped, before the first step: the (possibly
    quantized, sharded) weights and, for LoRA, the adapter's fp32 parameters."""
    st = rank_state(cfg, shape)
    own = adapter_params(cfg, shape) * 4 // (cfg.gpus if cfg.engine in ("fsdp2", "zero3") else 1)
    return (st.weights + (own if cfg.method == "lora" and cfg.cpu_offload != "all" else 0)
            + reference_copy_bytes(cfg, shape))


def reference_copy_bytes(cfg: TrialConfig, shape: Shape) -> int:
    """DPO with `dpo_reference=copy`: the separate reference model's weights, loaded as the base is
    (quantized or not); 0 for every other config."""
    if cfg.trainer != "dpo" or cfg.dpo_reference != "copy":
        return 0
    weight_b = 4 if cfg.precision == "fp32" else 2
    lin, emb = shape.linear_params(), shape.embedding_params() + (2 * shape.layers + 1) * shape.hidden
    return _base_bytes(cfg, lin, emb, weight_b)


def _kernels(cfg: TrialConfig | None) -> tuple[bool, bool]:
    return (bool(cfg.liger), bool(cfg.torch_compile)) if cfg is not None else (False, False)



# --------------------------------------------------------------------------- what fits, by the prior

MAX_GPUS = 1024
"""The most GPUs `reach` considers for a sharded saving (powers of two up to it)."""
SHARDING = ("fsdp2", "zero3")
"""The engines that shard the weights over the ranks (FSDP2, DeepSpeed ZeRO-3)."""


def weights_floor(cfg: TrialConfig, shape: Shape) -> int:
    """The least the loaded model can hold on cfg's largest rank before any step: `loaded_bytes` of a shape no
    larger than the real model, whatever its architecture. The embeddings count once (a config.json without
    tie_word_embeddings may tie them) and the MLP as two hidden x intermediate matrices (Llama's gated MLP has
    three, GPT-NeoX's and Falcon's two); biases, experts and wider heads only add to the real model."""
    return loaded_bytes(cfg, replace(shape, tied=True, intermediate=shape.intermediate * 2 // 3))


def beyond_reach(candidates: list[TrialConfig], shape: Shape, usable: int,
                 margin: float = PRIOR_MARGIN) -> bool:
    """Nothing in `candidates` can fit in `usable` bytes, for certain: each one's weights alone
    (`weights_floor`, what exists before the first step) exceed it by more than the prior's margin. A config
    merely predicted over is never counted here: the search probes it where its policy would."""
    return bool(candidates) and all(weights_floor(c, shape) > usable * (1 + margin) for c in candidates)


class Change(StrEnum):
    """The savings `reach` weighs, one kind each."""

    QUANTIZE = "a 4-bit base"
    LENGTH = "a shorter length"
    MODEL = "a smaller model"
    GPUS = "more GPUs"
    CARD = "a larger card"


@dataclass(frozen=True)
class Saving:
    """One change that would bring a space under the usable memory, by the prior, or why it would not."""

    kind: Change
    change: str
    """What to allow, for a person ('a 4-bit base (QLoRA, --space qlora)')."""
    fits: bool
    detail: str
    """The prior's figures behind it ('weights 3.6 GiB, smallest predicted peak 4.2 GiB')."""
    amount: int | None = None
    """The figure of a change that fits: the smallest peak (4-bit, card), the longest length, the most
    parameters, the fewest GPUs."""

    def describe(self) -> str:
        return f"{self.change}: {self.detail}"


@dataclass(frozen=True)
class Reach:
    """What a space needs of a card by the prior (the memory model before any probe), and the smallest
    savings that would bring it under the card's usable memory."""

    usable: int
    weights: dict[str, int]
    """Per base in the space (precision or quantization, with the LoRA adapter): its smallest weights."""
    smallest_peak: int | None
    """The space's smallest predicted peak (None: an empty space)."""
    certain: bool
    """Nothing in the space can fit, whatever the prior's error (`beyond_reach`)."""
    savings: tuple[Saving, ...]

    def describe(self) -> str:
        """Why nothing fits and what would, in one paragraph: the weights, then the savings that would fit
        and those that would not."""
        need = ", ".join(f"{format_size(n)} ({base})" for base, n in self.weights.items())
        would = [s.describe() for s in self.savings if s.fits]
        would_not = [s.describe() for s in self.savings if not s.fits]
        if self.certain:
            text = (f"the weights alone need {need} in every configuration, more than the usable "
                    f"{format_size(self.usable)} by more than the memory model's error")
        else:
            text = (f"the smallest predicted peak is {format_size(self.smallest_peak)} against the usable "
                    f"{format_size(self.usable)} (weights: {need})")
        if would:
            text += f". Would fit, by the memory model: {'; '.join(would)}"
        if would_not:
            text += f". Would not: {'; '.join(would_not)}"
        return text


def reach(candidates: list[TrialConfig], shape: Shape, usable: int, on_gpu: bool = True,
          margin: float = PRIOR_MARGIN) -> Reach:
    """What `candidates` (a space's configs) need of a card with `usable` bytes by the prior, and for each
    saving (a 4-bit base, a shorter length, a smaller model, more GPUs sharding the weights, a larger card)
    the least of it that would fit. Pure: no probe, no study; `autofit search` says it when nothing can fit,
    and a plan of a space per card can say it for each."""
    weights: dict[str, int] = {}
    candidates = frontier(candidates)  # every group's weights, and the least peak of each
    for c in candidates:
        base = _base_name(c)
        weights[base] = min(weights.get(base, loaded_bytes(c, shape)), loaded_bytes(c, shape))
    least = smallest_peak(candidates, shape, on_gpu)
    savings = () if least is None or least <= usable else (
        four_bit(candidates, shape, usable, on_gpu), shorter_length(candidates, shape, usable, on_gpu),
        smaller_model(candidates, shape, usable, on_gpu), more_gpus(candidates, shape, usable, on_gpu),
        larger_card(candidates, shape, on_gpu))
    return Reach(usable, weights, least, beyond_reach(candidates, shape, usable, margin),
                 tuple(s for s in savings if s is not None))


def smallest_peak(candidates: list[TrialConfig], shape: Shape, on_gpu: bool = True) -> int | None:
    """The least peak the prior predicts among `candidates` (None: none)."""
    return min((prior(c, shape, on_gpu).total() for c in frontier(candidates)), default=None)


def frontier(candidates: list[TrialConfig]) -> list[TrialConfig]:
    """Per memory group (`group_key`), the config of the smallest micro-batch, at its shortest length: the
    prior grows with tokens per micro-batch and with nothing else the group leaves out, so the least peak of
    `candidates` is among these, at any length they are given (a space of 1,280 configs has a few dozen)."""
    fewest: dict[str, TrialConfig] = {}
    for c in candidates:
        key = group_key(c)
        if key not in fewest or _smaller(c, fewest[key]):
            fewest[key] = c
    return list(fewest.values())


def _smaller(a: TrialConfig, b: TrialConfig) -> bool:
    return (a.micro_batch_size, a.tokens_per_micro_batch) < (b.micro_batch_size, b.tokens_per_micro_batch)


def variants(candidates: list[TrialConfig], **changes: Value) -> list[TrialConfig]:
    """Each candidate with `changes`, where the result is a valid config (full + nf4 is not), once each."""
    out: dict[str, TrialConfig] = {}
    wanted = tuple(sorted(changes.items()))
    for c in candidates:
        v = _variant(c, wanted)
        if v is not None:
            out.setdefault(v.key(), v)
    return list(out.values())


@functools.lru_cache(maxsize=65536)  # `autofit plan --card all` asks the same variants for every card
def _variant(cfg: TrialConfig, changes: tuple[tuple[str, Value], ...]) -> TrialConfig | None:
    """cfg with `changes`, or None where that is no valid config."""
    try:
        return cfg.replace(**dict(changes))
    except UsageError:
        return None


def four_bit(candidates: list[TrialConfig], shape: Shape, usable: int, on_gpu: bool = True) -> Saving | None:
    """The space's configs on a 4-bit base (QLoRA: LoRA on nf4 weights, one GPU): what its weights need and
    whether its smallest predicted peak fits. None for an empty space."""
    four = variants(candidates, method="lora", quantization="nf4", engine="none", cpu_offload="off",
                    reshard_after_forward=True)
    peak = smallest_peak(four, shape, on_gpu)
    if peak is None:
        return None
    weights = min(loaded_bytes(c, shape) for c in four)
    where = ("in the space" if any(c.quantization == "nf4" for c in candidates) else
             "QLoRA: quantization nf4 in a copy of the space" if any(c.trainer == "dpo" for c in candidates) else
             "QLoRA, --space qlora")  # the qlora space trains SFT: a DPO space gets nf4 in its own copy
    return Saving(Change.QUANTIZE, f"a 4-bit base ({where})", peak <= usable,
                  f"weights {format_size(weights)}, smallest predicted peak {format_size(peak)}", peak)


def shorter_length(candidates: list[TrialConfig], shape: Shape, usable: int,
                   on_gpu: bool = True) -> Saving | None:
    """The longest max_length (a multiple of 8, the shortest a config takes) at which some config of the
    space is predicted to fit (the prior grows with tokens per micro-batch: bisected)."""
    if not candidates:
        return None
    longest = max(c.max_length for c in candidates)

    def fits(n: int) -> bool:
        peak = smallest_peak(variants(candidates, max_length=8 * n), shape, on_gpu)
        return peak is not None and peak <= usable

    if not fits(1):
        return Saving(Change.LENGTH, "a shorter --max-length", False,
                      "what does not shrink with the length exceeds the usable memory at any length")
    lo, hi = 1, max(longest // 8, 1)  # fits(lo) holds
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    peak = smallest_peak(variants(candidates, max_length=8 * lo), shape, on_gpu)
    return Saving(Change.LENGTH, f"--max-length {8 * lo}" + (" or shorter" if lo > 1 else ""), True,
                  f"predicted peak {format_size(peak)}", 8 * lo)


def scaled(shape: Shape, s: float) -> Shape:
    """The shape's family at a fraction `s` of its width and depth (hidden, intermediate and layers times s,
    the vocabulary and heads kept): about s**3 of its decoder's parameters; at least one of each."""
    return replace(shape, hidden=max(1, round(shape.hidden * s)),
                   intermediate=max(1, round(shape.intermediate * s)), layers=max(1, round(shape.layers * s)))


def smaller_model(candidates: list[TrialConfig], shape: Shape, usable: int,
                  on_gpu: bool = True) -> Saving | None:
    """The largest model of this shape's family (`scaled`) whose smallest predicted peak in the space fits:
    its parameter count, bisected over the scale."""
    if not candidates or not shape.total_params():
        return None
    candidates = frontier(candidates)  # once, not at each of the bisection's 40 steps

    def fits(s: float) -> bool:
        peak = smallest_peak(candidates, scaled(shape, s), on_gpu)
        return peak is not None and peak <= usable

    if not fits(0.0):
        return Saving(Change.MODEL, "a smaller model", False,
                      "the vocabulary's embeddings and what is not weights exceed the usable memory at any "
                      "size")
    lo, hi = 0.0, 1.0
    for _ in range(40):  # 2**-40 of the scale: far finer than a parameter count is told
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    params = scaled(shape, lo).total_params()
    return Saving(Change.MODEL, f"a smaller model of at most {_params(params)} parameters", True,
                  f"this one has {_params(shape.total_params())}", params)


def more_gpus(candidates: list[TrialConfig], shape: Shape, usable: int, on_gpu: bool = True) -> Saving | None:
    """The fewest GPUs (a power of two up to MAX_GPUS) over which an engine that shards the weights (FSDP2,
    ZeRO-3) brings the space's smallest predicted per-rank peak under the usable memory; a 16-bit base
    (a quantized one is not sharded), FSDP2's checkpointing on every layer where the space's is partial."""
    if not candidates:
        return None
    searched = {c.engine for c in candidates} & set(SHARDING)
    where = "" if searched else " (in a space searching `engine: [fsdp2, zero3]`; this one shards nothing)"
    batch = max(c.global_batch for c in candidates)
    gpus = 2
    while gpus <= MAX_GPUS:
        for engine in SHARDING:
            ranks = variants([_shardable(c, engine) for c in candidates], gpus=gpus, engine=engine)
            peak = smallest_peak(ranks, shape, on_gpu)
            if peak is not None and peak <= usable:
                name = "FSDP2" if engine == "fsdp2" else "ZeRO-3"
                wider = f", a --global-batch of at least {gpus}" if gpus > batch else ""  # a sequence per GPU
                return Saving(Change.GPUS, f"--gpus {gpus} sharded with {name}{where}", True,
                              f"predicted peak {format_size(peak)} per GPU{wider}", gpus)
        gpus *= 2
    return Saving(Change.GPUS, "more GPUs", False,
                  f"sharded over {MAX_GPUS} GPUs, each one's predicted peak still exceeds the usable memory")


def larger_card(candidates: list[TrialConfig], shape: Shape, on_gpu: bool = True) -> Saving | None:
    """The usable memory the space's smallest predicted peak needs."""
    peak = smallest_peak(candidates, shape, on_gpu)
    if peak is None:
        return None
    return Saving(Change.CARD, f"a card with {format_size(peak)} usable", True,
                  "the space's smallest predicted peak", peak)


def _shardable(cfg: TrialConfig, engine: str) -> TrialConfig:
    """cfg as a sharding engine runs it: a 16-bit base, nothing offloaded; FSDP2 checkpoints every layer or
    none."""
    ckpt = cfg.gradient_checkpointing
    if engine == "fsdp2" and ckpt not in ("off", "on"):
        ckpt = "on"
    return cfg.replace(quantization="none", cpu_offload="off", reshard_after_forward=True,
                       gradient_checkpointing=ckpt)


def _base_name(cfg: TrialConfig) -> str:
    base = cfg.quantization if cfg.quantization != "none" else cfg.precision
    return f"{base} weights" + (" + LoRA adapter" if cfg.method == "lora" else "")


def _params(n: int) -> str:
    """A parameter count as people write it: 6.7B, 350M, 90,112."""
    if n >= 1e9:
        return f"{n / 1e9:.1f}B"
    return f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n:,}"
