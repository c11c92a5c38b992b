"""Both engines in this process, no Triton in between: the loop's engine calls
(specdec/engines/calls.py) for unit tests and offline tools (build/train_draft.py)."""

from __future__ import annotations

from specdec.engines.calls import run_draft, run_target
from specdec.engines.engine import Engine
from specdec.engines.wire import EngineBatch, EngineResult


class LocalEngines:
    """The draft and target engines called directly, as the engine models call them."""

    def __init__(self, draft_engine: Engine, target_engine: Engine) -> None:
        self.draft_engine = draft_engine
        self.target_engine = target_engine

    def draft(self, batch: EngineBatch) -> EngineResult:
        return run_draft(self.draft_engine, batch)

    def target(self, batch: EngineBatch) -> EngineResult:
        return run_target(self.target_engine, batch)
