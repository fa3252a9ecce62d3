"""The mailbox of a Ray run (arl/cluster/mailbox.py): the batch queue and the engines' order queues
as boxes of one actor, each box a FIFO with the queue interface the rollout worker and trainer
rank 0 use.  Without Ray: the actor's class run on asyncio, the boxes on a stand-in handle (the
real actor runs in every Ray run of the suite)."""
import asyncio
import pickle
import queue

import pytest

from arl.cluster.mailbox import Box, mailbox_class


def test_boxes_are_separate_fifos_and_a_get_times_out():
    async def run():
        m = mailbox_class()(3)
        await m.put(0, "a")
        await m.put(2, "x")
        await m.put(0, "b")
        got = [await m.get(0, 1.0), await m.get(0, 1.0), await m.get(2, 1.0)]
        waiting = asyncio.ensure_future(m.get(1, 5.0))  # a waiting get does not hold up a put
        await asyncio.sleep(0)
        await m.put(1, "late")
        return got, await waiting, await m.get(1, 0.05)

    got, late, empty = asyncio.run(run())
    assert got == [(True, "a"), (True, "b"), (True, "x")] and late == (True, "late") and empty == (False, None)


class _Handle:
    """A stand-in for the actor handle: ``method.remote`` runs the method on a local actor."""

    def __init__(self, actor):
        self.actor = actor
        self.put = self._method("put")
        self.put_many = self._method("put_many")
        self.get = self._method("get")

    def _method(self, name):
        actor = self.actor

        class M:
            @staticmethod
            def remote(*args):
                return asyncio.run(getattr(actor, name)(*args))
        return M


def test_a_box_is_a_queue(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda x: x)
    handle = _Handle(mailbox_class()(2))
    batches, orders = Box(handle, 0), Box(handle, 1)
    batches.put(("batch", 0))
    orders.put(("stop",))
    assert batches.get(timeout=1.0) == ("batch", 0) and orders.get() == ("stop",)
    with pytest.raises(queue.Empty):
        batches.get(timeout=0.01)
    with pytest.raises(queue.Empty):
        orders.get(block=False)
    orders.put(("start", 2))
    assert orders.get(block=False) == ("start", 2)  # what is there is taken without waiting
    assert pickle.loads(pickle.dumps(Box("handle", 3))).index == 3  # boxes travel to the actors


def test_each_rank_fetches_its_part_from_the_object_store(monkeypatch):
    """Rank 0 keeps part 0 and posts a reference to each other rank's part in that rank's box (the
    box holds the reference, not the part), all in one call; rank r fetches its part, in order,
    step after step."""
    import ray

    from arl.cluster.mailbox import RankParts

    class Ref:  # what ray.put returns: a reference the object store resolves
        def __init__(self, value):
            self.value = value

    store = []
    monkeypatch.setattr(ray, "put", lambda v: store.append(v) or Ref(v))
    handle = _Handle(mailbox_class()(3))
    calls = []
    many = handle.put_many.remote
    handle.put_many.remote = lambda items: calls.append(len(items)) or many(items)
    handle.put.remote = lambda *a: pytest.fail("rank 0 posts every rank's part in one call")
    parts = RankParts([Box(handle, 1), Box(handle, 2)])  # box 0: the batches, as in mailboxes()
    monkeypatch.setattr(ray, "get", lambda x: x.value if isinstance(x, Ref) else x)
    for step in range(2):
        mbs = [f"s{step}r{r}" for r in range(3)]
        assert parts.scatter(mbs, 0) == mbs[0]
    assert store == ["s0r1", "s0r2", "s1r1", "s1r2"]  # only the other ranks' parts went to the store
    assert calls == [2, 2]  # one mailbox call a step
    held = asyncio.run(handle.actor.get(1, 0))[1]
    assert isinstance(held, list) and isinstance(held[0], Ref)  # the box holds a reference
    assert [parts.scatter(None, 2), parts.scatter(None, 2)] == ["s0r2", "s1r2"]
    assert parts.scatter(None, 1) == "s1r1"  # (its step-0 reference was taken above)
    # it travels to the trainer actors (a real handle pickles; the stand-in's local actor would not)
    assert pickle.loads(pickle.dumps(RankParts([Box("handle", 1), Box("handle", 2)]))).boxes[1].index == 2
