"""Run a script as the ranks of a torch.distributed job on this machine, for tests.

The test side calls `run_ranks` (one node) or `run_nodes` (several torchrun "nodes" on
one machine, each with its own environment; `Nodes` gives each node its own local
directory and host-memory area), or `spawn_nodes` (the ranks as plain processes, for
tests that kill some). `run_nodes` starts each node's ranks directly, with the
environment torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR/PORT) and torchrun's teardown when a rank fails; with
`torchrun=True` (or SNAPCORE_MP_TORCHRUN=1 for every run) it starts one torchrun per
node instead, as on several machines: tests/multiproc/test_harness.py runs its launcher
tests both ways, and one two-node snapcore test runs under torchrun. The agents cost
two imports of torch per node and run, about 5 s of CPU, most of a short test's time on
two cores. Each torchrun listens on 127.0.0.1 only
(static rendezvous, a free port found by binding port 0; gloo is pinned to `lo`). Quirk
of torch 2.13: torchrun's TCPStore, on the master port, listens on every interface
(`*:port`) whatever --master-addr says, and torch offers no bind address; every
connection still goes to 127.0.0.1, and gloo's listeners are on 127.0.0.1 only.

torchrun (or run_nodes itself) starts every worker through this module's trampoline
(`python launch.py --rank-entry SCRIPT ARGS...`, standard library only), which runs
SCRIPT as its child with stdout and stderr in `<workdir>/rank<R>.log` and records the
child's exit status in `rank<R>.exit` (negative: killed by that signal). A rank's own
status is thus known even when it was SIGKILLed or torchrun tore it down (torchrun sends
SIGTERM to every other rank once one fails, and reports only the first failures, as
text).

The rank side (a script run this way) may call `report(value)` to hand a JSON value back
(`RankResult.result`), `maybe_die(point)` to SIGKILL itself where the launcher asked it
to (`kill_at`), and `rank()`, `world_size()`, `workdir()`. `tests/multiproc` is on the
ranks' PYTHONPATH, so a script anywhere can `import launch, models`.

On timeout, every process of the run is SIGKILLed and `LaunchError` (an AssertionError)
is raised with each rank's output tail. torchrun starts each worker in a session of its
own, so killing torchrun's process group is not enough: every process whose environment
carries the run's id (`SNAPCORE_MP_RUN`, inherited by the ranks and anything they start)
is found in /proc and killed, after the job and also after a normal end.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LOOPBACK = "127.0.0.1"

ENV_RUN = "SNAPCORE_MP_RUN"  # the run's id: marks every process of the run
ENV_DIR = "SNAPCORE_MP_DIR"  # the run's workdir: logs, exit statuses, results
ENV_DIE = "SNAPCORE_MP_DIE"  # "RANK@POINT[#N],...": where maybe_die() kills a rank

_TAIL_CHARS = 4000
_PORT_TRIES = 3
# run_ranks/run_nodes under torchrun by default? SNAPCORE_MP_TORCHRUN=1 runs every test's
# job under torchrun agents; tests/multiproc/test_harness.py runs some both ways.
TORCHRUN = os.environ.get("SNAPCORE_MP_TORCHRUN") == "1"


# ---------------------------------------------------------------------------- test side


@dataclass(frozen=True)
class RankResult:
    """One rank's outcome. `exitcode` is negative for a signal (-9: SIGKILL) and None
    when no status was recorded (the run was killed on timeout before the rank ended)."""

    rank: int
    node: int
    exitcode: int | None
    output: str
    result: Any  # the last value the rank passed to report(), or None

    def tail(self, chars: int = _TAIL_CHARS) -> str:
        return self.output[-chars:]


class LaunchError(AssertionError):
    """A run that timed out (`timed_out`) or, with check=True, had a rank exit non-zero."""

    def __init__(
        self, message: str, results: list[RankResult], *, timed_out: bool, run_id: str
    ) -> None:
        super().__init__(message)
        self.results = results
        self.timed_out = timed_out
        self.run_id = run_id


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def run_ranks(
    script: Path,
    world_size: int,
    args: Sequence[str] = (),
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    kill_at: Mapping[int, str] | None = None,
    check: bool = True,
    workdir: Path | None = None,
    torchrun: bool | None = None,
) -> list[RankResult]:
    """Run `script args` as `world_size` ranks of one node; results by rank.

    `timeout` bounds the whole run (seconds). `env` is added to the ranks' environment.
    `kill_at` maps a rank to a point ("POINT" or "POINT#N": its Nth time) at which its
    `maybe_die` SIGKILLs it. With `check`, any non-zero exit raises LaunchError.
    `workdir` (default: a temporary directory, removed unless the run failed) holds the
    logs and results. `torchrun`: as in `run_nodes`."""
    return run_nodes(
        script,
        world_size,
        args,
        timeout=timeout,
        node_envs=[env or {}],
        kill_at=kill_at,
        check=check,
        workdir=workdir,
        torchrun=torchrun,
    )


def run_nodes(
    script: Path,
    nproc_per_node: int,
    args: Sequence[str] = (),
    *,
    timeout: float,
    node_envs: Sequence[Mapping[str, str]],
    env: Mapping[str, str] | None = None,
    kill_at: Mapping[int, str] | None = None,
    check: bool = True,
    workdir: Path | None = None,
    torchrun: bool | None = None,
) -> list[RankResult]:
    """Run a job of `len(node_envs)` nodes: node N runs global ranks N*nproc_per_node and
    up, with `env` and then `node_envs[N]` added to its environment. Otherwise as
    `run_ranks`.

    With `torchrun` (default: `TORCHRUN`), one torchrun per node (`--nnodes
    len(node_envs)`, all on the same master port), as a job is started on several
    machines. Without it, the ranks are started directly (`_launch_direct`) with the
    environment torchrun gives its workers, and the first rank that fails has the
    others terminated, as torchrun does: the same job, without two agents that each
    import torch (about 2.5 s of CPU each, and most of a short test's time on 2 cores)."""
    if not node_envs:
        raise ValueError("node_envs: at least one node")
    world = nproc_per_node * len(node_envs)
    for r in kill_at or {}:
        if not 0 <= r < world:
            raise ValueError(f"kill_at: no rank {r} in a world of {world}")
    own_dir = workdir is None
    wd = Path(tempfile.mkdtemp(prefix="snapcore-mp-")) if workdir is None else workdir
    wd.mkdir(parents=True, exist_ok=True)
    for _ in range(_PORT_TRIES):
        _clear(wd, world, len(node_envs))  # a reused workdir's old results
        run_id = uuid.uuid4().hex
        launch = _launch if (TORCHRUN if torchrun is None else torchrun) else _launch_direct
        timed_out, agents = launch(
            Path(script), nproc_per_node, args, timeout, node_envs, env, kill_at, wd, run_id
        )
        if not _lost_port_race(wd, world, agents):
            break
    results = [_collect(wd, r, r // nproc_per_node) for r in range(world)]
    failed = timed_out or (check and any(r.exitcode != 0 for r in results))
    if failed:
        why = f"timed out after {timeout:g} s" if timed_out else "a rank failed"
        raise LaunchError(
            _report(why, results, wd, len(node_envs)), results, timed_out=timed_out, run_id=run_id
        )
    if own_dir:
        shutil.rmtree(wd, ignore_errors=True)
    return results


def spawn_nodes(
    script: Path,
    nproc_per_node: int,
    args: Sequence[str] = (),
    *,
    timeout: float,
    node_envs: Sequence[Mapping[str, str]],
    workdir: Path,
    env: Mapping[str, str] | None = None,
) -> list[tuple[int | None, Any]]:
    """Run `script args` as the ranks of a job in plain processes, without torchrun
    (env:// rendezvous on a free 127.0.0.1 port): node N's ranks are N*nproc_per_node
    and up, with `env` and then `node_envs[N]` in their environment. For a test that
    kills ranks or nodes: no agent tears the survivors down when a rank dies, as
    torchrun's would (and torchrun's exit barrier would hold the survivors' agent for
    300 s). Returns each rank's (exit status, last reported value or None); each rank's
    output is in `<workdir>/spawn<R>.log` (`spawn_logs`). Ranks still running after
    `timeout` seconds are SIGKILLed and AssertionError raised with their logs."""
    workdir.mkdir(parents=True, exist_ok=True)
    world = nproc_per_node * len(node_envs)
    port = free_port()
    pythonpath = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(world):
            rank_env = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "GLOO_SOCKET_IFNAME": "lo",
                **(env or {}),
                **node_envs[rank // nproc_per_node],
                "MASTER_ADDR": LOOPBACK,
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank % nproc_per_node),
                "WORLD_SIZE": str(world),
                ENV_DIR: str(workdir),
                "PYTHONPATH": pythonpath,
            }
            with open(workdir / f"spawn{rank}.log", "wb") as log:  # the child keeps its copy
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(script), *args],
                        env=rank_env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + timeout
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        why = f"the ranks did not finish in {timeout:g} s:\n{spawn_logs(workdir, world)}"
        raise AssertionError(why) from None
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    out: list[tuple[int | None, Any]] = []
    for rank, p in enumerate(procs):
        path = workdir / f"rank{rank}.json"
        out.append((p.returncode, json.loads(path.read_text()) if path.exists() else None))
    return out


def spawn_logs(workdir: Path, world: int) -> str:
    """The tails of the ranks' outputs of a `spawn_nodes` run, for an assertion's message."""
    return "\n".join(
        f"--- rank {r}\n" + (workdir / f"spawn{r}.log").read_text(errors="replace")[-3000:]
        for r in range(world)
    )


class Nodes:
    """`count` "nodes" on this machine, for a snapcore job run with `run_nodes` or
    `spawn_nodes` (`node_envs=nodes.envs`): each has its own local directory
    (`dirs[N]`, under `root`, in `SNAPCORE_TEST_LOCAL`) and its own host-memory area
    (`areas[N]`, a name unique to this test, in `SNAPCORE_TEST_HOST`; its files are in
    `shm[N]`, also in `SNAPCORE_TEST_SHM`). A store spec takes them as
    `{"local": "$SNAPCORE_TEST_LOCAL", "host": "$SNAPCORE_TEST_HOST"}`. Use it as a
    context manager, or call `cleanup()`: the host areas outlive the processes."""

    def __init__(self, root: Path, count: int = 2) -> None:
        self.dirs = [root / f"node{n}" for n in range(count)]
        self.areas = [f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}-n{n}" for n in range(count)]
        self.shm = [Path("/dev/shm") / f"snapcore-{a}" for a in self.areas]
        self.envs = [
            {"SNAPCORE_TEST_LOCAL": str(d), "SNAPCORE_TEST_HOST": a, "SNAPCORE_TEST_SHM": str(s)}
            for d, a, s in zip(self.dirs, self.areas, self.shm, strict=True)
        ]

    def run(
        self, script: Path, nproc_per_node: int, args: Sequence[str] = (), **kw: Any
    ) -> list[RankResult]:
        """`run_nodes` on these nodes."""
        return run_nodes(script, nproc_per_node, args, node_envs=self.envs, **kw)

    def spawn(
        self, script: Path, nproc_per_node: int, args: Sequence[str] = (), **kw: Any
    ) -> list[tuple[int | None, Any]]:
        """`spawn_nodes` on these nodes."""
        return spawn_nodes(script, nproc_per_node, args, node_envs=self.envs, **kw)

    def replace(self, node: int) -> None:
        """A new machine: the node's directory and host memory are gone."""
        shutil.rmtree(self.dirs[node], ignore_errors=True)
        shutil.rmtree(self.shm[node], ignore_errors=True)

    def cleanup(self) -> None:
        for path in self.shm:
            shutil.rmtree(path, ignore_errors=True)

    def __enter__(self) -> Nodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def processes_of(run_id: str) -> list[int]:
    """The live processes (not zombies) whose environment carries this run's id."""
    marker = f"{ENV_RUN}={run_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()  # a zombie's is empty
        except OSError:  # gone, or another user's
            continue
        if marker in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def _run_env(
    env: Mapping[str, str] | None,
    node_env: Mapping[str, str],
    kill_at: Mapping[int, str] | None,
    wd: Path,
    run_id: str,
) -> dict[str, str]:
    """A node's environment (its torchrun's, or its ranks' before their own variables):
    this process's, the run's settings, `env`, then `node_env`."""
    pythonpath = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",  # 2 cores; also spares torchrun's banner about it
        "GLOO_SOCKET_IFNAME": "lo",  # gloo binds the hostname's address otherwise
        "PYTHONUNBUFFERED": "1",  # a killed rank's last lines reach its log
        **(env or {}),
        **node_env,
        "PYTHONPATH": pythonpath,
        ENV_RUN: run_id,
        ENV_DIR: str(wd),
        ENV_DIE: ",".join(f"{r}@{p}" for r, p in (kill_at or {}).items()),
    }


