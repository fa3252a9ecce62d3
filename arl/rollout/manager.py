"""Async rollout manager: many episodes in flight, groups handed to the trainer, bounded staleness.

Scheduling.  Each task seed becomes a group of ``group_size`` episodes (same task, different
samples).  An episode holds one environment from a bounded pool for its whole life, so the pool
size bounds both live environments and concurrent tool calls; the engine batches whatever turns are
pending, so it stays busy while other episodes wait on tools.

Staleness.  Policy version v = the weights after v trainer updates.  A group started at version v
may be consumed at step ``v + max_staleness`` at the latest.  Two rules make that hold:
(1) generation pauses once ``(version + max_staleness + 1) * groups_per_step`` groups have been
started (so at most ``groups_per_step`` unconsumed groups are ever due at a step), and
(2) ``get_batch`` takes the groups that are due first, waiting for them, then the oldest finished
ones.  Finished-but-unconsumed groups are therefore bounded too (the hand-over queue).  The next
batch may be taken once ``step <= version + max_staleness`` (``wait_for_weights`` waits for that).

Mask & filter.  An unrecoverable fault (env failed to start, died) → the trajectory becomes a
MASKED placeholder (all chunk ids -1, reward 0) so the batch keeps its size.  A recoverable fault
(tool timeout, transient error) → the episode is re-run (``rollout.retries`` times, new fault
draws), then FILTERED.  Per batch at most ``rollout.filter_cap`` of the trajectories may be
FILTERED; past the cap the extra ones are kept (``over_cap: keep``: trained with reward 0) or masked.

Configuration: the ``rollout`` section of the training config as is (``arl.config.RolloutConfig``),
plus what the process knows at run time (its share of the groups, the env pool size, the episode
settings, the sampling seed).
"""
from __future__ import annotations

import asyncio
import itertools
import math
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional

import numpy as np

from ..config import RolloutConfig
from ..data.batch import RolloutBatch, placeholder
from ..data.expert import tag_resampled
from ..data.trajectory import Trajectory, TrajectoryStatus
from ..env.base import Environment, Fault
from .engine import RolloutEngine
from .episode import ChatFormat, EpisodeConfig, run_episode


@dataclass
class _Group:
    gid: int
    seed: int
    start_version: int
    trajectories: list = field(default_factory=list)
    done: bool = False
    start: object = None  # IPA StartState every sample of the group starts from (None: the task's start)


def derive_sample_seed(base: int, task_seed: int, sample: int) -> int:
    """Sampling seed of one trajectory (int tuples hash the same in every process)."""
    return hash((int(base), int(task_seed), int(sample))) & 0x7FFFFFFF


class EnvPool:
    """At most ``size`` live environments, created lazily, reused across episodes."""

    def __init__(self, factory: Callable[[], Environment], size: int):
        self.factory, self.size = factory, size
        self._free: list = []
        self._sem = asyncio.Semaphore(size)
        self.in_use = 0
        self.peak_in_use = 0

    async def acquire(self) -> Environment:
        await self._sem.acquire()
        self.in_use += 1
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return self._free.pop() if self._free else self.factory()

    async def release(self, env: Environment, broken: bool = False) -> None:
        self.in_use -= 1
        if broken:  # a dead sandbox is not handed out again
            try:
                await env.close()
            except Exception:
                pass
        else:
            self._free.append(env)
        self._sem.release()

    async def close(self) -> None:
        envs, self._free = self._free, []
        for e in envs:
            await e.close()


REWARD_EXCEPTIONS_SHOWN = 3  # reward exceptions printed per manager; all are counted


