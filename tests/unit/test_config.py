"""The config file of ``cpushim run``: each key into RunOptions, flags over the file over the
defaults, every refusal with file, line and key, the sample file, and a live reload."""

from __future__ import annotations

import argparse
import grp
import os
import re
import subprocess
import sys
import threading
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import get_args

import orjson
import pytest

from shim.cli import build_parser, log_config, run_options
from shim.config import (
    FAILURE_POLICIES,
    KEYS,
    KEYS_BY_NAME,
    ConfigError,
    key_line,
    load_config,
    parse_address,
    parse_config,
    reload_options,
    resolve,
)
from shim.cpuset import CPUSet
from shim.engine import FailurePolicy
from shim.run import DEFAULT_RESERVED_COUNT, RunOptions, build_policy
from tests.harness.sysfs import SINGLE_SOCKET_NO_HT, write_sysfs

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "contrib" / "config.toml"
PATH = Path("config.toml")
DEFAULTS = RunOptions()
NOT_KEYS = {"config_path", "cli_overrides"}


def parse_cli(*argv: str) -> RunOptions:
    return run_options(build_parser().parse_args(["run", *argv]))


def from_text(text: str) -> RunOptions:
    return resolve({}, parse_config(text, PATH))


@dataclass(frozen=True)
class Case:
    key: str
    toml: str
    flags: tuple[str, ...]
    value: object


CASES = (
    Case("listen", '"unix:///tmp/x/cri.sock"', ("--listen", "unix:///tmp/x/cri.sock"),
         "unix:///tmp/x/cri.sock"),
    Case("runtimeEndpoint", '"unix:///tmp/ctd.sock"',
         ("--runtime-endpoint", "unix:///tmp/ctd.sock"), "unix:///tmp/ctd.sock"),
    Case("imageEndpoint", '"/tmp/images.sock"', ("--image-endpoint", "/tmp/images.sock"),
         "/tmp/images.sock"),
    Case("socketGroup", '"daemon"', ("--socket-group", "daemon"), "daemon"),
    Case("upstreamWait", "5", ("--upstream-wait", "5"), 5.0),
    Case("shutdownGrace", "2.5", ("--shutdown-grace", "2.5"), 2.5),
    Case("cpuManagerPolicy", '"none"', ("--policy", "none"), "none"),
    Case("reservedSystemCPUs", '"0,2-3"', ("--reserved-cpus", "0,2-3"), "0,2-3"),
    Case("reservedCPUCount", "2", ("--reserved-cpu-count", "2"), 2),
    Case(
        "cpuManagerPolicyOptions",
        '{ full-pcpus-only = "true", align-by-socket = "false", strict-cpu-reservation = true }',
        ("--policy-option", "full-pcpus-only", "--policy-option", "strict-cpu-reservation"),
        ("full-pcpus-only", "strict-cpu-reservation"),
    ),
    Case("stateDir", '"/tmp/state"', ("--state-dir", "/tmp/state"), Path("/tmp/state")),
    Case("sysfsRoot", '"/tmp/sys"', ("--sysfs-root", "/tmp/sys"), Path("/tmp/sys")),
    Case("failurePolicy", '"fail-open"', ("--failure-policy", "fail-open"), "fail-open"),
    Case("recoverFromRuntime", "true", ("--recover-from-runtime",), True),
    Case("resyncPeriod", "0", ("--resync-period", "0"), 0.0),
    Case("projectionDir", '"/tmp/projection"', ("--projection-dir", "/tmp/projection"),
         Path("/tmp/projection")),
    Case("projectionMountPath", '"/cpus"', ("--projection-mount-path", "/cpus"), Path("/cpus")),
    Case("metricsAddress", '"[::1]:9000"', ("--metrics-address", "[::1]:9000"), "[::1]:9000"),
    Case("eventLoop", '"asyncio"', ("--event-loop", "asyncio"), "asyncio"),
    Case("logLevel", '"debug"', ("--log-level", "debug"), "debug"),
)  # fmt: skip


def test_every_option_has_a_key_and_a_case() -> None:
    settable = {f.name for f in fields(RunOptions)} - NOT_KEYS
    assert {key.field for key in KEYS} == settable
    assert {case.key for case in CASES} == set(KEYS_BY_NAME)


def test_every_run_flag_has_a_key() -> None:
    # argparse keeps its actions private; this is the one way to list what `run` accepts.
    subparsers = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    run_actions = subparsers.choices["run"]._actions
    flags = {a.option_strings[0]: a.dest for a in run_actions if a.dest != "help"}
    assert flags.pop("--config") == "config_path"
    assert flags == {key.flag: key.field for key in KEYS}


