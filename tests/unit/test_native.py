"""Tests of the native extension snapcore._native (csrc/), through its Python API."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import random
import shutil
import subprocess
import sys
import threading
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
from gil import releases_gil

from snapcore import _native
from snapcore.errors import CudaError, NativeError, SnapcoreError, StorageError

PAGE = _native.page_size()
MiB = 1 << 20

needs_gpu = pytest.mark.skipif(
    not _native.cuda_available(), reason=f"no usable CUDA: {_native.cuda_status()}"
)


def view(address: int, n: int) -> ctypes.Array[ctypes.c_char]:
    """The n bytes at `address`, readable and writable from Python."""
    return (ctypes.c_char * n).from_address(address)


def fill(address: int, data: bytes) -> None:
    ctypes.memmove(address, data, len(data))


def read(address: int, n: int) -> bytes:
    return ctypes.string_at(address, n)


@pytest.fixture
def shm_path():
    """A unique path under /dev/shm, removed afterwards."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm on this machine")
    path = Path("/dev/shm") / f"snapcore-test-{os.getpid()}-{uuid.uuid4().hex}"
    yield str(path)
    path.unlink(missing_ok=True)


def o_direct_supported(directory: Path) -> bool:
    probe = directory / f".odirect-probe-{uuid.uuid4().hex}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)
    os.close(fd)
    return True


# --- machine facts and CUDA status ---------------------------------------------------


def test_page_size_and_threads():
    assert os.sysconf("SC_PAGE_SIZE") == PAGE
    assert _native.hardware_threads() == len(os.sched_getaffinity(0))


@pytest.mark.skipif(_native.cuda_available(), reason="CUDA is available here")
def test_cuda_unavailable_says_why():
    assert _native.cuda_available() is False
    status = _native.cuda_status()
    assert status and not status.startswith("ok")
    # Asked twice, the answer is the same and nothing raises.
    assert _native.cuda_status() == status
    with pytest.raises(CudaError, match="CUDA is unavailable"):
        _native.CudaCopier(0)


def test_native_errors_are_snapcore_errors():
    assert issubclass(StorageError, OSError) and issubclass(StorageError, SnapcoreError)
    assert issubclass(CudaError, NativeError) and issubclass(NativeError, RuntimeError)


# --- Arena -----------------------------------------------------------------------------


def test_arena_size_is_exact_up_to_a_page():
    with _native.Arena(3 * PAGE + 1, pin=False) as arena:
        assert arena.size == 3 * PAGE + 1
        assert arena.bytes_held == 4 * PAGE
        assert arena.bytes_pinned == 0
    # Not a power of two: 5 MiB + 3 bytes holds 5 MiB + one page, not 8 MiB.
    with _native.Arena(5 * MiB + 3, pin=False) as arena:
        assert arena.bytes_held == 5 * MiB + PAGE


def test_arena_memory_is_zeroed_readable_and_writable():
    n = 3 * MiB + 17
    with _native.Arena(n, pin=False, threads=2) as arena:
        assert arena.address % PAGE == 0
        buf = view(arena.address, n)
        assert buf.raw == bytes(n)
        data = random.Random(1).randbytes(n)
        buf[:] = data
        assert read(arena.address, n) == data


@pytest.mark.parametrize("prefault", [True, False])
@pytest.mark.parametrize("huge_pages", [True, False])
def test_arena_options(prefault, huge_pages):
    with _native.Arena(4 * MiB, prefault=prefault, huge_pages=huge_pages, pin=False) as arena:
        if huge_pages:
            assert arena.address % (2 * MiB) == 0  # placed where THP can back it
        else:
            assert arena.huge_pages is False
        view(arena.address, 4 * MiB)[4 * MiB - 1] = b"x"
        assert read(arena.address + 4 * MiB - 1, 1) == b"x"


def test_arena_parallel_prefault():
    n = 130 * MiB + 1  # two prefault threads' worth
    with _native.Arena(n, pin=False, threads=3) as arena:
        buf = view(arena.address, arena.bytes_held)
        assert buf[0] == buf[n - 1] == buf[arena.bytes_held - 1] == b"\0"
        buf[n - 1] = b"z"
        assert read(arena.address + n - 1, 1) == b"z"


def test_arena_without_cuda_is_not_pinned():
    if _native.cuda_available():
        pytest.skip("CUDA is available here; see test_arena_pinned")
    with _native.Arena(PAGE, pin=True) as arena:
        assert arena.pinned is False
        assert arena.bytes_pinned == 0


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("huge_pages", [True, False])
def test_anonymous_arena_is_not_inherited_by_fork(huge_pages):
    """MADV_DONTFORK ("dc"): a child forked after a save (a DataLoader worker) neither
    copies the arena (pinned pages are copied at once by fork) nor sees it."""
    if not Path("/proc/self/smaps").exists():
        pytest.skip("no /proc/self/smaps")
    with _native.Arena(4 * MiB + 1, pin=False, huge_pages=huge_pages) as arena:
        assert "dc" in vm_flags(arena.address)
        assert "dc" in vm_flags(arena.address + arena.bytes_held - 1)


def test_shared_arena_stays_visible_to_a_forked_child(shm_path):
    """A shared mapping is not copied by fork: it is left inheritable."""
    if not Path("/proc/self/smaps").exists():
        pytest.skip("no /proc/self/smaps")
    with _native.Arena(PAGE, shm_path=shm_path, pin=False) as arena:
        assert "dc" not in vm_flags(arena.address)


def test_arena_close_is_idempotent_and_final():
    arena = _native.Arena(PAGE, pin=False)
    assert arena.closed is False and arena.shm_path is None
    arena.close()
    arena.close()
    assert arena.closed is True
    with pytest.raises(ValueError, match="closed"):
        _ = arena.address


@pytest.mark.skipif(
    ctypes.util.find_library("numa") is None or not Path("/proc/self/numa_maps").exists(),
    reason="no libnuma (or no NUMA support in the kernel): arenas are not placed",
)
def test_arena_prefers_the_numa_node_asked_for():
    """The pages of an arena for a GPU come from the GPU's NUMA node: the policy is set
    before the prefault (node 0 exists on every Linux machine)."""

    def policy(address: int) -> str:
        for line in Path("/proc/self/numa_maps").read_text().splitlines():
            if int(line.split()[0], 16) == address:
                return line.split()[1]
        raise AssertionError(f"no mapping at {address:#x}")

    with _native.Arena(4 * MiB, pin=False, numa_node=0) as arena:
        assert arena.numa_error is None, arena.numa_error
        assert arena.numa_node == 0
        assert policy(arena.address) == "prefer:0"
    with _native.Arena(4 * MiB, pin=False) as arena:
        assert arena.numa_node == -1 and arena.numa_error is None
        assert policy(arena.address) == "default"
    with _native.Arena(4 * MiB, pin=False, numa_node=4095) as arena:  # no such node
        assert arena.numa_node == -1 and "mbind" in (arena.numa_error or ""), arena.numa_error


def test_arena_rejects_size_zero():
    with pytest.raises(ValueError):
        _native.Arena(0)


def test_arena_shm_is_a_file_of_the_right_size(shm_path):
    n = 2 * PAGE + 100
    with _native.Arena(n, shm_path=shm_path, pin=False) as arena:
        assert arena.shm_path == shm_path
        st = os.stat(shm_path)
        assert st.st_size == arena.bytes_held == 3 * PAGE
        assert st.st_mode & 0o777 == 0o600
        data = random.Random(2).randbytes(n)
        fill(arena.address, data)
        # MAP_SHARED: the bytes are in the file, visible to another process.
        with open(shm_path, "rb") as f:
            assert f.read(n) == data
    # Closing keeps the file: it is what survives a crash of the training process.
    assert os.path.exists(shm_path)
    with _native.Arena(n, shm_path=shm_path, pin=False) as again:
        assert read(again.address, n) == data


def test_arena_shm_error_is_storage_error(tmp_path):
    missing = tmp_path / "no-such-dir" / "arena"
    with pytest.raises(StorageError) as info:
        _native.Arena(PAGE, shm_path=str(missing), pin=False)
    assert info.value.errno == errno.ENOENT
    assert info.value.filename == str(missing)


# --- copy_host ------------------------------------------------------------------------


@pytest.mark.parametrize("nontemporal", [False, True])
@pytest.mark.parametrize("threads", [1, 0, 3, 7])
def test_copy_host_many_odd_sizes(threads, nontemporal):
    rng = random.Random(threads)
    sizes = [0, 1, 3, 4095, 4097, 1, 0, 65537, 3 * MiB + 5, 7, 12 * MiB + 1, 100, 0]
    sizes += [rng.randrange(1, 20000) for _ in range(200)]
    total = sum(sizes)
    with _native.Arena(total, pin=False) as src, _native.Arena(total, pin=False) as dst:
        data = rng.randbytes(total)
        fill(src.address, data)
        # Scatter: copy i lands at a shuffled position of the destination.
        offsets = []
        pos = 0
        for n in sizes:
            offsets.append(pos)
            pos += n
        order = list(range(len(sizes)))
        rng.shuffle(order)
        copies = []
        expected = bytearray(total)
        dpos = 0
        for i in order:
            n = sizes[i]
            copies.append((dst.address + dpos, src.address + offsets[i], n))
            expected[dpos : dpos + n] = data[offsets[i] : offsets[i] + n]
            dpos += n
        _native.copy_host(copies, threads=threads, nontemporal=nontemporal)
        assert read(dst.address, total) == bytes(expected)


