"""An engine that Ray restarted (arl/trainer/restarts.py, arl/trainer/link.py): where it starts, the
weights and evaluations it is sent, without processes (tests/test_ray_launcher.py kills a real one)."""
import queue
from types import SimpleNamespace

import pytest

from arl.config import load_config
from arl.trainer.link import RolloutLink
from arl.trainer.restarts import resync_engine
from arl.trainer.step_log import OrderedLog


class _Logger:
    def __init__(self):
        self.records = {}

    def log(self, step, rec, wall_s):
        self.records[step] = rec


def _link(engines=2):
    return RolloutLink(queue.Queue(), [queue.Queue() for _ in range(engines)], on_eval=lambda v, s: None)


def _orders(q):
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def test_restarted_engine_starts_at_its_next_batch_with_the_current_weights(capsys):
    cfg = load_config(None, ["env.eval_tasks=4"])
    link = _link()
    link.start(5)  # a resumed run: the engines started at batch 5
    _orders(link.orders[0]), _orders(link.orders[1])
    for e in (0, 0, 0, 1):  # engine 0 delivered batches 5, 6, 7; engine 1 batch 5
        link._take(("batch", e, object()))
    log = OrderedLog(_Logger(), {6, 7, 8})
    log.eval_result(6, 0.5)
    sync = SimpleNamespace(mode="file", last=("/dev/shm/arl-weights-1/v8", 8, {"k": 1}))
    resync_engine(1, link, sync, log, cfg)
    assert _orders(link.orders[1]) == [("start", 6), ("weights", "/dev/shm/arl-weights-1/v8", 8, {"k": 1})]
    resync_engine(0, link, sync, log, cfg)  # engine 0 also evaluates: 7 is lost, 8 is ordered again
    assert _orders(link.orders[0]) == [("start", 8), ("weights", "/dev/shm/arl-weights-1/v8", 8, {"k": 1}),
                                       ("eval", 8, 4)]
    assert log.unanswered(8) == [8] and 7 not in log.eval_versions
    out = capsys.readouterr().out
    assert "arl.train: engine 0 restarted: it makes batch 8 on, with the weights of version 8" in out
    assert "held-out evaluation of version 7 lost with engine 0's restart; its record has none" in out


def test_restart_before_the_first_sync_and_under_the_group_sync():
    cfg = load_config(None)
    link = _link(1)
    resync_engine(0, link, None, None, cfg)  # the first sync's order comes after "start"
    assert _orders(link.orders[0]) == [("start", 0)]
    with pytest.raises(RuntimeError, match="cannot rejoin the weight-sync group yet"):
        resync_engine(0, link, SimpleNamespace(mode="group", last=None), None, cfg)


def test_link_hands_a_restart_to_its_handler():
    seen = []
    link = RolloutLink(queue.Queue(), [queue.Queue()], on_eval=lambda v, s: None, on_restart=seen.append)
    link.batches.put(("restarted", 0))
    assert link.poll(0.1) and seen == [0]


def test_dropped_evaluation_lets_the_record_through():
    logger = _Logger()
    log = OrderedLog(logger, {1, 2})
    log.add(1, {"a": 1.0}, 0.0)
    assert logger.records == {} and log.waiting()
    log.drop_eval(1)
    assert logger.records == {1: {"a": 1.0}} and "success/heldout" not in logger.records[1]


def test_restarted_worker_ignores_orders_until_start():
    """The orders its former self left in the queue (old weights, an evaluation) are skipped; from
    ``start`` on it obeys."""
    import asyncio

    from arl.rollout.worker import RolloutHooks, RolloutWorker

    orders = queue.Queue()
    for msg in [("weights", "/gone/v3", 3, None), ("eval", 3, 4), ("start", 6), ("weights", "/shm/v8", 8, None),
                ("stop",)]:
        orders.put(msg)
    w = RolloutWorker(load_config(None), "unused", queue.Queue(), orders, 0, RolloutHooks(), None, restarted=True)
    loaded = []

    async def load(source, version, chooser):
        loaded.append((source, version))

    async def evaluate(*a):
        loaded.append(("eval",) + a)

    w._load_weights, w._evaluate = load, evaluate
    asyncio.run(w._take_orders())
    assert loaded == [("/shm/v8", 8)] and w.first_step == 6 and not w.restarted and w.stop.is_set()
