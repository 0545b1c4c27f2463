"""Exclusive creates that fail part-way, and what becomes of their CPUs."""

from __future__ import annotations

from pathlib import Path

import pytest

from shim.cpuset import CPUSet
from shim.cri.calls import Status
from shim.policy.options import StaticPolicyOptions
from shim.policy.static import StaticPolicy
from tests.fake_runtime import FakeRuntime
from tests.unit.engine_env import (
    TOPOLOGY,
    assert_consistent,
    env,
    make_env,
)

pytestmark = pytest.mark.anyio

__all__ = ["env"]  # the fixture


async def test_a_next_attempt_does_not_keep_a_held_set_the_policy_no_longer_allows(
    tmp_path: Path,
) -> None:
    # Spread over two cores under distribute-cpus-across-cores; a restart turns on
    # full-pcpus-only, which keeps the running container's set. Its next attempt, created
    # before cpushim saw the old one exit, must get whole cores, as it does when the exit
    # was seen (docs/architecture.md: the rules for an adopted container).
    spread = StaticPolicy.create(
        TOPOLOGY,
        reserved=CPUSet.parse("0"),
        options=StaticPolicyOptions(distribute_cpus_across_cores=True),
    )
    whole = StaticPolicy.create(
        TOPOLOGY, reserved=CPUSet.parse("0"), options=StaticPolicyOptions(full_pcpus_only=True)
    )
    async with FakeRuntime() as fake:
        env = await make_env(fake, tmp_path / "state", spread)
        try:
            pod = await env.kubelet.run_pod("db", "guaranteed")
            first = await env.kubelet.start_new(pod, "main", 2000)
            before = CPUSet.parse(env.cpus(first))
            assert TOPOLOGY.whole_cores_in(before) != before  # two lone threads
            await env.restart(whole)
            assert env.cpus(first) == str(before)  # kept while it runs
            fake.exit_container(first, 137)  # a crash cpushim has not seen
            second = await env.kubelet.start_new(pod, "main", 2000, attempt=1)
            after = CPUSet.parse(env.cpus(second))
            assert TOPOLOGY.whole_cores_in(after) == after, f"{after} is not whole cores"
            assert_consistent(env)
        finally:
            env.channel.close()


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
