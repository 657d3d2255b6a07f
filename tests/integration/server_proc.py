"""`pagedinfer serve` as a real process on a free loopback port, for the server tests.

Its output goes to a file, never to an unread pipe (a server that logs more than the pipe
holds, ~64 KiB of stats lines and tracebacks, would block on its next write). It runs in its
own process group, so a stop that SIGTERM cannot finish (a request stuck in the engine keeps
uvicorn's graceful shutdown waiting) ends the server and its engine together.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def small_engine_flags(max_model_len: int = 512) -> list[str]:
    """float32 (exact greedy parity with LLM.generate), 64 MiB of KV cache."""
    return ["--dtype", "float32", "--kv-cache-memory-bytes", str(64 * 2**20),
            "--max-model-len", str(max_model_len)]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(
        self,
        *args: str,
        startup_timeout_s: float = 600.0,
        command: str = "serve",
        ready_path: str = "/health",
        avoid_ports: tuple[int, ...] = (),
    ) -> None:
        """`pagedinfer {command} --port P *args` (command "disagg-proxy" for the proxy),
        up once `ready_path` answers 200."""
        # A port another process of the test will bind (a KV connector's) is not ours, even
        # if the OS offers it again meanwhile.
        self.port = free_port()
        while self.port in avoid_ports:
            self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(
            "w+", prefix="pagedinfer-server-", suffix=".log", delete=False
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedinfer", command, "--port", str(self.port), *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited during startup:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(self.base + ready_path, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server did not come up:\n{self.log()[-4000:]}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        with open(self._log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stop(self, graceful_timeout_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=graceful_timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of the group is left
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(timeout=30)
        self._log.close()
        os.unlink(self._log.name)
