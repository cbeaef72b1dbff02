// The Python face of the native core: the only file that knows Python.
//
// Arguments are converted while the GIL is held; every call that copies, faults memory,
// waits on the GPU or does I/O then releases it. C++ exceptions become snapcore's own
// Python exceptions (snapcore/errors.py).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "snapcore/arena.hpp"
#include "snapcore/cuda_context.hpp"
#include "snapcore/cuda_copy.hpp"
#include "snapcore/error.hpp"
#include "snapcore/file_io.hpp"
#include "snapcore/host_copy.hpp"
#include "snapcore/shim/cuda.hpp"
#include "snapcore/shuffle.hpp"
#include "snapcore/system.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using CopyTuple = std::tuple<std::uintptr_t, std::uintptr_t, std::size_t>;
using release_gil = nb::call_guard<nb::gil_scoped_release>;

std::vector<snapcore::CopySpec> to_specs(const std::vector<CopyTuple>& copies) {
  std::vector<snapcore::CopySpec> specs;
  specs.reserve(copies.size());
  for (const auto& [dst, src, n] : copies) {
    specs.push_back(snapcore::CopySpec{dst, src, n});
  }
  return specs;
}

void* as_pointer(std::uintptr_t address) { return reinterpret_cast<void*>(address); }

// Raises snapcore.errors.<name>(*args); the module is imported here, on first failure, so
// that importing snapcore._native never depends on the rest of the package.
template <typename... Args>
void raise(const char* name, std::optional<int> code, Args&&... args) {
  try {
    nb::object cls = nb::module_::import_("snapcore.errors").attr(name);
    nb::object exc = cls(std::forward<Args>(args)...);
    if (code) {
      nb::setattr(exc, "code", nb::int_(*code));
    }
    PyErr_SetObject(cls.ptr(), exc.ptr());
  } catch (nb::python_error& e) {
    e.restore();  // the import failed: report that instead
  }
}