def test_copy_host_streaming_stores_keep_the_bytes_around_each_copy():
    """Streaming stores write whole cache lines: the part of a copy that shares a line
    with its neighbours (head and tail) must go through ordinary stores, for every
    alignment of source and destination."""
    rng = random.Random(7)
    size = 4 * PAGE + 4096
    with _native.Arena(size, pin=False) as src, _native.Arena(size, pin=False) as dst:
        data = rng.randbytes(size)
        fill(src.address, data)
        for src_shift, dst_shift, n in [
            (0, 0, 4 * PAGE),
            (1, 0, 3 * PAGE + 17),
            (0, 63, 2 * PAGE + 1),
            (17, 5, 64),
            (5, 17, 63),
            (33, 31, 129),
            (0, 1, 1),
        ]:
            guard = bytes([0xA5]) * size
            fill(dst.address, guard)
            _native.copy_host(
                [(dst.address + dst_shift, src.address + src_shift, n)], 0, nontemporal=True
            )
            got = read(dst.address, size)
            assert got[dst_shift : dst_shift + n] == data[src_shift : src_shift + n]
            assert got[:dst_shift] == guard[:dst_shift], (src_shift, dst_shift, n)
            assert got[dst_shift + n :] == guard[dst_shift + n :], (src_shift, dst_shift, n)


def test_copy_host_empty_and_zero_length():
    _native.copy_host([])
    _native.copy_host([(0, 0, 0)])


def test_copy_host_rejects_overlap_and_null():
    with _native.Arena(2 * PAGE, pin=False) as a:
        with pytest.raises(ValueError, match="overlap"):
            _native.copy_host([(a.address + 10, a.address, 100)])
        with pytest.raises(ValueError, match="null"):
            _native.copy_host([(0, a.address, 100)])
    with pytest.raises(TypeError):
        _native.copy_host([(1, 2)])  # type: ignore[list-item]


def test_copy_host_releases_the_gil():
    arenas: list[_native.Arena] = []

    def make(n: int) -> Callable[[], None]:
        src, dst = _native.Arena(n, pin=False), _native.Arena(n, pin=False)
        arenas.extend((src, dst))  # allocated and faulted outside the call that is checked
        return lambda: _native.copy_host([(dst.address, src.address, n)] * 4, threads=1)

    try:
        assert releases_gil(make, 32 * MiB)
    finally:
        for a in arenas:
            a.close()


def test_copy_host_pool_survives_fork():
    """A child forked after the pool started gets a pool of its own, not a deadlock."""
    with _native.Arena(8 * MiB, pin=False) as a:
        _native.copy_host([(a.address + 4 * MiB, a.address, 4 * MiB)], threads=4)
    code = (
        "import os, warnings\n"
        "warnings.simplefilter('ignore', DeprecationWarning)\n"
        "from snapcore import _native\n"
        "a = _native.Arena(8 << 20, pin=False)\n"
        "_native.copy_host([(a.address + (4 << 20), a.address, 4 << 20)], threads=4)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        # The parent's anonymous arena is not mapped in the child (MADV_DONTFORK).
        "    b = _native.Arena(8 << 20, pin=False)\n"
        "    _native.copy_host([(b.address + (4 << 20), b.address, 4 << 20)], threads=4)\n"
        "    os._exit(0)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "raise SystemExit(os.waitstatus_to_exitcode(status))\n"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        result = subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True)
    assert result.returncode == 0, result.stderr.decode()


def test_a_child_forked_during_a_restore_to_the_gpu_can_close_snapcore():
    """A fork while another thread holds the restore ring's lock (a restore to the GPU
    in progress): the child gets a lock of its own and no ring (the parent's is not
    mapped there), so snapcore.close() in the child returns instead of waiting forever."""
    code = (
        "import os, signal, threading, warnings\n"
        "warnings.simplefilter('ignore', DeprecationWarning)\n"
        "import snapcore\n"
        "from snapcore.staging import h2d\n"
        "h2d._ring = object()  # a ring kept by the parent (never touched in the child)\n"
        "held, release = threading.Event(), threading.Event()\n"
        "def restore():  # holds the lock as a restore does\n"
        "    with h2d._ring_lock:\n"
        "        held.set()\n"
        "        release.wait(60)\n"
        "t = threading.Thread(target=restore)\n"
        "t.start()\n"
        "held.wait(60)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    signal.alarm(20)  # a child that hangs is killed: the test fails, no orphan\n"
        "    snapcore.close()\n"
        "    os._exit(0 if h2d._ring is None else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "release.set()\n"
        "t.join()\n"
        "raise SystemExit(os.waitstatus_to_exitcode(status))\n"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        result = subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True)
    assert result.returncode == 0, result.stderr.decode()


# --- FileWriter and read_into -----------------------------------------------------------


def write_pattern(path: Path, data: bytes, arena, *, direct: bool, offset: int = 0):
    """Writes `data` at `offset` of `path` from the arena, in three write_at calls that hit
    an aligned start, an unaligned start and an unaligned tail."""
    fill(arena.address, data)
    cut1 = 2 * PAGE
    cut2 = cut1 + MiB + 123
    with _native.FileWriter(str(path), direct=direct) as w:
        w.write_at(offset, arena.address, cut1)
        w.write_at(offset + cut1, arena.address + cut1, cut2 - cut1)
        w.write_at(offset + cut2, arena.address + cut2, len(data) - cut2)
        w.sync()
        assert w.bytes_written == len(data)
        return w.direct


@pytest.mark.parametrize("direct", [True, False])
def test_file_writer_round_trip(tmp_path, direct):
    n = 5 * MiB + 4321
    data = random.Random(3).randbytes(n)
    path = tmp_path / "data.bin"
    with _native.Arena(n, pin=False) as arena:
        used_direct = write_pattern(path, data, arena, direct=direct)
    assert used_direct is (direct and o_direct_supported(tmp_path))
    assert path.read_bytes() == data
    assert oct(path.stat().st_mode & 0o777) == oct(0o644 & ~current_umask())


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_file_writer_at_offset_keeps_what_is_before(tmp_path):
    path = tmp_path / "gap.bin"
    data = random.Random(4).randbytes(3 * MiB + 1)
    with _native.Arena(len(data), pin=False) as arena:
        write_pattern(path, data, arena, direct=True, offset=PAGE + 7)
    content = path.read_bytes()
    assert content[: PAGE + 7] == bytes(PAGE + 7)
    assert content[PAGE + 7 :] == data


def test_file_writer_on_tmpfs(shm_path):
    """tmpfs refuses O_DIRECT before Linux 6.6 and takes it since: either way the writer
    says which it used and the data is right."""
    data = random.Random(5).randbytes(2 * MiB + 99)
    with _native.Arena(len(data), pin=False) as arena:
        used_direct = write_pattern(Path(shm_path), data, arena, direct=True)
    assert used_direct is o_direct_supported(Path(shm_path).parent)
    assert Path(shm_path).read_bytes() == data


FALLBACK_SCRIPT = """
import random, sys
from pathlib import Path
from snapcore import _native
path = Path(sys.argv[1]) / "data.bin"
data = random.Random(8).randbytes(3 * (1 << 20) + 77)
arena = _native.Arena(len(data), pin=False)
(__import__("ctypes")).memmove(arena.address, data, len(data))
w = _native.FileWriter(str(path), direct=True)
assert w.direct is False, "ramfs took O_DIRECT"
w.write_at(0, arena.address, 1 << 20)
w.write_at(1 << 20, arena.address + (1 << 20), len(data) - (1 << 20))
w.sync()
w.close()
assert path.read_bytes() == data
print("fallback-ok")
"""


def test_file_writer_falls_back_where_o_direct_is_refused(tmp_path):
    """ramfs refuses O_DIRECT at open (EINVAL). Mounting one needs a mount namespace:
    the test runs in one of its own, and is skipped where none can be made."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    script = tmp_path / "fallback.py"
    script.write_text(FALLBACK_SCRIPT)
    shell = f'mount -t ramfs none "{mnt}" || exit 77; exec "{sys.executable}" "{script}" "{mnt}"'
    result = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", shell],
        capture_output=True,
        timeout=120,
    )
    if result.returncode == 77 or b"unshare failed" in result.stderr:
        pytest.skip(f"cannot mount a ramfs here: {result.stderr.decode().strip()}")
    assert result.returncode == 0, result.stderr.decode()
    assert b"fallback-ok" in result.stdout


def test_file_writer_concurrent_disjoint_writes(tmp_path):
    piece = MiB + 3
    k = 8
    data = random.Random(6).randbytes(piece * k)
    path = tmp_path / "concurrent.bin"
    with _native.Arena(len(data), pin=False) as arena:
        fill(arena.address, data)
        with _native.FileWriter(str(path)) as w:
            threads = [
                threading.Thread(
                    target=w.write_at, args=(i * piece, arena.address + i * piece, piece)
                )
                for i in range(k)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert w.bytes_written == len(data)
    assert path.read_bytes() == data


@pytest.mark.parametrize("direct", [True, False])
def test_file_writer_enospc_is_storage_error(direct):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    with (
        _native.Arena(4 * PAGE, pin=False) as arena,
        _native.FileWriter("/dev/full", direct=direct) as w,
        pytest.raises(StorageError) as info,
    ):
        w.write_at(0, arena.address, 4 * PAGE)
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == "/dev/full"
    assert isinstance(info.value, OSError)


def test_file_writer_open_error(tmp_path):
    path = tmp_path / "missing" / "f.bin"
    with pytest.raises(StorageError) as info:
        _native.FileWriter(str(path))
    assert info.value.errno == errno.ENOENT
    assert info.value.filename == str(path)


def test_file_writer_close(tmp_path):
    w = _native.FileWriter(str(tmp_path / "c.bin"), direct=False)
    assert w.path == str(tmp_path / "c.bin") and w.closed is False
    w.close()
    w.close()
    assert w.closed is True
    with pytest.raises(ValueError, match="closed"):
        w.write_at(0, 1, 1)


@pytest.mark.parametrize("threads", [1, 3])
def test_read_into_round_trip(tmp_path, threads):
    n = 40 * MiB + 5  # large enough to be split over threads
    data = random.Random(7).randbytes(n + 1000)
    path = tmp_path / "r.bin"
    path.write_bytes(data)
    with _native.Arena(n, pin=False) as arena:
        _native.read_into(str(path), 999, n, arena.address, threads=threads)
        assert read(arena.address, n) == data[999 : 999 + n]
        _native.read_into(str(path), 0, 0, arena.address)


def test_read_into_truncated(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 100)
    with _native.Arena(PAGE, pin=False) as arena:
        with pytest.raises(NativeError, match=r"truncated: .*short\.bin has 100 bytes, need 150"):
            _native.read_into(str(path), 50, 100, arena.address)
        # Nothing of it is an OSError: a short file is damage, not an I/O failure.
        with pytest.raises(NativeError) as info:
            _native.read_into(str(path), 0, 101, arena.address)
        assert not isinstance(info.value, OSError)


def test_read_into_missing_file(tmp_path):
    with _native.Arena(PAGE, pin=False) as arena, pytest.raises(StorageError) as info:
        _native.read_into(str(tmp_path / "nope"), 0, 1, arena.address)
    assert info.value.errno == errno.ENOENT


def test_drop_page_cache(tmp_path):
    path = tmp_path / "cached.bin"
    path.write_bytes(b"y" * (3 * PAGE))
    assert _native.drop_page_cache(str(path)) is True
    assert path.read_bytes() == b"y" * (3 * PAGE)
    with pytest.raises(StorageError):
        _native.drop_page_cache(str(tmp_path / "nope"))


# --- stubs ------------------------------------------------------------------------------


STUB_NANOBIND = "3.1"  # the nanobind whose stubgen wrote snapcore/_native.pyi


def test_stub_matches_module(tmp_path):
    """snapcore/_native.pyi is what nanobind's stub generator makes of the built module
    (after ruff format): regenerate it when the binding changes."""
    nanobind = pytest.importorskip("nanobind")
    pytest.importorskip("nanobind.stubgen")
    # Another stub generator may word the same module differently.
    if nanobind.__version__.split(".")[:2] != STUB_NANOBIND.split("."):
        pytest.skip(f"the stub was made with nanobind {STUB_NANOBIND}, not {nanobind.__version__}")
    ruff = shutil.which("ruff") or shutil.which("ruff", path=os.path.dirname(sys.executable))
    if ruff is None:
        pytest.skip("ruff is not installed")
    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "_native.pyi"
    subprocess.run(
        [sys.executable, "-m", "nanobind.stubgen", "-q", "-m", "snapcore._native", "-o", out],
        check=True,
    )
    subprocess.run(
        [ruff, "format", "--quiet", "--config", repo / "pyproject.toml", out], check=True
    )
    committed = repo / "snapcore" / "_native.pyi"
    assert out.read_text() == committed.read_text(), (
        "snapcore/_native.pyi is stale: run `python -m nanobind.stubgen -m snapcore._native "
        "-o snapcore/_native.pyi && ruff format snapcore/_native.pyi`"
    )


# --- the CUDA path against a fake driver ---------------------------------------------

FAKE_DRIVER_SCENARIO = """
import ctypes, os
from snapcore import _native
from snapcore.errors import CudaError

fake = ctypes.CDLL("libcuda.so.1")  # the handle snapcore already opened
fake.fake_cuda_log.restype = ctypes.c_char_p
fake.fake_cuda_state.restype = ctypes.c_longlong
def state(*names): return [fake.fake_cuda_state(n.encode()) for n in names]
def log(): return fake.fake_cuda_log().decode().splitlines()
def expect_raises(exc, fn, *args):
    try:
        fn(*args)
    except exc as e:
        return e
    raise AssertionError(f"{fn} did not raise {exc}")
LEAKS = ("ctx_refs", "streams", "events", "depth", "registered")

assert _native.cuda_available() and _native.cuda_status() == "ok: 1 device(s)"
arena = _native.Arena(3 * 4096 + 1)
assert arena.pinned and arena.bytes_pinned == arena.bytes_held == 4 * 4096
assert state("registered", "ctx_refs") == [4 * 4096, 1]

data = bytes(range(250)) * 4
src = _native.Arena(1000, pin=False)
ctypes.memmove(src.address, data, 1000)
copier = _native.CudaCopier(0)
assert copier.device == 0 and copier.stream != 0
start = len(log())
copies = [(arena.address, src.address, 600), (arena.address, src.address, 0),
          (arena.address + 600, src.address + 600, 400)]
event = copier.d2h(copies, 0)
event.synchronize()
assert event.query() is True
event.make_stream_wait(12345)
assert log()[start:] == [
    "EventRecord e2 ext:0", "StreamWaitEvent s1 e2",  # after the caller's stream
    "MemcpyDtoHAsync 1000 s1",  # the two halves continue one another: merged, one call
    "EventRecord e3 s1",
    "EventSynchronize e3", "StreamWaitEvent ext:12345 e3",
], log()[start:]
assert ctypes.string_at(arena.address, 1000) == data

dev = _native.Arena(1000, pin=False)
start = len(log())
event2 = copier.h2d([(dev.address, arena.address, 1000)], 777)
assert log()[start:] == ["EventRecord e4 ext:777", "StreamWaitEvent s1 e4",
                         "MemcpyHtoDAsync 1000 s1", "EventRecord e5 s1"], log()[start:]
assert ctypes.string_at(dev.address, 1000) == data
assert state("events") == [2]  # the completion events Python holds
del event, event2
copier.close()
copier.close()
assert "closed" in str(expect_raises(ValueError, copier.d2h, [], 0))
arena.close()
assert state(*LEAKS) == [0] * 5, state(*LEAKS)

assert "does not exist" in str(expect_raises(ValueError, _native.CudaCopier, 1))

os.environ["FAKE_CUDA_FAIL"] = "cuMemHostRegister"
unpinned = _native.Arena(4096)  # pinning failed: the arena is unpinned, and says why
assert not unpinned.pinned and unpinned.bytes_pinned == 0
e = unpinned.pin_error
assert "CUDA_ERROR_OUT_OF_MEMORY" in e and "MemHostRegister" in e, e
assert state("ctx_refs", "depth") == [0, 0]  # the context was let go of
ctypes.memset(unpinned.address, 1, 4096)
unpinned.close()
assert _native.Arena(4096, pin=False).pin_error is None
os.environ["FAKE_CUDA_FAIL"] = "cuMemcpyDtoHAsync"
copier = _native.CudaCopier(0)
e = expect_raises(CudaError, copier.d2h, [(dev.address, src.address, 10)], 0)
assert "CUDA_ERROR_OUT_OF_MEMORY" in str(e), e
assert log()[-1].startswith("StreamSynchronize s"), log()[-3:]  # queued part drained
del os.environ["FAKE_CUDA_FAIL"]
copier.close()
assert state(*LEAKS) == [0] * 5, state(*LEAKS)
assert "no current context!" not in log()
print("fake-driver-ok")
"""


@pytest.fixture(scope="module")
def fake_driver_dir(tmp_path_factory):
    """A directory holding csrc/testing/fake_libcuda.c built as libcuda.so.1."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake CUDA driver")
    source = Path(__file__).resolve().parents[2] / "csrc" / "testing" / "fake_libcuda.c"
    out = tmp_path_factory.mktemp("fake-cuda")
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O1", "-o", out / "libcuda.so.1", source, "-lpthread"],
        check=True,
    )
    return out


