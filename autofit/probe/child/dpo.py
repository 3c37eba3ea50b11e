"""A preference-tuning probe: one configuration trained through TRL's `DPOTrainer`, measured as an SFT probe is.

The same protocol as `measure.run_probe` (docs/DESIGN.md, "The probe"): the device and its cap, the model as
the recipe builds it, warm-up then timed optimizer steps with the same callback, checkpointing verified per
layer, the same outcomes. What differs is what DPO trains:

- a micro-batch of n pairs is one policy forward of 2n rows (prompt + chosen, prompt + rejected, concatenated
  along the batch by TRL's DataCollatorForPreference), and the reference's log-probabilities come from a
  second forward under `no_grad` (LoRA: the same model with the adapter disabled, TRL's default for a PEFT
  model; `dpo_reference=copy`: a separate reference model), or were computed once before training
  (`precompute_ref_log_probs`: no reference forward in the step);
- the pairs: random tokens with prompt + completion at max_length (the worst case), or the dataset's pairs
  tokenized as `data/preference.py` counts them; the heaviest micro-batch (the longest pairs) first, then a
  seeded draw of the data's;
- the figures: trained preference pairs per second, with the tokens/s of the two rows beside it (non-pad
  tokens of prompt + chosen and prompt + rejected), each step brought to the data's mean micro-batch by the
  window's own time model (`timing.micro_batch_time_model`: a fixed cost per micro-batch plus a cost per tensor
  token, fitted over the timed steps, as an SFT probe on data does).
  A precomputed reference pass is paid once, before training: its seconds per pair are added to each pair's
  time, as over one epoch (TRL keeps the log-probabilities for later epochs).

The pairs reach DPOTrainer tokenized (`prompt_ids`, `chosen_ids`, `rejected_ids`): the subclass passes such
a dataset through instead of tokenizing text again (TRL's `_prepare_dataset` tokenizes text rows only), so
the search, `autofit data` and the probe count the same tokens.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autofit.config import recipe
from autofit.config.dpo import keep_checkpointing_as_asked
from autofit.data.preference import (
    PairLengths,
    epoch_order,
    micro_batch_means,
    pair_lengths,
    pair_tokenizer,
    read_preferences,
    token_pairs,
)
from autofit.estimate.effects import HALF_TOKENS
from autofit.probe.child import allocator
from autofit.probe.child.build import Model, decoder_layers
from autofit.probe.child.errors import Unsupported
from autofit.probe.child.gate import (
    check_architecture,
    check_support,
    kernel_figures,
    mismatch_result,
    run_dpo_gate,
)
from autofit.probe.child.kernels import GateResult
from autofit.probe.child.measure import (
    Trained,
    _stop_runaway,
    base_model,
    check_lora_targets,
    describe_optimizer,
    figures,
    loaded,
    prepare_device,
    start_loading,
    verify_checkpointing,
)
from autofit.probe.child.sampler import Memory
from autofit.probe.child.state import ProbeState
from autofit.probe.child.timing import TimingPlan, make_callback, micro_batch_time_model, spread
from autofit.protocol.request import SPREAD_BOUND, ProbeRequest
from autofit.protocol.result import ProbeResult

if TYPE_CHECKING:
    from datasets import Dataset  # type: ignore[import-untyped,unused-ignore]  # datasets 5.2: no type hints

TokenPair = tuple[list[int], list[int], list[int]]
"""(prompt ids, chosen ids, rejected ids)."""


@dataclass(frozen=True)
class Pairs:
    """The pairs a probe trains, in order (the heaviest micro-batch first), and the data's mean micro-batch."""

    ids: list[TokenPair]
    pad_id: int
    max_length: int
    pad_max: bool
    """Rows padded to max_length (`batching=pad_max`) rather than to the micro-batch's longest."""
    mean_tensor: float
    """The data's mean micro-batch: tensor tokens (2 rows a pair, padded as the batching pads)."""
    mean_real: float
    """The data's mean micro-batch: non-pad tokens of both rows."""
    dropped: int = 0
    """Pairs of the data TRL would drop at this max_length (the prompt fills it): never drawn, counted."""
    epoch_pairs: int = 0
    """The dataset's pairs TRL trains on (one epoch; 0: random pairs, no dataset)."""

    def lengths(self, k: int) -> PairLengths:
        p, c, r = self.ids[k]
        return PairLengths(len(p), len(c), len(r))

    def micro_batch_tensor(self, first: int, size: int) -> int:
        """Tensor tokens of the micro-batch of pairs [first, first + size): 2 rows per pair."""
        rows = [self.lengths(k % len(self.ids)).rows(self.max_length) for k in range(first, first + size)]
        return 2 * size * (self.max_length if self.pad_max else max(max(r) for r in rows))


