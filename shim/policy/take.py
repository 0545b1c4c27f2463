"""Topology-aware best fit: which CPUs an exclusive request gets.

The rules follow kubelet's static policy (cpu_assignment.go, takeByTopologyNUMAPacked and
takeByTopologyNUMADistributed); docs/allocator.md describes them and where we differ. All the
work is on int bitmasks: a CPU set is ``CPUSet.mask``, a grouping is a mask from the Topology.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import combinations
from typing import TypeAlias

from shim.cpuset import CPUSet
from shim.policy.options import StaticPolicyOptions
from shim.topology import Topology, whole_cores_mask

__all__ = ["AllocationError", "SMTAlignmentError", "take_by_topology", "take_distributed"]

_DEFAULT_OPTIONS = StaticPolicyOptions()


class AllocationError(ValueError):
    """The request cannot be met from the CPUs on offer."""


class SMTAlignmentError(AllocationError):
    """full-pcpus-only: the request is not a whole number of physical cores, or there are not
    enough whole free cores."""


def take_by_topology(
    topology: Topology,
    available: CPUSet,
    count: int,
    *,
    options: StaticPolicyOptions = _DEFAULT_OPTIONS,
) -> CPUSet:
    """Choose ``count`` CPUs from ``available`` (offline CPUs in it are ignored).

    Raises AllocationError (SMTAlignmentError under full-pcpus-only) when it cannot.
    """
    if count < 0:
        raise ValueError(f"cannot take a negative number of CPUs ({count})")
    if count == 0:
        return CPUSet()
    avail = available.mask & topology.online.mask
    per_core = topology.cpus_per_core
    # full-pcpus-only is checked first, as kubelet's enforceSMTAlignment runs before it
    # allocates: a shortage under this option is an SMTAlignmentError too.
    if avail.bit_count() < count and not options.full_pcpus_only:
        raise AllocationError(
            f"cannot allocate {count} CPUs: only {avail.bit_count()} available"
            f" ({CPUSet.from_mask(avail) or 'none'})"
        )
    if options.full_pcpus_only:
        if count % per_core:
            raise SMTAlignmentError(
                f"SMT alignment error: {count} CPUs requested, not a multiple of"
                f" {per_core} CPUs per core (full-pcpus-only)"
            )
        # A partly taken core (a reserved thread, another container) must not be split.
        avail = whole_cores_mask(topology, avail)
        if avail.bit_count() < count:
            raise SMTAlignmentError(
                f"SMT alignment error: {count} CPUs requested but only {avail.bit_count()}"
                f" CPUs in whole free cores ({per_core} CPUs per core, full-pcpus-only)"
            )

    spread = options.distribute_cpus_across_cores
    if options.distribute_cpus_across_numa:
        mask = _take_distributed(topology, avail, count, _numa_group(topology, options), spread)
    else:
        mask = _take_packed(
            topology, avail, count, spread, options.prefer_align_cpus_by_uncorecache
        )

    if mask.bit_count() != count:  # a bug, not a user error; never hand out a wrong size
        raise AllocationError(f"allocator accounting error: wanted {count}, chose {mask:#x}")
    if options.full_pcpus_only and whole_cores_mask(topology, mask) != mask:
        # Possible only when cores differ in thread count (an offline sibling).
        raise SMTAlignmentError(
            f"SMT alignment error: {count} CPUs cannot be made of whole free cores"
            f" ({per_core} CPUs per core, full-pcpus-only)"
        )
    return CPUSet.from_mask(mask)


def take_distributed(
    topology: Topology, available: CPUSet, count: int, options: StaticPolicyOptions
) -> CPUSet:
    """distribute-cpus-across-numa's choice without take_by_topology's checks: ``count`` CPUs
    over the fewest NUMA nodes, in whole cores under full-pcpus-only (packed when ``count``
    is not a multiple of the core size). For the reserved set, which kubelet takes this way
    with no full-pcpus-only check. The caller makes sure ``available`` holds ``count``
    online CPUs."""
    avail = available.mask & topology.online.mask
    group = _numa_group(topology, options)
    return CPUSet.from_mask(_take_distributed(topology, avail, count, group, spread=False))


def _numa_group(topology: Topology, options: StaticPolicyOptions) -> int:
    """The chunk distribute-cpus-across-numa shares out: a whole core under full-pcpus-only."""
    return topology.cpus_per_core if options.full_pcpus_only else 1


def _dedupe(ids: Iterable[int]) -> list[int]:
    return list(dict.fromkeys(ids))


class _Accumulator:
    """The CPUs chosen so far and those still free; one per decision."""

    __slots__ = ("avail", "layout", "needed", "numa_first", "result", "spread", "topology")

    def __init__(self, topology: Topology, avail: int, needed: int, spread: bool) -> None:
        self.topology = topology
        self.layout = topology.layout
        self.avail = avail
        self.needed = needed
        self.result = 0
        self.spread = spread
        # The larger of NUMA node and socket is the first level to take whole.
        self.numa_first = topology.num_sockets >= topology.num_numa_nodes

    def take(self, mask: int) -> None:
        self.result |= mask
        self.avail &= ~mask
        self.needed -= mask.bit_count()

    @property
    def satisfied(self) -> bool:
        return self.needed <= 0

    # -- orderings: fewest free CPUs first (best fit), then lowest id -----------------------

    def _by_free(self, masks: Mapping[int, int], ids: Iterable[int]) -> list[int]:
        avail = self.avail
        scored = sorted(((masks[i] & avail).bit_count(), i) for i in ids)
        return [i for free, i in scored if free]

    def sorted_numas(self) -> list[int]:
        numa_masks = self.topology.numa_masks
        if self.numa_first:
            return self._by_free(numa_masks, numa_masks)
        within = self.layout.socket_numas
        return _dedupe(
            n for s in self.sorted_sockets() for n in self._by_free(numa_masks, within[s])
        )

    def sorted_sockets(self) -> list[int]:
        socket_masks = self.topology.socket_masks
        if not self.numa_first:
            return self._by_free(socket_masks, socket_masks)
        within = self.layout.numa_sockets
        return _dedupe(
            s for n in self.sorted_numas() for s in self._by_free(socket_masks, within[n])
        )

    def core_groups(self) -> list[tuple[int, ...]]:
        """Core indices grouped by the level just above cores, groups in best-fit order."""
        if self.numa_first:
            return [self.layout.socket_cores[s] for s in self.sorted_sockets()]
        return [self.layout.numa_cores[n] for n in self.sorted_numas()]

    def sorted_cores(self) -> list[int]:
        core_list, avail = self.layout.core_list, self.avail
        ordered: list[int] = []
        for group in self.core_groups():
            scored = sorted(((core_list[i] & avail).bit_count(), i) for i in group)
            ordered.extend(i for free, i in scored if free)
        return _dedupe(ordered)

    # -- steps ----------------------------------------------------------------------------

    def take_whole(self, masks: Mapping[int, int] | Sequence[int], order: Sequence[int]) -> None:
        """Take each group in ``order`` that is entirely free and no bigger than what is left."""
        for key in order:
            mask = masks[key]
            if self.avail & mask == mask and self.needed >= mask.bit_count():
                self.take(mask)

    def take_whole_levels(self) -> None:
        topology = self.topology
        if self.numa_first:
            self.take_whole(topology.numa_masks, self.sorted_numas())
            if not self.satisfied:
                self.take_whole(topology.socket_masks, self.sorted_sockets())
        else:
            self.take_whole(topology.socket_masks, self.sorted_sockets())
            if not self.satisfied:
                self.take_whole(topology.numa_masks, self.sorted_numas())

    def take_whole_cores(self) -> None:
        # Only complete SMT cores count here: a core whose sibling is offline would otherwise
        # look like a small whole core and win best fit over a real one.
        core_list, per_core = self.layout.core_list, self.topology.cpus_per_core
        for index in self.sorted_cores():
            mask = core_list[index]
            if mask.bit_count() == per_core and self.avail & mask == mask:
                if self.needed < per_core:
                    return
                self.take(mask)

    def take_threads_packed(self) -> None:
        """Single threads, filling the most used cores (and sockets) first so that whole
        cores stay free for later requests."""
        core_list = self.layout.core_list
        for index in self.sorted_cores():
            free = core_list[index] & self.avail
            while free and self.needed > 0:
                low = free & -free
                self.take(low)
                free ^= low
            if self.satisfied:
                return

    def take_threads_spread(self) -> None:
        """Single threads, one per core before any core's second thread, group by group."""
        core_list = self.layout.core_list
        for group in self.core_groups():
            avail = self.avail
            # Idle cores first so the first pass avoids cores other containers use.
            cores = sorted(
                (-(core_list[i] & avail).bit_count(), i) for i in group if core_list[i] & avail
            )
            threads = [_bits(core_list[i] & avail) for _, i in cores]
            for rank in range(max((len(t) for t in threads), default=0)):
                for bits in threads:
                    if rank < len(bits):
                        self.take(bits[rank])
                        if self.satisfied:
                            return

    def take_uncore_aligned(self) -> None:
        """prefer-align-cpus-by-uncorecache: whole uncore-cache groups while the request
        needs at least one, then the rest from the fullest single group that can hold it."""
        topology = self.topology
        uncore_masks, within = topology.uncore_masks, self.layout.numa_uncores

        def ordered() -> list[int]:
            numas = self.sorted_numas()
            return _dedupe(u for n in numas for u in self._by_free(uncore_masks, within[n]))

        self.take_whole(uncore_masks, ordered())
        if self.satisfied:
            return
        for uncore in ordered():
            free = uncore_masks[uncore] & self.avail
            if free.bit_count() >= self.needed:
                inner = _Accumulator(topology, free, self.needed, self.spread)
                inner.take_cores_then_threads()
                self.take(inner.result)
                return

    def take_cores_then_threads(self) -> None:
        if not self.spread:
            self.take_whole_cores()
            if self.satisfied:
                return
            self.take_threads_packed()
        else:
            self.take_threads_spread()


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low)
        mask ^= low
    return out


