"""The config file of ``cpushim run`` (TOML): one key per flag, named like kubelet's setting
where kubelet has one. The command line overrides the file and the file overrides the built-in
defaults (the ones of :class:`shim.run.RunOptions`).

Parsing is pure (:func:`parse_config`); :func:`load_config` only adds the file read, and
:func:`reload_options` reads the file again for a live reload, keeping the flags.
"""

from __future__ import annotations

import argparse
import difflib
import grp
import math
import os
import re
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

from shim.cpuset import CPUSet
from shim.cri.upstream import unix_path
from shim.fileio import read_regular_file
from shim.log import LEVELS
from shim.policy.options import OptionsError, StaticPolicyOptions

if TYPE_CHECKING:
    from shim.engine import FailurePolicy
    from shim.run import RunOptions

__all__ = [
    "EVENT_LOOPS",
    "FAILURE_POLICIES",
    "KEYS",
    "KEYS_BY_NAME",
    "LOG_LEVELS",
    "POLICIES",
    "ConfigError",
    "ConfigValues",
    "Key",
    "flag_type",
    "key_line",
    "load_config",
    "parse_address",
    "parse_config",
    "reload_options",
    "resolve",
]

POLICIES: Final = ("none", "static")
# The engine's FailurePolicy literal, spelled out so that reading a config does not import the
# engine; a unit test keeps the two equal.
FAILURE_POLICIES: Final[tuple[FailurePolicy, ...]] = ("fail-closed", "fail-open")
EVENT_LOOPS: Final = ("auto", "uvloop", "asyncio")
LOG_LEVELS: Final = LEVELS

# RunOptions field name -> converted value, for the keys present in one file.
ConfigValues = Mapping[str, object]


class ConfigError(Exception):
    """A config file that cannot be used; ``str()`` is ``path:line: key: message``, less the
    parts that are unknown (a missing file has neither line nor key)."""

    def __init__(
        self, path: Path, message: str, *, line: int | None = None, key: str | None = None
    ) -> None:
        self.path = path
        self.line = line
        self.key = key
        self.message = message
        where = str(path) if line is None else f"{path}:{line}"
        super().__init__(f"{where}: {key}: {message}" if key is not None else f"{where}: {message}")


class _Invalid(ValueError):
    """A value a key refuses; ``subkey`` names the entry of a table that is at fault."""

    def __init__(self, message: str, subkey: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.subkey = subkey


# -- values ------------------------------------------------------------------------------------


def _show(value: object) -> str:
    """A value the way the file spells it, for messages."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return repr(value)


def _string(value: object) -> str:
    if not isinstance(value, str):
        raise _Invalid(f"want a string, got {_show(value)}")
    return value


def _nonempty(value: object) -> str:
    text = _string(value)
    if not text:
        raise _Invalid("must not be empty")
    return text


def _group(value: object) -> str:
    text = _nonempty(value)
    try:
        grp.getgrnam(text)
    except KeyError:
        # Checked here, so that the error names the file and line before anything starts.
        raise _Invalid(f"no group named {text!r} on this node") from None
    return text


def _endpoint(value: object) -> str:
    text = _string(value)
    try:
        unix_path(text)
    except ValueError as exc:
        raise _Invalid(str(exc)) from None
    return text


def _image_endpoint(value: object) -> str:
    # Empty means the runtime's endpoint, as when the key is left out.
    text = _string(value)
    return _endpoint(text) if text else text


def _seconds(value: object) -> float:
    # bool is an int to Python, but `true` is no number of seconds.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Invalid(f"want a number of seconds, got {_show(value)}")
    if not math.isfinite(value) or value < 0:
        raise _Invalid(f"want a finite number of seconds, 0 or more, got {_show(value)}")
    return float(value)


def _seconds_text(text: str) -> object:
    try:
        return float(text)
    except ValueError:
        raise _Invalid(f"want a number of seconds, got {text!r}") from None


def _cpu_count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Invalid(f"want a whole number of CPUs, got {_show(value)}")
    if value < 1:
        raise _Invalid(f"the static policy needs at least one reserved CPU, got {value}")
    return value


def _count_text(text: str) -> object:
    try:
        return int(text)
    except ValueError:
        raise _Invalid(f"want a whole number of CPUs, got {text!r}") from None


def _cpu_list(value: object) -> str:
    text = _string(value)
    try:
        cpus = CPUSet.parse(text)
    except ValueError:
        raise _Invalid(f"not a CPU list: {text!r}") from None
    if not cpus:
        raise _Invalid("an empty list reserves nothing; the static policy needs at least one CPU")
    # One spelling per set: "0,1" rewritten as "0-1" is no change to reload for.
    return str(cpus)


def _boolean(value: object) -> bool:
    if not isinstance(value, bool):
        raise _Invalid(f"want true or false, got {_show(value)}")
    return value


def _path(value: object) -> Path:
    return Path(_nonempty(value))


def _absolute_path(value: object) -> Path:
    path = _path(value)
    if not path.is_absolute():
        raise _Invalid(f"want an absolute path, got {str(path)!r}")
    return path


def _projection_path(value: object) -> Path:
    path = _absolute_path(value)
    # "/" as the mount path would cover every new container's root file system; as the
    # directory, the sweep of stale projections would look at the node's own root.
    if os.path.normpath(path) in ("/", "//"):
        raise _Invalid("want a directory of its own, not the root directory")
    return path


def _choice(*choices: str) -> Callable[[object], str]:
    def convert(value: object) -> str:
        text = _string(value)
        if text not in choices:
            raise _Invalid(f"unknown value {text!r}: want {_either(choices)}")
        return text

    return convert


def _either(choices: tuple[str, ...]) -> str:
    return ", ".join(choices[:-1]) + f" or {choices[-1]}"


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host in brackets) as host and port; ValueError otherwise."""
    host, colon, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"an IPv6 address goes in brackets, [::1]:9464; got {text!r}")
    if not colon or not host or not re.fullmatch("[0-9]{1,5}", port) or not 0 < int(port) < 65536:
        raise ValueError(f"want HOST:PORT, got {text!r}")
    return host, int(port)


