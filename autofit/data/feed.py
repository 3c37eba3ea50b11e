"""What the probe child trains on with `--dataset`: the strategy's seeded micro-batches, the
heaviest micro-batch (run once for worst-case memory), and the counts behind the objective
(trained tokens, pad fraction). torch is imported by the collators only, when a batch is built.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .batching import Batching, BatchPlan, MicroBatch, plan
from .collate import collate


@dataclass(frozen=True)
class Feed:
    strategy: Batching
    plan: BatchPlan
    token_ids: Sequence[Sequence[int]]
    pad_id: int
    flatten_packed: bool = False

    def batch(self, mb: MicroBatch) -> dict[str, Any]:
        return collate(self.strategy, mb, self.token_ids, self.pad_id, self.plan.max_length, self.flatten_packed)

    def micro_batches(self, n: int) -> Iterator[tuple[MicroBatch, dict[str, Any]]]:
        """The first `n` micro-batches of the plan, cycling if the data is shorter."""
        batches = self.plan.batches
        for k in range(n):
            mb = batches[k % len(batches)]
            yield mb, self.batch(mb)

    def heaviest(self) -> tuple[MicroBatch, dict[str, Any]]:
        return self.plan.heaviest, self.batch(self.plan.heaviest)


def make_feed(strategy: Batching, token_ids: Sequence[Sequence[int]], pad_id: int, max_length: int,
              micro_batch_size: int, seed: int = 0, flatten_packed: bool = False) -> Feed:
    lengths = [len(t) for t in token_ids]
    return Feed(strategy, plan(strategy, lengths, max_length, micro_batch_size, seed), token_ids, pad_id,
                flatten_packed)


def trained_tokens_per_second(batches: Sequence[MicroBatch], seconds: float) -> float:
    """The objective: tokens that carry a label (after the shift), per second."""
    return sum(b.trained_tokens for b in batches) / seconds if seconds > 0 else 0.0
