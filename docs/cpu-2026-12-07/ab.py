"""Issue 48's served A/B: k = 0 tokens/s of 16 greedy streams (64-token requests) for 20 s on
a fresh bfloat16 server of the checkout it runs from (the real pair).

    cd CHECKOUT && PYTHONPATH=$PWD .venv/bin/python docs/cpu-2026-12-07/ab.py NAME
"""

import sys
import threading
import time

from specdec.client import generate
from specdec.harness import ManagedServer

SETTINGS = {"DTYPE": "bfloat16", "NUM_SLOTS": "32", "MAX_CONTEXT": "1024"}


def run(name: str) -> None:
    server = ManagedServer(f"ab-{name}", {**SETTINGS, "CALIBRATION_SECONDS": "0"})
    try:
        url, model = server.url, "speculative_decoding"
        for _ in range(4):
            generate("warm up", url=url, model=model, max_tokens=8, num_draft_tokens=0)
        tokens, lock = [0], threading.Lock()
        start = time.time()

        def user(i: int) -> None:
            while time.time() < start + 20:
                prompt = f"Write a story about ship {i}."
                result = generate(prompt, url=url, model=model, max_tokens=64, num_draft_tokens=0)
                with lock:
                    tokens[0] += 64 if result.error is None else 0

        users = [threading.Thread(target=user, args=(i,)) for i in range(16)]
        for thread in users:
            thread.start()
        for thread in users:
            thread.join()
        print(name, f"{tokens[0] / (time.time() - start):.1f} tok/s")
    finally:
        server.stop()


if __name__ == "__main__":
    run(sys.argv[1])