def _address(value: object) -> str:
    text = _string(value)
    if text:
        try:
            parse_address(text)
        except ValueError as exc:
            raise _Invalid(f"{exc}; an empty string switches metrics off") from None
    return text


def _policy_options(value: object) -> tuple[str, ...]:
    """kubelet's map form, ``{full-pcpus-only = "true"}``; TOML booleans are accepted too.
    The result is what ``--policy-option`` gives: the names switched on."""
    if not isinstance(value, dict):
        raise _Invalid(f'want a table of option = "true" or "false", got {_show(value)}')
    raw: dict[str, str] = {}
    for name, setting in value.items():
        if name in KEYS_BY_NAME:
            # A line added at the end of a file that ends with this table, as the sample
            # does, lands in it: "unknown option" would not say how to fix that.
            raise _Invalid(
                f"{name} is a top-level key, read here as a policy option because it comes"
                " after the [cpuManagerPolicyOptions] header: move it above that header",
                subkey=name,
            )
        if isinstance(setting, bool):
            setting = "true" if setting else "false"
        elif not isinstance(setting, str):
            raise _Invalid(f"want true or false, got {_show(setting)}", subkey=name)
        try:
            StaticPolicyOptions.parse({name: setting})
        except OptionsError as exc:
            raise _Invalid(str(exc), subkey=name) from None
        raw[name] = setting
    try:
        enabled = StaticPolicyOptions.parse(raw).enabled
    except OptionsError as exc:
        raise _Invalid(str(exc)) from None
    # In name order: the same options in another order are no change to reload for.
    return tuple(sorted(name for name in raw if name in enabled))


# -- keys --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Key:
    """A config key: the RunOptions field it sets, the flag that overrides it, and how a
    value from the file (or the flag's text, for :func:`flag_type`) becomes the field's."""

    name: str
    field: str
    flag: str
    convert: Callable[[object], object]
    from_text: Callable[[str], object] = str


