"""The seam between the rollout processes and trainer rank 0: what ``batches`` and each engine's
``orders`` must be.  The local launcher passes ``multiprocessing`` queues, the Ray launcher
boxes of one mailbox actor (arl/cluster/mailbox.py); the rollout worker and
``arl.trainer.link.RolloutLink`` use only this."""
from __future__ import annotations

from typing import Any, Optional, Protocol


class Channel(Protocol):
    def put(self, item: Any) -> None:
        """Hand ``item`` over (a tuple of picklable parts; see arl/rollout/worker.py)."""

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        """The next item; raises ``queue.Empty`` (or a subclass) when ``timeout`` passes first."""
