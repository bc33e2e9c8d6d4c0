"""Runs ``tests/multiprocess_script.py`` on 2 processes as torchrun would, forked from a process that imported it.

usage: python tests/forked_launch.py --serve

A server for the tests (:class:`ForkedLauncher` starts it once): it imports the script (torch, Lightning, crossbow:
most of the seconds a fresh process takes here) and, for each request, forks a launcher that forks the ranks. Each
rank starts as torchrun starts one: torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``, ...) on top of the request's, so Lightning finds its
``TorchElasticEnvironment`` and launches nothing itself; one torch thread unless the request sets
``OMP_NUM_THREADS`` (torchrun's default with several processes per node); NumPy's and ``random``'s generators seeded
afresh, and Lightning's ``rank_zero_only.rank`` set, as importing them in a fresh process would; then the script's
``main``, from start to end. Only Python's hash seed is the server's, the same on both ranks (it is fixed when an
interpreter starts): a test about something that differs between ranks' hashes belongs under torchrun.

The server never computes anything, so every rank starts as a fresh process would after its imports (a fork after
torch's thread pools have started can hang the child). Should the server ever hold more native threads than after its
imports, it refuses to fork and :class:`ForkedLauncher` runs that and every later request under torchrun.

As under torchrun, the first rank to fail ends the other, the run's exit status is that rank's (1 for a signal,
which is written to stderr), and nothing outlives the run: the launcher and the ranks die with their parent, and the
server ends a run in flight when it is interrupted or its client goes.

Protocol (one request at a time): a JSON line ``{"args", "env", "cwd", "stdout", "stderr", "timeout"}`` on the
server's stdin; the ranks write their output to the two files named; the server answers with a JSON line
``{"returncode"}`` (-9 where the run outlived ``timeout`` seconds and was killed; None where it refused to fork).
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("multiprocess_script.py")
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """SIGKILL once the parent process ends (Linux), also where it ended before this call."""
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (AttributeError, OSError):  # (not Linux: the timeout and the server's handlers still end the run)
        pass
    if os.getppid() != parent:
        os._exit(1)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1


def _start_as_torchrun_would(script: Any, rank: int, port: int, args: list[str]) -> None:
    """What a rank that torchrun started would have differently from the server: its environment, torch threads,
    random generators, Lightning's rank, and its command line."""
    import numpy as np
    import torch
    from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    world_size = str(script.WORLD_SIZE)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        ROLE_NAME="default",
        WORLD_SIZE=world_size,
        LOCAL_WORLD_SIZE=world_size,
        ROLE_WORLD_SIZE=world_size,
        GROUP_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RUN_ID="forked",
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # (torchrun's, with several processes per node)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # (read when torch was imported, in the server)
    random.seed()
    np.random.seed()
    rank_zero_only.rank = fabric_rank_zero_only.rank = rank
    sys.argv = [str(SCRIPT), *args]


def _run_rank(script: Any, rank: int, port: int, args: list[str]) -> None:
    """A forked rank: started as torchrun would start it, then the script; never returns."""
    code = 1
    try:
        _die_with_parent()
        _start_as_torchrun_would(script, rank, port, args)
        script.main()
        code = 0
    except SystemExit as exit_:  # (as the interpreter ends on it: a message is written and exits 1)
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()  # (as an uncaught error would be)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # (nothing of the server's runs in a rank)


def _launch(script: Any, request: dict[str, Any], answers: Any) -> None:
    """The forked launcher of one request: its environment, folder and output files, then the ranks; never
    returns."""
    failed = 1
    try:
        os.setpgrp()  # (the ranks in its group: the server kills the group to end the run)
        _die_with_parent()
        for handled in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM):
            signal.signal(handled, signal.SIG_DFL)
        answers.close()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(file, fd)
            os.close(file)
        port, ranks = _free_port(), {}
        for rank in range(script.WORLD_SIZE):
            pid = os.fork()
            if pid == 0:
                _run_rank(script, rank, port, request["args"])
            ranks[pid] = rank
        failed = 0
        while ranks:
            pid, status = os.wait()
            rank = ranks.pop(pid)
            code = os.waitstatus_to_exitcode(status)
            if code < 0:
                print(f"forked_launch: rank {rank} was killed by signal {-code}", file=sys.stderr, flush=True)
            if code != 0 and not failed:  # the other would wait for it in a collective forever
                failed = code if 0 < code < 256 else 1
                for other in ranks:
                    os.kill(other, signal.SIGKILL)
    except BaseException:
        import traceback

        traceback.print_exc()
        failed = 1
    finally:
        os._exit(failed)


