"""An engine that Ray restarted (arl/trainer/restarts.py, arl/trainer/link.py): where it starts, the
weights and evaluations it is sent, and the new weight-sync group every engine joins (gloo, threads),
without processes (tests/test_ray_launcher.py and tests/test_ray_nodes.py kill real ones)."""
import contextlib
import queue
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from arl.config import load_config
from arl.rollout.weight_sync import WeightSyncWorkerExtension
from arl.trainer.link import RolloutLink
from arl.trainer.restarts import resync_engine
from arl.trainer.step_log import OrderedLog

# every test here takes under 4 s (2 CPU cores, -n 2); a regression in the group's epochs or its
# rendezvous hangs instead of failing, so a minute, not pytest.ini's 900 s, names the test that hung
pytestmark = pytest.mark.timeout(60)

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


def test_restart_answered_inside_a_sync_leaves_that_versions_evaluation_to_the_sync(capsys):
    """A restart answered while version 8's group forms (``in_sync``): 8's evaluation is ordered by
    the sync itself right after (not twice); 7's was lost with the engine."""
    cfg = load_config(None, ["env.eval_tasks=4"])
    link = _link(1)
    log = OrderedLog(_Logger(), {7, 8})
    sync = SimpleNamespace(mode="file", last=("/dev/shm/arl-weights-1/v8", 8, None), in_sync=8)
    resync_engine(0, link, sync, log, cfg)
    assert _orders(link.orders[0]) == [("start", 0), ("weights", "/dev/shm/arl-weights-1/v8", 8, None)]
    assert log.unanswered(8) == [8] and 7 not in log.eval_versions
    assert "held-out evaluation of version 7 lost with engine 0's restart" in capsys.readouterr().out


def test_restart_before_the_first_sync_and_under_the_group_sync(capsys):
    cfg = load_config(None)
    link = _link(1)
    resync_engine(0, link, None, None, cfg)  # the first sync's order comes after "start"
    assert _orders(link.orders[0]) == [("start", 0)]
    rejoined = []
    sync = SimpleNamespace(mode="group", last=(None, 3, None), rejoin=lambda: rejoined.append(1))
    resync_engine(0, link, sync, None, cfg)  # the weights come over a new group, to every engine
    assert _orders(link.orders[0]) == [("start", 0)] and rejoined == [1]
    assert "engine 0 restarted: it makes batch 0 on, with the weights of version 3" in capsys.readouterr().out


class _Engine(threading.Thread):
    """An engine's one worker, in a thread: takes its orders like the rollout worker (join_sync,
    weights; the stand-in model runner keeps what it loads), until "stop"."""

    def __init__(self, orders, ignore_before_start=False, die_at_join=None):
        super().__init__(daemon=True)
        self.orders, self.skip, self.die_at_join = orders, ignore_before_start, die_at_join
        self.loaded, self.versions, self.ranks = {}, [], []

    def run(self):
        ext = _Worker(self.loaded)
        while True:
            msg = self.orders.get(timeout=60)
            if self.skip and msg[0] != "start":
                continue  # a restarted engine: its former self's orders
            if msg[0] == "start":
                self.skip = False
            elif msg[0] == "join_sync" and self.die_at_join:  # dies with the order taken (ARL_TEST_KILL_ENGINE=<e>:join)
                if self.die_at_join == "after_taking_its_rank":  # ... and a rank in the group, beating once
                    import datetime

                    import torch.distributed as dist

                    host, port, n, _, epoch = msg[1:]
                    run = dist.TCPStore(host, int(port), n, is_master=False, timeout=datetime.timedelta(seconds=60))
                    group = dist.PrefixStore(f"arl-weight-sync/{epoch}", run)
                    group.add(f"beat/{int(group.add('receivers', 1))}", 1)
                return
            elif msg[0] == "join_sync":
                self.ranks.append(ext.arl_join_weight_sync(*msg[1:5], 60.0, msg[5]))
            elif msg[0] == "weights":
                n = ext.arl_receive_weights(msg[1].meta, msg[1].buckets)
                self.versions.append(msg[2] if n > 0 else ("broken", msg[2]))
            elif msg[0] == "stop":
                return


