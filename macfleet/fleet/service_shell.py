"""The thin shell around service.py: write a service definition where launchd or systemd --user
reads it, load it, stop it, ask whether it runs and where its logs are.

Every call to the service manager goes through one injected `runner` (subprocess.run by
default, with a deadline), so the decisions are tested without launchctl or a user systemd.
Where the manager is absent (a container, a box without a user session bus) every verb raises
ServiceManagerMissing with what was tried and what to run instead; nothing is written.
"""

from __future__ import annotations

import os
import plistlib
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from macfleet.fleet import service as svc

DEFAULT_CALL_S = 30.0  # one launchctl / systemctl call
Runner = Callable[[Sequence[str]], subprocess.CompletedProcess]


def run_command(cmd: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=DEFAULT_CALL_S)


class ServiceManagerMissing(RuntimeError):
    """No launchd / user systemd to install into here."""


class ServiceError(RuntimeError):
    """The service manager refused a step (its own words are in the message)."""


@dataclass(frozen=True)
class ServiceState:
    role: str
    path: Path  # the plist or unit file
    installed: bool
    running: bool
    pid: int | None
    detail: str  # the manager's own words: "active (running)", "state = running", ...
    argv: tuple[str, ...] = ()  # the installed command line (empty when not installed)


def _words(p: subprocess.CompletedProcess) -> str:
    return " ".join(((p.stderr or "") + " " + (p.stdout or "")).split())[:300]


class SystemdUser:
    """systemd --user: units in $XDG_CONFIG_HOME/systemd/user, logs in journald."""

    name = "systemd --user"

    def __init__(self, home: Path, environ: dict[str, str], runner: Runner = run_command):
        self.home, self.environ, self.run = home, environ, runner

    def check(self) -> None:
        if shutil.which("systemctl", path=self.environ.get("PATH")) is None:
            raise ServiceManagerMissing("no systemctl on this machine (not a systemd system)")
        try:
            p = self.run(["systemctl", "--user", "show-environment"])
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ServiceManagerMissing(f"`systemctl --user` failed: {e}") from None
        if p.returncode != 0:
            raise ServiceManagerMissing(
                f"no user systemd here (`systemctl --user`: {_words(p) or 'failed'}); a user "
                "manager runs in a login session, or always after `loginctl enable-linger "
                "$USER` (as root)")

    def path(self, spec: svc.ServiceSpec) -> Path:
        return svc.systemd_unit_path(spec, self.home, self.environ)

    def render(self, spec: svc.ServiceSpec) -> bytes:
        return svc.systemd_unit(spec).encode()

    def _ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        p = self.run(["systemctl", "--user", *args])
        if check and p.returncode != 0:
            raise ServiceError(f"systemctl --user {' '.join(args)}: {_words(p)}")
        return p

    def load(self, spec: svc.ServiceSpec) -> None:
        self._ctl("daemon-reload")
        self._ctl("enable", spec.unit)
        self._ctl("restart", spec.unit)  # a running old definition is replaced by the new one

    def unload(self, role: str) -> None:
        unit = f"{svc.UNIT_PREFIX}{role}.service"
        self._ctl("disable", "--now", unit, check=False)

    def after_remove(self, role: str) -> None:
        self._ctl("daemon-reload", check=False)
        self._ctl("reset-failed", f"{svc.UNIT_PREFIX}{role}.service", check=False)

    def state(self, role: str, path: Path) -> tuple[bool, int | None, str]:
        p = self._ctl("show", "-p", "ActiveState", "-p", "SubState", "-p", "MainPID",
                      f"{svc.UNIT_PREFIX}{role}.service", check=False)
        kv = dict(line.split("=", 1) for line in p.stdout.splitlines() if "=" in line)
        pid = int(kv.get("MainPID", "0") or 0) or None
        detail = f"{kv.get('ActiveState', '?')} ({kv.get('SubState', '?')})"
        return kv.get("ActiveState") == "active", pid, detail

    def installed_argv(self, path: Path) -> tuple[str, ...]:
        for line in path.read_text().splitlines():
            if line.startswith("ExecStart="):
                words = shlex.split(line[len("ExecStart="):])
                return tuple(w.replace("%%", "%").replace("$$", "$") for w in words)
        return ()

    def logs_command(self, role: str, path: Path, lines: int, follow: bool) -> list[str]:
        cmd = ["journalctl", "--user", "-u", f"{svc.UNIT_PREFIX}{role}.service", "-n",
               str(lines), "--no-pager"]
        return cmd + ["-f"] if follow else cmd


