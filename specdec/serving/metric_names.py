"""The names of speculative_decoding's own Prometheus metrics that readers split by label.

Pure, so that the BLS's metrics (serving/metrics.py), the bench and the tests read one
definition.
"""

# Where the loop's time goes, per iteration: asking Triton which streams were cancelled,
# the draft model's call, the target's call, the rest of the scheduler's step (admission,
# proposers, the controller, acceptance), and building the responses and handing them to
# the outbox (serving/outbox.py; it waits only when the outbox is two iterations behind).
LOOP_PARTS = ("cancel_check", "draft", "target", "schedule", "respond")
# Seconds the outbox spent sending responses and applying metric updates.
OUTBOX_SECONDS = "specdec_outbox_seconds_total"
# How requests end (specdec_requests_total{outcome=...}).
OUTCOMES = ("end", "length", "stop", "cancelled", "error", "invalid", "rejected", "shutdown")
# The engine calls the loop makes, and the bytes their results bring back through Triton
# (specdec_engine_calls_total{call=...}, specdec_engine_result_bytes_total{call=...}).
ENGINE_CALLS = "specdec_engine_calls_total"
ENGINE_RESULT_BYTES = "specdec_engine_result_bytes_total"
ENGINE_CALL_KINDS = ("draft", "target")
# Target passes by the tokens the sequence emitted in them (accepted + 1; 0 when its end
# token came first): specdec_target_passes_by_tokens_total{tokens="0".."max k + 1"}.
PASSES_BY_TOKENS = "specdec_target_passes_by_tokens_total"
# 1 once the start-up cost measurement is over (done, turned off or given up), 0 before:
# until then requests wait (specdec/loop/calibration.py).
CALIBRATED = "specdec_calibrated"
