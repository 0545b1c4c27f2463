"""Live reload of the config file: watched with inotify, validated, applied or refused.

The file's directory is watched, not the file: editors and config management replace it by
rename, which a watch on the file itself would not follow. A file that does not parse, or
whose values make no policy, is refused with the reason (file, line, key) and the running
config stays. A good one applies what can change while running:

- the policy, its options and the reserved CPUs: a new policy is built and the engine re-plans
  under it (``Engine.change_policy``): containers move, the checkpoint is rewritten;
- the failure policy, the log level and the resync period;

and logs the keys that only a restart applies (sockets, directories, the metrics address...).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import fields, replace
from typing import TYPE_CHECKING

from shim.config import KEYS, ConfigError, reload_options
from shim.inotify import (
    FILE_CHANGES,
    Event,
    Subscription,
    WatchError,
)
from shim.log import set_level
from shim.policy import CPUPolicy

if TYPE_CHECKING:
    from shim.engine.watching import Watcher
    from shim.run import RunOptions

log = logging.getLogger(__name__)

# The RunOptions fields that make the policy.
POLICY_FIELDS = frozenset(
    {"policy", "reserved_cpus", "reserved_cpu_count", "policy_options", "sysfs_root"}
)
# The ones applied without a new policy.
LIVE_FIELDS = frozenset({"failure_policy", "log_level", "resync_period"})
# Where the options came from, not what they say.
_PROVENANCE = frozenset({"config_path", "cli_overrides"})
# The log names the keys an operator edits, not the fields they fill.
_KEY_OF_FIELD = {key.field: key.name for key in KEYS}


class ConfigReloader:
    def __init__(
        self,
        watcher: Watcher,
        options: RunOptions,
        build_policy: Callable[[RunOptions], CPUPolicy],
    ) -> None:
        if options.config_path is None:
            raise ValueError("there is no config file to reload")
        self.watcher = watcher
        self.engine = watcher.engine
        self.options = options
        self._build_policy = build_policy
        self._subscription: Subscription | None = None

    @property
    def path(self) -> str:
        assert self.options.config_path is not None
        return str(self.options.config_path)

    def start(self) -> None:
        assert self.options.config_path is not None
        directory = self.options.config_path.parent
        name = self.options.config_path.name

        def on_event(event: Event) -> None:
            if event.name == name:
                self.watcher.jobs.request("config", self.reload)

        try:
            self._subscription = self.watcher.inotify.subscribe(
                str(directory), FILE_CHANGES, on_event
            )
        except WatchError as exc:
            self.engine.counters["watch_errors"] += 1
            log.warning(
                "cannot watch the config file; changes to it need a restart",
                extra={"fields": {"config": self.path, "error": str(exc)}},
            )

    def stop(self) -> None:
        if self._subscription is not None:
            self.watcher.inotify.unsubscribe(self._subscription)
            self._subscription = None

    async def reload(self) -> None:
        """Read the file again and apply what changed; refuse a bad file."""
        try:
            new = await asyncio.to_thread(reload_options, self.options)
        except ConfigError as exc:
            self._refuse(str(exc), line=exc.line, key=exc.key)
            return
        changed = sorted(
            f.name
            for f in fields(new)
            if f.name not in _PROVENANCE and getattr(new, f.name) != getattr(self.options, f.name)
        )
        if not changed:
            return
        policy: CPUPolicy | None = None
        if POLICY_FIELDS.intersection(changed):
            try:
                policy = await asyncio.to_thread(self._build_policy, new)
            except (OSError, ValueError) as exc:
                self._refuse(str(exc), line=None, key=None)
                return
        if policy is not None:
            try:
                lost = await self.engine.change_policy(policy)
            except OSError as exc:
                self._refuse(f"cannot write the checkpoint: {exc}", line=None, key=None)
                return
        else:
            lost = []
        self.engine.options = replace(self.engine.options, failure_policy=new.failure_policy)
        if new.log_level != self.options.log_level:
            set_level(new.log_level)
        if new.resync_period != self.options.resync_period:
            self.watcher.set_resync_period(new.resync_period)
        restart = [name for name in changed if name not in POLICY_FIELDS | LIVE_FIELDS]
        self.options = new
        self.engine.counters["config_reloads"] += 1
        log.info(
            "config reloaded",
            extra={
                "fields": {
                    "config": self.path,
                    "changed": sorted(_KEY_OF_FIELD.get(name, name) for name in changed),
                    "reserved": str(self.engine.policy.reserved),
                    "options": sorted(self.engine.policy.option_names),
                    "shared": str(self.engine.state.shared),
                    "lost_exclusive": [str(k) for k in lost],
                    "need_restart": sorted(_KEY_OF_FIELD.get(name, name) for name in restart),
                }
            },
        )

    def _refuse(self, error: str, *, line: int | None, key: str | None) -> None:
        self.engine.counters["config_errors"] += 1
        log.error(
            "config file refused; the running config stays",
            extra={"fields": {"config": self.path, "error": error, "line": line, "key": key}},
        )