@pytest.fixture(scope="module")
def fake_batch_driver_dir(fake_driver_dir, tmp_path_factory):
    """The fake driver of a CUDA 13 machine: with cuMemcpyBatchAsync_v2."""
    cc = shutil.which("cc") or shutil.which("gcc")
    source = Path(__file__).resolve().parents[2] / "csrc" / "testing" / "fake_libcuda.c"
    out = tmp_path_factory.mktemp("fake-cuda-batch")
    flags = ["-shared", "-fPIC", "-O1", "-DFAKE_CUDA_BATCH"]
    subprocess.run([cc, *flags, "-o", out / "libcuda.so.1", source, "-lpthread"], check=True)
    return out


def run_with_fake_driver(directory: Path, code: str, **env: str):
    paths = [str(directory), os.environ.get("LD_LIBRARY_PATH", "")]
    environ = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(p for p in paths if p), **env}
    return subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, timeout=120
    )


def test_cuda_path_against_a_fake_driver(fake_driver_dir):
    """The shim, contexts, streams, events, pinning and error mapping, call by call, with a
    stand-in libcuda.so.1 (csrc/testing/fake_libcuda.c): what a GPU-less machine can check
    of the CUDA path."""
    result = run_with_fake_driver(fake_driver_dir, FAKE_DRIVER_SCENARIO)
    assert result.returncode == 0, result.stderr.decode()
    assert b"fake-driver-ok" in result.stdout


def test_cuda_init_failure_is_reported_not_raised(fake_driver_dir):
    code = (
        "from snapcore import _native\n"
        "assert _native.cuda_available() is False\n"
        "print(_native.cuda_status())\n"
        "assert _native.Arena(4096, pin=True).pinned is False\n"
    )
    result = run_with_fake_driver(fake_driver_dir, code, FAKE_CUDA_NO_DEVICE="1")
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().startswith("cuInit failed: CUDA_ERROR_NO_DEVICE (100)")