def test_the_readmes_flag_table_names_every_flag_with_its_key() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    rows = re.findall(r"^\| `(--[a-z-]+)` \| `([A-Za-z]+)` \|", readme, re.MULTILINE)
    assert dict(rows) == {key.flag: key.name for key in KEYS}
    assert len(rows) == len(KEYS)


def shown_default(value: object) -> str:
    """A default as the README and the help texts write it."""
    if value is None or value == ():
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def test_the_readmes_flag_table_gives_each_default_the_code_has() -> None:
    readme = (REPO / "README.md").read_text()
    rows = re.findall(r"^\| `(--[a-z-]+)` \| `[A-Za-z]+` \| ([^|]+) \|", readme, re.MULTILINE)
    assert len(rows) == len(KEYS)
    by_flag = {key.flag: key for key in KEYS}
    for flag, written in rows:
        field = by_flag[flag].field
        default = getattr(DEFAULTS, field)
        if field == "image_endpoint":  # follows the runtime's (test below)
            assert written.strip() == "the runtime endpoint"
        elif field == "reserved_cpu_count":  # unset: the static policy takes this many
            assert written.strip() == str(DEFAULT_RESERVED_COUNT)
        else:
            assert written.strip().strip("`") == shown_default(default), flag


def test_the_help_texts_give_each_default_the_code_has() -> None:
    subparsers = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    for action in subparsers.choices["run"]._actions:
        said = re.search(r"\(default:? ([^;)]+)", action.help or "")
        if said is None or action.dest == "help":
            continue
        if action.dest == "image_endpoint":
            assert said.group(1) == "the runtime's"
        elif action.dest == "reserved_cpu_count":
            assert said.group(1) == str(DEFAULT_RESERVED_COUNT)
        else:
            assert said.group(1) == shown_default(getattr(DEFAULTS, action.dest)), action.dest


def run_help(dest: str) -> str:
    subparsers = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    return next(a.help or "" for a in subparsers.choices["run"]._actions if a.dest == dest)


def test_the_help_texts_say_which_cpus_the_none_policy_gives(tmp_path: Path) -> None:
    """Offline CPUs left out, reserved ones kept in: what the help, the README and the sample
    config say of none is what build_policy makes of it."""
    spec = replace(SINGLE_SOCKET_NO_HT, offline=frozenset({7}))
    sysfs = write_sysfs(spec, tmp_path / "sys")
    policy = build_policy(replace(DEFAULTS, policy="none", reserved_cpus="0", sysfs_root=sysfs))
    assert policy.shared_pool({}) == spec.online() == CPUSet.parse("0-6")
    said = "every container on every online CPU"
    assert f"none: {said}" in run_help("policy")
    readme = (REPO / "README.md").read_text()
    assert f"`none`: {said} |" in readme
    assert f'"none": {said}.' in SAMPLE.read_text()
    # The reserved CPUs are still in the none policy's pool: their texts must not say
    # otherwise.
    assert "none policy uses every online CPU" in run_help("reserved_cpus")


def test_failure_policies_are_the_engines() -> None:
    assert set(FAILURE_POLICIES) == set(get_args(FailurePolicy))


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.key)
def test_key_sets_its_field(case: Case) -> None:
    field = KEYS_BY_NAME[case.key].field
    options = from_text(f"{case.key} = {case.toml}\n")
    assert getattr(options, field) == case.value
    assert getattr(DEFAULTS, field) != case.value
    # Nothing else moved (but the image endpoint, which follows the runtime's).
    assert options == replace(resolve({field: case.value}, {}), cli_overrides=frozenset())


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.key)
def test_flag_sets_the_same_field(case: Case) -> None:
    field = KEYS_BY_NAME[case.key].field
    options = parse_cli(*case.flags)
    assert getattr(options, field) == case.value
    assert options.cli_overrides == {field}


def test_without_config_the_defaults_apply() -> None:
    assert parse_cli() == DEFAULTS
    assert parse_cli().cli_overrides == frozenset()
    assert parse_cli().config_path is None


