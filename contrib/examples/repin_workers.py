"""A workload that follows its cpuset: worker threads re-pinned on every change.

    python repin_workers.py [--workers N] [PATH]

PATH is the container's projection directory: the argument, else ``$CPUSHIM_PROJECTION``,
else ``/run/cpushim``. Needs only the standard library, anyio and ``shim.projection``
(``pip install anyio`` and ``pip install --no-deps cpushim``, or put the repository on
PYTHONPATH). Each worker hashes a buffer now and then; on every new state the main thread
pins each worker to the container's CPUs, one CPU per worker in turn, and prints what it did.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import threading

import anyio

from shim.projection import DEFAULT_PATH, Projection, watch

# Between bursts of work; a real workload would take its work from a queue instead.
PAUSE = 0.05


class Worker(threading.Thread):
    def __init__(self, index: int, stop: threading.Event) -> None:
        super().__init__(name=f"worker-{index}", daemon=True)
        self.stop = stop
        self.started_up = threading.Event()

    def run(self) -> None:
        self.started_up.set()
        data = os.urandom(1 << 16)
        while not self.stop.wait(PAUSE):
            hashlib.sha256(data).digest()


def repin(workers: list[Worker], state: Projection) -> None:
    cpus = sorted(state.cpu_ids())
    print(
        f"generation {state.generation} at {state.updated_at}: cpus {state.cpus}"
        f" ({state.pool}, NUMA nodes {list(state.numa_nodes)})",
        flush=True,
    )
    for index, worker in enumerate(workers):
        # One CPU each, round robin; a worker that may roam would get all of ``cpus``.
        cpu = cpus[index % len(cpus)]
        assert worker.native_id is not None  # set once the thread has started
        try:
            os.sched_setaffinity(worker.native_id, {cpu})
        except OSError as exc:  # the thread ended, or the CPU is not ours (yet)
            print(f"  {worker.name} (tid {worker.native_id}): not pinned: {exc}", flush=True)
            continue
        print(f"  {worker.name} (tid {worker.native_id}) -> CPU {cpu}", flush=True)


async def follow(path: str, workers: list[Worker]) -> None:
    async for state in watch(path):
        repin(workers, state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "path", nargs="?", default=os.environ.get("CPUSHIM_PROJECTION", DEFAULT_PATH)
    )
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()

    stop = threading.Event()
    workers = [Worker(index, stop) for index in range(args.workers)]
    for worker in workers:
        worker.start()
        worker.started_up.wait()
    print(f"{len(workers)} workers; watching {args.path}", flush=True)
    try:
        anyio.run(follow, args.path, workers)
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()


if __name__ == "__main__":
    main()