class _Worker(WeightSyncWorkerExtension):
    device = torch.device("cpu")
    model_config = SimpleNamespace(hf_text_config=SimpleNamespace(tie_word_embeddings=False))

    def __init__(self, loaded):
        self._loaded = loaded

    def reload_weights(self, weights_iterator, is_checkpoint_format):
        for name, t in weights_iterator:
            self._loaded[name] = t.clone()


class _Trainer:
    """What the weight sender reads of the trainer: a ZeRO-2 CPU policy's state dict."""
    zero3, device, parking = False, torch.device("cpu"), None

    def __init__(self, zero3=False):
        self.module = torch.nn.Linear(4, 3)
        self.module.get_output_embeddings = self.module.get_input_embeddings = lambda: None  # untied
        self.zero3, self.gathers = zero3, 0

    def full_state_dict(self, to_cpu=True, copy=True):
        self.gathers += 1  # under ZeRO-3 a collective: every rank must call it, never rank 0 alone
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def park(self):
        pass

    def awake(self):
        return contextlib.nullcontext()


@pytest.mark.parametrize("bucket_mb, zero3", [(0, False), (1, False), (1, True)])
@pytest.mark.parametrize("dies", ["between_syncs", "before_a_sync"])
def test_restarted_engine_rejoins_a_new_weight_sync_group(monkeypatch, capsys, bucket_mb, zero3, dies):
    """Group sync (gloo, threads): engines 0 and 1 join group 0 and load version 1; engine 1 dies
    (its thread ends: its connections close, as a killed process's do).  ``between_syncs``: its
    restart is answered (``resync_engine``) before the next sync.  ``before_a_sync``: the trainer
    syncs version 2 first: the broadcast fails, trainer and engine 0 leave group 0 (one line; the
    engine keeps waiting), then the restart comes.  Either way every engine joins group 1 and loads
    the current weights; the next version reaches both over it, bitwise.  Under ZeRO-3 rank 0 resends
    its host copy of the last sync (gathering is every rank's collective, and only rank 0 is there)."""
    from arl.procs import free_port
    from arl.trainer.sync import WeightSender

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    cfg = load_config(None, ["rollout.weight_sync=group", f"rollout.sync_bucket_mb={bucket_mb}", "launcher=ray"])
    link, tr = _link(2), _Trainer(zero3)
    sender = WeightSender(cfg, tr, 0, link, ("127.0.0.1", free_port()))
    assert sender.keep == zero3
    a, b = _Engine(link.orders[0]), _Engine(link.orders[1])
    a.start(), b.start()
    sender(1, None)
    link.send(1, ("stop",))  # engine 1 "dies" after loading version 1
    b.join(timeout=60)
    assert b.versions == [1] and b.ranks and not b.is_alive()
    version = 1
    if dies == "before_a_sync":
        version = _update(tr, 2)
        sender(version, None)  # engine 1 is gone: the broadcast fails, the sync returns
        assert sender.group is None
        assert "arl.train: weight sync group: a broadcast failed (" in capsys.readouterr().out
    c = _Engine(link.orders[1], ignore_before_start=True)  # Ray's restart of engine 1
    c.start()
    link._take(("batch", 0, object()))
    gathers = tr.gathers
    resync_engine(1, link, sender, None, cfg)
    assert sender.epoch == 1 and tr.gathers == gathers + (0 if zero3 else 1)
    version = _update(tr, version + 1)
    sender(version, None)
    want = tr.module.state_dict()
    link.broadcast(("stop",))
    a.join(timeout=60), c.join(timeout=60)
    if dies == "between_syncs":
        assert a.versions == [1, 1, 2] and c.versions == [1, 2]
    else:  # engine 0's load of version 2 broke (or, one broadcast in all, got it before the sender
        # hit the dead member); the group of the restart brought it (again)
        assert a.versions in ([1, ("broken", 2), 2, 3], [1, 2, 2, 3]) and c.versions == [2, 3]
    assert sorted(c.ranks + [a.ranks[-1]]) == [1, 2]  # group 1 numbered its receivers afresh
    for e in (a, c):
        assert sorted(e.loaded) == sorted(want)
        for k in want:
            assert torch.equal(e.loaded[k], want[k]), k
    sender.close()


