"""How a verify check records what it found: :class:`Finding` and the per-run collector.

Every check appends failures and warnings here; failures are counted per check (the counts are
always complete) and kept up to ``MAX_FAILURES_PER_CHECK`` per check for the report.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from .models import ExpertName
from .shards import TensorInfo
from .verify_thresholds import MAX_FAILURES_PER_CHECK

__all__ = ["Finding"]


@dataclasses.dataclass
class Finding:
    """One failed check or warning; ``message`` is a full sentence naming what was expected."""

    check: str  # e.g. "structure.index", "fidelity.sqnr", "compute.kernel"
    message: str
    tensor: str | None = None
    shard: str | None = None
    layer: int | None = None
    expert: int | None = None
    proj: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


class _Findings:
    def __init__(self) -> None:
        self.failures: list[Finding] = []
        self.warnings: list[Finding] = []
        self.counts: collections.Counter[str] = collections.Counter()
        self.failed_layers: set[int] = set()

    def fail(self, check: str, message: str, **where: Any) -> None:
        self.counts[check] += 1
        if where.get("layer") is not None:
            self.failed_layers.add(where["layer"])
        if self.counts[check] <= MAX_FAILURES_PER_CHECK:
            self.failures.append(Finding(check, message, **where))

    def warn(self, check: str, message: str, **where: Any) -> None:
        self.warnings.append(Finding(check, message, **where))


def _where(
    ex: ExpertName, info: TensorInfo | None = None, suffix: str | None = None
) -> dict[str, Any]:
    return {
        "tensor": ex.tensor(suffix) if suffix else (info.name if info else ex.module),
        "shard": info.shard if info else None,
        "layer": ex.layer,
        "expert": ex.expert,
        "proj": ex.proj,
    }


def _label(ex: ExpertName) -> str:
    return f"layer {ex.layer} expert {ex.expert} {ex.proj}"