def serve() -> None:
    _die_with_parent()  # (and so, in turn, a run in flight: see _launch)
    answers = os.fdopen(os.dup(1), "w")  # the answers' own descriptor: what the imports print goes to stderr
    os.dup2(2, 1)
    sys.path.insert(0, str(ROOT))
    from tests import multiprocess_script as script  # the imports every rank would pay

    threads = _os_threads()
    running: list[int] = []

    def end_run(signum: int, frame: Any) -> None:  # (interrupted, or the client went: the run goes with it)
        for pid in running:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGINT, end_run)
    signal.signal(signal.SIGTERM, end_run)
    for line in sys.stdin:
        request = json.loads(line)
        code: Optional[int] = None
        if _os_threads() <= threads:  # (threads that the imports started may have ended since)
            pid = os.fork()
            if pid == 0:
                _launch(script, request, answers)
            running.append(pid)
            code = _wait(pid, request["timeout"])
            running.remove(pid)
        answers.write(json.dumps({"returncode": code}) + "\n")
        answers.flush()


def _wait(pid: int, timeout: float) -> int:
    """The launcher's exit status; after ``timeout`` seconds it and its ranks are killed (-9)."""

    def kill_run(*_: Any) -> None:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:  # (it ended meanwhile)
            pass

    previous = signal.signal(signal.SIGALRM, kill_run)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def torchrun(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """The script under torchrun itself, on 2 processes: what ``subprocess.run`` returns."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(SCRIPT), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


class ForkedLauncher:
    """The tests' side: starts the server on first use, sends it one run at a time; stopped at exit. Where the
    server refuses to fork, this and every later run go to torchrun."""

    def __init__(self) -> None:
        self._server: Optional[subprocess.Popen] = None
        self._refused = False

    def run(self, args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        """Runs the script with ``args`` on 2 ranks; what ``subprocess.run`` would return."""
        if self._refused:
            return torchrun(args, env, timeout)
        if self._server is None or self._server.poll() is not None:
            self._server = subprocess.Popen(
                [sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
        server = self._server
        assert server.stdin is not None and server.stdout is not None
        with tempfile.TemporaryDirectory() as output:  # (not in the run's folder, which tests look into)
            stdout, stderr = Path(output, "stdout"), Path(output, "stderr")
            request = {"args": args, "env": env, "cwd": os.getcwd(), "timeout": timeout}
            try:
                server.stdin.write(json.dumps({**request, "stdout": str(stdout), "stderr": str(stderr)}) + "\n")
                server.stdin.flush()
                answer = server.stdout.readline()
            except BaseException:  # (interrupted mid-run: the server, and so the run, end; the next run starts anew)
                self.close(kill=True)
                raise
            if not answer:
                raise RuntimeError(f"the forked launcher's server ended (exit status {server.wait()})")
            code = json.loads(answer)["returncode"]
            if code is None:
                self._refused = True
                return torchrun(args, env, timeout)
            return subprocess.CompletedProcess(args, code, stdout.read_text(), stderr.read_text())

    def close(self, kill: bool = False) -> None:
        """Stops the server: at once with ``kill`` (a run in flight ends with it), else once its run ends."""
        server, self._server = self._server, None
        if server is None or server.poll() is not None:
            return
        if kill:
            server.terminate()
        assert server.stdin is not None
        try:
            server.stdin.close()
        except BrokenPipeError:
            pass
        server.wait()


if __name__ == "__main__":
    if sys.argv[1:] != ["--serve"]:
        sys.exit(__doc__)
    serve()