def test_image_endpoint_follows_the_runtime_unless_set() -> None:
    assert parse_cli("--runtime-endpoint", "/a.sock").image_endpoint == "/a.sock"
    assert parse_cli("--runtime-endpoint", "/a.sock", "--image-endpoint", "").image_endpoint == (
        "/a.sock"
    )
    assert from_text('runtimeEndpoint = "/a.sock"').image_endpoint == "/a.sock"
    assert from_text('runtimeEndpoint = "/a.sock"\nimageEndpoint = ""').image_endpoint == "/a.sock"
    assert from_text('imageEndpoint = "/i.sock"').image_endpoint == "/i.sock"
    assert from_text('imageEndpoint = "/i.sock"').runtime_endpoint == DEFAULTS.runtime_endpoint


def test_policy_options_are_in_name_order_without_false_ones() -> None:
    text = (
        "[cpuManagerPolicyOptions]\n"
        'strict-cpu-reservation = "True"\n'
        "distribute-cpus-across-numa = false\n"
        'full-pcpus-only = "1"\n'
    )
    assert from_text(text).policy_options == ("full-pcpus-only", "strict-cpu-reservation")
    assert from_text("[cpuManagerPolicyOptions]\n").policy_options == ()


def test_dotted_option_keys() -> None:
    assert from_text("cpuManagerPolicyOptions.align-by-socket = true").policy_options == (
        "align-by-socket",
    )


def test_metrics_can_be_switched_off() -> None:
    assert from_text('metricsAddress = ""').metrics_address == ""
    assert parse_cli("--metrics-address", "").metrics_address == ""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:9464", ("127.0.0.1", 9464)),
        ("[::1]:80", ("::1", 80)),
        ("node-1.example:65535", ("node-1.example", 65535)),
        ("localhost:1", ("localhost", 1)),
    ],
)
def test_parse_address(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize(
    "text", ["9464", ":9464", "host:", "host:0", "host:65536", "::1:80", "[::1:80", "::1]:80"]
)
def test_parse_address_refuses(text: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(text))):
        parse_address(text)


# -- flags over the file -----------------------------------------------------------------------


def write(tmp_path: Path, text: str, name: str = "config.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_flags_override_the_file_and_the_file_the_defaults(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        'listen = "unix:///tmp/file.sock"\n'
        "shutdownGrace = 3\n"
        'logLevel = "error"\n'
        'metricsAddress = ""\n',
    )
    options = parse_cli("--config", str(config), "--shutdown-grace", "7", "--log-level", "debug")
    assert options.config_path == config
    assert options.listen == "unix:///tmp/file.sock"  # file
    assert options.metrics_address == ""  # file
    assert options.shutdown_grace == 7.0  # flag
    assert options.log_level == "debug"  # flag
    assert options.upstream_wait == DEFAULTS.upstream_wait  # neither
    assert options.cli_overrides == {"config_path", "shutdown_grace", "log_level"}


@pytest.mark.parametrize(
    ("file_key", "flags", "reserved_cpus", "reserved_cpu_count"),
    [
        ('reservedSystemCPUs = "0,1"', ("--reserved-cpu-count", "3"), None, 3),
        ("reservedCPUCount = 2", ("--reserved-cpus", "4"), "4", None),
        ("reservedCPUCount = 2", ("--reserved-cpu-count", "3"), None, 3),
        ("reservedCPUCount = 2", (), None, 2),
    ],
)
def test_a_reserved_flag_overrides_both_reserved_keys(
    tmp_path: Path,
    file_key: str,
    flags: tuple[str, ...],
    reserved_cpus: str | None,
    reserved_cpu_count: int | None,
) -> None:
    options = parse_cli("--config", str(write(tmp_path, file_key)), *flags)
    assert (options.reserved_cpus, options.reserved_cpu_count) == (
        reserved_cpus,
        reserved_cpu_count,
    )


def test_a_policy_option_flag_replaces_the_files_options(tmp_path: Path) -> None:
    config = write(
        tmp_path, '[cpuManagerPolicyOptions]\nfull-pcpus-only = "true"\nalign-by-socket = "true"\n'
    )
    assert parse_cli("--config", str(config)).policy_options == (
        "align-by-socket",
        "full-pcpus-only",
    )
    options = parse_cli("--config", str(config), "--policy-option", "strict-cpu-reservation")
    assert options.policy_options == ("strict-cpu-reservation",)


