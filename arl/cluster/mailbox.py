"""The batch queue, every engine's order queue, the trainer ranks' micro-batch boxes and the
engines' "up" box of a Ray run, in one actor.  A Ray queue actor per queue (``ray.util.queue.Queue``) would be a process per
queue, each importing Ray; here the queues are boxes of one async actor, and each side holds a
``Box``: the channel the rollout worker and trainer rank 0 expect (arl/rollout/channel.py)."""
from __future__ import annotations

import queue
from typing import Any, List, NamedTuple, Optional


def mailbox_class():
    """The mailbox actor's class: ``boxes`` unbounded FIFO queues, an async actor (a waiting ``get``
    does not hold up a ``put``).  Made here, not at module level, so that cloudpickle ships it by
    value: its worker then imports Ray and asyncio only, not arl (whose package imports torch)."""
    import asyncio as aio

    class MailboxActor:
        def __init__(self, boxes: int):
            self.boxes = [aio.Queue() for _ in range(boxes)]

        async def put(self, box: int, item: Any) -> None:
            self.boxes[box].put_nowait(item)

        async def put_many(self, items: list) -> None:
            """``[(box, item), ...]`` in one call."""
            for box, item in items:
                self.boxes[box].put_nowait(item)

        async def get(self, box: int, timeout: Optional[float]) -> tuple:
            """(True, item), or (False, None) when nothing came within ``timeout`` seconds (0: take
            what is there now; ``wait_for`` with 0 would give up before even a queued item)."""
            try:
                if timeout == 0:
                    return True, self.boxes[box].get_nowait()
                return True, await aio.wait_for(self.boxes[box].get(), timeout)
            except (aio.TimeoutError, aio.QueueEmpty):
                return False, None

    return MailboxActor


class Box:
    """Box ``index`` of a mailbox actor, as a queue: ``put``, and ``get`` that raises
    ``queue.Empty`` when nothing comes in time.  Picklable: it travels to the actors."""

    def __init__(self, actor, index: int):
        self.actor, self.index = actor, index

    def put(self, item: Any) -> None:
        import ray

        ray.get(self.actor.put.remote(self.index, item))

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        import ray

        ok, item = ray.get(self.actor.get.remote(self.index, timeout if block else 0))
        if not ok:
            raise queue.Empty
        return item


class RankParts:
    """Each trainer rank's micro-batches of a step, through Ray's object store: trainer rank 0 (which
    computes the step's advantages and packs for every rank) puts each other rank's part there and
    posts its reference in that rank's box (every rank's in one call to the mailbox); the rank
    fetches its part itself, from the node that holds it.  No pickles through rank 0's ``torch.distributed`` group (the local launcher's
    ``arl.trainer.dist.ScatterParts``); the same ``scatter`` call."""

    def __init__(self, boxes: list):
        self.boxes = boxes  # boxes[r - 1]: trainer rank r's

    def scatter(self, parts, rank: int):
        import ray

        if rank == 0:
            if self.boxes:  # in lists: Ray hands the boxes the references, not the values
                posts = [(box.index, [ray.put(parts[r])]) for r, box in enumerate(self.boxes, start=1)]
                ray.get(self.boxes[0].actor.put_many.remote(posts))
            return parts[0]
        (ref,) = self.boxes[rank - 1].get()
        return ray.get(ref)


class Mail(NamedTuple):
    """A run's mailbox: the actor and its boxes as channels."""
    actor: Any
    batches: Box  # every engine -> trainer rank 0
    orders: List[Box]  # trainer rank 0 -> engine e
    parts: RankParts  # trainer rank 0 -> the other ranks
    ready: Box  # engine -> the launcher: up (colocated: and asleep), arl/rollout/colocate.py


def mailboxes(ray, engines: int, world: int = 1, **options) -> Mail:
    """The mailbox actor of a run with ``engines`` engines and ``world`` trainer ranks, and its boxes."""
    actor = ray.remote(mailbox_class()).options(num_cpus=0, **options).remote(engines + world + 1)
    parts = RankParts([Box(actor, 1 + engines + r) for r in range(world - 1)])
    return Mail(actor, Box(actor, 0), [Box(actor, 1 + e) for e in range(engines)], parts,
                Box(actor, engines + world))