def _within_one_group(topology: Topology, mask: int) -> bool:
    """Whether ``mask`` lies in one NUMA node and one socket."""
    return any(mask & ~m == 0 for m in topology.numa_masks.values()) and any(
        mask & ~m == 0 for m in topology.socket_masks.values()
    )


def _fitting_groups(topology: Topology, avail: int, count: int, uncore: bool) -> list[int]:
    """Masks of the single NUMA nodes, else single sockets (the smaller kind of group
    first), that can hold all ``count`` CPUs, best first: those whose whole free cores cover
    the most of the request (so the choice splits no more cores than need be), then, with
    ``uncore``, those with an uncore-cache group that holds it all, then best fit (fewest
    free CPUs), then lowest id."""
    per_core = topology.cpus_per_core
    cores_wanted = count // per_core
    levels = [topology.numa_masks, topology.socket_masks]
    if topology.num_sockets > topology.num_numa_nodes:
        levels.reverse()
    for masks in levels:
        ranked = []
        for group, mask in masks.items():
            free = mask & avail
            if free.bit_count() < count:
                continue
            whole_cores = whole_cores_mask(topology, free).bit_count() // per_core
            one_cache = uncore and any(
                (free & cache).bit_count() >= count for cache in topology.uncore_masks.values()
            )
            ranked.append((-min(whole_cores, cores_wanted), not one_cache, free.bit_count(), group))
        if ranked:
            return [masks[group] for *_, group in sorted(ranked)]
    return []