def test_a_policy_flag_for_none_leaves_the_files_options_behind(tmp_path: Path) -> None:
    # The file's options are for the file's static policy; none takes none (kubelet refuses
    # options with it), and no flag could empty the file's table.
    config = write(
        tmp_path,
        'cpuManagerPolicy = "static"\n[cpuManagerPolicyOptions]\nfull-pcpus-only = "true"\n',
    )
    options = parse_cli("--config", str(config), "--policy", "none")
    assert (options.policy, options.policy_options) == ("none", ())
    build_policy(replace(options, sysfs_root=write_sysfs(SINGLE_SOCKET_NO_HT, tmp_path / "sys")))
    # Kept for a flag naming static, and refused when given as flags with none.
    assert parse_cli("--config", str(config), "--policy", "static").policy_options == (
        "full-pcpus-only",
    )
    both = parse_cli("--policy", "none", "--policy-option", "full-pcpus-only")
    with pytest.raises(ValueError, match="need the static policy"):
        build_policy(replace(both, sysfs_root=write_sysfs(SINGLE_SOCKET_NO_HT, tmp_path / "s2")))


def test_a_bad_new_flag_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["--resync-period", "-1"],
        ["--resync-period", "soon"],
        ["--metrics-address", "9464"],
        ["--projection-mount-path", "relative"],
        ["--projection-mount-path", "/"],
        ["--projection-dir", "/"],
        # Each flag takes what its key takes, not merely what its Python type parses.
        ["--upstream-wait", "-1"],
        ["--upstream-wait", "inf"],
        ["--shutdown-grace", "nan"],
        ["--reserved-cpu-count", "0"],
        ["--reserved-cpu-count", "two"],
        ["--listen", "tcp://0.0.0.0:1"],
        ["--runtime-endpoint", "containerd.sock"],
        ["--socket-group", ""],
        ["--socket-group", "no-such-group-here"],
        ["--state-dir", ""],
        ["--reserved-cpus", "3-1"],
        ["--policy-option", "full-pcpus"],
    ):
        with pytest.raises(SystemExit) as exited:
            build_parser().parse_args(["run", *argv])
        assert exited.value.code == 2
        assert argv[0] in capsys.readouterr().err


# -- refusals ----------------------------------------------------------------------------------

