"""Exclusive creates that fail part-way, and what becomes of their CPUs."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from grpclib.const import Status as GrpcStatus

from shim.cpuset import CPUSet
from shim.cri.calls import Reply, Status, UnaryCall
from shim.cri.upstream import ChannelForward, ReplySeen, RuntimeChannel
from shim.engine import requests as rq
from shim.policy.options import StaticPolicyOptions
from shim.policy.static import StaticPolicy
from shim.state import ContainerKey
from tests.fake_runtime import FakeRuntime
from tests.unit.engine_env import (
    FIRST_SINGLE,
    TOPOLOGY,
    Env,
    assert_consistent,
    env,
    make_env,
    through_relay,
    until,
)

pytestmark = pytest.mark.anyio

__all__ = ["env"]  # the fixture


class ReplyLost:
    """A forward whose request reaches the runtime, which acts on it, but whose reply never
    comes back: StreamForward when kubelet's connection closes (or the runtime's drops)
    after the request went out (shim/cri/server.py: connection_lost, CallAborted)."""

    def __init__(self, runtime: RuntimeChannel, call: UnaryCall) -> None:
        self._inner = ChannelForward(runtime, call)
        self.sent = False
        self.reply: Reply | None = None

    async def __call__(
        self, request: bytes | None = None, *, seen: ReplySeen | None = None
    ) -> Reply:
        self.sent = True
        await self._inner(request)  # the runtime creates the container
        self.reply = Reply.no_answer(Status.UNAVAILABLE, "cpushim: the client went away")
        return self.reply


async def test_a_create_whose_reply_is_lost_keeps_its_cpus(env: Env) -> None:
    kubelet = env.kubelet
    pod = await kubelet.run_pod("db", "guaranteed")
    request = kubelet.create_request(pod, "main", 1000).SerializeToString()
    call = UnaryCall(rq.CREATE_CONTAINER, (), request, 10.0)
    reply = await env.engine.handle(call, ReplyLost(env.channel, call))
    assert reply.status is Status.UNAVAILABLE
    [orphan] = env.fake.containers
    assert env.cpus(orphan) == FIRST_SINGLE  # the runtime holds it on the CPU it was given
    # Another pod's container must not be given the CPU the runtime's container holds.
    other = await kubelet.run_pod("other", "guaranteed")
    other_id = await kubelet.start_new(other, "main", 1000)
    assert env.cpus(other_id) != FIRST_SINGLE
    assert FIRST_SINGLE not in str(env.engine.state.shared).split(",")
    # kubelet's next attempt of the container gets the CPU the lost attempt was given.
    again = await kubelet.start_new(pod, "main", 1000, attempt=1)
    assert env.cpus(again) == FIRST_SINGLE
    assert_consistent(env)


async def test_a_reload_keeps_the_cpus_of_a_create_whose_reply_is_lost_as_they_are(
    env: Env,
) -> None:
    """The container the runtime made on the CPU runs there untracked until a sweep finds
    it: nothing moves it. strict-cpu-reservation turned on by a reload leaves the shared
    pool no CPU unless an assignment gives way; the last key used to, here the held one,
    and its CPU went to the pool while the container ran there. It keeps it; the tracked
    container gives way and shares."""
    pod = await env.kubelet.run_pod("db", "guaranteed", uid="ffffffff-0000-0000-0000-0")
    request = env.kubelet.create_request(pod, "main", 1000).SerializeToString()
    call = UnaryCall(rq.CREATE_CONTAINER, (), request, 10.0)
    assert (await env.engine.handle(call, ReplyLost(env.channel, call))).unanswered
    [orphan] = env.fake.containers
    big = await env.kubelet.run_pod("big", "guaranteed", uid="00000000-0000-0000-0000-0")
    big_id = await env.kubelet.start_new(big, "main", 6000)
    assert (env.cpus(orphan), env.cpus(big_id)) == (FIRST_SINGLE, "1-3,5-7")

    strict = StaticPolicy.create(
        TOPOLOGY,
        reserved=CPUSet.parse("0"),
        options=StaticPolicyOptions(strict_cpu_reservation=True),
    )
    assert await env.engine.change_policy(strict) == [ContainerKey(big.uid, "main")]
    held = env.engine.state.assignments[ContainerKey(pod.uid, "main")]
    assert (held.cpus, held.container_id) == (CPUSet.parse(FIRST_SINGLE), "")
    assert env.cpus(big_id) == str(env.engine.state.shared) == "1-3,5-7"
    assert env.cpus(orphan) == FIRST_SINGLE
    assert_consistent(env)


async def test_a_create_whose_client_went_away_keeps_its_cpus_through_the_relay(env: Env) -> None:
    """kubelet's connection closes while containerd makes the container: the relay ends the
    forward without an answer, so the CPUs stay held for the container's next attempt."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    request = env.kubelet.create_request(pod, "main", 1000).SerializeToString()
    async with through_relay(env) as kubelet:
        gate = env.fake.gate("CreateContainer")
        call = asyncio.create_task(kubelet.unary(UnaryCall(rq.CREATE_CONTAINER, (), request, 10.0)))
        await until(lambda: bool(env.fake.calls_of("CreateContainer")), "the create sent")
        kubelet.close()  # kubelet goes away; containerd goes on and makes the container
        reply = await call
        assert reply.status is not Status.OK
        env.fake.ungate("CreateContainer")
        gate.set()
        await until(lambda: bool(env.fake.containers), "the container made")
        await until(lambda: env.engine.counters["unknown_create_outcomes"] == 1, "the outcome seen")
    key = ContainerKey(pod.uid, "main")
    assert env.engine.state.assignments[key].cpus == CPUSet.parse(FIRST_SINGLE)
    assert env.engine.counters["failed_exclusive_creates"] == 0
    other = await env.kubelet.start_new(
        await env.kubelet.run_pod("other", "guaranteed"), "main", 1000
    )
    assert env.cpus(other) != FIRST_SINGLE
    assert_consistent(env)


