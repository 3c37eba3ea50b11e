"""The measured batching strategy in the YAML trainers' keys (axolotl, LLaMA-Factory), and what they
cannot reproduce (written as NOT EXPRESSED comments and warned about, as every lost setting is).

Sources: axolotl's config schema (`sample_packing`, `pad_to_sequence_len`, `batch_flattening` which
requires flash attention, `group_by_length`; its multipack binning is not best-fit-decreasing);
LLaMA-Factory's DataArguments (`packing`, `neat_packing` = packing without cross-attention, which
sets packing; `cutoff_len -= 1` when packing; no flattening option; its collator pads to the longest
of a batch, to a multiple of 8).
"""

from __future__ import annotations

from autofit.config.spec import TrialConfig


def axolotl_batching(cfg: TrialConfig) -> tuple[dict[str, object], list[str]]:
    b, flash = cfg.batching, cfg.attn_implementation.startswith("flash_attention")
    if b == "pad_max":
        return {"sample_packing": False, "pad_to_sequence_len": True}, []
    if b in ("pad_longest", "group_by_length"):
        return {"sample_packing": False, "pad_to_sequence_len": False,
                **({"group_by_length": True} if b == "group_by_length" else {})}, []
    if b == "padding_free" and flash:
        return {"sample_packing": False, "pad_to_sequence_len": False, "batch_flattening": True}, []
    if b == "padding_free":
        return {"sample_packing": False, "pad_to_sequence_len": False}, [
            (f"batching=padding_free: axolotl's batch_flattening requires flash attention (measured with "
            f"{cfg.attn_implementation}); written as dynamic padding (pad_longest), slower than measured")]
    return {"sample_packing": True, "pad_to_sequence_len": True}, [
        "batching=packed: axolotl's multipack binning is not best-fit-decreasing; rows fill differently"]


def llama_factory_batching(cfg: TrialConfig, pretraining: bool = False) -> tuple[dict[str, object], list[str]]:
    """`pretraining`: text rows, LLaMA-Factory's `stage: pt`, which refuses neat_packing and packs by joining every
    text into one stream cut into cutoff_len blocks (samples split, attending to each other)."""
    b = cfg.batching
    if b == "packed" and pretraining:
        return {"packing": False}, [
            "batching=packed: LLaMA-Factory's pre-training stage (text rows) packs by joining every text and cutting "
            "the stream into cutoff_len blocks (samples split, attending to each other), and refuses neat_packing; "
            "written as one sample a row (dynamic padding), which trains what was measured, slower"]
    if b == "packed":  # neat_packing: no attention across samples; cutoff_len loses one token when packing
        return {"packing": True, "neat_packing": True, "cutoff_len": cfg.max_length + 1}, [
            "batching=packed: LLaMA-Factory packs by a greedy knapsack, not best-fit-decreasing"]
    out: dict[str, object] = {"packing": False, **({"group_by_length": True} if b == "group_by_length"
                                                   else {})}
    if b == "pad_max":
        return out, [("batching=pad_max: LLaMA-Factory pads to the longest of a batch (a multiple of 8), not "
                     "to cutoff_len; written as dynamic padding, which uses less memory than measured")]
    if b == "padding_free":
        return out, [("batching=padding_free: LLaMA-Factory has no flattening option; written as dynamic "
                     "padding (pad_longest), slower than measured")]
    return out, []
