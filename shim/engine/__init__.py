"""The orchestrator between kubelet's calls, the policy, the checkpoint and the runtime."""

from shim.engine.core import Engine, EngineOptions, FailurePolicy, ProjectionSettings
from shim.engine.tracked import Phase, Tracked

__all__ = ["Engine", "EngineOptions", "FailurePolicy", "Phase", "ProjectionSettings", "Tracked"]