ERRORS = [
    # (text, line, key, part of the message)
    ('\n# comment\n\nlisten = "/a.sock"\n\n\nreservedSystemCPUs = "x"\n', 7,
     "reservedSystemCPUs", "not a CPU list: 'x'"),
    ('# reservedSystemCPUs = "0"\nreservedSystemCPUs = "3-1"\n', 2, "reservedSystemCPUs",
     "not a CPU list: '3-1'"),
    ('reservedSystemCPUs = ""', 1, "reservedSystemCPUs", "at least one CPU"),
    ("reservedSystemCPUs = [0, 1]", 1, "reservedSystemCPUs", "want a string, got an array"),
    ('listen = "/a.sock"\nreservedCpus = "0"\n', 2, "reservedCpus",
     "unknown key; did you mean reservedSystemCPUs?"),
    ('reserved-cpus = "0"', 1, "reserved-cpus", "did you mean reservedSystemCPUs?"),
    ("zzzz = 1", 1, "zzzz", "unknown key"),
    ("policy = 'static'", 1, "policy", "did you mean cpuManagerPolicy?"),
    ('logLevel = "info"\n[metrics]\naddress = "x"\n', 2, "metrics", "unknown key"),
    ("reservedCPUCount = 0", 1, "reservedCPUCount", "at least one reserved CPU, got 0"),
    ("reservedCPUCount = 1.5", 1, "reservedCPUCount", "want a whole number of CPUs, got 1.5"),
    ("reservedCPUCount = true", 1, "reservedCPUCount", "got true"),
    ('reservedSystemCPUs = "0"\nlogLevel = "info"\nreservedCPUCount = 1\n', 3,
     "reservedCPUCount", "give reservedSystemCPUs or reservedCPUCount, not both"),
    ('upstreamWait = "60"', 1, "upstreamWait", "want a number of seconds, got '60'"),
    ("shutdownGrace = -1", 1, "shutdownGrace", "0 or more, got -1"),
    ("resyncPeriod = nan", 1, "resyncPeriod", "finite"),
    ("upstreamWait = inf", 1, "upstreamWait", "finite"),
    ("upstreamWait = false", 1, "upstreamWait", "got false"),
    ('cpuManagerPolicy = "dynamic"', 1, "cpuManagerPolicy",
     "unknown value 'dynamic': want none or static"),
    ("cpuManagerPolicy = 1", 1, "cpuManagerPolicy", "want a string, got 1"),
    ('failurePolicy = "ignore"', 1, "failurePolicy", "want fail-closed or fail-open"),
    ('eventLoop = "trio"', 1, "eventLoop", "want auto, uvloop or asyncio"),
    ('logLevel = "trace"', 1, "logLevel", "want debug, info, warning or error"),
    ('listen = "tcp://0.0.0.0:1"', 1, "listen", "only unix:// sockets"),
    ('runtimeEndpoint = "containerd.sock"', 1, "runtimeEndpoint", "absolute socket path"),
    ('imageEndpoint = "http://x"', 1, "imageEndpoint", "only unix://"),
    ('socketGroup = ""', 1, "socketGroup", "must not be empty"),
    ('socketGroup = "no-such-group-here"', 1, "socketGroup",
     "no group named 'no-such-group-here' on this node"),
    ('stateDir = ""', 1, "stateDir", "must not be empty"),
    ("sysfsRoot = 1", 1, "sysfsRoot", "want a string, got 1"),
    ('projectionMountPath = "run/cpushim"', 1, "projectionMountPath", "want an absolute path"),
    ('projectionDir = "run/projection"', 1, "projectionDir", "want an absolute path"),
    ('projectionMountPath = "/"', 1, "projectionMountPath", "not the root directory"),
    ('projectionMountPath = "//./"', 1, "projectionMountPath", "not the root directory"),
    ('projectionDir = "/"', 1, "projectionDir", "not the root directory"),
    ('metricsAddress = "9464"', 1, "metricsAddress", "want HOST:PORT, got '9464'"),
    ('metricsAddress = "::1:9464"', 1, "metricsAddress", "brackets"),
    ('recoverFromRuntime = "yes"', 1, "recoverFromRuntime", "want true or false, got 'yes'"),
    ('"listen" = 5', 1, "listen", "want a string, got 5"),
    ('logLevel = "info"\n\n[cpuManagerPolicyOptions]\nfull-pcpus-only = "true"\n'
     'full-pcpu-only = "true"\n', 5, "cpuManagerPolicyOptions.full-pcpu-only",
     "unknown CPU manager policy option 'full-pcpu-only'"),
    ('cpuManagerPolicyOptions = { align-by-socket = "yes" }', 1,
     "cpuManagerPolicyOptions.align-by-socket", "bad value 'yes'"),
    ('logLevel = "info"\ncpuManagerPolicyOptions = { bogus = "true" }\n', 2,
     "cpuManagerPolicyOptions.bogus", "unknown CPU manager policy option 'bogus'"),
    ('listen = "/a.sock"\ncpuManagerPolicyOptions.full-pcpus-only = 1\n', 2,
     "cpuManagerPolicyOptions.full-pcpus-only", "want true or false, got 1"),
    ("[cpuManagerPolicyOptions]\nfull-pcpus-only = true\ndistribute-cpus-across-cores = true\n",
     1, "cpuManagerPolicyOptions", "can not be used at the same time"),
    ('cpuManagerPolicyOptions = ["full-pcpus-only"]', 1, "cpuManagerPolicyOptions",
     "want a table"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "line", "key", "message"), ERRORS)