FORKED_CHILD_SCENARIO = """
import ctypes, os
from snapcore import _native
from snapcore.errors import CudaError

fake = ctypes.CDLL("libcuda.so.1")
fake.fake_cuda_log.restype = ctypes.c_char_p
def log(): return fake.fake_cuda_log().decode().splitlines()

assert _native.cuda_available()
arena = _native.Arena(1 << 20)
assert arena.pinned
copier = _native.CudaCopier(0)
size = arena.bytes_held
pid = os.fork()
if pid == 0:
    try:
        calls = len(log())
        assert _native.cuda_available() is False
        assert "fork" in _native.cuda_status(), _native.cuda_status()
        try:
            _native.CudaCopier(0)
            raise AssertionError("a CudaCopier in a forked child")
        except CudaError as e:
            assert "fork" in str(e), e
        fresh = _native.Arena(size)  # may take the address range the parent's arena had
        assert not fresh.pinned
        copier.close()  # the parent's stream and registration are not the child's to free
        arena.close()
        ctypes.memset(fresh.address, 7, size)  # still mapped: arena.close() unmapped nothing
        fresh.close()
        assert len(log()) == calls, log()[calls:]  # the child made no driver call
    except BaseException as e:
        print("child:", repr(e), flush=True)
        os._exit(1)
    os._exit(0)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0
assert _native.cuda_available()  # the parent is unaffected
copier.close()
arena.close()
print("fork-ok")
"""


def test_cuda_is_unavailable_in_a_forked_child(fake_driver_dir):
    """A CUDA context does not survive fork(): a child forked after the driver was loaded
    sees CUDA unavailable, and freeing what it inherited calls no driver function."""
    result = run_with_fake_driver(fake_driver_dir, FORKED_CHILD_SCENARIO)
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()
    assert "fork-ok" in out


FAKE_LOG = """
import ctypes
fake = ctypes.CDLL("libcuda.so.1")
fake.fake_cuda_log.restype = ctypes.c_char_p
fake.fake_cuda_state.restype = ctypes.c_longlong
def log(): return fake.fake_cuda_log().decode().splitlines()
def state(*names): return [fake.fake_cuda_state(n.encode()) for n in names]
"""

PIN_DEVICE_SCENARIO = (
    FAKE_LOG
    + """
from snapcore import _native
assert _native.cuda_status() == "ok: 2 device(s)"
arena = _native.Arena(4096, device=1)
assert arena.pinned
arena.close()
assert log() == ["PrimaryCtxRetain 1", "MemHostRegister 4096 ctx1",
                 "MemHostUnregister ctx1", "PrimaryCtxRelease 1"], log()
try:
    _native.Arena(4096, device=2)
    raise AssertionError("an arena pinned on a device that does not exist")
except ValueError as e:
    assert "does not exist" in str(e), e
assert state("ctx_refs", "registered") == [0, 0]
print("pin-device-ok")
"""
)


def test_arena_is_pinned_in_the_context_of_the_device_asked_for(fake_driver_dir):
    """Not GPU 0's on every rank: a context on GPU 0 costs each rank memory there, and
    breaks every rank but one in EXCLUSIVE_PROCESS mode."""
    result = run_with_fake_driver(fake_driver_dir, PIN_DEVICE_SCENARIO, FAKE_CUDA_DEVICES="2")
    assert result.returncode == 0, result.stderr.decode()
    assert b"pin-device-ok" in result.stdout


CPU_STATE_SCENARIO = (
    FAKE_LOG
    + """
import sys, warnings
warnings.simplefilter("ignore", DeprecationWarning)
import torch
import snapcore
from snapcore import _native
assert _native.cuda_available()
state = {"w": torch.arange(100_000, dtype=torch.float32), "step": 3}
snapcore.prepare(state, sys.argv[1]).result()
snapcore.save(state, sys.argv[1], step=1)
snapcore.async_save(state, sys.argv[1], step=2).wait()
snapcore.close()
assert not [c for c in log() if "Register" in c or "PrimaryCtx" in c], log()
print("cpu-state-ok")
"""
)


def test_a_cpu_only_state_is_never_pinned(fake_driver_dir, tmp_path):
    """Pinning a state with no CUDA tensor would only cost a context and locked memory."""
    code = CPU_STATE_SCENARIO.replace("sys.argv[1]", repr(str(tmp_path / "store")))
    result = run_with_fake_driver(fake_driver_dir, code)
    assert result.returncode == 0, result.stderr.decode()
    assert b"cpu-state-ok" in result.stdout


def test_pin_device_is_the_first_cuda_tensors():
    torch = pytest.importorskip("torch")
    from snapcore.staging.arena import pin_device

    cpu, cuda0, cuda1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
    assert pin_device([cpu, cpu]) is None
    assert pin_device([]) is None
    assert pin_device([cpu, cuda1, cuda0]) == 1
    assert pin_device([cuda0, cuda1]) == 0


PIN_FAILURE_SCENARIO = (
    FAKE_LOG
    + """
import os, warnings
warnings.simplefilter("ignore", DeprecationWarning)
from snapcore.staging.arena import HostArena
os.environ["FAKE_CUDA_FAIL"] = "cuMemHostRegister"
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    arena = HostArena(1 << 20, device=0)
assert not arena.native.pinned
messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
assert len(messages) == 1 and "unpinned" in messages[0], messages
assert "CUDA_ERROR_OUT_OF_MEMORY" in messages[0], messages
arena.u8[:] = 3  # usable all the same
assert int(arena.u8.sum()) == 3 << 20
arena.close()
del os.environ["FAKE_CUDA_FAIL"]
with warnings.catch_warnings():
    warnings.simplefilter("error")
    pinned = HostArena(1 << 20, device=0)
assert pinned.native.pinned
pinned.close()
assert state("ctx_refs", "registered", "depth") == [0, 0, 0]
print("pin-failure-ok")
"""
)


def test_a_failed_pinning_warns_and_falls_back_to_unpinned_memory(fake_driver_dir):
    """cuMemHostRegister can fail (locked-memory limits, a GPU in EXCLUSIVE_PROCESS mode):
    the snapshot is then staged through pageable memory, slower, instead of failing."""
    result = run_with_fake_driver(fake_driver_dir, PIN_FAILURE_SCENARIO)
    assert result.returncode == 0, result.stderr.decode()
    assert b"pin-failure-ok" in result.stdout


EVENT_FLAGS_SCENARIO = (
    FAKE_LOG
    + """
from snapcore import _native
copier = _native.CudaCopier(0)
event = copier.d2h([], 0)
BLOCKING_SYNC, DISABLE_TIMING = 0x1, 0x2  # CU_EVENT_*
assert state("event_flags") == [BLOCKING_SYNC | DISABLE_TIMING], state("event_flags")
event.synchronize()
del event
copier.close()
print("event-flags-ok")
"""
)


def test_completion_events_block_instead_of_spinning(fake_driver_dir):
    """Without CU_EVENT_BLOCKING_SYNC, waiting for the copies spins a CPU core."""
    result = run_with_fake_driver(fake_driver_dir, EVENT_FLAGS_SCENARIO)
    assert result.returncode == 0, result.stderr.decode()
    assert b"event-flags-ok" in result.stdout


STAGING_ORDER_SCENARIO = (
    FAKE_LOG
    + """
import warnings
warnings.simplefilter("ignore", DeprecationWarning)
import torch
from snapcore import _native
from snapcore.io_types import Window
from snapcore.planning.layout import BlobPlan
from snapcore.staging import copy as staging_copy
from snapcore.staging.arena import HostArena

class Stream:  # torch.cuda.current_stream(device) of a CPU build of torch
    def __init__(self, device): self.cuda_stream = 1000 + device.index
torch.cuda.current_stream = Stream

def copy_host(*args, **kwargs):  # the CPU copies, placed in the driver's log
    fake.fake_cuda_mark(b"copy_host")
    native_copy_host(*args, **kwargs)
native_copy_host = _native.copy_host
_native.copy_host = copy_host

class Blob(BlobPlan):  # "device memory" is host memory to the fake driver
    def __init__(self, offset, source, device):
        super().__init__(offset, source.nbytes, source, True, source.data_ptr(), [0])
        self._device = torch.device(device)
    @property
    def device(self): return self._device

sources = [torch.full((256,), i, dtype=torch.uint8) for i in range(5)]
devices = ["cuda:0", "cpu", "cuda:1", "cuda:0", "cuda:1"]
blobs = [Blob(256 * i, s, d) for i, (s, d) in enumerate(zip(sources, devices))]
arena = HostArena(256 * 5, device=0)
stager = staging_copy.Stager()
for wait_gpu in ("cpu", "stream"):
    w = Window(arena, 0, 256 * 5, 0, 0)
    start = len(log())
    stager.copy(blobs, w, defer=False, wait_gpu=wait_gpu)
    calls = [c for c in log()[start:] if not c.startswith("PrimaryCtx")
             and not c.startswith("StreamCreate")]
    last_copy = max(i for i, c in enumerate(calls) if c.startswith("MemcpyDtoHAsync"))
    waits = [i for i, c in enumerate(calls)
             if c.startswith("EventSynchronize") or c.startswith("StreamWaitEvent ext")]
    # every device's copies queued, then the CPU copies, then the waits
    assert calls.index("copy_host") > last_copy, calls
    assert len(waits) == 2 and min(waits) > calls.index("copy_host"), calls
    assert [c.split()[1] for c in calls if c.startswith("StreamWaitEvent ext")] == (
        [] if wait_gpu == "cpu" else ["ext:1000", "ext:1001"]), calls
    assert bytes(arena.u8) == b"".join(bytes(s) for s in sources)
    arena.u8.zero_()

def failing_copy_host(*args, **kwargs):
    fake.fake_cuda_mark(b"copy_host failed")
    raise OSError("a CPU copy failed")
_native.copy_host = failing_copy_host
start = len(log())
try:
    stager.copy(blobs, Window(arena, 0, 256 * 5, 0, 0), defer=False, wait_gpu="stream")
    raise AssertionError("the CPU copy's failure was lost")
except OSError:
    pass
calls = log()[start:]
after = calls[calls.index("copy_host failed"):]
# the GPUs' copies were queued already: they are waited for before the error goes up
assert len([c for c in after if c.startswith("EventSynchronize")]) == 2, calls
stager.close()
arena.close()
print("staging-order-ok")
"""
)


