"""Runs ``tests/multiprocess_script.py`` on 2 processes as torchrun would, forked from a process that imported it.

usage: python tests/forked_launch.py --serve

A server for the tests (:class:`ForkedLauncher` starts it once): it imports the script (torch, Lightning, crossbow:
most of the seconds a fresh process takes here) and, for each request, forks a launcher that forks the ranks.
Each rank gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``TORCHELASTIC_RUN_ID``, ...) on top of the request's, so Lightning finds its ``TorchElasticEnvironment`` and
launches nothing itself, and runs the script's ``main`` from start to end, as under torchrun. The server never
computes anything, so every rank starts as a fresh process would after its imports; the ranks share nothing else.
As under torchrun, the first rank to fail ends the other, and its exit status is the run's (else 0).

Protocol (one request at a time): a JSON line ``{"args", "env", "cwd", "stdout", "stderr", "timeout"}`` on the
server's stdin; the ranks write their output to the two files named; the server answers with a JSON line
``{"returncode"}`` (-9 where the run outlived ``timeout`` seconds and was killed).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_rank(script: Any, rank: int, port: int, args: list[str]) -> None:
    """A forked rank: torchrun's environment, then the script; never returns."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        WORLD_SIZE=str(script.WORLD_SIZE),
        LOCAL_WORLD_SIZE=str(script.WORLD_SIZE),
        ROLE_WORLD_SIZE=str(script.WORLD_SIZE),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RUN_ID="forked",
    )
    sys.argv = [script.__file__, *args]
    code = 0
    try:
        script.main()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()  # (as an uncaught error would be)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # (nothing of the server's runs in a rank)


def _launch(script: Any, request: dict[str, Any], answers: Any) -> None:
    """The forked launcher of one request: its environment, folder and output files, then the ranks; never
    returns."""
    os.setpgrp()  # (the ranks in its group: the server kills the group when a run outlives its time)
    answers.close()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file, fd)
        os.close(file)
    port, ranks = _free_port(), []
    for rank in range(script.WORLD_SIZE):
        pid = os.fork()
        if pid == 0:
            _run_rank(script, rank, port, request["args"])
        ranks.append(pid)
    failed = 0
    while ranks:
        pid, status = os.wait()
        ranks.remove(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:  # the other would wait for it in a collective forever
            failed = code
            for other in ranks:
                os.kill(other, signal.SIGKILL)
    os._exit(failed if 0 <= failed < 256 else 1)


def serve() -> None:
    sys.path.insert(0, str(ROOT))
    answers = os.fdopen(os.dup(1), "w")  # the answers' own descriptor: what the imports print goes to stderr
    os.dup2(2, 1)
    from tests import multiprocess_script as script  # the imports every rank would pay

    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _launch(script, request, answers)
        answers.write(json.dumps({"returncode": _wait(pid, request["timeout"])}) + "\n")
        answers.flush()


def _wait(pid: int, timeout: float) -> int:
    """The launcher's exit status; after ``timeout`` seconds it and its ranks are killed (-9)."""

    def kill_run(*_: Any) -> None:
        os.killpg(pid, signal.SIGKILL)

    previous = signal.signal(signal.SIGALRM, kill_run)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class ForkedLauncher:
    """The tests' side: starts the server on first use, sends it one run at a time; stopped at exit."""

    def __init__(self) -> None:
        self._server: Optional[subprocess.Popen] = None

    def run(self, args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        """Runs the script with ``args`` on 2 forked ranks; what ``subprocess.run`` would return."""
        if self._server is None or self._server.poll() is not None:
            self._server = subprocess.Popen(
                [sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
        assert self._server.stdin is not None and self._server.stdout is not None
        with tempfile.TemporaryDirectory() as output:  # (not in the run's folder, which tests look into)
            stdout, stderr = Path(output, "stdout"), Path(output, "stderr")
            request = dict(args=args, env=env, cwd=os.getcwd(), stdout=str(stdout), stderr=str(stderr), timeout=timeout)
            self._server.stdin.write(json.dumps(request) + "\n")
            self._server.stdin.flush()
            answer = self._server.stdout.readline()
            if not answer:
                raise RuntimeError(f"the forked launcher's server ended (exit status {self._server.wait()})")
            code = json.loads(answer)["returncode"]
            return subprocess.CompletedProcess(args, code, stdout.read_text(), stderr.read_text())

    def close(self) -> None:
        if self._server is not None and self._server.poll() is None:
            assert self._server.stdin is not None
            self._server.stdin.close()
            self._server.wait()


if __name__ == "__main__":
    if sys.argv[1:] != ["--serve"]:
        sys.exit(__doc__)
    serve()