class Launchd:
    """launchd: a LaunchAgent in the user's gui domain, logs in ~/Library/Logs/macfleet."""

    name = "launchd"
    BOOTSTRAP_TRIES = 5  # bootout finishes asynchronously: a quick bootstrap may hit EIO

    def __init__(self, home: Path, environ: dict[str, str], runner: Runner = run_command,
                 uid: int | None = None, sleep: Callable[[float], None] = time.sleep):
        self.home, self.environ, self.run, self.sleep = home, environ, runner, sleep
        self.domain = f"gui/{os.getuid() if uid is None else uid}"

    def check(self) -> None:
        if shutil.which("launchctl", path=self.environ.get("PATH")) is None:
            raise ServiceManagerMissing("no launchctl on this machine (not macOS)")

    def path(self, spec: svc.ServiceSpec) -> Path:
        return svc.launchd_plist_path(spec, self.home)

    def render(self, spec: svc.ServiceSpec) -> bytes:
        svc.launchd_log_dir(self.home).mkdir(parents=True, exist_ok=True)
        return svc.launchd_plist(spec, self.home)

    def load(self, spec: svc.ServiceSpec) -> None:
        self.unload(spec.role)
        self.run(["launchctl", "enable", f"{self.domain}/{spec.label}"])
        for i in range(self.BOOTSTRAP_TRIES):
            p = self.run(["launchctl", "bootstrap", self.domain, str(self.path(spec))])
            if p.returncode == 0:
                return
            self.sleep(0.5 * (i + 1))
        raise ServiceError(f"launchctl bootstrap {self.domain} {self.path(spec)}: {_words(p)}")

    def unload(self, role: str) -> None:
        self.run(["launchctl", "bootout", f"{self.domain}/{svc.LABEL_PREFIX}{role}"])

    def after_remove(self, role: str) -> None:
        pass

    def state(self, role: str, path: Path) -> tuple[bool, int | None, str]:
        p = self.run(["launchctl", "print", f"{self.domain}/{svc.LABEL_PREFIX}{role}"])
        if p.returncode != 0:
            return False, None, "not loaded"
        kv = {}
        for line in p.stdout.splitlines():
            k, sep, v = line.strip().partition(" = ")
            if sep and k not in kv:
                kv[k] = v
        pid = int(kv["pid"]) if kv.get("pid", "").isdigit() else None
        return kv.get("state") == "running", pid, f"state = {kv.get('state', '?')}"

    def installed_argv(self, path: Path) -> tuple[str, ...]:
        return tuple(plistlib.loads(path.read_bytes()).get("ProgramArguments", ()))

    def logs_command(self, role: str, path: Path, lines: int, follow: bool) -> list[str]:
        log = svc.launchd_log_dir(self.home) / f"{role}.log"
        return ["tail", "-n", str(lines), *(["-F"] if follow else []), str(log)]


Manager = SystemdUser | Launchd


def manager_for(platform: str = sys.platform, *, home: Path | None = None,
                environ: dict[str, str] | None = None, runner: Runner = run_command) -> Manager:
    home = Path.home() if home is None else home
    environ = dict(os.environ) if environ is None else environ
    if platform == "darwin":
        return Launchd(home, environ, runner)
    if platform.startswith("linux"):
        return SystemdUser(home, environ, runner)
    raise ServiceManagerMissing(f"no launchd or systemd on {platform}")


def install(m: Manager, spec: svc.ServiceSpec) -> Path:
    """Write (or replace) the definition and (re)start the service; nothing is written when the
    manager is missing. A definition the manager refuses is removed again."""
    m.check()
    path = m.path(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = m.render(spec)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # the same path every time: installing twice replaces
    try:
        m.load(spec)
    except ServiceError:
        m.unload(spec.role)
        path.unlink(missing_ok=True)
        m.after_remove(spec.role)
        raise
    return path


def uninstall(m: Manager, role: str) -> bool:
    """Stop the service and remove its definition; False when none was installed."""
    m.check()
    path = m.path(svc.ServiceSpec(role, ()))
    m.unload(role)
    existed = path.exists()
    path.unlink(missing_ok=True)
    m.after_remove(role)
    return existed


def installed_roles(m: Manager) -> list[str]:
    return [r for r in svc.ROLES if m.path(svc.ServiceSpec(r, ())).exists()]


def state(m: Manager, role: str) -> ServiceState:
    m.check()
    path = m.path(svc.ServiceSpec(role, ()))
    if not path.exists():
        return ServiceState(role, path, False, False, None, "not installed")
    running, pid, detail = m.state(role, path)
    return ServiceState(role, path, True, running, pid, detail, m.installed_argv(path))