void translate(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const snapcore::IoError& e) {
    raise("StorageError", std::nullopt, e.error_code(), e.what(), e.path());
  } catch (const snapcore::CudaError& e) {
    raise("CudaError", e.code(), e.what());
  } catch (const snapcore::Error& e) {
    raise("NativeError", std::nullopt, e.what());
  }
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() =
      "snapcore's native core: host arena, parallel copies, CUDA side-stream copies and\n"
      "file I/O. Addresses, streams and events are plain integers; nothing here knows\n"
      "PyTorch.";

  nb::register_exception_translator(translate);

  m.def("cuda_available", &snapcore::shim::CudaDriver::is_available,
        "Whether libcuda.so.1 loaded, cuInit succeeded and a device exists. False in a\n"
        "child forked after the driver was loaded. Never raises.");
  m.def("cuda_status", &snapcore::shim::CudaDriver::status,
        "'ok: N device(s)', or why CUDA is unavailable.");
  m.def(
      "cuda_device_numa_node",
      [](int device, const std::string& sysfs_root) {
        return snapcore::cuda_device_numa_node(device, sysfs_root);
      },
      "device"_a, "sysfs_root"_a = "/sys/bus/pci/devices",
      "The NUMA node of CUDA device `device`: its PCI bus id from the driver, then\n"
      "<sysfs_root>/<bus id>/numa_node; -1 on a machine of one node. CudaError when CUDA\n"
      "is unavailable.");
  m.def("page_size", &snapcore::page_size,
        "The page size: arena granularity and the alignment O_DIRECT writes use.");
  m.def("hardware_threads", &snapcore::hardware_threads,
        "CPUs this process may run on (its affinity mask).");

  nb::class_<snapcore::Arena>(
      m, "Arena",
      "Host memory of an exact size (rounded up to the page size only), optionally\n"
      "backed by a shared-memory file, prefaulted and pinned once.")
      .def(
          "__init__",
          [](snapcore::Arena* self, std::size_t size, std::optional<std::string> shm_path,
             bool huge_pages, bool pin, int device, int numa_node, bool prefault,
             std::size_t threads) {
            snapcore::ArenaOptions options;
            options.shm_path = std::move(shm_path);
            options.huge_pages = huge_pages;
            options.pin = pin;
            options.device = device;
            options.numa_node = numa_node;
            options.prefault = prefault;
            options.threads = threads;
            new (self) snapcore::Arena(size, std::move(options));
          },
          "size"_a, nb::kw_only(), "shm_path"_a = nb::none(), "huge_pages"_a = true,
          "pin"_a = true, "device"_a = 0, "numa_node"_a = -1, "prefault"_a = true,
          "threads"_a = 0, release_gil(),
          "Maps `size` bytes. With `shm_path`, the file is created (0600) or reused,\n"
          "sized, mapped shared and never unlinked; without, the memory is private and\n"
          "not inherited by fork() (MADV_DONTFORK). `pin` registers the memory with CUDA\n"
          "(portable, in `device`'s primary context: the device the state lives on)\n"
          "when CUDA is available and does nothing otherwise; if the driver refuses, the\n"
          "arena stays unpinned and `pin_error` says why. `numa_node` (>= 0) is made\n"
          "the preferred node of its pages before they are faulted (mbind through\n"
          "libnuma.so.1; `numa_error` says why not, and the arena is made all the same).\n"
          "`threads` (0 = all) prefault it.")
      .def_prop_ro("address", &snapcore::Arena::address,
                   "Start address; ValueError once closed.")
      .def_prop_ro("size", &snapcore::Arena::size, "Bytes usable: the size asked for.")
      .def_prop_ro("bytes_held", &snapcore::Arena::bytes_held,
                   "Bytes mapped: size rounded up to the page size.")
      .def_prop_ro("bytes_pinned", &snapcore::Arena::bytes_pinned,
                   "Bytes registered with CUDA (0 when not pinned).")
      .def_prop_ro("pinned", &snapcore::Arena::pinned)
      .def_prop_ro("pin_error", &snapcore::Arena::pin_error,
                   "Why the driver refused to pin it (the arena is then unpinned), or None.")
      .def_prop_ro("numa_node", &snapcore::Arena::numa_node,
                   "The NUMA node its pages were placed on (preferred), or -1.")
      .def_prop_ro("numa_error", &snapcore::Arena::numa_error,
                   "Why the NUMA node asked for was not used, or None.")
      .def_prop_ro("huge_pages", &snapcore::Arena::huge_pages,
                   "Whether madvise(MADV_HUGEPAGE) succeeded.")
      .def_prop_ro("shm_path", &snapcore::Arena::shm_path)
      .def_prop_ro("closed", &snapcore::Arena::closed)
      .def("close", &snapcore::Arena::close, release_gil(),
           "Unpins, unmaps and closes the file (which stays). Idempotent.\n"
           "Every pointer into the arena is invalid afterwards.")
      .def("__enter__", [](snapcore::Arena& self) -> snapcore::Arena& { return self; },
           nb::rv_policy::reference)
      .def(
          "__exit__",
          [](snapcore::Arena& self, nb::handle, nb::handle, nb::handle) { self.close(); },
          "exc_type"_a.none(), "exc_value"_a.none(), "traceback"_a.none());

  m.def(
      "copy_host",
      [](const std::vector<CopyTuple>& copies, std::size_t threads, bool nontemporal) {
        const auto specs = to_specs(copies);
        nb::gil_scoped_release release;
        snapcore::copy_host(specs, threads,
                            nontemporal ? snapcore::Stores::kNonTemporal
                                        : snapcore::Stores::kNormal);
      },
      "copies"_a, "threads"_a = 0, nb::kw_only(), "nontemporal"_a = false,
      "Copies every (dst_address, src_address, nbytes) in parallel on `threads`\n"
      "threads (0 = all) of a persistent pool, without the GIL. `nontemporal` writes\n"
      "with streaming stores that bypass the caches (x86-64; memcpy elsewhere): for\n"
      "copies much larger than the caches that are not read back at once.");

  m.def(
      "byte_shuffle",
      [](std::uintptr_t dst, std::uintptr_t src, std::size_t nbytes, std::size_t element_size,
         std::size_t threads) {
        snapcore::byte_shuffle(as_pointer(dst), as_pointer(src), nbytes, element_size, threads);
      },
      "dst"_a, "src"_a, "nbytes"_a, "element_size"_a, "threads"_a = 0, release_gil(),
      "Groups byte k of every element together: with n = nbytes // element_size,\n"
      "dst[k*n + i] = src[i*element_size + k]; the nbytes % element_size trailing bytes\n"
      "are copied unchanged. element_size is 1, 2, 4, 8 or 16; the regions must not\n"
      "overlap. Runs on `threads` threads (0 = all) without the GIL.");
  m.def(
      "byte_unshuffle",
      [](std::uintptr_t dst, std::uintptr_t src, std::size_t nbytes, std::size_t element_size,
         std::size_t threads) {
        snapcore::byte_unshuffle(as_pointer(dst), as_pointer(src), nbytes, element_size,
                                 threads);
      },
      "dst"_a, "src"_a, "nbytes"_a, "element_size"_a, "threads"_a = 0, release_gil(),
      "The inverse of byte_shuffle: dst[i*element_size + k] = src[k*n + i].");

  nb::class_<snapcore::CudaEvent>(m, "CudaEvent",
                                  "Completes when the copies it was returned for are done.")
      .def("synchronize", &snapcore::CudaEvent::synchronize, release_gil(),
           "Blocks until the event completes, without the GIL.")
      .def("query", &snapcore::CudaEvent::query, "True when the event has completed.")
      .def(
          "make_stream_wait",
          [](const snapcore::CudaEvent& self, std::uintptr_t stream) {
            self.make_stream_wait(reinterpret_cast<snapcore::cu::CUstream>(stream));
          },
          "stream"_a,
          "Makes work queued later on `stream` (an integer CUstream) wait for this\n"
          "event, on the GPU: the calling thread does not block.");

  nb::class_<snapcore::CudaCopier>(
      m, "CudaCopier",
      "Device<->host copies on a non-blocking side stream of its own, ordered after\n"
      "the caller's stream.")
      .def(nb::init<int>(), "device"_a,
           "Retains `device`'s primary context and creates the side stream in it.")
      .def_prop_ro("device", &snapcore::CudaCopier::device)
      .def_prop_ro("stream", &snapcore::CudaCopier::stream,
                   "The side stream, as an integer CUstream.")
      .def(
          "d2h",
          [](snapcore::CudaCopier& self, const std::vector<CopyTuple>& copies,
             std::uintptr_t after_stream) { return self.d2h(to_specs(copies), after_stream); },
          "copies"_a, "after_stream"_a, release_gil(),
          "Queues (dst_host, src_device, nbytes) copies after the work already on\n"
          "`after_stream` (0 = legacy default stream); returns their completion event.\n"
          "Buffers must stay alive, and the sources unchanged, until it completes.")
      .def(
          "h2d",
          [](snapcore::CudaCopier& self, const std::vector<CopyTuple>& copies,
             std::uintptr_t after_stream) { return self.h2d(to_specs(copies), after_stream); },
          "copies"_a, "after_stream"_a, release_gil(),
          "Queues (dst_device, src_host, nbytes) copies; as d2h.")
      .def("close", &snapcore::CudaCopier::close, release_gil(),
           "Waits for the side stream, then destroys it. Idempotent.");

  nb::class_<snapcore::FileWriter>(
      m, "FileWriter",
      "Writes one file at explicit offsets, through O_DIRECT where the file system\n"
      "takes it. write_at and sync may run on several threads at once (disjoint ranges).")
      .def(nb::init<std::string, bool, bool>(), "path"_a, nb::kw_only(), "direct"_a = true,
           "truncate"_a = true, release_gil(),
           "Creates or truncates `path` (0644). `direct` asks for O_DIRECT; where the\n"
           "file system refuses it the writer is buffered and `direct` is False.\n"
           "`truncate=False` keeps an existing file's bytes and blocks (a recycled file:\n"
           "writes over its blocks need no allocation).")
      .def_prop_ro("direct", &snapcore::FileWriter::direct, "Whether O_DIRECT is in use.")
      .def_prop_ro("path", &snapcore::FileWriter::path)
      .def_prop_ro("bytes_written", &snapcore::FileWriter::bytes_written)
      .def_prop_ro("closed", &snapcore::FileWriter::closed)
      .def(
          "write_at",
          [](snapcore::FileWriter& self, std::uint64_t offset, std::uintptr_t address,
             std::size_t nbytes) { self.write_at(offset, as_pointer(address), nbytes); },
          "offset"_a, "address"_a, "nbytes"_a, release_gil(),
          "Writes `nbytes` from `address` at `offset` of the file, without the GIL.")
      .def("sync", &snapcore::FileWriter::sync, release_gil(), "fdatasync.")
      .def("close", &snapcore::FileWriter::close, release_gil(), "Idempotent.")
      .def("__enter__",
           [](snapcore::FileWriter& self) -> snapcore::FileWriter& { return self; },
           nb::rv_policy::reference)
      .def(
          "__exit__",
          [](snapcore::FileWriter& self, nb::handle, nb::handle, nb::handle) { self.close(); },
          "exc_type"_a.none(), "exc_value"_a.none(), "traceback"_a.none(), release_gil());

  m.def(
      "read_into",
      [](const std::string& path, std::uint64_t offset, std::size_t nbytes,
         std::uintptr_t address, std::size_t threads) {
        snapcore::read_into(path, offset, nbytes, as_pointer(address), threads);
      },
      "path"_a, "offset"_a, "nbytes"_a, "address"_a, nb::kw_only(), "threads"_a = 1,
      release_gil(),
      "Reads exactly `nbytes` at `offset` of `path` into `address`. A file too short\n"
      "raises NativeError('truncated: ...'); open and read failures raise StorageError.");
  m.def("drop_page_cache", &snapcore::drop_page_cache, "path"_a, release_gil(),
        "Writes back and evicts `path` from the page cache; True when the kernel accepted.");
}
