"""A probe result stored as the search stores it: an Optuna trial with the config's params and the
result in its user attributes, for building `Knowledge` in-process without a study."""

from __future__ import annotations

from typing import Any

from optuna.distributions import CategoricalDistribution
from optuna.trial import FrozenTrial, create_trial

from autofit.config.spec import TrialConfig
from autofit.protocol.result import ProbeResult


def probe_trial(dimensions: dict[str, list[Any]], res: ProbeResult, number: int) -> FrozenTrial:
    """`res` as trial `number` of a study over `dimensions` (a Space's)."""
    c = TrialConfig.from_dict(res.config)
    t = create_trial(params={k: getattr(c, k) for k in dimensions},
                     distributions={k: CategoricalDistribution(v) for k, v in dimensions.items()},
                     value=res.tokens_per_s or 0.0,
                     user_attrs={"kind": "probe", "config_key": c.key(), "result": res.to_dict()})
    t.number = number
    return t
