"""Exclusive creates that fail part-way, and what becomes of their CPUs."""

from __future__ import annotations

from pathlib import Path

import pytest

from shim.cri.calls import Status
from tests.fake_runtime import FakeRuntime
from tests.unit.engine_env import (
    env,
    make_env,
)

pytestmark = pytest.mark.anyio

__all__ = ["env"]  # the fixture


@pytest.mark.parametrize("failure_policy", ["fail-closed", "fail-open"])
async def test_an_internal_error_after_the_decision_leaks_no_cpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure_policy: str
) -> None:
    async with FakeRuntime() as fake:
        env = await make_env(fake, tmp_path / "state", failure_policy=failure_policy)  # type: ignore[arg-type]
        try:
            kubelet = env.kubelet
            shared_id = await kubelet.start_new(await kubelet.run_pod("web", "besteffort"), "main")
            pod = await kubelet.run_pod("db", "guaranteed")
            real_apply = env.engine._apply
            calls = 0

            async def apply_then_fail() -> None:
                nonlocal calls
                calls += 1
                await real_apply()
                if calls == 1:
                    raise RuntimeError("a bug after the decision")

            monkeypatch.setattr(env.engine, "_apply", apply_then_fail)
            reply = await kubelet.create(pod, "main", 1000)
            monkeypatch.undo()
            expected = Status.INTERNAL if failure_policy == "fail-closed" else Status.OK
            assert reply.status is expected, reply.status_message
            # Nothing holds the CPU: not in memory, not on disk, and the shared ones have it.
            assert env.engine.state.assignments == {}
            await env.engine.checkpoint_written()
            assert env.saved() == {}
            assert env.cpus(shared_id) == "0-7"
        finally:
            env.channel.close()