def test_refusal_names_file_line_and_key(text: str, line: int, key: str, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config(text, PATH)
    error = raised.value
    assert (error.path, error.line, error.key) == (PATH, line, key)
    assert message in error.message
    assert str(error) == f"config.toml:{line}: {key}: {error.message}"


def test_the_issue_example() -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config('\n\n\n\n\n\nreservedSystemCPUs = "x"\n', PATH)
    assert str(raised.value) == "config.toml:7: reservedSystemCPUs: not a CPU list: 'x'"


def test_syntax_error_is_tomllibs_message_with_the_file() -> None:
    text = 'listen = "/a.sock"\nupstreamWait = \n'
    with pytest.raises(tomllib.TOMLDecodeError) as toml_error:
        tomllib.loads(text)
    with pytest.raises(ConfigError) as raised:
        parse_config(text, PATH)
    assert (raised.value.line, raised.value.key) == (2, None)
    assert str(raised.value) == f"config.toml:2: {toml_error.value}"


def test_duplicate_key_names_the_key_and_both_lines() -> None:
    with pytest.raises(
        ConfigError, match=r"^config\.toml:2: listen: set twice \(line 1 and line 2\); keep one$"
    ):
        parse_config('listen = "/a.sock"\nlisten = "/b.sock"\n', PATH)


def test_duplicate_key_after_other_keys_names_the_duplicate() -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config('logLevel = "info"\nlisten = "/a.sock"\nlisten = "/b.sock"\n', PATH)
    assert (raised.value.line, raised.value.key) == (3, "listen")
    assert raised.value.message == "set twice (line 2 and line 3); keep one"


def test_a_key_first_written_on_the_failing_line_is_tomllibs_message() -> None:
    # listen.x overwrites listen, but listen.x itself is set only once: not "set twice".
    text = 'listen = "/a.sock"\nlisten.x = 1\n'
    with pytest.raises(tomllib.TOMLDecodeError) as toml_error:
        tomllib.loads(text)
    with pytest.raises(ConfigError) as raised:
        parse_config(text, PATH)
    assert str(raised.value) == f"config.toml:2: {toml_error.value}"
    assert raised.value.key is None


def test_key_line() -> None:
    assert key_line(None, "listen") is None
    assert key_line(b'logLevel = "info"\nlisten = "/a.sock"\n', "listen") == 2
    assert key_line(b'logLevel = "info"\n', "listen") is None


def test_a_flag_for_one_reserved_form_drops_only_the_files_reserved_keys() -> None:
    file_values = parse_config('reservedCPUCount = 2\nlogLevel = "debug"\n', PATH)
    options = resolve({"reserved_cpus": "0"}, file_values)
    assert (options.reserved_cpus, options.reserved_cpu_count) == ("0", None)
    assert options.log_level == "debug"


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "absent.toml"
    with pytest.raises(ConfigError) as raised:
        load_config(missing)
    assert (raised.value.path, raised.value.line, raised.value.key) == (missing, None, None)
    assert str(raised.value) == (
        f"{missing}: cannot read the config file: No such file or directory"
    )


def test_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"^{re.escape(str(tmp_path))}: cannot read"):
        load_config(tmp_path)


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    """A FIFO at the path held start-up for as long as nobody wrote into it."""
    fifo = tmp_path / "config.toml"
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def load() -> None:
        try:
            load_config(fifo)
        except BaseException as exc:  # handed to the test's thread
            outcome.append(exc)
        else:
            outcome.append(None)

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(timeout=10)
    if reader.is_alive():
        # Let the blocked open through, so that the thread ends.
        os.close(os.open(fifo, os.O_WRONLY))
        reader.join(timeout=10)
        pytest.fail("load_config waited for a writer on a FIFO")
    [raised] = outcome
    assert isinstance(raised, ConfigError)
    assert str(raised) == f"{fifo}: cannot read the config file: not a regular file"


def test_bytes_that_are_not_utf8_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes('socketGroup = "gruppé"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_config(path)


def test_load_config_reads_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, 'failurePolicy = "fail-open"\nupstreamWait = 1\n')
    assert dict(load_config(path)) == {"failure_policy": "fail-open", "upstream_wait": 1.0}


# -- the sample --------------------------------------------------------------------------------


def test_sample_equals_the_defaults() -> None:
    assert resolve({}, load_config(SAMPLE)) == DEFAULTS


def test_sample_shows_every_key() -> None:
    text = SAMPLE.read_text()
    for key in KEYS:
        if key.name == "cpuManagerPolicyOptions":
            assert "\n[cpuManagerPolicyOptions]\n" in text
        else:
            assert re.search(rf"^(# )?{key.name} = ", text, re.MULTILINE), key.name


@pytest.mark.parametrize("line", ['reservedSystemCPUs = "0,1"', "reservedCPUCount = 2"])
def test_a_key_added_below_the_samples_table_says_to_move_it_above(line: str) -> None:
    """The natural edit, a line added at the end of the installed file, lands in the
    [cpuManagerPolicyOptions] table that the file ends with: say so, not that the option is
    unknown."""
    text = SAMPLE.read_text() + line + "\n"
    name = line.split()[0]
    with pytest.raises(ConfigError) as raised:
        parse_config(text, SAMPLE)
    error = raised.value
    assert (error.line, error.key) == (len(text.splitlines()), f"cpuManagerPolicyOptions.{name}")
    assert error.message == (
        f"{name} is a top-level key, read here as a policy option because it comes after the"
        " [cpuManagerPolicyOptions] header: move it above that header"
    )


def test_sample_lines_commented_out_are_good_values(monkeypatch: pytest.MonkeyPatch) -> None:
    # The sample's socket group is one the operator makes first.
    monkeypatch.setattr(grp, "getgrnam", lambda name: grp.getgrgid(0))
    lines = SAMPLE.read_text().splitlines()
    as_shipped = parse_config("\n".join(lines), SAMPLE)
    commented = [i for i, line in enumerate(lines) if re.match(r"# [\w-]+ = ", line)]
    assert len(commented) == 4 + 6  # image, group, the two reserved keys; six policy options
    for index in commented:
        text = "\n".join([*lines[:index], lines[index].removeprefix("# "), *lines[index + 1 :]])
        assert parse_config(text, SAMPLE) != as_shipped, lines[index]