def _take_packed(topology: Topology, avail: int, count: int, spread: bool, uncore: bool) -> int:
    chosen = _take_packed_from(topology, avail, count, spread, uncore)
    if _within_one_group(topology, chosen):
        return chosen
    # Best fit started in a group that could not hold the whole request. When one NUMA node
    # (or socket) can, take it all from there instead of spreading over two.
    groups = _fitting_groups(topology, avail, count, uncore)
    if not groups:
        return chosen
    return _take_packed_from(topology, avail & groups[0], count, spread, uncore)


def _take_packed_from(
    topology: Topology, avail: int, count: int, spread: bool, uncore: bool
) -> int:
    acc = _Accumulator(topology, avail, count, spread)
    acc.take_whole_levels()
    if uncore and not acc.satisfied:
        acc.take_uncore_aligned()
    if not acc.satisfied:
        acc.take_cores_then_threads()
    return acc.result


# -- distribute-cpus-across-numa -----------------------------------------------------------


def _spread_score(values: Iterable[int]) -> int:
    """Proportional to the variance of ``values`` (n^2 * variance), exact in integers; only
    compared between lists of the same length."""
    vals = list(values)
    return len(vals) * sum(v * v for v in vals) - sum(vals) ** 2


def _numa_count_range(
    topology: Topology, available_numas: int, count: int, group: int
) -> tuple[int, int]:
    """The fewest and most NUMA nodes worth trying for ``count`` CPUs in ``group``-sized
    chunks."""
    groups_total = -(-len(topology.online) // group)
    groups_per_numa = -(-groups_total // topology.num_numa_nodes)
    groups_needed = -(-count // group)
    fewest = -(-groups_needed // groups_per_numa)
    return fewest, min(groups_needed, available_numas)


def _hand_out(free: dict[int, int], nodes: Sequence[int], amount: int, group: int) -> bool:
    """Take ``amount`` from ``free`` in ``group`` chunks, round robin over ``nodes``; False if
    they cannot absorb it."""
    while amount > 0:
        progressed = False
        for node in nodes:
            if amount == 0:
                break
            if free[node] >= group:
                free[node] -= group
                amount -= group
                progressed = True
        if not progressed:
            return False
    return True


def _take_distributed(topology: Topology, avail: int, count: int, group: int, spread: bool) -> int:
    if count % group:
        return _take_packed(topology, avail, count, spread, uncore=False)
    numa_masks = topology.numa_masks
    numas = _Accumulator(topology, avail, count, spread).sorted_numas()
    free = {n: (numa_masks[n] & avail).bit_count() for n in numas}
    fewest, most = _numa_count_range(topology, len(numas), count, group)
    searched: dict[tuple[tuple[int, ...], int], _Remainder] = {}

    for size in range(fewest, most + 1):
        best: tuple[int, tuple[int, ...], tuple[int, ...]] | None = None
        for combo in combinations(numas, size):
            if sum(free[n] // group for n in combo) * group < count:
                continue
            share = (count // size // group) * group
            if any(free[n] < share for n in combo):
                continue
            after = dict(free)
            for n in combo:
                after[n] -= share
            remainder = count - share * size
            if remainder == 0:
                placed: tuple[int, tuple[int, ...]] | None = (_spread_score(after.values()), ())
            else:
                placed = _place_remainder(after, combo, remainder, group, searched)
            if placed is not None and (best is None or placed[0] < best[0]):
                best = (placed[0], combo, placed[1])
                if best[0] == 0:
                    break
        if best is None:
            continue
        _, combo, extra = best
        share = (count // size // group) * group
        result, left = 0, avail
        for n in combo:
            got = _take_packed(topology, left & numa_masks[n], share, spread, uncore=False)
            result, left = result | got, left & ~got
        remainder = count - share * size
        progressed = True
        while remainder > 0 and progressed:
            progressed = False
            for n in extra:
                if remainder == 0:
                    break
                if (left & numa_masks[n]).bit_count() < group:
                    continue
                got = _take_packed(topology, left & numa_masks[n], group, spread, uncore=False)
                result, left = result | got, left & ~got
                remainder -= group
                progressed = True
        return result
    return _take_packed(topology, avail, count, spread, uncore=False)


# Where a combination's remainder goes: positions in the combination, and the counts left.
_Remainder: TypeAlias = tuple[tuple[int, ...], tuple[int, ...]] | None


def _place_remainder(
    after: dict[int, int],
    combo: tuple[int, ...],
    remainder: int,
    group: int,
    searched: dict[tuple[tuple[int, ...], int], _Remainder],
) -> tuple[int, tuple[int, ...]] | None:
    """The subset of ``combo`` to take the remainder from that leaves the NUMA nodes most
    evenly used, and that score; bigger subsets are tried first so CPUs stay spread.

    Every subset takes the same ``remainder`` CPUs from ``combo``, so the total left stays
    the same and the variance over all nodes moves with the sum of squares over ``combo``
    alone: the winner depends only on ``combo``'s counts, in order. Combinations with the
    same counts (every one, on an idle machine of equal nodes) share one search through
    ``searched``. Searching per combination took 15 s for 195 CPUs on 16 idle nodes of 30,
    all of it on the CRI path."""
    counts = tuple(after[n] for n in combo)
    key = (counts, remainder)
    if key not in searched:
        searched[key] = _best_remainder(counts, remainder, group)
    found = searched[key]
    if found is None:
        return None
    positions, left = found
    trial = dict(after)
    trial.update(zip(combo, left, strict=True))
    return _spread_score(trial.values()), tuple(combo[i] for i in positions)


def _best_remainder(counts: tuple[int, ...], remainder: int, group: int) -> _Remainder:
    """For free ``counts`` of a combination's nodes: the positions to hand ``remainder`` out
    over that leave the smallest sum of squares (the first such, bigger subsets first), and
    the counts they leave."""
    candidates = [i for i, free in enumerate(counts) if free >= group]
    best: tuple[int, tuple[int, ...], tuple[int, ...]] | None = None
    for size in range(len(candidates), 0, -1):
        for subset in combinations(candidates, size):
            if sum(counts[i] for i in subset) < remainder:
                continue
            trial = dict(enumerate(counts))
            if not _hand_out(trial, subset, remainder, group):
                continue
            squares = sum(v * v for v in trial.values())
            if best is None or squares < best[0]:
                best = (squares, subset, tuple(trial.values()))
    return None if best is None else best[1:]