def run_dpo_probe(req: ProbeRequest, state: ProbeState, announce: Callable[[str], None]) -> ProbeResult:
    """Run the DPO probe `req` describes; `state` collects figures as they come, for failures."""
    allocator.apply(req)  # the config's allocator and environment, before the device is touched
    check_support(req)
    state.mem = Memory(req.device, req.nvml_index, req.memory_limit_bytes if req.device == "cpu" else None)
    state.mem.runaway = lambda now: _stop_runaway(req, state, now)
    check_architecture(req)
    pairs = probe_pairs(req)  # before the device's baseline: tokenizing is not the probe's memory
    sync = prepare_device(req, state)
    policy, reference, peft_config = load_models(req, state)
    state.stage = "setup"
    try:
        trained, extra, losses, gate = train_dpo(req, state, policy, reference, peft_config, pairs, sync, announce)
    except GateFailed as failed:
        return mismatch_result(req, failed.gate)
    verify_checkpointing(req, state.callback, trained.n_layers)
    ran = allocator.verify(req)
    assert state.callback is not None
    state.callback.losses[:] = losses  # the DPO loss Trainer logged each step (the forward's own is not it)
    res = kernel_figures(dpo_figures(req, state, trained, pairs, extra), req, state, gate)
    res.extra.update(ran)
    return res


class GateFailed(Exception):
    """The kernel config's DPO step differs from stock DPO's: the probe ends as `mismatch`."""

    def __init__(self, gate: GateResult) -> None:
        super().__init__(gate.reason)
        self.gate = gate


def load_models(req: ProbeRequest, state: ProbeState) -> tuple[Model, Model | None, Any]:
    """The policy's base as the recipe builds it (dtype, quantization, k-bit preparation; LoRA as a
    `LoraConfig` that DPOTrainer applies, as the exported TRL recipe does) and, for `dpo_reference=copy`, a
    second model with the same weights."""
    cfg = req.config
    start_loading(req, state)
    policy = base_model(req, state)
    peft_config = None
    lora = recipe.lora_arguments(cfg)
    if lora is not None:
        from peft import LoraConfig

        check_lora_targets(policy, lora["target_modules"])
        peft_config = LoraConfig(**lora)
    reference = base_model(req, state) if cfg.dpo_reference == "copy" else None
    if reference is not None:
        reference.requires_grad_(False)
    loaded(state)
    return policy, reference, peft_config


def probe_pairs(req: ProbeRequest) -> Pairs:
    """The pairs of the probe: random tokens at max_length (prompt half, each completion the other half), or
    the dataset's, the longest micro-batch first and then a seeded draw; enough for every step."""
    cfg = req.config
    n = req.micro_batches * cfg.micro_batch_size
    if req.dataset is None:
        import torch

        half = cfg.max_length // 2
        vocab = int(req.model.config.get("vocab_size", 32000))
        g = torch.Generator().manual_seed(0)
        ids = [tuple(torch.randint(0, vocab, (k,), generator=g).tolist() for k in (half, cfg.max_length - half,
                                                                                     cfg.max_length - half))
               for _ in range(n)]
        tensor = 2 * cfg.micro_batch_size * cfg.max_length
        return Pairs([(p, c, r) for p, c, r in ids], 0, cfg.max_length, True, tensor, tensor)
    return data_pairs(req, n)


