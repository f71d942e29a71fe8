"""Work done once per model in a child process: the GGUF conversion and a model's first load.

A child's memory goes back to the system whole when it exits, so what such work leaves behind (transformers' model
classes, the GGUF reader's tables, a fragmented heap, MKL's and oneDNN's caches from the tuner's products) never sits
under the model the parent then decodes with.  The parent passes the child's progress lines (``speculant: ...``) on as
they come; a child's failure is said in one line; Ctrl-C interrupts the child too, and a child whose parent ends
without interrupting it (SIGTERM, SIGKILL) is interrupted as by Ctrl-C (Linux).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..errors import SpeculantError


def can_run_children() -> bool:
    """Whether :func:`run_in_child` can run here: an interpreter to start (``sys.executable``) and ``os.pread`` for
    the progress relay (POSIX)."""
    return bool(sys.executable) and hasattr(os, "pread")


def run_in_child(module: str, function: str, args: list[str], what: str, progress=None, meanwhile=None) -> None:
    """Run ``module.function(args + [this process's pid])`` in a child process (same interpreter and ``speculant``);
    ``function`` calls :func:`interrupted_with_parent` with that pid first and exits with status 2 after printing a
    :class:`SpeculantError` as its one line (:func:`child_main`).  ``meanwhile()``, if given, runs here while the
    child works.  The child's progress lines go to ``progress`` (a text file; ``None``: not shown) as they come.

    Raises:
        SpeculantError: the child's own :class:`SpeculantError` message; or, where it failed otherwise, that ``what``
            failed, with its exit status and its last message (not a progress line), or the signal that killed it.
        OSError: no child process can be started here.
    """
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    code = f"import sys; from {module} import {function}; {function}(sys.argv[1:])"
    with tempfile.TemporaryFile("w+", errors="replace") as errors:
        proc = subprocess.Popen([sys.executable, "-c", code, *args, str(os.getpid())], env=env,
                                stdout=subprocess.DEVNULL, stderr=errors)
        finished = threading.Event()
        relay = threading.Thread(target=relay_progress, args=(errors.fileno(), progress, finished), daemon=True)
        if progress is not None:
            relay.start()
        try:
            if meanwhile is not None:
                meanwhile()
            proc.wait()
            finished.set()
            if progress is not None:
                relay.join()
        except BaseException:
            finished.set()
            proc.send_signal(signal.SIGINT)         # the child removes its partial output on KeyboardInterrupt
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if relay.is_alive():
                relay.join()                        # before the file it reads is closed
            raise
        errors.seek(0)
        lines = [line.strip() for line in errors.read().splitlines() if line.strip()]
    messages = [line for line in lines if not line.startswith("speculant:")]    # not its progress lines
    if proc.returncode == 2 and messages:           # the child's SpeculantError (child_main): its own one line
        raise SpeculantError(messages[-1])
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name if -proc.returncode in signal.valid_signals() else "a signal"
        oom = " (out of memory?)" if proc.returncode == -signal.SIGKILL else ""
        raise SpeculantError(f"{what} failed: its process was killed by {name}{oom}")
    if proc.returncode != 0:
        last = messages[-1] if messages else "no message"
        raise SpeculantError(f"{what} failed (exit status {proc.returncode}: {last})")


def child_main(argv: list[str], work) -> None:
    """The body of a child of :func:`run_in_child`: ``argv`` ends with the parent's pid; ``work(argv[:-1])`` runs
    interrupted with the parent (:func:`interrupted_with_parent`); a :class:`SpeculantError` is printed as its one
    line (exit status 2)."""
    interrupted_with_parent(int(argv[-1]))
    try:
        work(argv[:-1])
    except SpeculantError as e:
        print(str(e), file=sys.stderr)
        sys.exit(2)


def relay_progress(fd: int, out, finished) -> None:
    """Pass the lines starting with ``speculant:`` that a child writes to the file ``fd`` on to ``out`` as they come
    (read with ``pread``: the child's file offset is left alone), until ``finished`` is set and all is read."""
    offset, pending = 0, b""
    while True:
        chunk = os.pread(fd, 1 << 16, offset)
        if not chunk:
            if finished.is_set():
                return
            time.sleep(0.25)
            continue
        offset += len(chunk)
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            if line.startswith(b"speculant:"):
                print(line.decode(errors="replace"), file=out, flush=True)


def interrupted_with_parent(parent: int) -> None:
    """Have SIGINT (``KeyboardInterrupt``) delivered to this process when its parent ``parent`` ends (Linux
    ``prctl(PR_SET_PDEATHSIG)``; elsewhere nothing); raises ``KeyboardInterrupt`` at once if it has already ended.
    SIGINT is first given Python's handler and unblocked: a child inherits its parent's signal disposition and mask
    (a test runner's worker had SIGINT ignored or blocked, and the child then converted on alone)."""
    import ctypes

    signal.signal(signal.SIGINT, signal.default_int_handler)     # a disposition and a mask inherited from whatever
    if hasattr(signal, "pthread_sigmask"):                        # started us (SIG_IGN, blocked) would drop SIGINT
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGINT), 0, 0, 0)      # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        raise KeyboardInterrupt
