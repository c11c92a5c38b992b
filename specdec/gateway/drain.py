"""A replica's Kubernetes preStop (`python -m specdec.gateway drain`): wait until the gateway
has stopped sending it new requests and nothing runs or waits there (stopping the server
ends the streams it still runs with an error).
"""

from __future__ import annotations

import time


def drain(metrics_url: str, settle_s: float, timeout_s: float, poll_s: float = 1.0) -> bool:
    """A replica's preStop. Stopping the server ends its running streams with an error
    (outcome `shutdown`), so wait first: `settle_s` for the gateway to stop sending new
    requests here (the pod has left the headless Service's DNS answer), then until nothing
    runs or waits in the queue. False when `timeout_s` passed first."""
    from specdec.client import scrape_metrics  # tritonclient: loaded for this command only

    time.sleep(settle_s)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            values = scrape_metrics(metrics_url)
        except OSError:
            return True  # the server is gone: nothing left to wait for
        gauges = ("specdec_running_batch_size", "specdec_queued_requests")
        busy = sum(v for k, v in values.items() if k.split("{")[0] in gauges)
        if not busy:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