# -- reload ------------------------------------------------------------------------------------


def test_reload_reads_the_file_again_and_keeps_the_flags(tmp_path: Path) -> None:
    config = write(
        tmp_path, 'shutdownGrace = 3\nreservedCPUCount = 2\nlogLevel = "debug"\nresyncPeriod = 9\n'
    )
    first = parse_cli("--config", str(config), "--log-level", "warning", "--resync-period", "5")
    assert (first.shutdown_grace, first.reserved_cpu_count, first.log_level) == (3.0, 2, "warning")
    assert first.resync_period == 5.0

    config.write_text(
        'failurePolicy = "fail-open"\nreservedSystemCPUs = "1"\nlogLevel = "error"\n'
        "[cpuManagerPolicyOptions]\nfull-pcpus-only = true\n"
    )
    second = reload_options(first)
    assert second.shutdown_grace == DEFAULTS.shutdown_grace  # removed from the file
    assert second.failure_policy == "fail-open"  # added
    assert (second.reserved_cpus, second.reserved_cpu_count) == ("1", None)  # changed form
    assert second.policy_options == ("full-pcpus-only",)
    assert second.log_level == "warning"  # the flag still wins
    assert second.resync_period == 5.0
    assert second.config_path == config
    assert second.cli_overrides == first.cli_overrides
    assert reload_options(second) == second


def test_reload_of_a_bad_file_raises_and_names_it(tmp_path: Path) -> None:
    config = write(tmp_path, "reservedCPUCount = 2\n")
    options = parse_cli("--config", str(config))
    config.write_text("reservedCPUCount = 2\nreservedSystemCPUs = '0'\n")
    with pytest.raises(ConfigError) as raised:
        reload_options(options)
    assert (raised.value.path, raised.value.line) == (config, 2)
    config.unlink()
    with pytest.raises(ConfigError, match="No such file"):
        reload_options(options)


def test_reload_needs_a_config_file() -> None:
    with pytest.raises(ValueError, match="not read from a config file"):
        reload_options(parse_cli())


# -- the command -------------------------------------------------------------------------------


def cpushim(*argv: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "shim", "run", *argv],
        capture_output=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )


def log_events(stderr: bytes) -> list[dict[str, object]]:
    return [orjson.loads(line) for line in stderr.splitlines() if line.startswith(b"{")]


def test_run_refuses_a_bad_config_before_anything_else(tmp_path: Path) -> None:
    config = write(tmp_path, 'logLevel = "info"\nreservedCPUCount = "two"\n')
    done = cpushim("--config", str(config), "--listen", f"unix://{tmp_path}/cri.sock")
    assert done.returncode == 1
    (error,) = log_events(done.stderr)
    assert error["msg"] == "cannot run"
    assert error["error"] == (
        f"{config}:2: reservedCPUCount: want a whole number of CPUs, got 'two'"
    )
    assert (error["config"], error["line"], error["key"]) == (str(config), 2, "reservedCPUCount")
    assert not (tmp_path / "cri.sock").exists()


def test_exit_codes_are_the_guides(tmp_path: Path) -> None:
    """docs/operations.md's exit codes: 1 with a "cannot run" log line when cpushim cannot
    start, 2 with argparse's usage (no JSON) for a bad command line."""
    guide = (REPO / "docs" / "operations.md").read_text()
    section = guide[guide.index("## Exit codes\n") : guide.index("## Recover from a bad")]
    assert re.findall(r"^- (\d) ", section, re.MULTILINE) == ["0", "1", "2"]
    assert '`"msg":"cannot run"`' in " ".join(section.split())

    missing = cpushim("--config", str(tmp_path / "absent.toml"))
    assert missing.returncode == 1
    (error,) = log_events(missing.stderr)
    assert (error["msg"], error["config"]) == ("cannot run", str(tmp_path / "absent.toml"))

    bad_flag = cpushim("--upstream-wait", "soon")
    assert bad_flag.returncode == 2
    assert bad_flag.stderr.startswith(b"usage: cpushim run")
    assert not log_events(bad_flag.stderr)


