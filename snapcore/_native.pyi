"""
snapcore's native core: host arena, parallel copies, CUDA side-stream copies and
file I/O. Addresses, streams and events are plain integers; nothing here knows
PyTorch.
"""

from collections.abc import Sequence

def cuda_available() -> bool:
    """
    Whether libcuda.so.1 loaded, cuInit succeeded and a device exists. False in a
    child forked after the driver was loaded. Never raises.
    """

def cuda_status() -> str:
    """'ok: N device(s)', or why CUDA is unavailable."""

def cuda_device_numa_node(device: int, sysfs_root: str = "/sys/bus/pci/devices") -> int:
    """
    The NUMA node of CUDA device `device`: its PCI bus id from the driver, then
    <sysfs_root>/<bus id>/numa_node; -1 on a machine of one node. CudaError when CUDA
    is unavailable.
    """

def page_size() -> int:
    """
    The page size: arena granularity and the alignment O_DIRECT writes use.
    """

def hardware_threads() -> int:
    """CPUs this process may run on (its affinity mask)."""

class Arena:
    """
    Host memory of an exact size (rounded up to the page size only), optionally
    backed by a shared-memory file, prefaulted and pinned once.
    """

    def __init__(
        self,
        size: int,
        *,
        shm_path: str | None = None,
        huge_pages: bool = True,
        pin: bool = True,
        device: int = 0,
        numa_node: int = -1,
        prefault: bool = True,
        threads: int = 0,
    ) -> None:
        """
        Maps `size` bytes. With `shm_path`, the file is created (0600) or reused,
        sized, mapped shared and never unlinked; without, the memory is private and
        not inherited by fork() (MADV_DONTFORK). `pin` registers the memory with CUDA
        (portable, in `device`'s primary context: the device the state lives on)
        when CUDA is available and does nothing otherwise; if the driver refuses, the
        arena stays unpinned and `pin_error` says why. `numa_node` (>= 0) is made
        the preferred node of its pages before they are faulted (mbind through
        libnuma.so.1; `numa_error` says why not, and the arena is made all the same).
        `threads` (0 = all) prefault it.
        """

    @property
    def address(self) -> int:
        """Start address; ValueError once closed."""

    @property
    def size(self) -> int:
        """Bytes usable: the size asked for."""

    @property
    def bytes_held(self) -> int:
        """Bytes mapped: size rounded up to the page size."""

    @property
    def bytes_pinned(self) -> int:
        """Bytes registered with CUDA (0 when not pinned)."""

    @property
    def pinned(self) -> bool: ...
    @property
    def pin_error(self) -> str | None:
        """
        Why the driver refused to pin it (the arena is then unpinned), or None.
        """

    @property
    def numa_node(self) -> int:
        """The NUMA node its pages were placed on (preferred), or -1."""

    @property
    def numa_error(self) -> str | None:
        """Why the NUMA node asked for was not used, or None."""

    @property
    def huge_pages(self) -> bool:
        """Whether madvise(MADV_HUGEPAGE) succeeded."""

    @property
    def shm_path(self) -> str | None: ...
    @property
    def closed(self) -> bool: ...
    def close(self) -> None:
        """
        Unpins, unmaps and closes the file (which stays). Idempotent.
        Every pointer into the arena is invalid afterwards.
        """

    def __enter__(self) -> Arena: ...
    def __exit__(
        self, exc_type: object | None, exc_value: object | None, traceback: object | None
    ) -> None: ...

def copy_host(
    copies: Sequence[tuple[int, int, int]], threads: int = 0, *, nontemporal: bool = False
) -> None:
    """
    Copies every (dst_address, src_address, nbytes) in parallel on `threads`
    threads (0 = all) of a persistent pool, without the GIL. `nontemporal` writes
    with streaming stores that bypass the caches (x86-64; memcpy elsewhere): for
    copies much larger than the caches that are not read back at once.
    """

def byte_shuffle(dst: int, src: int, nbytes: int, element_size: int, threads: int = 0) -> None:
    """
    Groups byte k of every element together: with n = nbytes // element_size,
    dst[k*n + i] = src[i*element_size + k]; the nbytes % element_size trailing bytes
    are copied unchanged. element_size is 1, 2, 4, 8 or 16; the regions must not
    overlap. Runs on `threads` threads (0 = all) without the GIL.
    """

def byte_unshuffle(dst: int, src: int, nbytes: int, element_size: int, threads: int = 0) -> None:
    """The inverse of byte_shuffle: dst[i*element_size + k] = src[k*n + i]."""

class CudaEvent:
    """Completes when the copies it was returned for are done."""

    def synchronize(self) -> None:
        """Blocks until the event completes, without the GIL."""

    def query(self) -> bool:
        """True when the event has completed."""

    def make_stream_wait(self, stream: int) -> None:
        """
        Makes work queued later on `stream` (an integer CUstream) wait for this
        event, on the GPU: the calling thread does not block.
        """

class CudaCopier:
    """
    Device<->host copies on a non-blocking side stream of its own, ordered after
    the caller's stream.
    """

    def __init__(self, device: int) -> None:
        """Retains `device`'s primary context and creates the side stream in it."""

    @property
    def device(self) -> int: ...
    @property
    def stream(self) -> int:
        """The side stream, as an integer CUstream."""

    def d2h(self, copies: Sequence[tuple[int, int, int]], after_stream: int) -> CudaEvent:
        """
        Queues (dst_host, src_device, nbytes) copies after the work already on
        `after_stream` (0 = legacy default stream); returns their completion event.
        Buffers must stay alive, and the sources unchanged, until it completes.
        """

    def h2d(self, copies: Sequence[tuple[int, int, int]], after_stream: int) -> CudaEvent:
        """Queues (dst_device, src_host, nbytes) copies; as d2h."""

    def close(self) -> None:
        """Waits for the side stream, then destroys it. Idempotent."""

class FileWriter:
    """
    Writes one file at explicit offsets, through O_DIRECT where the file system
    takes it. write_at and sync may run on several threads at once (disjoint ranges).
    """

    def __init__(self, path: str, *, direct: bool = True, truncate: bool = True) -> None:
        """
        Creates or truncates `path` (0644). `direct` asks for O_DIRECT; where the
        file system refuses it the writer is buffered and `direct` is False.
        `truncate=False` keeps an existing file's bytes and blocks (a recycled file:
        writes over its blocks need no allocation).
        """

    @property
    def direct(self) -> bool:
        """Whether O_DIRECT is in use."""

    @property
    def path(self) -> str: ...
    @property
    def bytes_written(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    def write_at(self, offset: int, address: int, nbytes: int) -> None:
        """
        Writes `nbytes` from `address` at `offset` of the file, without the GIL.
        """

    def sync(self) -> None:
        """fdatasync."""

    def close(self) -> None:
        """Idempotent."""

    def __enter__(self) -> FileWriter: ...
    def __exit__(
        self, exc_type: object | None, exc_value: object | None, traceback: object | None
    ) -> None: ...

def read_into(path: str, offset: int, nbytes: int, address: int, *, threads: int = 1) -> None:
    """
    Reads exactly `nbytes` at `offset` of `path` into `address`. A file too short
    raises NativeError('truncated: ...'); open and read failures raise StorageError.
    """

def drop_page_cache(path: str) -> bool:
    """
    Writes back and evicts `path` from the page cache; True when the kernel accepted.
    """
