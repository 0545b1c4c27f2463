"""The container lifecycle calls the engine intercepts (``LIFECYCLE_PATHS``), the check that
a request decodes (``check_request``), and an interceptor that does only that and forwards
every call unchanged, which the relay's tests run behind. kubelet's ``none`` policy is the
engine with ``shim.policy.none``, not this."""

from __future__ import annotations

import logging

from google.protobuf.message import DecodeError

from shim.cri.calls import Reply, Status, UnaryCall
from shim.cri.upstream import Forward

log = logging.getLogger(__name__)

_RUNTIME = "/runtime.v1.RuntimeService/"

# The calls through which kubelet creates, changes and ends containers. The hot read-only
# calls (ListContainers, ContainerStatus, ...) stay on the splice's fast path.
LIFECYCLE_PATHS = frozenset(
    _RUNTIME + name
    for name in (
        "RunPodSandbox",
        "StopPodSandbox",
        "RemovePodSandbox",
        "CreateContainer",
        "StartContainer",
        "StopContainer",
        "RemoveContainer",
        "UpdateContainerResources",
    )
)


def check_request(call: UnaryCall) -> Reply | None:
    """An INVALID_ARGUMENT reply if the request does not decode, else None."""
    from shim.cri.methods import REQUEST_TYPES

    message_type = REQUEST_TYPES.get(call.path)
    if message_type is None:
        return None
    try:
        message_type.FromString(call.request)
    except DecodeError as exc:
        name = message_type.DESCRIPTOR.name
        log.warning("malformed request", extra={"fields": {"path": call.path, "error": str(exc)}})
        return Reply.error(Status.INVALID_ARGUMENT, f"cpushim: cannot decode {name}: {exc}")
    return None


class PassthroughInterceptor:
    def __init__(self, paths: frozenset[str] = LIFECYCLE_PATHS, *, amend: bool = False) -> None:
        self.paths = paths
        self.amend = amend

    def intercepts(self, path: str) -> bool:
        return path in self.paths

    def amends(self, path: str) -> bool:
        return self.amend

    async def handle(self, call: UnaryCall, forward: Forward) -> Reply:
        rejected = check_request(call)
        if rejected is not None:
            return rejected
        return await forward()
