"""Planted-bug tests (issue #54) for the Ray run's mailbox (arl/cluster/mailbox.py), without Ray: the
actor's class on asyncio, the boxes on stand-in handles.  Expectations written out by hand."""
import asyncio
from types import SimpleNamespace

import pytest

from arl.cluster.mailbox import Box, mailbox_class, mailboxes


def test_a_get_without_a_deadline_waits_for_the_item():
    """Plant: ``get(timeout=None)`` not blocking (a waiter with no deadline, e.g. an engine waiting
    for its next order, got Empty at once)."""
    async def run():
        m = mailbox_class()(2)
        waiting = asyncio.ensure_future(m.get(1, None))
        await asyncio.sleep(0.2)
        early = waiting.done()
        await m.put(1, "order")
        return early, await asyncio.wait_for(waiting, 5.0), await m.get(1, 0)

    early, got, after = asyncio.run(run())
    assert early is False and got == (True, "order") and after == (False, None)


class _Recorder:
    """A stand-in actor handle whose ``get.remote`` records (box, timeout) and finds an item."""

    def __init__(self):
        self.calls = []
        self.get = SimpleNamespace(remote=lambda box, timeout: self.calls.append((box, timeout)) or (True, "x"))


def test_a_box_passes_no_deadline_as_none(monkeypatch):
    """The same plant on the box's side: ``Box.get()`` must ask the actor with timeout None (wait),
    ``block=False`` with 0 (take what is there), a timeout as given."""
    import ray

    monkeypatch.setattr(ray, "get", lambda x: x)
    h = _Recorder()
    box = Box(h, 2)
    for kw in ({}, {"timeout": None}, {"block": True, "timeout": None}, {"block": False}, {"timeout": 1.5}):
        assert box.get(**kw) == "x"
    assert h.calls == [(2, None), (2, None), (2, None), (2, 0), (2, 1.5)]


class _FakeRay:
    """What ``mailboxes`` calls of Ray: ``remote(cls).options(...).remote(boxes)``; records boxes."""

    def __init__(self):
        self.boxes = None

    def remote(self, cls):
        outer = self

        class Actor:
            @staticmethod
            def options(**kw):
                return SimpleNamespace(remote=lambda n: setattr(outer, "boxes", n) or "actor")
        return Actor


@pytest.mark.parametrize("engines, world", [(1, 1), (2, 1), (2, 3), (3, 2)])
def test_every_box_has_its_own_number(engines, world):
    """Plant: the ready box numbered so that it collides with the last order box (one trainer rank)
    or the last parts box.  Box 0 the batches, 1..E the orders, E+1..E+W-1 the other ranks' parts,
    E+W the ready box: E + W + 1 boxes."""
    ray = _FakeRay()
    mail = mailboxes(ray, engines, world)
    assert ray.boxes == engines + world + 1
    parts = [b.index for b in mail.parts.boxes]
    assert mail.batches.index == 0 and [b.index for b in mail.orders] == list(range(1, engines + 1))
    assert parts == list(range(engines + 1, engines + world)) and mail.ready.index == engines + world
    every = [0, *[b.index for b in mail.orders], *parts, mail.ready.index]
    assert sorted(every) == list(range(ray.boxes))  # each box once, none outside the actor
