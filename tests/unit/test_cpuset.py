"""CPUSet: the kernel list format, set algebra, and the value-type contract."""

from __future__ import annotations

import operator
import os
import pickle
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shim.cpuset import MAX_CPU_ID, CPUSet
from tests.harness.sysfs import PROPERTY_SETTINGS

cpu_ids = st.integers(min_value=0, max_value=300)
id_sets = st.frozensets(cpu_ids, max_size=80)


def reference_format(ids: frozenset[int]) -> str:
    """The kernel's bitmap_print_to_pagebuf list format, written the slow obvious way."""
    parts: list[str] = []
    ordered = sorted(ids)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


@pytest.mark.parametrize(
    ("text", "members", "canonical"),
    [
        ("", [], ""),
        ("\n", [], ""),
        ("0", [0], "0"),
        ("0-3,8,10-11", [0, 1, 2, 3, 8, 10, 11], "0-3,8,10-11"),
        ("0-3,8,10-11\n", [0, 1, 2, 3, 8, 10, 11], "0-3,8,10-11"),
        ("  5 \n", [5], "5"),
        ("0,1", [0, 1], "0-1"),
        ("1,0", [0, 1], "0-1"),
        ("3-3", [3], "3"),
        ("0-1,2-3", [0, 1, 2, 3], "0-3"),
        ("0-4,2-6", list(range(7)), "0-6"),
        ("8,0-2,4", [0, 1, 2, 4, 8], "0-2,4,8"),
        ("007", [7], "7"),
        (f"{MAX_CPU_ID}", [MAX_CPU_ID], f"{MAX_CPU_ID}"),
    ],
)
def test_parse_and_format(text: str, members: list[int], canonical: str) -> None:
    cpus = CPUSet.parse(text)
    assert list(cpus) == members
    assert str(cpus) == canonical
    assert CPUSet.parse(str(cpus)) == cpus


@pytest.mark.parametrize(
    "text",
    [
        "3-1",
        "a",
        "1,,2",
        "-1",
        "1-",
        ",",
        "1,",
        ",1",
        "1-2-3",
        "0x1",
        "1 ,2",
        "1, 2",
        "+1",
        "1.0",
        "٣",
        "0-1\n2",
        f"{MAX_CPU_ID + 1}",
        f"0-{MAX_CPU_ID + 1}",
    ],
)
def test_parse_rejects_malformed_text_naming_it(text: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(text))):
        CPUSet.parse(text)


@pytest.mark.parametrize("bad", [-1, -100, MAX_CPU_ID + 1])
def test_constructor_rejects_out_of_range_ids(bad: int) -> None:
    with pytest.raises(ValueError, match=str(bad)):
        CPUSet([0, bad])


def test_the_largest_cpu_id_is_65535() -> None:
    # Linux's NR_CPUS tops out at 8192 today; the ceiling is a fixed part of the format.
    assert CPUSet([65535]).max() == 65535
    assert CPUSet.parse("65535") == CPUSet.from_mask(1 << 65535)
    with pytest.raises(ValueError, match="65536 out of range"):
        CPUSet([65536])
    with pytest.raises(ValueError, match="65536 in '65536' exceeds"):
        CPUSet.parse("65536")
    with pytest.raises(ValueError, match="bits above the maximum"):
        CPUSet.from_mask(1 << 65536)


def test_constructor_rejects_non_ints() -> None:
    with pytest.raises(TypeError):
        CPUSet(["1"])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        CPUSet([True])


def test_membership_is_for_cpu_ids_only() -> None:
    cpus = CPUSet([0, 1, 3])
    assert [cpu for cpu in (-1, 0, 1, 2, 3, 70000) if cpu in cpus] == [0, 1, 3]
    # bool is an int subclass, but the constructor refuses it as a CPU id; so does membership.
    assert True not in cpus
    assert False not in cpus
    assert [value for value in ("1", 1.0, None) if value in cpus] == []


def test_from_mask() -> None:
    assert CPUSet.from_mask(0b1011) == CPUSet([0, 1, 3])
    assert CPUSet.from_mask(0) == CPUSet()
    assert CPUSet([0, 1, 3]).mask == 0b1011
    with pytest.raises(ValueError, match="negative"):
        CPUSet.from_mask(-1)
    with pytest.raises(ValueError, match="maximum"):
        CPUSet.from_mask(1 << (MAX_CPU_ID + 1))