def data_pairs(req: ProbeRequest, n: int) -> Pairs:
    """The dataset's pairs, tokenized as `autofit data` counts them, ordered for the probe."""
    assert req.dataset is not None
    cfg = req.config
    prefs = read_preferences(str(req.dataset["path"]))
    if prefs.content_hash != req.dataset.get("content_hash"):
        raise Unsupported(f"the dataset {prefs.path} changed since the search started")
    tok = pair_tokenizer(req.model, prefs, req.data_cache)
    every = token_pairs(prefs, tok)
    kept = [p for p in every if len(p[0]) < cfg.max_length]  # TRL drops a pair whose prompt fills max_length
    if not kept:
        raise Unsupported(f"every pair's prompt fills max_length={cfg.max_length}: TRL drops them all")
    pad_max = cfg.batching == "pad_max"
    mb = cfg.micro_batch_size
    longest = sorted(range(len(kept)), key=lambda k: -PairLengths(*map(len, kept[k])).longest)
    order = epoch_order(len(kept), req.data_seed)
    # the data's mean micro-batch, as the search's expectation counts it (data/shapes.py)
    real, tensor = micro_batch_means(pair_lengths(every), cfg.max_length, mb, pad_max, req.data_seed)
    drawn = [order[k % len(order)] for k in range(max(n - mb, 0))]
    ids = [kept[k] for k in (longest[:mb] + drawn)]
    return Pairs(ids, tok.pad_id, cfg.max_length, pad_max, tensor, real, len(every) - len(kept), len(kept))


def _dataset(pairs: Pairs) -> Dataset:
    from datasets import Dataset  # type: ignore[import-untyped,unused-ignore]

    return Dataset.from_dict({"prompt_ids": [p for p, _, _ in pairs.ids], "chosen_ids": [c for _, c, _ in pairs.ids],
                              "rejected_ids": [r for _, _, r in pairs.ids]})