def test_default_staging_queues_every_device_then_copies_on_cpu_then_waits(fake_driver_dir):
    """The GPUs' copies run while the CPU copies do, and no device waits for another's."""
    result = run_with_fake_driver(fake_driver_dir, STAGING_ORDER_SCENARIO, FAKE_CUDA_DEVICES="2")
    assert result.returncode == 0, result.stderr.decode()
    assert b"staging-order-ok" in result.stdout


# The fake driver's "device memory" is host memory: a CPU tensor stands for a CUDA one.
FAKE_CUDA_BLOBS = """
import warnings
warnings.simplefilter("ignore", DeprecationWarning)
import torch
from snapcore import _native
from snapcore.planning.layout import BlobPlan

class Stream:  # torch.cuda.current_stream(device) of a CPU build of torch
    def __init__(self, device=None):
        self.cuda_stream = 1000 + (device.index if device is not None else 0)
torch.cuda.current_stream = Stream

class Blob(BlobPlan):
    def __init__(self, offset, source, device, raw=True):
        super().__init__(offset, source.nbytes, source, raw, source.data_ptr(), [0])
        self._device = torch.device(device)
    @property
    def device(self): return self._device
"""

OVERLAP_SCENARIO = (
    FAKE_LOG
    + FAKE_CUDA_BLOBS
    + """
import queue, threading, types
from snapcore.staging.arena import HostArena
from snapcore.staging.copy import Stager
from snapcore.staging.handle import SaveHandle, SaveStats
from snapcore.write.job import PersistJob

on_gpu = torch.nn.Parameter(torch.full((256,), 1.0))  # "cuda:0", written by the optimizer
on_cpu = torch.nn.Parameter(torch.full((256,), 2.0))
opt = torch.optim.SGD([on_gpu, on_cpu], lr=1.0)
on_gpu.grad, on_cpu.grad = torch.ones(256), torch.ones(256)
blobs = [Blob(0, on_gpu.data, "cuda:0"), Blob(1024, on_cpu.data, "cpu")]
layout = types.SimpleNamespace(blobs=blobs, total=2048)
arena = HostArena(2048, device=0)
stager = Stager()
handle = SaveHandle(1, SaveStats(1, 2048, 2048), ("local",))
windows = queue.Queue()
order = []
stepped = threading.Event()

stager.stage_whole(arena, layout, windows, [opt], handle)
assert handle.deferred
assert handle._staged.wait(60)  # the overlap thread: CPU copies, then the CUDA events

def persist():  # the persist thread, still busy with an earlier snapshot until the step
    stepped.wait(60)
    PersistJob._take_window(types.SimpleNamespace(windows=windows, handle=handle))
    order.append("window taken")

persister = threading.Thread(target=persist)
persister.start()
fake.fake_cuda_mark(b"step")
opt.step()
fake.fake_cuda_mark(b"stepped")
order.append("stepped")
stepped.set()
persister.join(120)
assert order == ["stepped", "window taken"], order
calls = log()
during = calls[calls.index("step") + 1 : calls.index("stepped")]
copied = [c for c in calls if c.startswith("MemcpyDtoHAsync")]
assert copied == ["MemcpyDtoHAsync 1024 s1"], calls
done = calls[calls.index(copied[0]) + 1].split()  # EventRecord eN s1: the copy's event
# the host does not block for the CUDA copies: the current stream waits for them
assert during == [f"StreamWaitEvent ext:1000 {done[1]}"], calls
assert torch.equal(arena.u8.view(torch.float32), torch.tensor([1.0] * 256 + [2.0] * 256))
assert torch.equal(on_gpu.data, torch.zeros(256))  # the step did happen

# A failed CPU copy fails the snapshot, and the step does not hang on it.
native_copy_host = _native.copy_host
def failing_copy_host(*args, **kwargs):
    if threading.current_thread().name.startswith("snapcore-overlap"):
        raise OSError("a CPU copy failed")
    native_copy_host(*args, **kwargs)
_native.copy_host = failing_copy_host
handle2 = SaveHandle(2, SaveStats(2, 2048, 2048), ("local",))
stager.stage_whole(arena, layout, windows, [opt], handle2)
opt.step()
try:
    PersistJob._take_window(types.SimpleNamespace(windows=windows, handle=handle2))
    raise AssertionError("the overlap thread's failure was lost")
except OSError:
    pass
stager.close()
arena.close()
del handle, handle2  # their completion events hold the context
import gc; gc.collect()  # and the failed window, through its error's traceback
LEAKS = ("streams", "events", "ctx_refs", "depth")
assert state(*LEAKS) == [0, 0, 0, 0], state(*LEAKS)
print("overlap-ok")
"""
)


def test_overlap_mode_step_makes_the_stream_wait_and_never_waits_for_the_persist_thread(
    fake_driver_dir,
):
    """Overlap mode: for CUDA tensors optimizer.step() only makes the current stream wait
    for the copies (no host block), and for no tensor does it wait for the persist thread,
    which may still be writing the previous snapshot."""
    result = run_with_fake_driver(fake_driver_dir, OVERLAP_SCENARIO)
    assert result.returncode == 0, result.stderr.decode()
    assert b"overlap-ok" in result.stdout


STREAMING_GATHER_SCENARIO = (
    FAKE_LOG
    + FAKE_CUDA_BLOBS
    + """
import queue, threading, types
from snapcore.staging.arena import HostArena
from snapcore.staging.copy import Stager
from snapcore.staging.handle import SaveHandle, SaveStats

gathers = []
class Strided(torch.Tensor):  # counts the gathers of a strided "CUDA" tensor
    def contiguous(self, *args, **kwargs):
        gathers.append(1)
        return torch.Tensor.contiguous(self.as_subclass(torch.Tensor), *args, **kwargs)

base = torch.arange(32 * 96, dtype=torch.int32).to(torch.uint8).view(32, 96)
source = base.t().as_subclass(Strided)  # 3072 bytes, not contiguous
assert not source.is_contiguous()
blobs = [Blob(0, source, "cuda:0", raw=False)]
layout = types.SimpleNamespace(blobs=blobs, total=3072)
arena = HostArena(2048, device=0)  # windows of 1024 bytes: three of them cut the tensor
stager = Stager()
handle = SaveHandle(1, SaveStats(1, 3072, 3072), ("local",))
windows = queue.Queue()
halves = [threading.Event(), threading.Event()]
for h in halves:
    h.set()
want = base.t().contiguous().view(-1)
got = []

def persist():  # takes each window as the persist thread does, frees its half
    for _ in range(3):
        w = windows.get()
        lo = w.arena_offset
        got.append(arena.u8[lo : lo + w.end - w.start].clone())
        w.keep.clear()
        halves[w.half].set()

taker = threading.Thread(target=persist)
taker.start()
stager.stage_streaming(arena, layout, windows, halves, handle)
taker.join(120)
assert torch.equal(torch.cat(got), want)
assert len(gathers) == 1, gathers  # once per snapshot, not once per window
assert [c for c in log() if c.startswith("MemcpyDtoHAsync")] == ["MemcpyDtoHAsync 1024 s1"] * 3
stager.close()
arena.close()
print("streaming-gather-ok")
"""
)


def test_streaming_gathers_a_strided_cuda_tensor_once_per_snapshot(fake_driver_dir):
    """A strided CUDA tensor that several streaming windows cut through is gathered on the
    GPU once (and its temporary kept up to the last window), not once per window."""
    result = run_with_fake_driver(fake_driver_dir, STREAMING_GATHER_SCENARIO)
    assert result.returncode == 0, result.stderr.decode()
    assert b"streaming-gather-ok" in result.stdout


# What the restore-to-the-GPU scenarios share: a CPU build of torch told it has CUDA
# streams (per thread, as torch's current stream is), and a reader of a saved state.
RESTORE_PRELUDE = (
    FAKE_LOG
    + """
import gc, re, signal, sys, threading, time, warnings
warnings.simplefilter("ignore", DeprecationWarning)
import torch
import snapcore
from snapcore import _native
from snapcore.errors import CorruptSnapshot
from snapcore.read import Reader
from snapcore.staging import h2d
from snapcore.tiers import LocalTier

MiB = 1 << 20

class Stream:  # torch.cuda.current_stream(device) of a CPU build of torch: per thread
    def __init__(self, device=None):
        main = threading.current_thread() is threading.main_thread()
        self.cuda_stream = (1000 if main else 2000) + device
torch.cuda.current_stream = Stream

def reader_of(saved):
    \"\"\"``saved`` saved to the test's store, and a reader of it with its tensor index.\"\"\"
    snapcore.save(saved, sys.argv[1], step=1)
    snapcore.close()
    tier = LocalTier(sys.argv[1])
    reader = Reader([(tier, tier.read_manifest(1))])
    return reader, {p: i for i, p in reader.paths.items()}
"""
)


def run_restore_scenario(directory: Path, tmp_path: Path, code: str, ok: bytes, **env: str):
    """A RESTORE_PRELUDE scenario against the fake driver, its store in ``tmp_path``, with
    1 MiB chunks; it must print ``ok``."""
    code = code.replace("sys.argv[1]", repr(str(tmp_path / "store")))
    result = run_with_fake_driver(directory, code, SNAPCORE_CHUNK_MB="1", **env)
    assert result.returncode == 0, result.stderr.decode()
    assert ok in result.stdout