class RolloutManager:
    def __init__(self, engine: RolloutEngine, env_factory: Callable[[], Environment], tokenizer_or_format,
                 tasks: Iterable[int] | None = None, config: RolloutConfig | None = None, *,
                 groups_per_step: Optional[int] = None, pool_size: int = 32, episode: Optional[EpisodeConfig] = None,
                 seed: Optional[int] = None, start_for: Callable | None = None, imitate_once_per_group: bool = True,
                 task_row: Callable[[int], dict] | None = None, first_step: Optional[int] = None,
                 in_order: bool = False, task_origin: Callable[[int], str] | None = None):
        """``config``: the ``rollout`` section (group size, staleness, retries, filter cap).
        ``groups_per_step``: groups in one batch (default ``config.tasks_per_step``; an engine's share
        when several engines split a batch).  ``pool_size``: live environments = episodes (and tool
        calls) in flight.  ``seed``: sampling seeds derive from it (None: engine randomness).
        ``start_for``: the IPA chunk-initialization hook, ``async (task_seed) -> StartState | None``;
        a group whose task gets a state starts every sample from that expert prefix and its
        trajectories are tagged (``ipa_prefix_chunks``; ``ipa_imitate`` on sample 0 only when
        ``imitate_once_per_group``, else on all).  ``task_row``: task seed -> the dataset row the
        environment's reset gets (``env.dataset``; None: the env makes the task from the seed).
        ``first_step``: the index of the first batch this manager hands over (default: the engine's
        version; a resumed run whose checkpoint holds the batches that were in flight starts after
        them).  ``in_order``: a reproducible run (``trainer.deterministic``): batch k is groups
        [k*G, (k+1)*G) whatever finishes first, and new weights wait until the started groups are
        done, so every group samples from its start version alone."""
        self.engine, self.task_row, self.task_origin = engine, task_row, task_origin  # origin: seed -> "file line n"
        self.start_for, self.imitate_once = start_for, imitate_once_per_group
        self.cfg = config if config is not None else RolloutConfig()
        self.groups_per_step = int(groups_per_step if groups_per_step is not None else self.cfg.tasks_per_step)
        if self.groups_per_step < 1 or pool_size < 1:
            raise ValueError(f"RolloutManager: groups_per_step ({self.groups_per_step}) and pool_size ({pool_size}) "
                             "must be >= 1")
        self.episode = episode if episode is not None else EpisodeConfig()
        self.seed = seed
        self.fmt = tokenizer_or_format if isinstance(tokenizer_or_format, ChatFormat) else ChatFormat(tokenizer_or_format)
        self.pool = EnvPool(env_factory, pool_size)
        self._tasks: Iterator[int] = iter(tasks if tasks is not None else itertools.count())
        # versions are the engine's; step counts from the version the manager starts at (a
        # resumed trainer at step s starts with an engine at version s), or from ``first_step``
        # past the batches the checkpoint held; the gate counts groups from there
        self.version = engine.version
        self.step = self._base = engine.version if first_step is None else int(first_step)  # the next batch's index
        self.in_order = in_order
        self._groups: list = []  # started, not yet consumed (oldest first)
        self._started = 0
        self._extra = 0  # groups taken by get_groups (dynamic sampling): each lets one more start
        self._cond = asyncio.Condition()
        self._producer: asyncio.Task | None = None
        self._tasks_running: set = set()
        self._error: BaseException | None = None
        self._exhausted = False
        self.counters = Counter()

    # --- lifecycle ---
    async def start(self) -> None:
        if self._producer is None:
            self._producer = asyncio.create_task(self._produce())

    async def stop(self) -> None:
        tasks = list(self._tasks_running) + ([self._producer] if self._producer else [])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._producer = None
        await self.pool.close()

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc):
        await self.stop()

    # --- trainer side ---
    def due(self) -> bool:
        """The next batch may be taken: its step is within ``staleness`` of the policy version."""
        return self.step <= self.version + self.cfg.staleness

    async def wait_for_weights(self) -> None:
        """Until ``due()``: the trainer has synced the weights the next batch needs."""
        async with self._cond:
            while not self.due():
                await self._cond.wait()

    async def update_weights(self, weights_dir: str | os.PathLike, version: int | None = None) -> None:
        """Sync the trainer's weights into the engine; opens the generation gate by one step."""
        if self.in_order:
            async with self._cond:
                while not self._settled():
                    await self._cond.wait()
        await self.engine.update_weights(weights_dir, version)
        async with self._cond:
            self.version = self.engine.version
            self._cond.notify_all()

    async def get_batch(self) -> RolloutBatch:
        """The next step's groups (waits for them).  Every trajectory in it has
        ``step - policy_version <= max_staleness`` where step counts batches consumed before it."""
        G, k = self.groups_per_step, self.cfg.staleness
        if not self.due():
            raise ValueError(f"get_batch: step {self.step} is more than max_staleness={k} ahead of the "
                             f"policy version {self.version}; call update_weights first")
        await self.start()
        async with self._cond:
            while True:
                self._raise_if_failed()
                finished = [g for g in self._groups if g.done]
                if self.in_order:
                    picked = self._oldest(G)
                    if picked is not None:
                        break
                else:
                    due = [g for g in self._groups if g.start_version + k <= self.step]
                    if all(g.done for g in due) and len(finished) >= G:
                        picked = due + [g for g in sorted(finished, key=lambda g: (g.start_version, g.gid))
                                        if g not in due]
                        break
                if self._exhausted and not self._tasks_running and len(finished) < G:
                    raise ValueError("tasks: exhausted before a full batch could be formed")
                await self._cond.wait()
            self.step += 1
            return self._hand_over(picked[:G])

    async def get_groups(self, n: int) -> RolloutBatch:
        """``n`` more groups for the batch ``get_batch`` just returned (dynamic sampling's refill):
        the step does not advance, and the generation gate opens by ``n`` groups so the pipeline
        keeps its depth.  Every group taken was started within ``max_staleness`` of that step (the
        groups still in flight after ``get_batch`` all were), so the staleness bound holds."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"get_groups: n must be an int >= 1, got {n!r}")
        if self.step == self._base:
            raise ValueError("get_groups: no batch taken yet; call get_batch first")
        await self.start()
        async with self._cond:
            self._extra += n
            self._cond.notify_all()  # the producer may start n more groups
            while True:
                self._raise_if_failed()
                finished = [g for g in self._groups if g.done]
                picked = self._oldest(n) if self.in_order else (
                    sorted(finished, key=lambda g: (g.start_version, g.gid))[:n] if len(finished) >= n else None)
                if picked is not None:
                    break
                if self._exhausted and not self._tasks_running:
                    raise ValueError(f"tasks: exhausted with {len(finished)} of {n} extra groups formed")
                await self._cond.wait()
            return self._hand_over(picked)

    def _oldest(self, n: int) -> Optional[list]:
        """The ``n`` oldest unconsumed groups once all of them are done, else None."""
        oldest = sorted(self._groups, key=lambda g: g.gid)[:n]
        return oldest if len(oldest) == n and all(g.done for g in oldest) else None

    def _gate(self) -> int:
        """How many groups may have been started at the current version."""
        return (self.version - self._base + self.cfg.staleness + 1) * self.groups_per_step + self._extra

    def _settled(self) -> bool:
        """Every group the gate lets start has started and finished (``in_order``'s weight swap)."""
        if self._error is not None or self._producer is None:
            return True
        return all(g.done for g in self._groups) and (self._exhausted or self._started >= self._gate())

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"rollout producer failed: {type(self._error).__name__}: {self._error}") from self._error

    def _hand_over(self, picked: list) -> RolloutBatch:
        """Remove ``picked`` from the pool and return them as a batch of step ``self.step - 1``
        (caller holds ``_cond``; the producer is woken: the gate may have opened)."""
        for g in picked:
            self._groups.remove(g)
        self._cond.notify_all()
        trajs = [t for g in sorted(picked, key=lambda g: g.gid) for t in g.trajectories]
        failed = sum(bool(t.metadata.get("reward_exception")) for t in trajs)
        if trajs and failed == len(trajs):  # nothing to learn from: stop, saying why
            last = trajs[-1].metadata["reward_exception"]
            raise RuntimeError(f"reward_fn raised on every episode of step {self.step - 1} ({failed} of {failed}; "
                               f"last: {last}); fix env.reward_fn (python -m arl.train --dry-run runs it once)")
        trajs = self._apply_filter_cap(trajs)  # first: the metrics count what the cap kept
        metrics = dict(self._metrics(trajs), **{"fault/reward_exception": sum(t.metadata.get("reward_exceptions", 0)
                                                                               for t in trajs)})
        return RolloutBatch(self.step - 1, trajs, metrics)

    # --- generation side ---
    async def _produce(self) -> None:
        try:
            while True:
                async with self._cond:
                    while self._started >= self._gate():
                        self.counters["gate_waits"] += 1
                        await self._cond.wait()  # trainer lags: generation pauses
                    try:
                        seed = int(next(self._tasks))
                    except StopIteration:
                        self._exhausted = True
                        self._cond.notify_all()
                        return
                    g = _Group(self._started, seed, self.version)
                    self._groups.append(g)
                    self._started += 1
                    self._cond.notify_all()
                t = asyncio.create_task(self._run_group(g))
                self._tasks_running.add(t)
                t.add_done_callback(self._tasks_running.discard)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # surfaced to the trainer by get_batch
            self._error = e
            async with self._cond:
                self._cond.notify_all()

    async def _run_group(self, g: _Group) -> None:
        try:
            if self.start_for is not None:
                g.start = await self.start_for(g.seed)
            trajs = await asyncio.gather(*(self._run_one(g, i) for i in range(self.cfg.group_size)))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self._error = e
            trajs = []
        async with self._cond:
            g.trajectories, g.done = list(trajs), True
            self._cond.notify_all()

    async def _run_one(self, g: _Group, index: int) -> Trajectory:
        n, raised = self.cfg.group_size, 0
        for attempt in range(self.cfg.retries + 1):
            sample = index + attempt * n  # new fault/latency draws on a retry, same task
            sample_seed = None if self.seed is None else derive_sample_seed(self.seed, g.seed, sample)
            env = await self.pool.acquire()
            broken = True
            try:
                task = self.task_row(g.seed) if self.task_row is not None else None
                t = await run_episode(self.engine, env, self.fmt, g.seed, self.episode, sample=sample,
                                      group_id=g.gid, sample_seed=sample_seed, start=g.start, task=task)
                broken = t.metadata["fault"] == Fault.UNRECOVERABLE.value
            finally:
                await self.pool.release(env, broken=broken)
            t.metadata.update(attempts=attempt + 1, start_version=g.start_version)
            if not t.turns:
                t.policy_version = g.start_version
            raised += bool(t.metadata.get("reward_exception"))
            t.metadata["reward_exceptions"] = raised  # attempts whose reward function raised
            if t.metadata.get("reward_exception"):
                self._reward_exception(g.seed, t.metadata["reward_exception"])
            fault = Fault(t.metadata["fault"])
            if fault is Fault.UNRECOVERABLE:
                self.counters["unrecoverable"] += 1
                return placeholder(t)
            if fault is Fault.NONE:
                if g.start is not None:
                    t = tag_resampled(g.start, t, imitate=index == 0 or not self.imitate_once)
                return t
            self.counters["recoverable"] += 1
            if attempt < self.cfg.retries:
                self.counters["retries"] += 1
        t.status = TrajectoryStatus.FILTERED
        return t

    def _reward_exception(self, task_seed: int, what: str) -> None:
        """The reward function raised: said on stderr the first times (a reward bug must not look
        like a model that never succeeds), counted always (``fault/reward_exception``)."""
        self.counters["reward_exception"] += 1
        if self.counters["reward_exception"] <= REWARD_EXCEPTIONS_SHOWN:
            origin = self.task_origin(task_seed) if self.task_origin is not None else f"task seed {task_seed}"
            print(f"arl: reward_fn raised {what} ({origin})", file=sys.stderr, flush=True)

    # --- mask & filter cap, metrics ---
    def _apply_filter_cap(self, trajs: list) -> list:
        cap = math.floor(self.cfg.filter_cap * len(trajs))
        filtered = [i for i, t in enumerate(trajs) if t.status is TrajectoryStatus.FILTERED]
        for i in filtered[cap:]:
            t = trajs[i]
            t.metadata["over_filter_cap"] = True
            if self.cfg.over_cap == "mask":
                trajs[i] = placeholder(t)
            else:
                t.status = TrajectoryStatus.OK
                t.reward = 0.0
        return trajs

    def _metrics(self, trajs: list) -> dict:
        status = Counter(t.status for t in trajs)
        stale = [self.step - 1 - t.policy_version for t in trajs]
        ok = [t for t in trajs if t.status is TrajectoryStatus.OK]
        n = max(len(trajs), 1)
        return {
            "rollout/num_trajectories": len(trajs),
            "rollout/num_ok": status[TrajectoryStatus.OK],
            "rollout/num_masked": status[TrajectoryStatus.MASKED],
            "rollout/num_filtered": status[TrajectoryStatus.FILTERED],
            "rollout/filtered_frac": status[TrajectoryStatus.FILTERED] / n,
            "rollout/num_over_filter_cap": sum(bool(t.metadata.get("over_filter_cap")) for t in trajs),
            "rollout/retries": sum(t.metadata.get("attempts", 1) - 1 for t in trajs),
            "rollout/staleness_mean": float(np.mean(stale)) if stale else 0.0,
            "rollout/staleness_max": int(max(stale)) if stale else 0,
            "rollout/reward_mean": float(np.mean([t.reward for t in ok])) if ok else 0.0,
            "rollout/tokens": int(sum(len(t) for t in trajs)),
            "rollout/turns_mean": float(np.mean([len(t.turns) for t in trajs])) if trajs else 0.0,
            "rollout/tool_calls": int(sum(t.metadata.get("tool_calls", 0) for t in trajs)),
            "rollout/env_pool_peak": self.pool.peak_in_use,
            "rollout/gate_waits": self.counters["gate_waits"],
        }


async def fill_batch(manager: RolloutManager, batch: RolloutBatch, make_sampler: Optional[Callable]) -> RolloutBatch:
    """Dynamic sampling, acted out: a judge ``make_sampler(target_groups)`` (``add`` / ``groups_needed``
    / ``finish``, e.g. ``arl.stabilizers.DynamicSampler``) looks at ``batch`` (just taken from
    ``manager``) and says how many groups are missing; ``manager.get_groups(n)`` samples them, until
    the judge is satisfied.  Returns a ``RolloutBatch`` of the same step with the judge's metrics
    added; a pass-through when ``make_sampler`` is None (dynamic sampling off)."""
    target = len({int(t.group_id) for t in batch.trajectories})
    if make_sampler is None or target == 0:
        return batch
    sampler = make_sampler(target)
    sampler.add(batch.trajectories)
    metrics = dict(batch.metrics)
    extra_trajs = 0
    while (n := sampler.groups_needed()) > 0:
        extra = await manager.get_groups(n)
        extra_trajs += len(extra.trajectories)
        sampler.add(extra.trajectories)
    trajs, m = sampler.finish()
    metrics.update(m)
    metrics["stab/extra_trajectories"] = extra_trajs
    return RolloutBatch(batch.step, trajs, metrics)