def test_run_takes_its_settings_from_the_config(tmp_path: Path) -> None:
    # The runtime never answers: how long cpushim waits, and for which socket, says which
    # settings reached it.
    config = write(
        tmp_path,
        f'listen = "unix://{tmp_path}/cri.sock"\n'
        f'runtimeEndpoint = "unix://{tmp_path}/absent.sock"\n'
        f'stateDir = "{tmp_path}/state"\n'
        "upstreamWait = 0.3\n"
        'logLevel = "debug"\n',
    )
    from_file = cpushim("--config", str(config))
    assert from_file.returncode == 1
    events = log_events(from_file.stderr)
    assert events[0]["msg"] == "config"
    assert events[0]["flags"] == []
    error = next(e for e in events if e["level"] == "error")
    assert f"runtime unix://{tmp_path}/absent.sock did not answer within 0.3s" in str(
        error["error"]
    )

    overridden = cpushim("--config", str(config), "--upstream-wait", "0.2", "--log-level", "info")
    assert overridden.returncode == 1
    events = log_events(overridden.stderr)
    assert events[0]["flags"] == ["log_level", "upstream_wait"]
    assert not any(e["level"] == "debug" for e in events)
    error = next(e for e in events if e["level"] == "error")
    assert "did not answer within 0.2s" in str(error["error"])


def test_a_duplicate_key_names_the_key_and_both_lines() -> None:
    """operations.md warns of exactly this slip (recoverFromRuntime set a second time); the
    refusal must say which key, not tomllib's bare 'Cannot overwrite a value'."""
    text = SAMPLE.read_text()
    first = text[: text.index("recoverFromRuntime = false")].count("\n") + 1
    edited = "recoverFromRuntime = true\n" + text
    with pytest.raises(ConfigError) as refused:
        parse_config(edited, Path("/etc/cpushim/config.toml"))
    assert refused.value.key == "recoverFromRuntime"
    assert refused.value.line == first + 1
    assert "set twice" in refused.value.message
    assert "line 1" in refused.value.message


def test_a_duplicate_key_on_the_last_line_still_has_a_line() -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config('logLevel = "info"\nlogLevel = "debug"', Path("c.toml"))
    assert (refused.value.line, refused.value.key) == (2, "logLevel")


@pytest.mark.parametrize(
    ("options", "key"),
    [
        (RunOptions(reserved_cpus="0,100"), "reservedSystemCPUs"),
        (RunOptions(reserved_cpus="0-7"), "reservedSystemCPUs"),
        (RunOptions(reserved_cpu_count=8), "reservedCPUCount"),
    ],
)
def test_a_reservation_the_machine_cannot_meet_names_its_key(
    tmp_path: Path, options: RunOptions, key: str
) -> None:
    """README: bad values stop cpushim naming the key. 'reserved CPUs 100 are not online'
    alone does not say which setting (file key or flag) to fix; a reload's refusal logged it
    with key null."""
    sysfs = write_sysfs(SINGLE_SOCKET_NO_HT, tmp_path / "sys")  # CPUs 0-7
    with pytest.raises(ValueError, match=rf"^{key} \(--reserved-cpu") as refused:
        build_policy(replace(options, sysfs_root=sysfs))
    assert getattr(refused.value, "key", None) == key


@pytest.mark.parametrize(
    ("in_file", "flags", "warned"),
    [
        ("recoverFromRuntime = true\n", (), True),
        ("recoverFromRuntime = false\n", ("--recover-from-runtime",), False),
        ("recoverFromRuntime = false\n", (), False),
        ("recoverFromRuntime = true\n", ("--no-recover-from-runtime",), False),
    ],
    ids=["file", "flag", "off", "turned-off-by-flag"],
)
def test_recovery_turned_on_in_the_config_file_is_warned_of(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    in_file: str,
    flags: tuple[str, ...],
    warned: bool,
) -> None:
    """operations.md: left true in the file, every start throws the checkpoint away. A flag
    is given once (systemd's unit runs with the file alone), so only the file is warned of."""
    config = tmp_path / "config.toml"
    config.write_text(in_file)
    options = parse_cli("--config", str(config), *flags)
    with caplog.at_level("INFO", logger="shim.cli"):
        log_config(options)
    warnings = [r for r in caplog.records if "recoverFromRuntime is on" in r.getMessage()]
    assert len(warnings) == (1 if warned else 0)
    if warned:
        assert warnings[0].levelname == "WARNING"
        assert warnings[0].__dict__["fields"]["config"] == str(config)
