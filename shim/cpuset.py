"""An immutable set of CPU ids, printed and parsed in the kernel's list format (``0-3,8,10-11``).

The set is an int bitmask (bit n set = CPU n present): union, intersection and size are
single big-int operations, which keeps the allocator fast on large machines.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Final

__all__ = ["MAX_CPU_ID", "CPUSet"]

# Linux caps NR_CPUS at 8192 today; a generous ceiling stops text such as "0-4000000000" from
# allocating a gigantic mask while leaving room for future kernels.
MAX_CPU_ID: Final = 65535

_ITEM = re.compile(r"([0-9]+)(?:-([0-9]+))?")


def _parse_id(digits: str, text: str) -> int:
    value = int(digits)
    if value > MAX_CPU_ID:
        raise ValueError(f"CPU id {value} in {text!r} exceeds the maximum {MAX_CPU_ID}")
    return value


class CPUSet:
    """A set of non-negative CPU ids; immutable and hashable, iterates in ascending order."""

    __slots__ = ("_mask",)

    _mask: int

    def __init__(self, cpus: Iterable[int] = ()) -> None:
        mask = 0
        for cpu in cpus:
            if not isinstance(cpu, int) or isinstance(cpu, bool):
                raise TypeError(f"CPU ids must be int, got {cpu!r}")
            if cpu < 0 or cpu > MAX_CPU_ID:
                raise ValueError(f"CPU id {cpu} out of range 0..{MAX_CPU_ID}")
            mask |= 1 << cpu
        object.__setattr__(self, "_mask", mask)

    @classmethod
    def from_mask(cls, mask: int) -> CPUSet:
        """The set whose members are the bits set in ``mask``."""
        if mask < 0:
            raise ValueError(f"a CPU mask cannot be negative: {mask}")
        if mask.bit_length() > MAX_CPU_ID + 1:
            raise ValueError(f"CPU mask has bits above the maximum CPU id {MAX_CPU_ID}")
        result = cls.__new__(cls)
        object.__setattr__(result, "_mask", mask)
        return result

    @classmethod
    def parse(cls, text: str) -> CPUSet:
        """Parse the kernel list format; surrounding whitespace (the kernel's newline) is ignored.

        ``""`` is the empty set. Raises ValueError naming the text for anything else malformed:
        empty items (``"1,,2"``), reversed ranges (``"3-1"``), signs, or non-digits.
        """
        stripped = text.strip()
        if not stripped:
            return _EMPTY
        mask = 0
        for item in stripped.split(","):
            match = _ITEM.fullmatch(item)
            if match is None:
                raise ValueError(f"invalid CPU list {text!r}: bad item {item!r}")
            first = _parse_id(match.group(1), text)
            last_digits = match.group(2)
            if last_digits is None:
                mask |= 1 << first
                continue
            last = _parse_id(last_digits, text)
            if last < first:
                raise ValueError(f"invalid CPU list {text!r}: range {item!r} is reversed")
            mask |= ((1 << (last - first + 1)) - 1) << first
        return cls.from_mask(mask)

    @property
    def mask(self) -> int:
        """The bitmask: bit n is set when CPU n is a member."""
        return self._mask

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("CPUSet is immutable")

    def ranges(self) -> Iterator[tuple[int, int]]:
        """Maximal runs of consecutive ids as inclusive ``(first, last)`` pairs, ascending."""
        mask = self._mask
        while mask:
            start = (mask & -mask).bit_length() - 1
            shifted = mask >> start
            # shifted ^ (shifted + 1) sets the run of trailing ones plus the bit above it.
            run = (shifted ^ (shifted + 1)).bit_length() - 1
            yield start, start + run - 1
            mask &= ~(((1 << run) - 1) << start)

    def __str__(self) -> str:
        return ",".join(
            str(first) if first == last else f"{first}-{last}" for first, last in self.ranges()
        )

    def __repr__(self) -> str:
        return f"CPUSet({str(self)!r})"

    def __iter__(self) -> Iterator[int]:
        for first, last in self.ranges():
            yield from range(first, last + 1)

    def __len__(self) -> int:
        return self._mask.bit_count()

    def __bool__(self) -> bool:
        return self._mask != 0

    def __contains__(self, cpu: object) -> bool:
        # bool is an int, but True is no more CPU 1 here than in the constructor.
        if not isinstance(cpu, int) or isinstance(cpu, bool) or cpu < 0:
            return False
        return bool(self._mask >> cpu & 1)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CPUSet):
            return NotImplemented
        return self._mask == other._mask

    def __hash__(self) -> int:
        return hash((CPUSet, self._mask))

    def __reduce__(self) -> tuple[object, tuple[int]]:
        return (CPUSet.from_mask, (self._mask,))

    def __or__(self, other: CPUSet) -> CPUSet:
        if not isinstance(other, CPUSet):
            return NotImplemented
        return CPUSet.from_mask(self._mask | other._mask)

    def __and__(self, other: CPUSet) -> CPUSet:
        if not isinstance(other, CPUSet):
            return NotImplemented
        return CPUSet.from_mask(self._mask & other._mask)

    def __sub__(self, other: CPUSet) -> CPUSet:
        if not isinstance(other, CPUSet):
            return NotImplemented
        return CPUSet.from_mask(self._mask & ~other._mask)

    def __xor__(self, other: CPUSet) -> CPUSet:
        if not isinstance(other, CPUSet):
            return NotImplemented
        return CPUSet.from_mask(self._mask ^ other._mask)

    def union(self, *others: CPUSet) -> CPUSet:
        mask = self._mask
        for other in others:
            mask |= other._mask
        return CPUSet.from_mask(mask)

    def intersection(self, *others: CPUSet) -> CPUSet:
        mask = self._mask
        for other in others:
            mask &= other._mask
        return CPUSet.from_mask(mask)

    def difference(self, *others: CPUSet) -> CPUSet:
        mask = self._mask
        for other in others:
            mask &= ~other._mask
        return CPUSet.from_mask(mask)

    def symmetric_difference(self, other: CPUSet) -> CPUSet:
        return CPUSet.from_mask(self._mask ^ other._mask)

    def issubset(self, other: CPUSet) -> bool:
        return self._mask & ~other._mask == 0

    def issuperset(self, other: CPUSet) -> bool:
        return other._mask & ~self._mask == 0

    def isdisjoint(self, other: CPUSet) -> bool:
        return self._mask & other._mask == 0

    def min(self) -> int:
        """The lowest id; ValueError when empty."""
        if not self._mask:
            raise ValueError("min() of an empty CPUSet")
        return (self._mask & -self._mask).bit_length() - 1

    first = min

    def max(self) -> int:
        """The highest id; ValueError when empty."""
        if not self._mask:
            raise ValueError("max() of an empty CPUSet")
        return self._mask.bit_length() - 1

    def take_lowest(self, count: int) -> CPUSet:
        """The ``count`` lowest ids; ValueError when ``count`` is negative or exceeds the size."""
        if count < 0 or count > len(self):
            raise ValueError(f"cannot take {count} CPUs from {len(self)} in {self}")
        return CPUSet.from_mask(lowest_bits(self._mask, count))


def lowest_bits(mask: int, count: int) -> int:
    """The ``count`` lowest set bits of ``mask`` (all of them when it has fewer)."""
    result = 0
    while count > 0 and mask:
        low = mask & -mask
        result |= low
        mask ^= low
        count -= 1
    return result


_EMPTY: Final = CPUSet()