def pad_tokenizer(pad_id: int) -> Any:
    """What DPOTrainer needs of a tokenizer when the pairs come tokenized: a pad token in its vocabulary (the
    collator pads with its id; the attention mask hides it)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<pad>": pad_id}, unk_token="<pad>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<pad>")


PASS_WARMUP_BATCHES = 2
"""Batches of the precomputed pass left out of its cost per pair: the process's first forwards (the BLAS
handles, each new shape's kernels), which a pass over a whole dataset pays once and the probe's few pairs
would spread over each pair (S7: 0.116 s a pair over 48 pairs, ~0.06 s in a step)."""


class Timed:
    """The precomputed reference pass as TRL runs it inside DPOTrainer's constructor: the model's hash (its cache
    key, over every weight: paid once a run) and each batch of the pass (the pairs in it, its seconds)."""

    def __init__(self) -> None:
        self.precompute_seconds = 0.0
        self.hash_seconds = 0.0
        self.batches: list[tuple[int, float]] = []
        self._inside = False
        self._last: tuple[int, float] | None = None

    def pass_started(self) -> None:
        self._inside = True

    def batch_started(self, pairs: int) -> None:
        """A batch of the pass begins: the one before it ends now."""
        now = time.perf_counter()
        if self._inside:
            self._close(now)
            self._last = (pairs, now)

    def pass_ended(self, seconds: float) -> None:
        """The pass is over (its last batch ends with the pass's own gathering), after `seconds` in all."""
        self._close(time.perf_counter())
        self._inside = False
        self.precompute_seconds = seconds

    def _close(self, now: float) -> None:
        if self._last is not None:
            self.batches.append((self._last[0], now - self._last[1]))
        self._last = None

    def seconds_per_pair(self) -> float:
        """The pass's seconds per pair past its first batches (all of them where there are no more)."""
        steady = self.batches[PASS_WARMUP_BATCHES:] if len(self.batches) > PASS_WARMUP_BATCHES else self.batches
        pairs = sum(n for n, _ in steady)
        return sum(t for _, t in steady) / pairs if pairs else 0.0


def trainer_class(timed: Timed) -> Any:
    """DPOTrainer, passing tokenized pairs through (`_prepare_dataset` tokenizes text rows only) and timing
    the precomputed reference pass, batch by batch, into `timed`."""
    from trl.trainer.dpo_trainer import DPOTrainer

    class ProbeDPOTrainer(DPOTrainer):

        def _prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, dataset_name: str) -> Any:
            if "prompt_ids" in dataset.column_names:
                return dataset
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

        def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
            t0 = time.perf_counter()
            timed.pass_started()
            try:
                return super()._precompute_ref_logps(dataset, name, batch_size)
            finally:
                timed.pass_ended(time.perf_counter() - t0)

        def compute_ref_log_probs(self, model: Any, inputs: Any) -> Any:
            timed.batch_started(int(inputs["input_ids"].shape[0]) // 2)  # chosen and rejected rows
            return super().compute_ref_log_probs(model, inputs)  # type: ignore[no-untyped-call]

    return ProbeDPOTrainer


@contextlib.contextmanager
def held(announce: Callable[[str], None], timing: bool) -> Iterator[None]:
    """While `timing`: the runner told that a timed phase runs (it holds standbys still importing), then told it
    ended; as the timing callback does around the timed steps."""
    if timing:
        announce("start")
    try:
        yield
    finally:
        if timing:
            announce("end")


@contextlib.contextmanager
def timed_model_hash(timed: Timed) -> Iterator[None]:
    """TRL hashes every weight of the reference (`hash_module`, the key of its on-disk cache of the pass) in
    DPOTrainer's constructor when it precomputes: seconds a run pays once, timed into `timed`."""
    import trl.trainer.dpo_trainer as dpo_trainer

    names = vars(dpo_trainer)  # the name DPOTrainer's constructor calls it by
    original = names["hash_module"]

    def hashed(module: Any) -> str:
        t0 = time.perf_counter()
        try:
            return str(original(module))
        finally:
            timed.hash_seconds += time.perf_counter() - t0

    names["hash_module"] = hashed
    try:
        yield
    finally:
        names["hash_module"] = original


def dpo_arguments(req: ProbeRequest, out: str, steps: int, pairs: Pairs) -> dict[str, Any]:
    """DPOConfig's keyword arguments: the recipe's TrainingArguments (DPOConfig is one) and TRL's own."""
    cfg = req.config
    kw = recipe.training_arguments(cfg, on_cpu=req.device == "cpu", max_steps=steps,
                                   gradient_accumulation_steps=req.probe_accumulation)
    kw.update(output_dir=out, logging_steps=1, disable_tqdm=True, max_length=cfg.max_length,
              train_sampling_strategy="sequential", dataloader_drop_last=False,
              # explicit: DPOConfig's own default is on (TrainingArguments' off)
              gradient_checkpointing=kw["activation_checkpointing"],
              pad_to_multiple_of=cfg.max_length if pairs.pad_max else None)
    return kw


def train_dpo(req: ProbeRequest, state: ProbeState, policy: Model, reference: Model | None, peft_config: Any,
              pairs: Pairs, sync: Callable[[], object],
              announce: Callable[[str], None]) -> tuple[Trained, dict[str, Any], list[float], GateResult | None]:
    """Warm-up and timed optimizer steps through DPOTrainer; (what trained, DPO's figures, the logged losses, the
    correctness gate's verdict). A kernel config is first checked against stock DPO on the first pair, on the
    trainer's own model (`gate.run_dpo_gate`); GateFailed where it differs."""
    from transformers import TrainerCallback
    from trl.trainer.dpo_config import DPOConfig

    cfg, ga = req.config, req.probe_accumulation
    assert state.mem is not None
    plan = TimingPlan(req.warmup_steps, req.timed_steps, req.extra_timed_steps,
                      req.config_accumulation - ga, announce)
    cb = state.callback = make_callback(state.mem, sync, plan)
    if not isinstance(cb, TrainerCallback):
        raise TypeError(f"autofit: the timing callback {type(cb).__name__} is not a TrainerCallback")
    per_step = ga * cfg.micro_batch_size
    cb.step_cost = lambda step: float(sum(
        pairs.micro_batch_tensor(step * per_step + m * cfg.micro_batch_size, cfg.micro_batch_size) + HALF_TOKENS
        for m in range(ga)))
    keep_checkpointing_as_asked()  # TRL's reference forward would leave every layer checkpointed, none offloaded
    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(**dpo_arguments(req, out, plan.most_steps, pairs))
        timed = Timed()
        # the pass and the hash run in the constructor: timed as the steps are, other probes' imports held
        with timed_model_hash(timed), held(announce, cfg.precompute_ref_log_probs):
            trainer = trainer_class(timed)(model=policy, ref_model=reference, args=args,
                                           train_dataset=_dataset(pairs), processing_class=pad_tokenizer(pairs.pad_id),
                                           peft_config=peft_config, callbacks=[cb])
        state.stage = "check"
        gate = run_dpo_gate(req, state, trainer, pairs.ids[0], pairs.pad_id)
        if gate is not None and not gate.ok:
            raise GateFailed(gate)
        state.stage = "setup"
        model = trainer.model
        hook = model.register_forward_hook(cb.forward_hook)
        cb.trainer = trainer
        trainer.train()
        hook.remove()
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        logged = [h for h in trainer.state.log_history if "loss" in h]
        losses = [float(h["loss"]) for h in logged]
    cb.stop_timing()
    sync()
    state.mem.stop()
    # the pass's cost per trained pair over one epoch: its steady seconds a pair, and the model's hash once over
    # the dataset's pairs (without a dataset the run's length is unknown: the hash is reported, not counted)
    pass_s = timed.seconds_per_pair() + (timed.hash_seconds / pairs.epoch_pairs if pairs.epoch_pairs else 0.0)
    extra: dict[str, Any] = {"precompute_seconds": round(timed.precompute_seconds, 4),
                                "precompute_pairs": len(pairs.ids) if cfg.precompute_ref_log_probs else 0,
                                "precompute_hash_seconds": round(timed.hash_seconds, 4),
                                "precompute_batches": [(n, round(t, 5)) for n, t in timed.batches],
                                "precompute_s_per_pair": round(pass_s, 6) if cfg.precompute_ref_log_probs else 0.0,
                                "reference": "separate model" if reference is not None else (
                                    "precomputed" if cfg.precompute_ref_log_probs else "adapter disabled"),
                                "dpo_last_log": {k: v for k, v in (logged[-1] if logged else {}).items()
                                                 if k.startswith(("rewards/", "logps/", "loss", "grad_norm"))}}
    return Trained(trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
                   total=sum(p.numel() for p in model.parameters()), n_layers=len(decoder_layers(model)),
                   train_seconds=time.perf_counter() - state.t_start, optimizer=describe_optimizer(optimizer),
                   engine={}, bnb_modules=sum(type(m).__module__.startswith("bitsandbytes")
                                              for m in model.modules())), extra, losses, gate


def dpo_figures(req: ProbeRequest, state: ProbeState, trained: Trained, pairs: Pairs,
                extra: dict[str, Any]) -> ProbeResult:
    """The SFT probe's figures (memory, steps, stability), with DPO's speed: pairs/s and tokens/s of both
    rows at the data's mean micro-batch, a precomputed reference pass paid once (over one epoch)."""
    cfg, cb = req.config, state.callback
    assert cb is not None
    res = figures(req, state, trained)
    real = cb.real_seconds()[-req.timed_steps:]
    first = len(cb.steps) - len(real)
    per_step = req.probe_accumulation * cfg.micro_batch_size
    pre = float(extra["precompute_s_per_pair"])  # the pass's seconds a pair, over one epoch
    # each step's mean micro-batch (tensor tokens) and its seconds per micro-batch at the config's accumulation
    xs = [statistics.fmean(pairs.micro_batch_tensor((first + k) * per_step + m * cfg.micro_batch_size,
                                                    cfg.micro_batch_size) for m in range(req.probe_accumulation))
          for k in range(len(real))]
    us = [t / req.config_accumulation for t in real]
    a, b = micro_batch_time_model(xs, us)
    pairs_s, tokens_s = [], []
    for x, u in zip(xs, us, strict=True):
        # seconds of the data's mean micro-batch: this step's, brought there by the window's own time model
        mean_s = u - b * (x - pairs.mean_tensor)
        if mean_s <= 0:
            mean_s = a + b * pairs.mean_tensor
        pair_s = mean_s / cfg.micro_batch_size + pre
        pairs_s.append(1 / pair_s)
        tokens_s.append(pairs.mean_real / cfg.micro_batch_size / pair_s)
    res.tokens_per_s, res.tokens_per_s_min, res.tokens_per_s_max = (statistics.median(tokens_s), min(tokens_s),
                                                                     max(tokens_s))
    res.pairs_per_s = statistics.median(pairs_s)
    res.noisy = spread(tokens_s) > SPREAD_BOUND
    res.extra.update(extra, trainer="dpo", pairs_per_s=res.pairs_per_s,
                     tokens_per_pair=round(pairs.mean_real / cfg.micro_batch_size, 2),
                     mean_micro_batch_tensor_tokens=round(pairs.mean_tensor, 2), pairs_dropped=pairs.dropped,
                     heaviest_tensor_tokens=pairs.micro_batch_tensor(0, cfg.micro_batch_size),
                     time_model={"seconds_per_micro_batch": a, "seconds_per_tensor_token": b})
    return res