def test_repr_and_value_semantics() -> None:
    a = CPUSet.parse("0-3")
    assert repr(a) == "CPUSet('0-3')"
    assert repr(CPUSet()) == "CPUSet('')"
    assert a == CPUSet(range(4))
    assert a != CPUSet(range(5))
    assert a != "0-3"
    assert hash(a) == hash(CPUSet([3, 2, 1, 0]))
    assert {a: 1}[CPUSet.parse("0,1,2,3")] == 1
    assert pickle.loads(pickle.dumps(a)) == a
    with pytest.raises(AttributeError):
        a._mask = 0
    assert not CPUSet()
    assert CPUSet([0])


def test_algebra() -> None:
    a, b = CPUSet.parse("0-5"), CPUSet.parse("4-9")
    assert a | b == CPUSet.parse("0-9") == a.union(b)
    assert a & b == CPUSet.parse("4-5") == a.intersection(b)
    assert a - b == CPUSet.parse("0-3") == a.difference(b)
    assert a ^ b == CPUSet.parse("0-3,6-9") == a.symmetric_difference(b)
    assert a.union(b, CPUSet([20])) == CPUSet.parse("0-9,20")
    assert a.intersection(b, CPUSet([5])) == CPUSet([5])
    assert a.difference(b, CPUSet([0])) == CPUSet.parse("1-3")
    assert CPUSet.parse("4-5").issubset(a)
    assert not b.issubset(a)
    assert a.issuperset(CPUSet([1, 2]))
    assert a.isdisjoint(CPUSet.parse("6-7"))
    assert not a.isdisjoint(b)
    assert 3 in a
    assert 0 in a
    assert 5 in a
    assert 6 not in a
    assert -1 not in a
    assert "3" not in a
    assert len(a) == 6
    assert len(CPUSet()) == 0


@pytest.mark.parametrize("op", [operator.or_, operator.and_, operator.sub, operator.xor])
def test_operators_refuse_other_types(op: Callable[[object, object], object]) -> None:
    with pytest.raises(TypeError):
        op(CPUSet.parse("0-3"), {1})


def test_min_max_first_take_lowest() -> None:
    cpus = CPUSet.parse("3,7-9,20")
    assert cpus.min() == cpus.first() == 3
    assert cpus.max() == 20
    assert cpus.take_lowest(0) == CPUSet()
    assert cpus.take_lowest(3) == CPUSet.parse("3,7-8")
    assert cpus.take_lowest(5) == cpus
    with pytest.raises(ValueError, match="cannot take 6"):
        cpus.take_lowest(6)
    with pytest.raises(ValueError, match="cannot take -1"):
        cpus.take_lowest(-1)
    with pytest.raises(ValueError, match="empty"):
        CPUSet().min()
    with pytest.raises(ValueError, match="empty"):
        CPUSet().max()


def test_round_trips_the_kernels_own_strings() -> None:
    status = Path("/proc/self/status").read_text()
    allowed = re.search(r"^Cpus_allowed_list:\s*(.*)$", status, re.MULTILINE)
    assert allowed is not None
    text = allowed.group(1)
    assert str(CPUSet.parse(text)) == text
    assert set(CPUSet.parse(text)) == os.sched_getaffinity(0)

    online = Path("/sys/devices/system/cpu/online").read_text()
    assert str(CPUSet.parse(online)) == online.strip()
    for name in ("possible", "present", "offline", "isolated"):
        path = Path("/sys/devices/system/cpu") / name
        if path.exists():
            raw = path.read_text()
            assert str(CPUSet.parse(raw)) == raw.strip()


@PROPERTY_SETTINGS
@given(id_sets)
def test_format_matches_reference_and_round_trips(ids: frozenset[int]) -> None:
    cpus = CPUSet(ids)
    assert str(cpus) == reference_format(ids)
    assert CPUSet.parse(str(cpus)) == cpus
    assert CPUSet.parse(str(cpus) + "\n") == cpus
    assert list(cpus) == sorted(ids)
    assert len(cpus) == len(ids)
    assert CPUSet.from_mask(cpus.mask) == cpus
    if ids:
        assert cpus.min() == min(ids)
        assert cpus.max() == max(ids)


@PROPERTY_SETTINGS
@given(id_sets, id_sets, st.integers(min_value=0, max_value=80))
def test_algebra_matches_frozenset(a: frozenset[int], b: frozenset[int], n: int) -> None:
    x, y = CPUSet(a), CPUSet(b)
    assert set(x | y) == a | b
    assert set(x & y) == a & b
    assert set(x - y) == a - b
    assert set(x ^ y) == a ^ b
    assert x.issubset(y) == (a <= b)
    assert x.isdisjoint(y) == a.isdisjoint(b)
    assert (x == y) == (a == b)
    if n <= len(a):
        assert set(x.take_lowest(n)) == set(sorted(a)[:n])