KEYS: Final[tuple[Key, ...]] = (
    Key("listen", "listen", "--listen", _endpoint),
    Key("runtimeEndpoint", "runtime_endpoint", "--runtime-endpoint", _endpoint),
    Key("imageEndpoint", "image_endpoint", "--image-endpoint", _image_endpoint),
    Key("socketGroup", "socket_group", "--socket-group", _group),
    Key("upstreamWait", "upstream_wait", "--upstream-wait", _seconds, _seconds_text),
    Key("shutdownGrace", "shutdown_grace", "--shutdown-grace", _seconds, _seconds_text),
    Key("cpuManagerPolicy", "policy", "--policy", _choice(*POLICIES)),
    Key("reservedSystemCPUs", "reserved_cpus", "--reserved-cpus", _cpu_list),
    Key("reservedCPUCount", "reserved_cpu_count", "--reserved-cpu-count", _cpu_count, _count_text),
    Key("cpuManagerPolicyOptions", "policy_options", "--policy-option", _policy_options),
    Key("stateDir", "state_dir", "--state-dir", _path),
    Key("sysfsRoot", "sysfs_root", "--sysfs-root", _path),
    Key("failurePolicy", "failure_policy", "--failure-policy", _choice(*FAILURE_POLICIES)),
    Key("recoverFromRuntime", "recover_from_runtime", "--recover-from-runtime", _boolean),
    Key("resyncPeriod", "resync_period", "--resync-period", _seconds, _seconds_text),
    # Absolute: the mount names it to the runtime, which would resolve it against its own.
    Key("projectionDir", "projection_dir", "--projection-dir", _projection_path),
    Key(
        "projectionMountPath", "projection_mount_path", "--projection-mount-path", _projection_path
    ),
    Key("metricsAddress", "metrics_address", "--metrics-address", _address),
    Key("eventLoop", "event_loop", "--event-loop", _choice(*EVENT_LOOPS)),
    Key("logLevel", "log_level", "--log-level", _choice(*LOG_LEVELS)),
)
KEYS_BY_NAME: Final[Mapping[str, Key]] = MappingProxyType({key.name: key for key in KEYS})
# A flag's spelling used as a key ("reserved-cpus") is a likely slip: point at the real key.
_BY_FLAG: Final = {key.flag.removeprefix("--"): key for key in KEYS}
# Fields that are one setting in two forms: a flag for either overrides the file's both.
_ALTERNATIVES: Final = (frozenset({"reserved_cpus", "reserved_cpu_count"}),)


def flag_type(name: str) -> Callable[[str], object]:
    """An argparse ``type`` for the flag of key ``name``: it accepts what the key accepts."""
    key = KEYS_BY_NAME[name]

    def convert(text: str) -> object:
        try:
            return key.convert(key.from_text(text))
        except _Invalid as exc:
            raise argparse.ArgumentTypeError(exc.message) from None

    return convert


# -- files -------------------------------------------------------------------------------------


def load_config(path: Path) -> ConfigValues:
    """The values of the file at ``path``; ConfigError naming the path when it cannot be read
    or is not a good config."""
    try:
        # A FIFO put there would hold start-up until something wrote into it.
        data = read_regular_file(path)
    except OSError as exc:
        raise ConfigError(path, f"cannot read the config file: {exc.strerror or exc}") from None
    return config_from_bytes(data, path)


def config_from_bytes(data: bytes, path: Path) -> ConfigValues:
    """The values of a config file read already (``data``) from ``path``; ConfigError naming
    the path when it is not a good config."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(path, f"not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    return parse_config(text, path)


def parse_config(text: str, path: Path) -> ConfigValues:
    """The values of a config file's ``text``, by RunOptions field name, for the keys present;
    ``path`` is only for messages. The first fault found raises ConfigError."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise _syntax_error(path, text, str(exc)) from None
    lines = _KeyLines(text)
    values: dict[str, object] = {}
    for name, raw in document.items():
        key = KEYS_BY_NAME.get(name)
        if key is None:
            raise ConfigError(path, _unknown(name), line=lines.find((name,)), key=name)
        try:
            values[key.field] = key.convert(raw)
        except _Invalid as exc:
            at = (name,) if exc.subkey is None else (name, exc.subkey)
            raise ConfigError(path, exc.message, line=lines.find(at), key=".".join(at)) from None
    for group in _ALTERNATIVES:
        given = [name for name in document if KEYS_BY_NAME[name].field in group]
        if len(given) > 1:
            raise ConfigError(
                path,
                f"give {_either(tuple(given))}, not both",
                line=lines.find((given[-1],)),
                key=given[-1],
            )
    return MappingProxyType(values)


def _unknown(name: str) -> str:
    if name in _BY_FLAG:
        return f"unknown key; did you mean {_BY_FLAG[name].name}?"
    # Case folded: reservedSystemCpus is a slip for reservedSystemCPUs, not another key.
    folded = {key.lower(): key for key in KEYS_BY_NAME}
    close = difflib.get_close_matches(name.lower(), folded, n=1)
    if close:
        return f"unknown key; did you mean {folded[close[0]]}?"
    return "unknown key"


def _decode_error_line(message: str, text: str = "") -> int | None:
    # Python 3.11's TOMLDecodeError has no line attribute; its message ends with the place.
    found = re.search(r"\(at line (\d+), column \d+\)$", message)
    if found:
        return int(found.group(1))
    if message.endswith("(at end of document)") and text:
        return len(text.splitlines()) or None
    return None


