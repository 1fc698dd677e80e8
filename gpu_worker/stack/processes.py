"""Run the three services as subprocesses: what `make run`, `make serve` and the stack tests share.

Each service is started with its own `python -m ... serve` command line on a loopback port picked
free, its stdout and stderr going to a log file, and is not considered up until its
grpc.health.v1 check answers SERVING. A process that dies while starting fails the start with the
tail of its log. `stop()` sends SIGTERM (each server drains in-flight calls) in reverse start order
and waits; only a process still alive after the grace period is killed.

`prefix` runs a command inside something else, e.g. `["ip", "netns", "exec", "host-b"]` for the
multi-host test, with `host` the address the service is reachable at from here.

Secrets (the cache write token) reach a child through its environment, never its command line:
`ps` shows every process's argv to every local user, while /proc/PID/environ is readable by the
process's owner only.
"""
from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Self

from gpu_worker.edge.client import wait_for_health

STOP_GRACE_S = 20.0


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the OS picks it; a tiny race is accepted)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class ServiceProcess:
    name: str
    address: str
    argv: list[str]
    log_path: pathlib.Path
    proc: subprocess.Popen

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass
class Stack:
    var_dir: pathlib.Path
    python: str = sys.executable
    env: dict[str, str] = field(default_factory=dict)
    processes: list[ServiceProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.var_dir = pathlib.Path(self.var_dir)
        (self.var_dir / "logs").mkdir(parents=True, exist_ok=True)

    # -- the three services -----------------------------------------------------------------
    def start_governor(self, name: str = "governor", db: pathlib.Path | None = None,
                       extra: list[str] | None = None, **kw) -> ServiceProcess:
        db = db or self.var_dir / "governor.db"
        return self.start(name, ["-m", "services.governor", "serve", "--db", str(db), *(extra or [])],
                          **kw)

    def start_cache(self, name: str = "cache", db: pathlib.Path | None = None,
                    write_token: str | None = None, extra: list[str] | None = None,
                    **kw) -> ServiceProcess:
        db = db or self.var_dir / "kernel_cache.db"
        args = ["-m", "cache_service", "serve", "--db", str(db)]
        secrets = {"GPUPLANE_CACHE_WRITE_TOKEN": write_token} if write_token else {}
        return self.start(name, [*args, *(extra or [])], secrets=secrets, **kw)

    def start_worker(self, name: str = "worker", backend: str = "auto", governor: str | None = None,
                     cache: str | None = None, cache_dir: pathlib.Path | None = None,
                     cache_write_token: str | None = None, extra: list[str] | None = None,
                     **kw) -> ServiceProcess:
        cache_dir = cache_dir or self.var_dir / name / "kernels"
        args = ["-m", "gpu_worker", "serve", "--backend", backend, "--cache-dir", str(cache_dir),
                "--worker-id", name, "--governor", governor or "", "--cache", cache or ""]
        secrets = ({"GPUPLANE_WORKER_CACHE_WRITE_TOKEN": cache_write_token} if cache_write_token
                   else {})
        return self.start(name, [*args, *(extra or [])], secrets=secrets, **kw)

    # -- generic ----------------------------------------------------------------------------
    def start(self, name: str, args: list[str], host: str = "127.0.0.1", port: int | None = None,
              prefix: list[str] | None = None, health_timeout_s: float = 120.0,
              secrets: dict[str, str] | None = None) -> ServiceProcess:
        """Start `python ARGS --listen HOST:PORT` and wait until it is healthy; `secrets` are
        environment variables for this child only (see the module's note)."""
        port = port or free_port(host)
        address = f"{host}:{port}"
        argv = [*(prefix or []), self.python, *args, "--listen", f"{host}:{port}"]
        log_path = self.var_dir / "logs" / f"{name}.log"
        env = {**os.environ, "GPUPLANE_LOG_FORMAT": "text", **self.env, **(secrets or {})}
        with open(log_path, "ab") as log_file:  # the child keeps its own descriptor
            proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        service = ServiceProcess(name, address, argv, log_path, proc)
        self.processes.append(service)
        self._wait_up(service, health_timeout_s)
        return service

    def _wait_up(self, service: ServiceProcess, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not service.alive():
                raise RuntimeError(f"{service.name} exited with {service.proc.returncode} while "
                                   f"starting ({' '.join(service.argv)}):\n{service.log_tail()}")
            try:
                wait_for_health(service.address, timeout_s=1.0)
                return
            except TimeoutError:
                continue
        raise TimeoutError(f"{service.name} at {service.address} not healthy after {timeout_s:.0f}s:"
                           f"\n{service.log_tail()}")

    def stop_one(self, service: ServiceProcess, grace_s: float = STOP_GRACE_S) -> int:
        """SIGTERM, wait for the drain, kill only if it overstays. Returns the exit code."""
        if service.alive():
            service.proc.send_signal(signal.SIGTERM)
            try:
                service.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                service.proc.kill()
                service.proc.wait()
        if service in self.processes:
            self.processes.remove(service)
        return service.proc.returncode

    def stop(self) -> dict[str, int]:
        """Stop every process in reverse start order; returns name -> exit code."""
        codes = {}
        for service in reversed(list(self.processes)):
            codes[service.name] = self.stop_one(service)
        return codes

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
