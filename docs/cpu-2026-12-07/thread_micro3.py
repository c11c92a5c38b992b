"""Issue 48's OpenMP-team measurement: the real target (bfloat16, 16 rows at 300 cached
positions) loaded on the main thread (`main`) or on a thread that then ends (`temp`), its
k = 0 target call run on another thread: median ms of 16 calls, three times.

    PYTHONPATH=$PWD .venv/bin/python docs/cpu-2026-12-07/thread_micro3.py main|temp
"""

import statistics
import sys
import threading
import time

import numpy as np
import torch

from specdec.engines.calls import run_target
from specdec.engines.llama import LlamaEngine
from specdec.engines.wire import EngineBatch
from specdec.paths import PROJECT_ROOT

ROWS = 16
holder: dict[str, LlamaEngine] = {}


def create() -> None:
    target = PROJECT_ROOT / "models" / "smollm2-135m-instruct"
    holder["e"] = LlamaEngine.from_checkpoint(target, 64, 2048, dtype=torch.bfloat16)


def batch() -> EngineBatch:
    def full(value, dtype):
        return np.full(ROWS, value, dtype)

    return EngineBatch(
        input_ids=np.random.randint(3, 49000, ROWS).astype(np.int64),
        input_lengths=full(1, np.int32),
        slot_ids=np.arange(ROWS, dtype=np.int32),
        cache_lengths=full(300, np.int32),
        num_steps=full(1, np.int32),
        temperature=full(0, np.float32),
        top_k=full(0, np.int32),
        top_p=full(1, np.float32),
        end_ids=full(2, np.int32),
        min_tokens_left=full(0, np.int32),
        seeds=full(0, np.int64),
    )


def bench(tag: str) -> None:
    call = batch()
    for _ in range(3):
        times = []
        for _ in range(20):
            start = time.perf_counter()
            run_target(holder["e"], call)
            times.append((time.perf_counter() - start) * 1e3)
        print(tag, f"{statistics.median(times[4:]):.1f} ms", flush=True)


def run_on_thread(work, *args) -> None:
    thread = threading.Thread(target=work, args=args)
    thread.start()
    thread.join()


if __name__ == "__main__":
    if sys.argv[1] == "temp":
        run_on_thread(create)
    else:
        create()
    run_on_thread(bench, f"loaded on {sys.argv[1]}, run on another thread")