RESTORE_H2D_SCENARIO = (
    RESTORE_PRELUDE
    + """
g = torch.Generator().manual_seed(0)
saved = {"a": torch.randn(5 << 17, generator=g), "b": torch.randn(1000, generator=g)}
reader, index = reader_of(saved)  # 1 MiB chunks: "a" is three, "b" one
out = {k: torch.zeros_like(v) for k, v in saved.items()}  # "device memory" of GPUs 0 and 1
read = reader.read_chunks
def marked_read(jobs, threads=0):  # the reader's verified reads, placed in the log
    assert threads == 1  # each worker reads its batch itself
    fake.fake_cuda_mark(f"read {len(jobs)}".encode())
    read(jobs, threads)
reader.read_chunks = marked_read
h2d.RING_SLOT_BYTES = 1 << 20  # batches of 1 MiB
h2d.SPARE_SLOTS = 1  # one worker (SNAPCORE_THREADS=1), two slots: the first read into twice
start = len(log())
reader._fill_cuda([(index["a"], out["a"].data_ptr(), 0), (index["b"], out["b"].data_ptr(), 1)])
for k in saved:
    assert torch.equal(out[k], saved[k]), k

names = {}
def norm(line):  # handles named by first appearance: e1, e2, ... and s1, s2, ...
    def sub(m):
        key = m.group(0)
        if key not in names:
            names[key] = key[0] + str(1 + sum(n[0] == key[0] for n in names))
        return names[key]
    return re.sub(r"\\b[es]\\d+\\b", sub, line)
calls = [norm(c) for c in log()[start:] if not c.startswith("PrimaryCtx")]
expected = [
    "DeviceGetPCIBusId 0",  # slot 0 is placed on GPU 0's NUMA node (none here)
    f"MemHostRegister {MiB} ctx0",  # and pinned, by the worker, when first read into
    "read 1",  # chunk 0 of "a" into slot 0
    "StreamCreate s1",
    "EventRecord e1 ext:1000", "StreamWaitEvent s1 e1",  # after GPU 0's current stream
    f"MemcpyHtoDAsync {MiB} s1", "EventRecord e2 s1",
    "StreamWaitEvent ext:1000 e2",  # GPU 0's current stream waits: no host block
    "DeviceGetPCIBusId 0", f"MemHostRegister {MiB} ctx0",  # slot 1
    "read 1",  # chunk 1 into slot 1, while slot 0 is copied
    "EventRecord e3 ext:1000", "StreamWaitEvent s1 e3",
    f"MemcpyHtoDAsync {MiB} s1", "EventRecord e4 s1", "StreamWaitEvent ext:1000 e4",
    "EventSynchronize e2",  # slot 0 is read into again only once its copy has run
    "read 2",  # the rest of "a", and "b"
    "EventRecord e5 ext:1000", "StreamWaitEvent s1 e5",
    f"MemcpyHtoDAsync {MiB // 2} s1", "EventRecord e6 s1", "StreamWaitEvent ext:1000 e6",
    "StreamCreate s2",
    "EventRecord e7 ext:1001", "StreamWaitEvent s2 e7",
    "MemcpyHtoDAsync 4000 s2", "EventRecord e8 s2", "StreamWaitEvent ext:1001 e8",
    "EventSynchronize e4", "EventSynchronize e6", "EventSynchronize e8",  # all copies run
    "StreamSynchronize s1", "StreamDestroy s1", "StreamSynchronize s2", "StreamDestroy s2",
    "MemHostUnregister ctx0", "MemHostUnregister ctx0",  # the ring goes with the restore
]
assert calls == expected, calls
assert state("streams", "events", "ctx_refs", "depth", "registered") == [0, 0, 0, 0, 0]
p = h2d.last_profile  # where the restore spent its time, for bench_gpu
got = tuple(p[k] for k in ("bytes", "workers", "slots", "slot_bytes", "reads", "ring_made"))
assert got == (5 * MiB // 2 + 4000, 1, 2, MiB, 3, 2), p
phases = ("ring_s", "read_s", "queue_s", "wait_s", "drain_s", "close_s")
assert min(p[k] for k in phases) >= 0, p
assert p["read_s"] > 0 and sum(p[k] for k in phases) <= p["total_s"], p

# SNAPCORE_RESTORE_RING_KEEP: the ring is kept, a second restore registers nothing, and
# snapcore.close() frees it.
with snapcore.settings.override(SNAPCORE_RESTORE_RING_KEEP="1"):
    registered = []
    for _ in range(2):
        again = {k: torch.zeros_like(v) for k, v in saved.items()}
        start = len(log())
        items = [(index["a"], again["a"].data_ptr(), 0), (index["b"], again["b"].data_ptr(), 1)]
        reader._fill_cuda(items)
        for k in saved:
            assert torch.equal(again[k], saved[k]), k
        registered.append([c for c in log()[start:] if c.startswith("MemHost")])
        # kept: 2 slots of 1 MiB registered, each holding GPU 0's primary context
        assert state("streams", "events", "ctx_refs", "registered") == [0, 0, 2, 2 * MiB]
    assert registered == [[f"MemHostRegister {MiB} ctx0"] * 2, []], registered
    assert h2d.last_profile["ring_made"] == 0
    # Other slot sizes (2 MiB batches): a new ring, the kept one freed first; never a
    # kept ring of other slots, which could take the ring past SNAPCORE_RESTORE_RING_MB.
    h2d.RING_SLOT_BYTES = 2 * MiB
    start = len(log())
    reader._fill_cuda([(index["a"], again["a"].data_ptr(), 0)])
    assert [c for c in log()[start:] if c.startswith("MemHost")] == (
        ["MemHostUnregister ctx0"] * 2 + [f"MemHostRegister {2 * MiB} ctx0"] * 2
    ), log()[start:]
start = len(log())
snapcore.close()  # frees it
assert [c for c in log()[start:] if c.startswith("MemHost")] == ["MemHostUnregister ctx0"] * 2
assert state("streams", "events", "ctx_refs", "depth", "registered") == [0, 0, 0, 0, 0]
print("restore-h2d-ok")
"""
)


def test_restore_to_the_gpu_reads_into_a_pinned_ring_and_copies_on_the_side_stream(
    fake_driver_dir, tmp_path
):
    """Restore to CUDA tensors: chunks read into a registered ring, copied host-to-device
    on each device's side stream after its current stream, which then waits for them (no
    blocking copy_ per tensor, no torch pinned allocation); a slot is reused only once its
    copies have run, and the restore returns once every copy completed, freeing the ring;
    with SNAPCORE_RESTORE_RING_KEEP the ring is kept for the next restore (not registered
    again) until snapcore.close()."""
    run_restore_scenario(
        fake_driver_dir, tmp_path, RESTORE_H2D_SCENARIO, b"restore-h2d-ok",
        FAKE_CUDA_DEVICES="2", SNAPCORE_THREADS="1",
    )  # fmt: skip


RESTORE_WORKERS_SCENARIO = (
    RESTORE_PRELUDE
    + """
g = torch.Generator().manual_seed(1)
saved = {f"t{i}": torch.randn(MiB // 4, generator=g) for i in range(12)}  # a chunk each
reader, index = reader_of(saved)
h2d.RING_SLOT_BYTES = MiB  # a batch per chunk: 12 batches, 4 workers, 6 slots

events = []  # what happened, in order: ("read", slot), ("queue", id, slots), ("sync", id)
lock = threading.Lock()
rings = []  # the slots the restores made, each an arena
def ring(*args, **kwargs):
    rings.append(h2d_arena(*args, **kwargs))
    return rings[-1]
h2d_arena, h2d.HostArena = h2d.HostArena, ring
def slot_of(address):  # which slot (arena) holds ``address``
    (i,) = [i for i, a in enumerate(rings) if a.address <= address < a.address + a.size]
    return i

class Event:
    def __init__(self, ev, slots):
        self.ev, self.slots = ev, slots
    def synchronize(self):
        self.ev.synchronize()
        with lock:
            events.append(("sync", id(self)))
    def make_stream_wait(self, stream):
        self.ev.make_stream_wait(stream)

made = []  # every event made, so that no id is reused
class Copier:  # the native copier, its events' slots noted
    def __init__(self, device):
        self.copier = _native.CudaCopier(device)
    def h2d(self, copies, stream):
        ev = Event(self.copier.h2d(copies, stream), {slot_of(src) for _, src, _ in copies})
        with lock:
            events.append(("queue", id(ev), ev.slots))
            made.append(ev)
        return ev
    def close(self):
        self.copier.close()
h2d._native = type("Native", (), {"CudaCopier": Copier})

both = threading.Barrier(2, timeout=60)  # the first two reads wait for each other
busy = [0, 0]  # reads running now, the most at once
read = reader.read_chunks
fail_at = [None]
def watched_read(jobs, threads=0):
    with lock:
        events.append(("read", slot_of(jobs[0][2])))
        n = len([e for e in events if e[0] == "read"])
        busy[0] += 1
        busy[1] = max(busy)
    try:
        if n <= 2:
            both.wait()  # only returns if two workers read at once
        if n == fail_at[0]:
            raise CorruptSnapshot("chunk damaged in every tier (the test's)")
        if fail_at[0] is not None and n > fail_at[0]:
            time.sleep(0.2)  # the failing worker has recorded its failure meanwhile
        read(jobs, threads)
    finally:
        with lock:
            busy[0] -= 1
reader.read_chunks = watched_read

def restore():
    out = {k: torch.zeros_like(v) for k, v in saved.items()}
    items = [(index[k], out[k].data_ptr(), i % 2) for i, k in enumerate(saved)]
    reader._fill_cuda(items)
    return out

out = restore()
for k in saved:
    assert torch.equal(out[k], saved[k]), k
# every copy ordered after the restoring thread's streams (not a worker's): ext:100x only
assert {c.split()[-1] for c in log() if c.startswith("EventRecord e")} >= {"ext:1000", "ext:1001"}
assert not [c for c in log() if "ext:200" in c], log()
p = h2d.last_profile
assert (p["workers"], p["slots"], p["reads"]) == (4, 6, 12), p
assert busy[1] >= 2, busy
assert len(rings) == 6 and all(a.native.closed for a in rings)  # made, then freed
flying = {s: set() for s in range(6)}  # each slot's copies not waited for yet
slot_of_event = {}
for e in events:
    if e[0] == "read":
        assert not flying[e[1]], f"slot {e[1]} read into before its copies ran: {events}"
    elif e[0] == "queue":
        for s in e[2]:
            flying[s].add(e[1])
    else:
        for s in flying:
            flying[s].discard(e[1])
assert not any(flying.values()), flying  # every copy waited for before the restore returned
reads = [e[1] for e in events if e[0] == "read"]
assert len(set(reads)) == 6 and len(reads) == 12, reads  # every slot, some twice

# A read failing in one worker: the others stop, every queued copy is waited for, the
# error is raised, and the ring is freed (a driver error may have left it in any state).
events.clear()
rings.clear()  # a new slot may be mapped where a freed one was
both = threading.Barrier(2, timeout=60)
fail_at[0] = 7
try:
    restore()
    raise AssertionError("a damaged chunk restored")
except CorruptSnapshot as e:
    assert "the test's" in str(e), e
queued = {e[1] for e in events if e[0] == "queue"}
synced = {e[1] for e in events if e[0] == "sync"}
assert queued and queued <= synced, (queued, synced)
assert len([e for e in events if e[0] == "read"]) < 12, events  # the workers stopped
assert h2d._ring is None and rings and all(a.native.closed for a in rings)
e = None
made.clear()
gc.collect()  # the failure's traceback held the failing worker's frame and its events
assert state("streams", "events", "ctx_refs", "depth", "registered") == [0, 0, 0, 0, 0]
print("restore-workers-ok")
"""
)


