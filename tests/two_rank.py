"""Shared by the 2-rank trainer tests (test_trainer_ds, test_old_logp_skip): the tiny Qwen2 they
train and the random chunk layout of their trajectories."""
import numpy as np
import torch


def tiny_qwen(seed: int = 0, **config):
    """A 2-layer Qwen2 over a 64-token vocabulary, fp32; ``config``: more Qwen2Config fields."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, max_position_embeddings=256, **config)
    return Qwen2ForCausalLM(cfg).float()


def random_chunk_ids(rng: np.random.Generator, L: int) -> np.ndarray:
    """[L] chunk ids: a prompt of 2-5 tokens, then model turns of 1-7 tokens (ids 0, 1, ...)
    separated by 1-4 untrained (-1) observation tokens."""
    chunk = np.full(L, -1, dtype=np.int32)
    pos, k = int(rng.integers(2, 6)), 0
    while pos < L - 1:
        span = int(rng.integers(1, 8))
        chunk[pos:pos + span] = k
        k += 1
        pos += span + int(rng.integers(1, 5))
    return chunk


def spawn_ranks(worker, result_dir, world: int = 2) -> None:
    """``worker(rank, world, port, result_dir)`` on ``world`` spawned gloo ranks, to their end; the
    ranks write their results under ``result_dir``."""
    import torch.multiprocessing as mp

    from arl.procs import free_port

    mp.spawn(worker, args=(world, free_port(), str(result_dir)), nprocs=world, join=True)