@pytest.mark.parametrize("zero3", [False, True])
@pytest.mark.parametrize("dies", ["before_taking_a_rank", "after_taking_its_rank"])
def test_engine_that_dies_before_the_first_group_forms(monkeypatch, capsys, zero3, dies):
    """Engine 1 dies on its first join order, before or after taking its rank in group 0 (then every
    rank is taken, but it beats no more); engine 0 has taken its rank and waits.  Nobody enters group
    0's rendezvous (it would wait for the dead one until the timeout): the trainer answers the engines
    meanwhile, the restarted engine 1's "restarted" (a second later) brings every engine into group 1
    (engine 0 gives group 0 up), and version 1 reaches both over it, bitwise."""
    from arl.procs import free_port
    from arl.trainer import sync as sync_mod

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setattr(sync_mod, "JOIN_TIMEOUT_S", 60.0)  # a regression fails in a minute, not half an hour
    cfg = load_config(None, ["rollout.weight_sync=group", "launcher=ray"])
    tr, senders = _Trainer(zero3), []
    link = RolloutLink(queue.Queue(), [queue.Queue(), queue.Queue()], on_eval=lambda v, s: None,
                       on_restart=lambda e: resync_engine(e, link, senders[0], None, cfg))
    senders.append(sync_mod.WeightSender(cfg, tr, 0, link, ("127.0.0.1", free_port())))
    a, dead = _Engine(link.orders[0]), _Engine(link.orders[1], die_at_join=dies)
    c = _Engine(link.orders[1], ignore_before_start=True)  # Ray's restart of engine 1

    def ray_restarts_it():
        dead.join(timeout=60)
        time.sleep(1.0)  # Ray notices the death and starts the actor again: the others beat meanwhile
        c.start()
        link.batches.put(("restarted", 1))

    a.start(), dead.start()
    threading.Thread(target=ray_restarts_it, daemon=True).start()
    senders[0](1, None)  # returns once group 1 has carried version 1
    assert senders[0].epoch == 1 and senders[0].group is not None and not dead.is_alive()
    want = tr.module.state_dict()
    link.broadcast(("stop",))
    a.join(timeout=60), c.join(timeout=60)
    assert a.ranks[0] == -1 and a.versions == [1] and c.versions == [1] and sorted([a.ranks[1]] + c.ranks) == [1, 2]
    for e in (a, c):
        for k in want:
            assert torch.equal(e.loaded[k], want[k]), k
    assert "engine 1 restarted: it makes batch 0 on, with the weights of version 1" in capsys.readouterr().out
    senders[0].close()


def _update(tr, version: int) -> int:
    with torch.no_grad():
        tr.module.weight.add_(1.0)
    return version


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


def test_engine_stays_shut_after_a_broken_group_sync(capsys):
    """A load that broke (a group member died) leaves the engine's model part old, part new: the
    version stays, generation waits until a later load succeeds; the rollout worker says so in one
    line and goes on taking orders."""
    import asyncio

    from arl.rollout.engine import RolloutEngine, Sample
    from arl.rollout.weight_sync import FromGroup, WeightSyncBroken
    from arl.rollout.worker import RolloutHooks, RolloutWorker

    class Engine(RolloutEngine):
        fail = True

        async def _generate(self, prompts, sampling):
            return [[Sample(token_ids=[1], logprobs=[0.0], text="x", finish_reason="stop")] for _ in prompts]

        async def _load_weights(self, weights_dir):
            pass

        async def _load_from_group(self, source):
            if self.fail:
                raise WeightSyncBroken("weight sync group: a member died mid-sync")

    async def scenario():
        eng = Engine()
        orders = queue.Queue()
        w = RolloutWorker(load_config(None), "unused", queue.Queue(), orders, 1, RolloutHooks())
        w.engine, w.schedule = eng, SimpleNamespace(load_weights=lambda load: load())
        orders.put(("weights", FromGroup([]), 2, None))
        orders.put(("stop",))
        await w._take_orders()
        assert eng.version == 0 and not w.synced.is_set()
        gen = asyncio.create_task(eng.generate([[5]], None))
        await asyncio.sleep(0.05)
        assert not gen.done()  # shut: the model may be half loaded
        eng.fail = False
        await eng.update_weights(FromGroup([]), 2)
        out = await asyncio.wait_for(gen, 5)
        assert eng.version == 2 and out[0][0].version == 2

    asyncio.run(scenario())
    assert ("arl.train: engine 1: weight sync group: a member died mid-sync; waiting for the trainer's new group"
            in capsys.readouterr().out)