def test_restore_to_the_gpu_reads_with_every_worker_and_reuses_a_slot_only_after_its_copies(
    fake_driver_dir, tmp_path
):
    """With several workers (SNAPCORE_THREADS=4) batches are read at once, each slot read
    into again only after the copies from it were waited for, and all copies waited for
    before the restore returns; a read failing in one worker stops the others, waits for
    every queued copy, frees the ring and raises."""
    run_restore_scenario(
        fake_driver_dir, tmp_path, RESTORE_WORKERS_SCENARIO, b"restore-workers-ok",
        FAKE_CUDA_DEVICES="2", SNAPCORE_THREADS="4",
    )  # fmt: skip


RESTORE_INTERRUPT_SCENARIO = (
    RESTORE_PRELUDE
    + """
g = torch.Generator().manual_seed(2)
saved = {f"t{i}": torch.randn(MiB // 4, generator=g) for i in range(24)}  # a chunk each
reader, index = reader_of(saved)
h2d.RING_SLOT_BYTES = MiB

seen = threading.Event()
def on_sigint(signum, frame):  # Ctrl-C, noted
    seen.set()
    raise KeyboardInterrupt
signal.signal(signal.SIGINT, on_sigint)
main = threading.main_thread().ident

lock = threading.Lock()
reads, busy, registered_late = [0], [0], []
read = reader.read_chunks
def slow_read(jobs, threads=0):
    with lock:
        reads[0] += 1
        n = reads[0]
        busy[0] += 1
    try:
        if n == 3:  # Ctrl-C twice while this worker reads, the second during the cleanup
            signal.pthread_kill(main, signal.SIGINT)
            seen.wait(30)
            time.sleep(0.2)
            signal.pthread_kill(main, signal.SIGINT)
            time.sleep(0.3)
            registered_late.append(state("registered")[0])  # the ring, under this read
        elif n > 3:
            seen.wait(30)
            time.sleep(0.2)  # the restoring thread stops the workers meanwhile
        else:
            time.sleep(0.05)
        read(jobs, threads)
    finally:
        with lock:
            busy[0] -= 1
reader.read_chunks = slow_read

out = {k: torch.zeros_like(v) for k, v in saved.items()}
items = [(index[k], out[k].data_ptr(), 0) for k in saved]
try:
    reader._fill_cuda(items)
    raise AssertionError("the restore was not interrupted")
except KeyboardInterrupt:
    at_return = (busy[0], reads[0])
assert at_return[0] == 0, at_return  # no worker still reading into the ring
assert registered_late and registered_late[0] > 0, registered_late  # not freed under it
assert 3 <= at_return[1] < 24, at_return  # the workers stopped at their next batch
time.sleep(0.5)
assert reads[0] == at_return[1], (reads, at_return)  # and none started since
syncs = {c.split()[1] for c in log() if c.startswith("EventSynchronize")}
records = {c.split()[1] for c in log() if c.startswith("EventRecord") and c.endswith(" s1")}
assert records and records <= syncs, (records, syncs)  # every copy queued was waited for
gc.collect()
assert state("streams", "events", "ctx_refs", "depth", "registered") == [0, 0, 0, 0, 0]

# Ctrl-C in the instant after the workers were started, before the restoring thread
# waits for them (here: in the pool's shutdown(wait=False)): they are stopped and waited
# for all the same before the ring goes.
class Pool(h2d.ThreadPoolExecutor):
    def shutdown(self, wait=True, **kwargs):
        super().shutdown(wait, **kwargs)
        if not wait:
            raise KeyboardInterrupt
h2d.ThreadPoolExecutor = Pool
reader.read_chunks = lambda jobs, threads=0: (busy.__setitem__(0, busy[0] + 1),
                                              time.sleep(0.1), read(jobs, threads),
                                              busy.__setitem__(0, busy[0] - 1))
busy[0] = 0
try:
    reader._fill_cuda(items)
    raise AssertionError("the restore was not interrupted")
except KeyboardInterrupt:
    at_return = busy[0]
assert at_return == 0, at_return
assert not h2d._leaked  # the workers were known to be done: the ring was freed
gc.collect()
assert state("streams", "events", "ctx_refs", "depth", "registered") == [0, 0, 0, 0, 0]
print("restore-interrupt-ok")
"""
)


def test_an_interrupted_restore_to_the_gpu_stops_its_workers_before_freeing_the_ring(
    fake_driver_dir, tmp_path
):
    """Ctrl-C during a restore to the GPU (twice: the second while the restore waits for
    its workers) stops the workers at their next batch; KeyboardInterrupt is raised only
    once no worker reads into the ring and every queued copy was waited for, and the ring
    is freed after that, not under a worker's read. The same for a Ctrl-C in the instant
    between starting the workers and waiting for them."""
    run_restore_scenario(
        fake_driver_dir, tmp_path, RESTORE_INTERRUPT_SCENARIO, b"restore-interrupt-ok",
        FAKE_CUDA_DEVICES="1", SNAPCORE_THREADS="4",
    )  # fmt: skip


BATCH_SCENARIO = (
    FAKE_LOG
    + """
import os
from snapcore import _native
src = _native.Arena(1 << 16, pin=False)  # "device memory"
dst = _native.Arena(1 << 16)
ctypes.memset(src.address, 5, 1 << 16)
copier = _native.CudaCopier(0)
copies = [(dst.address + 4096 * i, src.address + 8192 * i, 100 + i) for i in range(8)]
copies.append((dst.address + 4096 * 7 + 107, src.address + 8192 * 7 + 107, 50))  # continues
start = len(log())
copier.d2h(copies, 0).synchronize()
batch = [c for c in log()[start:] if c.startswith("Memcpy")]
assert batch == [f"MemcpyBatchAsync 8 {sum(100 + i for i in range(8)) + 50} s1"], log()[start:]
assert all(ctypes.string_at(dst.address + 4096 * i, 100 + i) == bytes([5]) * (100 + i)
           for i in range(8))

os.environ["FAKE_CUDA_FAIL"] = "cuMemcpyBatchAsync"  # a driver refusing the batch
other = _native.CudaCopier(0)
ctypes.memset(dst.address, 0, 1 << 16)
start = len(log())
other.h2d(copies[:3], 0).synchronize()
calls = [c for c in log()[start:] if c.startswith("Memcpy")]
assert [c.split()[:2] for c in calls] == [["MemcpyHtoDAsync", str(n)] for n in (100, 101, 102)]
assert ctypes.string_at(dst.address + 4096 * 2, 102) == bytes([5]) * 102
del os.environ["FAKE_CUDA_FAIL"]
copier.close()
other.close()
src.close()
dst.close()
assert state("streams", "ctx_refs", "depth", "registered") == [0, 0, 0, 0]
print("batch-ok")
"""
)


ADJACENT_ALLOCATIONS_SCENARIO = (
    FAKE_LOG
    + """
import os
from snapcore import _native
src = _native.Arena(1 << 16, pin=False)  # "device memory": two allocations, end to end
dst = _native.Arena(1 << 16)
fake.fake_cuda_alloc.argtypes = [ctypes.c_ulonglong, ctypes.c_size_t]
fake.fake_cuda_alloc(src.address, 1 << 15)
fake.fake_cuda_alloc(src.address + (1 << 15), 1 << 15)
for i in range(4):
    ctypes.memset(src.address + (1 << 14) * i, i + 1, 1 << 14)
copier = _native.CudaCopier(0)
# four tensors of 16 KiB, two in each allocation, to adjacent places in the arena: one
# run per allocation, none across the boundary (the real driver refuses such a copy)
copies = [(dst.address + (1 << 14) * i, src.address + (1 << 14) * i, 1 << 14) for i in range(4)]
start, queries = len(log()), state("range_queries")[0]
copier.d2h(copies, 0).synchronize()
calls = [c for c in log()[start:] if c.startswith("Memcpy")]
assert calls in (
    ["MemcpyBatchAsync 2 65536 s1"],  # a driver with cuMemcpyBatchAsync
    ["MemcpyDtoHAsync 32768 s1", "MemcpyDtoHAsync 32768 s1"],
), calls
assert state("range_queries")[0] - queries == 2  # once per run, not once per copy
for i in range(4):
    assert ctypes.string_at(dst.address + (1 << 14) * i, 1 << 14) == bytes([i + 1]) * (1 << 14)
# and back (restore): the device side is the destination, merged within each allocation
ctypes.memset(src.address, 0, 1 << 16)
start = len(log())
copier.h2d([(s, d, n) for d, s, n in copies], 0).synchronize()
calls = [c for c in log()[start:] if c.startswith("Memcpy")]
assert calls in (
    ["MemcpyBatchAsync 2 65536 s1"],
    ["MemcpyHtoDAsync 32768 s1", "MemcpyHtoDAsync 32768 s1"],
), calls
assert ctypes.string_at(src.address + (1 << 15) - 1, 2) == bytes([2, 3])
# a driver that cannot say which allocation holds an address: nothing is merged
os.environ["FAKE_CUDA_FAIL"] = "cuMemGetAddressRange"
start = len(log())
copier.d2h(copies, 0).synchronize()
calls = [c for c in log()[start:] if c.startswith("Memcpy")]
assert calls in (["MemcpyBatchAsync 4 65536 s1"], ["MemcpyDtoHAsync 16384 s1"] * 4), calls
del os.environ["FAKE_CUDA_FAIL"]
copier.close()
src.close()
dst.close()
print("adjacent-ok")
"""
)