async def test_a_create_the_runtime_refuses_gives_its_cpus_back_whatever_the_code(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """An error the runtime sent, even UNAVAILABLE or DEADLINE_EXCEEDED, is its answer: no
    container was made, and the CPUs go back. The log says why, beside what went back."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    for status in (GrpcStatus.UNAVAILABLE, GrpcStatus.DEADLINE_EXCEEDED, GrpcStatus.INTERNAL):
        caplog.clear()
        env.fake.fail_next("CreateContainer", status, "runtime says no")
        with caplog.at_level(logging.INFO, logger="shim.engine.core"):
            reply = await env.kubelet.create(pod, "main", 1000)
        assert reply.status.name == status.name
        assert env.engine.state.assignments == {}
        [told] = [r for r in caplog.records if "create failed" in r.getMessage()]
        assert told.__dict__["fields"] == {
            "pod": "default/db",
            "container": str(ContainerKey(pod.uid, "main")),
            "cpus": str(FIRST_SINGLE),
            "error": f"{status.name}: runtime says no",
        }
    assert env.engine.counters["failed_exclusive_creates"] == 3
    assert env.engine.counters["unknown_create_outcomes"] == 0
    assert_consistent(env)


async def test_a_create_that_cannot_reach_the_runtime_gives_its_cpus_back(env: Env) -> None:
    """Nothing left for the runtime: it made nothing, and the CPUs go back."""
    pod = await env.kubelet.run_pod("db", "guaranteed")
    request = env.kubelet.create_request(pod, "main", 1000).SerializeToString()
    call = UnaryCall(rq.CREATE_CONTAINER, (), request, 10.0)
    nowhere = RuntimeChannel("unix:///nonexistent/containerd.sock")
    reply = await env.engine.handle(call, ChannelForward(nowhere, call))
    assert reply.status is Status.UNAVAILABLE
    assert not reply.unanswered
    assert env.engine.state.assignments == {}
    assert env.engine.counters["failed_exclusive_creates"] == 1
    assert_consistent(env)


async def test_a_next_attempt_does_not_keep_a_held_set_the_policy_no_longer_allows(
    tmp_path: Path,
) -> None:
    # Spread over two cores under distribute-cpus-across-cores; a restart turns on
    # full-pcpus-only, which moves the running container onto whole cores (a set is kept
    # only if the policy would hand it out now). Its next attempt, created before cpushim
    # saw the old one exit, must get whole cores too, as it does when the exit was seen
    # (docs/architecture.md: the rules for an adopted container).
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
            moved = CPUSet.parse(env.cpus(first))
            assert TOPOLOGY.whole_cores_in(moved) == moved, f"{moved} is not whole cores"
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


async def test_a_retry_refused_as_reserved_keeps_the_cpus_of_the_unanswered_create(
    env: Env,
) -> None:
    """kubelet never had the first create's reply, so it retries the same attempt, which
    containerd refuses: the name is reserved for the container the first create made, on
    the CPUs it was given. Those must stay held, as they were before the retry."""
    kubelet = env.kubelet
    pod = await kubelet.run_pod("db", "guaranteed")
    request = kubelet.create_request(pod, "main", 1000).SerializeToString()
    call = UnaryCall(rq.CREATE_CONTAINER, (), request, 10.0)
    await env.engine.handle(call, ReplyLost(env.channel, call))
    [orphan] = env.fake.containers
    reply = await kubelet.create(pod, "main", 1000)  # attempt 0 again
    assert reply.status is not Status.OK
    assert "is reserved" in reply.status_message
    key = ContainerKey(pod.uid, "main")
    assert env.engine.state.assignments[key].cpus == CPUSet.parse(env.cpus(orphan))
    other = await kubelet.start_new(await kubelet.run_pod("other", "guaranteed"), "main", 1000)
    assert env.cpus(other) != env.cpus(orphan)


async def test_a_deadline_spent_connecting_to_the_runtime_is_no_unanswered_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing was written when the deadline passed while connecting: the runtime made
    nothing, so the reply must not say the outcome is unknown (the CPUs go back)."""
    from grpclib.client import Channel

    async def never(self: Channel) -> None:
        await asyncio.sleep(3600)

    monkeypatch.setattr(Channel, "__connect__", never)
    channel = RuntimeChannel("unix:///nonexistent/containerd.sock")
    try:
        reply = await channel.unary(UnaryCall(rq.CREATE_CONTAINER, (), b"", 0.05))
    finally:
        channel.close()
    assert reply.status is Status.DEADLINE_EXCEEDED
    assert not reply.unanswered
