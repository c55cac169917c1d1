"""The serving context every front end serves through: the engine (attached once the model is loaded), the serving
state (lifecycle.py), the metrics with the rest of the telemetry (telemetry.py: spans, request logs) and the served
model name (and its aliases: vLLM's further --served-model-name names). The server builds one and hands it to each
front end, so the front ends share one engine, one drain and one set of counts without knowing each other."""

from __future__ import annotations

from pagedserve.engine.outputs import EngineStats
from pagedserve.service.core.engine_handle import EngineHandle
from pagedserve.service.core.lifecycle import ServingState
from pagedserve.service.core.metrics import ServiceMetrics
from pagedserve.service.core.telemetry import Telemetry


class ServingContext:
    """telemetry: default metrics only (no tracing, no request log)."""

    def __init__(self, state: ServingState, metrics: ServiceMetrics, model_name: str,
                 telemetry: Telemetry | None = None, model_aliases: tuple[str, ...] = ()):
        self.state, self.metrics, self.model_name = state, metrics, model_name
        self.model_aliases = model_aliases
        self.telemetry = telemetry or Telemetry(metrics, model_name)
        self.engine: EngineHandle | None = None  # set by attach() once the model is loaded
        self.max_model_len: int | None = None  # the model's context length, once loaded

    def attach(self, engine: EngineHandle) -> None:
        self.engine, self.max_model_len = engine, engine.describe().max_model_len
        engine.observe_steps(self.metrics.observe_step)

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name a request may give the served model: the reported one first."""
        return (self.model_name, *self.model_aliases)

    def stats(self) -> EngineStats | None:
        """The engine's latest EngineStats, or None while the model loads."""
        return self.engine.stats() if self.engine is not None else None

    @property
    def serving(self) -> bool:
        """Loaded, not shutting down, and the engine alive: what HTTP health checks report."""
        state = self.state
        return state.ready and not state.draining and self.engine is not None and self.engine.dead_reason is None