def _syntax_error(path: Path, text: str, message: str) -> ConfigError:
    """tomllib's refusal with the file and line; a key set twice (tomllib: "Cannot overwrite
    a value") also names the key and the line that set it first."""
    line = _decode_error_line(message, text)
    if line is not None and message.startswith("Cannot overwrite a value"):
        keys = [(number, key) for number, key in _key_lines(text) if number <= line]
        if keys and keys[-1][0] == line:
            key = keys[-1][1]
            first = next(number for number, written in keys if written == key)
            if first != line:
                name = ".".join(key)
                return ConfigError(
                    path,
                    f"set twice (line {first} and line {line}); keep one",
                    line=line,
                    key=name,
                )
    return ConfigError(path, message, line=line)


# A TOML key, bare or quoted, and a dotted key made of them.
_SIMPLE_KEY = r"""[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|'[^']*'"""
_DOTTED_KEY = rf"(?:{_SIMPLE_KEY})(?:\s*\.\s*(?:{_SIMPLE_KEY}))*"
_HEADER = re.compile(rf"\s*\[\[?\s*({_DOTTED_KEY})\s*\]\]?")
_ASSIGNMENT = re.compile(rf"\s*({_DOTTED_KEY})\s*=")


class _KeyLines:
    """Where each key of a TOML text is written, since tomllib does not say. A line scan that
    follows table headers: right for the flat files and one table that configs are, and at
    worst wrong about a line (never about whether the file is good)."""

    def __init__(self, text: str) -> None:
        self._keys: list[tuple[int, tuple[str, ...]]] = list(_key_lines(text))

    def find(self, key: tuple[str, ...]) -> int | None:
        """The line defining ``key``; else the first line of a table inside it or holding it."""
        for number, written in self._keys:
            if written == key:
                return number
        for number, written in self._keys:
            shorter = min(len(written), len(key))
            if written[:shorter] == key[:shorter]:
                return number
        return None


def key_line(data: bytes | None, key: str) -> int | None:
    """The line of the config file's bytes ``data`` that sets top-level ``key``, if any."""
    if data is None:
        return None
    return _KeyLines(data.decode("utf-8", "replace")).find((key,))


def _key_lines(text: str) -> Iterator[tuple[int, tuple[str, ...]]]:
    table: tuple[str, ...] = ()
    for number, line in enumerate(text.splitlines(), start=1):
        header = _HEADER.match(line)
        if header is not None:
            table = _split_key(header.group(1))
            yield number, table
            continue
        assignment = _ASSIGNMENT.match(line)
        if assignment is not None:
            yield number, table + _split_key(assignment.group(1))


def _split_key(dotted: str) -> tuple[str, ...]:
    parts = re.findall(_SIMPLE_KEY, dotted)
    return tuple(part[1:-1] if part[0] in "\"'" else part for part in parts)


# -- resolution --------------------------------------------------------------------------------


def resolve(flags: Mapping[str, object], file_values: ConfigValues) -> RunOptions:
    """The options to run with: ``flags`` (RunOptions fields given on the command line, and
    only those) over ``file_values`` over the built-in defaults. The result remembers which
    fields were flags (``cli_overrides``) for :func:`reload_options`."""
    from shim.run import RunOptions  # shim.run may import this module: bind it late

    # Any: each value was checked against its field by the key's converter or the parser.
    merged: dict[str, Any] = {
        field: value
        for field, value in file_values.items()
        if not any(field in group and not group.isdisjoint(flags) for group in _ALTERNATIVES)
    }
    if flags.get("policy") == "none" and "policy_options" not in flags:
        # The file's options were the file's policy's: a flag that switches to none leaves
        # them behind. Given as flags too, build_policy refuses them, as kubelet does.
        merged.pop("policy_options", None)
    merged.update(flags)
    if not merged.get("image_endpoint"):
        merged["image_endpoint"] = merged.get("runtime_endpoint", RunOptions.runtime_endpoint)
    return RunOptions(**merged, cli_overrides=frozenset(flags))


def reload_options(current: RunOptions, data: bytes | None = None) -> RunOptions:
    """``current`` with its config file read again (or its bytes ``data``, read already):
    keys added, changed or removed there take effect, flags given on the command line still
    win. ConfigError when the file is bad."""
    path = current.config_path
    if path is None:
        raise ValueError("these options were not read from a config file")
    flags = {field: getattr(current, field) for field in current.cli_overrides}
    flags["config_path"] = path
    values = load_config(path) if data is None else config_from_bytes(data, path)
    return resolve(flags, values)