def _launch(
    script: Path,
    nproc: int,
    args: Sequence[str],
    timeout: float,
    node_envs: Sequence[Mapping[str, str]],
    env: Mapping[str, str] | None,
    kill_at: Mapping[int, str] | None,
    wd: Path,
    run_id: str,
) -> tuple[bool, list[int | None]]:
    """Start the torchruns, wait until they end or the deadline passes, kill whatever of
    the run is left. Returns (timed out, each torchrun's exit status)."""
    port = free_port()
    agents: list[subprocess.Popen[bytes]] = []
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        for node, node_env in enumerate(node_envs):
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={len(node_envs)}",
                f"--nproc-per-node={nproc}",
                f"--node-rank={node}",
                f"--master-addr={LOOPBACK}",
                f"--master-port={port}",
                "--rdzv-backend=static",
                "--max-restarts=0",
                "--monitor-interval=0.1",
                str(HERE / "launch.py"),
                "--rank-entry",
                str(script),
                *args,
            ]
            with open(wd / f"node{node}.log", "wb") as log:
                agents.append(
                    subprocess.Popen(
                        cmd,
                        env=_run_env(env, node_env, kill_at, wd, run_id),
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        for agent in agents:
            try:
                agent.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        _kill_run(run_id, agents)
    return timed_out, [a.returncode for a in agents]


def _launch_direct(
    script: Path,
    nproc: int,
    args: Sequence[str],
    timeout: float,
    node_envs: Sequence[Mapping[str, str]],
    env: Mapping[str, str] | None,
    kill_at: Mapping[int, str] | None,
    wd: Path,
    run_id: str,
) -> tuple[bool, list[int | None]]:
    """`_launch` without torchrun: each rank's trampoline started here, with the
    variables torchrun sets for its workers (rank 0 hosts the job's TCPStore on the
    master port, as env:// does). When a rank exits non-zero, the others get SIGTERM
    (forwarded by their trampolines), as torchrun's agent does. Returns (timed out,
    each trampoline's exit status)."""
    port = free_port()
    world = nproc * len(node_envs)
    procs: list[subprocess.Popen[bytes]] = []
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        for rank in range(world):
            node = rank // nproc
            rank_env = {
                **_run_env(env, node_envs[node], kill_at, wd, run_id),
                "MASTER_ADDR": LOOPBACK,
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank % nproc),
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(nproc),
                "GROUP_RANK": str(node),
                "GROUP_WORLD_SIZE": str(len(node_envs)),
                "ROLE_RANK": str(rank),
                "ROLE_WORLD_SIZE": str(world),
            }
            cmd = [sys.executable, str(HERE / "launch.py"), "--rank-entry", str(script), *args]
            with open(wd / f"node{node}.log", "ab") as log:
                procs.append(
                    subprocess.Popen(
                        cmd,
                        env=rank_env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        while [p.poll() for p in procs].count(None):  # polls every one (any() would stop)
            if time.monotonic() > deadline:
                timed_out = True
                break
            if any(p.returncode not in (None, 0) for p in procs):  # torchrun's teardown
                for p in procs:
                    if p.poll() is None:
                        with contextlib.suppress(ProcessLookupError):
                            p.terminate()
                for p in procs:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(timeout=max(0.1, min(30.0, deadline - time.monotonic())))
                break
            time.sleep(0.05)
    finally:
        _kill_run(run_id, procs)
    return timed_out, [p.returncode for p in procs]


def _kill_run(run_id: str, agents: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGKILL the torchruns' process groups, then every process left with the run's id
    until none is (a worker forked meanwhile carries the id too), then reap."""
    for agent in agents:
        if agent.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
    for agent in agents:
        agent.wait()
    for _ in range(200):
        left = processes_of(run_id)
        if not left:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)  # for init to reap them; bounded by the loop
    raise RuntimeError(f"processes of run {run_id} survive SIGKILL: {processes_of(run_id)}")


def _lost_port_race(wd: Path, world: int, agents: Sequence[int | None]) -> bool:
    """True when the master port was taken between free_port() and its bind, by
    torchrun (no rank started) or, launched directly, by rank 0's TCPStore: the only
    case worth a second try."""
    if all(code == 0 for code in agents):
        return False
    if any((wd / f"rank{r}.log").exists() for r in range(world)):
        logs = [wd / "rank0.log"] if len(agents) == world else []  # direct: rank 0's store
    else:
        logs = [p for p in wd.glob("node*.log") if p.is_file()]
    text = " ".join(p.read_text(errors="replace").lower() for p in logs if p.exists())
    return "address already in use" in text or "eaddrinuse" in text


def _clear(wd: Path, world: int, nnodes: int) -> None:
    for name in [f"node{n}.log" for n in range(nnodes)] + [
        f"rank{r}.{ext}" for r in range(world) for ext in ("log", "exit", "json")
    ]:
        (wd / name).unlink(missing_ok=True)


def _collect(wd: Path, rank: int, node: int) -> RankResult:
    log, status, res = (wd / f"rank{rank}.{ext}" for ext in ("log", "exit", "json"))
    output = log.read_text(errors="replace") if log.exists() else ""
    exitcode = int(status.read_text()) if status.exists() else None
    result = json.loads(res.read_text()) if res.exists() else None
    return RankResult(rank, node, exitcode, output, result)


def _report(why: str, results: list[RankResult], wd: Path, nnodes: int) -> str:
    lines = [f"{len(results)} ranks: {why} (logs in {wd})"]
    for r in results:
        lines.append(f"--- rank {r.rank} (node {r.node}): exit {r.exitcode}")
        lines.append(r.tail() or "<no output>")
    for n in range(nnodes):
        log = wd / f"node{n}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        lines.append(f"--- torchrun (or the trampolines, launched directly) of node {n}")
        lines.append(text[-_TAIL_CHARS // 2 :] or "<no output>")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- rank side


def rank() -> int:
    return int(os.environ["RANK"])


def world_size() -> int:
    return int(os.environ["WORLD_SIZE"])


def workdir() -> Path:
    """The run's directory, shared by all ranks (and nodes) of the run."""
    return Path(os.environ[ENV_DIR])


def report(value: Any) -> None:
    """Hand a JSON-serialisable value back to the test (the last call wins)."""
    dest = workdir() / f"rank{rank()}.json"
    tmp = dest.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, dest)


_seen: dict[str, int] = {}


def maybe_die(point: str) -> None:
    """SIGKILL this rank if the launcher's `kill_at` names it at `point` (at its Nth
    passage for "POINT#N", the first by default); otherwise do nothing."""
    _seen[point] = count = _seen.get(point, 0) + 1
    for spec in filter(None, os.environ.get(ENV_DIE, "").split(",")):
        who, _, where = spec.partition("@")
        name, _, nth = where.partition("#")
        if int(who) == rank() and name == point and count == int(nth or 1):
            print(f"maybe_die: rank {who} SIGKILLs itself at {point}#{count}", flush=True)
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------------------- trampoline


def _rank_entry(argv: list[str]) -> int:
    """Run `argv` (script and its arguments) as a child with its output in this rank's
    log; record its exit status; exit as it did (128+N for signal N, as a shell does)."""
    r, wd = rank(), workdir()
    children: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, _frame: object) -> None:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signum)

    # Installed first, so that a signal cannot end us before the status is written. The
    # child starts with default handlers (exec resets caught signals). torchrun signals
    # the whole process group; forwarding covers a signal sent to this process alone.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    with open(wd / f"rank{r}.log", "wb") as log:
        children.append(
            subprocess.Popen(
                [sys.executable, *argv], stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        )
    code = children[0].wait()
    status = wd / f"rank{r}.exit"
    tmp = status.with_suffix(".exit.tmp")
    tmp.write_text(str(code))
    os.replace(tmp, status)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    if sys.argv[1:2] != ["--rank-entry"]:
        sys.exit("usage: launch.py --rank-entry SCRIPT [ARGS...] (run by torchrun)")
    sys.exit(_rank_entry(sys.argv[2:]))