@pytest.mark.parametrize("batch", [False, True], ids=["per copy", "batch"])
def test_copies_are_not_merged_across_two_adjacent_allocations(
    batch, fake_driver_dir, fake_batch_driver_dir
):
    """Tensors of two device allocations that lie end to end in the address space (two
    16 MiB cudaMallocs can) go to the arena end to end too: the copies are merged within
    each allocation only. Merged across, the driver refused the copy with
    CUDA_ERROR_INVALID_VALUE (seen on an H200, tests/gpu/test_gpu.py's freed-tensor test)."""
    directory = fake_batch_driver_dir if batch else fake_driver_dir
    result = run_with_fake_driver(directory, ADJACENT_ALLOCATIONS_SCENARIO)
    assert result.returncode == 0, result.stderr.decode()
    assert b"adjacent-ok" in result.stdout


def test_many_small_copies_go_to_the_driver_in_one_batch(fake_batch_driver_dir):
    """One driver call for a whole window's copies where the driver has cuMemcpyBatchAsync
    (copies that continue one another merged first); one call per copy where it refuses."""
    result = run_with_fake_driver(fake_batch_driver_dir, BATCH_SCENARIO)
    assert result.returncode == 0, result.stderr.decode()
    assert b"batch-ok" in result.stdout


NUMA_SCENARIO = (
    FAKE_LOG
    + """
import os, sys, warnings
warnings.simplefilter("ignore", DeprecationWarning)
from snapcore import _native
from snapcore.staging.arena import HostArena, numa_node
root = sys.argv[1]  # a sysfs tree of PCI devices: 0000:3b:00.0 on node 1
assert _native.cuda_device_numa_node(0, root) == 1  # "00000000:3B:00.0" from the driver
assert _native.cuda_device_numa_node(1, root) == -1  # "0000:02:00.0": not in the tree
try:
    _native.cuda_device_numa_node(2, root)
    raise AssertionError("a device that does not exist")
except ValueError:
    pass
assert numa_node(None) == -1  # no device: no placement, no driver call
start = len(log())
arena = HostArena(1 << 20, device=1)  # this machine's sysfs: the node is found before pinning
assert log()[start:start + 2] == ["DeviceGetPCIBusId 1", "PrimaryCtxRetain 1"], log()[start:]
assert arena.native.numa_node == numa_node(1)
arena.close()
print("numa-ok")
"""
)


def test_the_arena_of_a_gpu_is_placed_on_its_numa_node(fake_driver_dir, tmp_path):
    """The GPU's NUMA node comes from the driver's PCI bus id and sysfs's numa_node."""
    device = tmp_path / "pci" / "0000:3b:00.0"
    device.mkdir(parents=True)
    (device / "numa_node").write_text("1\n")
    code = NUMA_SCENARIO.replace("sys.argv[1]", repr(str(tmp_path / "pci")))
    result = run_with_fake_driver(
        fake_driver_dir, code, FAKE_CUDA_DEVICES="2", FAKE_CUDA_PCI_BUS_ID="00000000:3B:00.0"
    )
    assert result.returncode == 0, result.stderr.decode()
    assert b"numa-ok" in result.stdout


PARTIAL_FAILURE_SCENARIO = (
    FAKE_LOG
    + FAKE_CUDA_BLOBS
    + """
import os, queue, types
from snapcore.errors import CudaError
from snapcore.io_types import Window
from snapcore.staging.arena import HostArena
from snapcore.staging.copy import Stager
from snapcore.staging.handle import SaveHandle, SaveStats

os.environ["FAKE_CUDA_FAIL"] = "cuMemcpyDtoHAsync"
os.environ["FAKE_CUDA_FAIL_DEVICE"] = "1"  # GPU 1's copies fail, GPU 0's are queued
buffer = torch.full((256,), 1.0)  # on GPU 0: copied before async_save returns
param = torch.nn.Parameter(torch.full((256,), 2.0))  # on GPU 1, written by the optimizer
opt = torch.optim.SGD([param], lr=1.0)
arena = HostArena(2048, device=0)
stager = Stager()

def queued_then_failed(calls):
    \"\"\"GPU 0's copy event, and whether it is waited for before the error goes up.\"\"\"
    record = next(i for i, c in enumerate(calls) if c.startswith("MemcpyDtoHAsync"))
    event = calls[record + 1].split()[1]  # EventRecord eN s1
    raised = calls.index("raised")
    return f"EventSynchronize {event}" in calls[record + 2 : raised]

# default mode: both devices in one call
blobs = [Blob(0, buffer, "cuda:0"), Blob(1024, param.data, "cuda:1")]
start = len(log())
try:
    stager.copy(blobs, Window(arena, 0, 2048, 0, 0), defer=False, wait_gpu="stream")
    raise AssertionError("GPU 1's failure was lost")
except CudaError:
    fake.fake_cuda_mark(b"raised")
assert queued_then_failed(log()[start:]), log()[start:]

# overlap mode: GPU 0's copies (not the optimizer's) queued with a stream wait, then GPU
# 1's (the optimizer's) fail
layout = types.SimpleNamespace(blobs=blobs, total=2048)
handle = SaveHandle(1, SaveStats(1, 2048, 2048), ("local",))
start = len(log())
try:
    stager.stage_whole(arena, layout, queue.Queue(), [opt], handle)
    raise AssertionError("GPU 1's failure was lost")
except CudaError:
    fake.fake_cuda_mark(b"raised")
calls = log()[start:]
assert "StreamWaitEvent ext:1000" in " ".join(calls), calls  # GPU 0's: no host wait then
assert queued_then_failed(calls), calls
stager.close()
arena.close()
print("partial-failure-ok")
"""
)


def test_a_partial_multi_device_failure_waits_for_every_queued_copy(fake_driver_dir):
    """When one GPU's copies fail, the copies already queued on the others still write into
    the arena and read their sources: they are waited for before the error goes up (and
    the arena can be reused, the sources freed), in default and in overlap mode."""
    result = run_with_fake_driver(fake_driver_dir, PARTIAL_FAILURE_SCENARIO, FAKE_CUDA_DEVICES="2")
    assert result.returncode == 0, result.stderr.decode()
    assert b"partial-failure-ok" in result.stdout


# --- GPU --------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
def test_cuda_status_ok():
    assert _native.cuda_status().startswith("ok: ")


@pytest.mark.gpu
@needs_gpu
def test_arena_pinned():
    with _native.Arena(3 * MiB + 1, pin=True) as arena:
        assert arena.pinned is True
        assert arena.bytes_pinned == arena.bytes_held
    assert arena.pinned is False


@pytest.mark.gpu
@needs_gpu
def test_cuda_copier_d2h_h2d_round_trip():
    torch = pytest.importorskip("torch")
    n = 1 << 22
    x = torch.arange(n, device="cuda:0", dtype=torch.float32)
    nbytes = x.numel() * x.element_size()
    stream = torch.cuda.current_stream()
    with _native.Arena(2 * nbytes, pin=True) as arena:
        copier = _native.CudaCopier(0)
        assert copier.device == 0 and copier.stream != 0
        # Work queued on the caller's stream before d2h must be seen by the copy.
        y = x.clone()
        for _ in range(20):
            y.mul_(1.0001)
        y.copy_(x * 3)
        half = nbytes // 2
        copies = [
            (arena.address, y.data_ptr(), half),
            (arena.address + half, y.data_ptr() + half, 0),  # empty copies are skipped
            (arena.address + half, y.data_ptr() + half, nbytes - half),
        ]
        event = copier.d2h(copies, stream.cuda_stream)
        event.synchronize()
        assert event.query() is True
        host = torch.frombuffer(view(arena.address, nbytes), dtype=torch.float32)
        assert torch.equal(host, (x * 3).cpu())

        z = torch.empty_like(x)
        event = copier.h2d([(z.data_ptr(), arena.address, nbytes)], stream.cuda_stream)
        event.make_stream_wait(stream.cuda_stream)  # no CPU wait: the stream orders it
        assert torch.equal(z, x * 3)
        copier.close()
        copier.close()


@pytest.mark.gpu
@needs_gpu
def test_cuda_event_orders_a_side_stream():
    torch = pytest.importorskip("torch")
    x = torch.ones(1 << 20, device="cuda:0")
    nbytes = x.numel() * 4
    with _native.Arena(nbytes, pin=True) as arena:
        copier = _native.CudaCopier(0)
        event = copier.d2h([(arena.address, x.data_ptr(), nbytes)], 0)
        other = torch.cuda.Stream()
        event.make_stream_wait(other.cuda_stream)
        with torch.cuda.stream(other):
            x.fill_(2.0)  # ordered after the copy: the host copy must hold ones
        other.synchronize()
        host = torch.frombuffer(view(arena.address, nbytes), dtype=torch.float32)
        assert torch.equal(host, torch.ones(1 << 20))
        copier.close()
