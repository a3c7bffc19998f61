// SPDX-License-Identifier: Apache-2.0
// ferry._ferry - the Python binding of ferry.hpp, shaped like MORI-IO's mori.io.
//
// Rules kept here:
// - Every call that can block (backends, registration, transfers, waits) runs
//   with the GIL released; waits are cut into short slices so Ctrl-C works.
// - Errors found before anything moves raise: InvalidArgumentError (a ValueError)
//   for bad arguments, NotFoundError (a LookupError) for missing things,
//   TransferError (a RuntimeError) for everything else (a backend that does not
//   start, a closed engine). Transfer outcomes stay in TransferStatus, as in MORI-IO.
// - Memory registered from a Python object (buffer, tensor) keeps that object
//   alive, and a buffer's export held, until deregister_memory() or close().
#include <pybind11/operators.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <vector>

#include "ferry/ferry.hpp"

namespace py = pybind11;
using namespace ferry;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

namespace {

// ---- errors -------------------------------------------------------------------------

PyObject* g_transfer_error = nullptr;   // ferry.TransferError(RuntimeError)
PyObject* g_invalid_error = nullptr;    // ferry.InvalidArgumentError(ValueError)
PyObject* g_not_found_error = nullptr;  // ferry.NotFoundError(LookupError)

// Thrown inside the binding; translated to one of the three classes above.
struct BindingError {
  StatusCode code;
  std::string message;
  bool transfer_error = false;  // TransferError whatever the code
};

[[noreturn]] void raise(StatusCode code, std::string message) {
  throw BindingError{code, std::move(message)};
}
[[noreturn]] void raise_transfer(StatusCode code, std::string message) {
  throw BindingError{code, std::move(message), true};
}
[[noreturn]] void raise_value(std::string message) {
  raise(StatusCode::ERR_INVALID_ARGS, std::move(message));
}

void check(const Result& r) {
  if (!r.ok()) raise(r.code, r.message);
}

void set_python_error(StatusCode code, const std::string& message, bool transfer_error = false) {
  PyObject* type = transfer_error                         ? g_transfer_error
                   : code == StatusCode::ERR_INVALID_ARGS ? g_invalid_error
                   : code == StatusCode::ERR_NOT_FOUND    ? g_not_found_error
                                                          : g_transfer_error;
  PyObject* exc = PyObject_CallFunction(type, "s", message.c_str());
  if (!exc) return;  // the constructor's own error stays set
  py::object code_obj = py::cast(code);
  if (PyObject_SetAttrString(exc, "code", code_obj.ptr()) != 0) PyErr_Clear();
  PyErr_SetObject(type, exc);
  Py_DECREF(exc);
}

PyObject* new_exception(py::module_& m, const char* name, PyObject* base, const char* doc) {
  std::string qual = std::string("ferry.") + name;
  py::dict attrs;
  attrs["code"] = py::none();
  PyObject* t = PyErr_NewExceptionWithDoc(qual.c_str(), doc, base, attrs.ptr());
  if (!t) throw py::error_already_set();
  m.add_object(name, py::handle(t));
  return t;
}

// ---- argument conversion ------------------------------------------------------------

// A non-negative integer (int, numpy integer, anything with __index__).
uint64_t to_u64(py::handle v, const char* what) {
  PyObject* idx = PyNumber_Index(v.ptr());
  if (!idx) {
    PyErr_Clear();
    throw py::type_error(std::string(what) + " must be an integer, not " +
                         std::string(py::str(py::type::handle_of(v).attr("__name__"))));
  }
  py::object i = py::reinterpret_steal<py::object>(idx);
  if (PyObject_RichCompareBool(i.ptr(), py::int_(0).ptr(), Py_LT) == 1)
    raise_value(std::string(what) + " must not be negative, got " + std::string(py::str(i)));
  unsigned long long x = PyLong_AsUnsignedLongLong(i.ptr());
  if (x == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    raise_value(std::string(what) + " does not fit in 64 bits");
  }
  return static_cast<uint64_t>(x);
}

size_t to_size(py::handle v, const char* what) {
  uint64_t x = to_u64(v, what);
  if (x > std::numeric_limits<size_t>::max()) raise_value(std::string(what) + " is too large");
  return static_cast<size_t>(x);
}

// A 1-D sequence of non-negative integers; numpy int64/uint64 arrays are read directly.
std::vector<size_t> to_sizes(py::handle obj, const char* what, bool allow_2d = false) {
  std::vector<size_t> out;
  if (PyObject_CheckBuffer(obj.ptr())) {
    Py_buffer v;
    if (PyObject_GetBuffer(obj.ptr(), &v, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) == 0) {
      std::string fmt = v.format ? v.format : "B";
      if (!fmt.empty() && (fmt[0] == '@' || fmt[0] == '=' || fmt[0] == '<')) fmt.erase(0, 1);
      bool is_signed = fmt == "q" || fmt == "l" || fmt == "n";
      bool is_unsigned = fmt == "Q" || fmt == "L" || fmt == "N";
      if ((v.ndim <= 1 || (allow_2d && v.ndim == 2)) && v.itemsize == 8 &&
          (is_signed || is_unsigned)) {
        size_t n = static_cast<size_t>(v.len / 8);
        out.resize(n);
        const auto* p = static_cast<const uint8_t*>(v.buf);
        for (size_t i = 0; i < n; ++i) {
          uint64_t x;
          std::memcpy(&x, p + i * 8, 8);
          if (is_signed && static_cast<int64_t>(x) < 0) {
            PyBuffer_Release(&v);
            raise_value(std::string(what) + "[" + std::to_string(i) + "] must not be negative");
          }
          out[i] = static_cast<size_t>(x);
        }
        PyBuffer_Release(&v);
        return out;
      }
      PyBuffer_Release(&v);
    } else {
      PyErr_Clear();
    }
  }
  if (py::isinstance<py::str>(obj) || py::isinstance<py::bytes>(obj) ||
      !py::hasattr(obj, "__iter__"))
    throw py::type_error(std::string(what) + " must be a sequence of integers");
  size_t i = 0;
  for (py::handle item : obj) {
    std::string name = std::string(what) + "[" + std::to_string(i++) + "]";
    out.push_back(to_size(item, name.c_str()));
  }
  return out;
}

std::optional<milliseconds> to_timeout(py::handle v, const char* what = "timeout_ms") {
  if (v.is_none()) return std::nullopt;
  double ms = py::cast<double>(v);
  if (!(ms >= 0)) raise_value(std::string(what) + " must be >= 0 or None");
  if (ms > 1e15) return std::nullopt;
  return milliseconds(static_cast<int64_t>(ms));
}

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

MemoryLocation to_location(py::handle v) {
  if (py::isinstance<MemoryLocation>(v)) return py::cast<MemoryLocation>(v);
  if (py::isinstance<py::str>(v)) {
    std::string s = lower(py::cast<std::string>(v));
    if (auto dot = s.rfind('.'); dot != std::string::npos) s = s.substr(dot + 1);
    if (s == "cpu" || s == "host") return MemoryLocation::CPU;
    if (s == "gpu" || s == "cuda" || s == "hip" || s == "rocm") return MemoryLocation::GPU;
    if (s == "unknown") return MemoryLocation::UNKNOWN;
    raise_value("unknown memory location '" + py::cast<std::string>(v) + "' (cpu, gpu)");
  }
  if (PyIndex_Check(v.ptr())) {
    uint64_t x = to_u64(v, "mem_loc");
    if (x > 2) raise_value("mem_loc out of range");
    return static_cast<MemoryLocation>(x);
  }
  throw py::type_error("mem_loc must be a MemoryLocationType or a string");
}

// Backend names: the enum (MORI-IO's BackendType plus OFI) or any plugin name.
enum class BackendType : int { Unknown = 0, XGMI = 1, RDMA = 2, TCP = 3, OFI = 4 };

std::string backend_name(py::handle v) {
  if (py::isinstance<BackendType>(v)) {
    switch (py::cast<BackendType>(v)) {
      case BackendType::XGMI:
        return "xgmi";
      case BackendType::RDMA:
        return "rdma";
      case BackendType::TCP:
        return "tcp";
      case BackendType::OFI:
        return "ofi";
      case BackendType::Unknown:
        break;
    }
    raise_value("BackendType.Unknown names no backend");
  }
  if (!py::isinstance<py::str>(v))
    throw py::type_error("backend must be a BackendType or a string");
  std::string s = lower(py::cast<std::string>(v));
  if (s.rfind("backendtype.", 0) == 0) s = s.substr(12);
  if (s.empty() || s.size() > 64)
    raise_value("bad backend name '" + py::cast<std::string>(v) + "'");
  for (char c : s)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-')
      raise_value("bad backend name '" + py::cast<std::string>(v) +
                  "' (letters, digits, '_' and '-' only)");
  if (s == "unknown") raise_value("'unknown' names no backend");
  return s;
}

// Plugin settings: None (the policy's), a dict (sent as JSON), a JSON string, or an
// object with to_dict() (ferry.TcpBackendConfig, RdmaBackendConfig, ...).
std::string settings_json(py::handle cfg) {
  if (cfg.is_none()) return {};
  if (py::isinstance<py::str>(cfg)) return py::cast<std::string>(cfg);
  py::object obj = py::reinterpret_borrow<py::object>(cfg);
  if (!py::isinstance<py::dict>(obj)) {
    if (!py::hasattr(obj, "to_dict"))
      throw py::type_error("backend config must be None, a dict, a JSON string or have to_dict()");
    obj = obj.attr("to_dict")();
  }
  return py::cast<std::string>(py::module_::import("json").attr("dumps")(obj));
}

uintptr_t to_pointer(py::handle v) {
  if (PyCapsule_CheckExact(v.ptr())) {
    void* p = PyCapsule_GetPointer(v.ptr(), PyCapsule_GetName(v.ptr()));
    if (!p) throw py::error_already_set();
    return reinterpret_cast<uintptr_t>(p);
  }
  if (PyIndex_Check(v.ptr())) return static_cast<uintptr_t>(to_u64(v, "ptr"));
  if (py::hasattr(v, "value")) {  // ctypes.c_void_p
    py::object val = v.attr("value");
    if (val.is_none()) raise_value("ptr is NULL");
    return static_cast<uintptr_t>(to_u64(val, "ptr"));
  }
  throw py::type_error("ptr must be an int, a ctypes pointer or a capsule");
}

py::bytes to_bytes(const std::vector<uint8_t>& v) {
  return py::bytes(reinterpret_cast<const char*>(v.data()), v.size());
}

std::vector<uint8_t> from_buffer(py::handle obj) {
  if (py::isinstance<py::str>(obj))
    throw py::type_error("unpack() takes bytes (the output of pack()), not str");
  Py_buffer v;
  if (PyObject_GetBuffer(obj.ptr(), &v, PyBUF_SIMPLE) != 0) {
    PyErr_Clear();
    throw py::type_error("unpack() takes a bytes-like object");
  }
  const auto* p = static_cast<const uint8_t*>(v.buf);
  std::vector<uint8_t> out(p, p + v.len);
  PyBuffer_Release(&v);
  return out;
}

py::dict backends_dict(const std::map<std::string, std::vector<uint8_t>>& b) {
  py::dict d;
  for (const auto& [name, blob] : b) d[py::str(name)] = to_bytes(blob);
  return d;
}

// ---- waiting with the GIL released --------------------------------------------------

constexpr milliseconds kSlice{100};  // how often a long wait looks at signals

void check_signals() {
  if (PyErr_CheckSignals() != 0) throw py::error_already_set();
}

// Waits for `st` up to `timeout` (nullopt: until it ends). True when it ended.
bool wait_status(const TransferStatus& st, std::optional<milliseconds> timeout) {
  if (timeout && timeout->count() <= 0) {
    // A poll: one round of the backend's progress, as C++ WaitFor(0) - which
    // is also what hands a tcp transfer that post() queued to its lanes.
    py::gil_scoped_release nogil;
    return st.WaitFor(milliseconds(0));
  }
  const auto start = Clock::now();
  while (true) {
    milliseconds slice = kSlice;
    if (timeout) {
      auto left = *timeout - std::chrono::duration_cast<milliseconds>(Clock::now() - start);
      if (left <= milliseconds(0)) return !st.InProgress();
      slice = std::min(slice, left);
    }
    bool done;
    {
      py::gil_scoped_release nogil;
      done = st.WaitFor(slice);
    }
    if (done) return true;
    check_signals();
  }
}

Op to_op(const std::string& op) {
  std::string o;
  for (char c : op) o += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (o == "read") return Op::READ;
  if (o == "write") return Op::WRITE;
  raise_value("op must be 'read' or 'write', not '" + op + "'");
}

// A notification message from Python: bytes-like (bytes, bytearray, memoryview,
// numpy) or str (UTF-8); None: no message.
std::optional<std::string> to_message(py::handle h) {
  if (h.is_none()) return std::nullopt;
  if (py::isinstance<py::str>(h)) return h.cast<std::string>();
  Py_buffer view;
  if (PyObject_GetBuffer(h.ptr(), &view, PyBUF_C_CONTIGUOUS) == 0) {
    std::string out(static_cast<const char*>(view.buf), static_cast<size_t>(view.len));
    PyBuffer_Release(&view);
    return out;
  }
  PyErr_Clear();
  raise(StatusCode::ERR_INVALID_ARGS, "message must be bytes-like or str");
}

py::dict notifications_dict(const std::map<std::string, std::vector<std::string>>& got) {
  py::dict out;
  for (const auto& [key, msgs] : got) {
    py::list l;
    for (const auto& m : msgs) l.append(py::bytes(m));
    out[py::str(key)] = l;
  }
  return out;
}

// Calls attempt(slice) (which waits up to `slice` with the GIL released) in
// slices of kSlice until it returns a value or `timeout` (nullopt: none) has
// passed, checking for Ctrl-C between slices.
template <class T, class F>
std::optional<T> wait_in_slices(std::optional<milliseconds> timeout, F&& attempt) {
  const auto start = Clock::now();
  while (true) {
    milliseconds slice = kSlice;
    if (timeout) {
      auto left = *timeout - std::chrono::duration_cast<milliseconds>(Clock::now() - start);
      slice = std::max(milliseconds(0), std::min(slice, left));
    }
    std::optional<T> got = attempt(slice);
    if (got) return got;
    if (timeout && Clock::now() - start >= *timeout) return std::nullopt;
    check_signals();
  }
}

// ---- engine -------------------------------------------------------------------------

// Shared by an IOEngine and the sessions made from it: a session keeps the engine
// alive; close() ends the engine even while sessions exist (they then refuse work).
struct EngineHolder {
  std::shared_mutex mu;  // shared: a call in progress; unique: close()
  std::unique_ptr<Engine> engine;
  std::string key;
  std::map<uint64_t, py::object> keep;  // memory id -> object kept alive; GIL only

  // Closes the engine with the GIL released (it joins its threads), then drops
  // the kept objects with the GIL held.
  void close() {
    {
      py::gil_scoped_release nogil;
      std::unique_lock lk(mu);
      engine.reset();
    }
    keep.clear();
  }

  ~EngineHolder() {
    // Destroyed from a Python deallocation (GIL held) or at interpreter exit.
    if (engine) {
#if PY_VERSION_HEX >= 0x030D0000
      const bool finalizing = Py_IsFinalizing();
#else
      const bool finalizing = _Py_IsFinalizing();
#endif
      if (Py_IsInitialized() && !finalizing && PyGILState_Check()) {
        py::gil_scoped_release nogil;
        engine.reset();
      } else {
        engine.reset();
      }
    }
  }

  // Runs fn(engine) with the GIL released while the engine cannot be closed.
  template <class F>
  auto with_engine(F&& fn) -> decltype(fn(std::declval<Engine&>())) {
    py::gil_scoped_release nogil;
    std::shared_lock lk(mu);
    if (!engine) raise(StatusCode::ERR_BAD_STATE, "IOEngine '" + key + "' is closed");
    return fn(*engine);
  }
};
using HolderPtr = std::shared_ptr<EngineHolder>;

class PySession {
 public:
  PySession(HolderPtr h, std::unique_ptr<Session> s) : h_(std::move(h)), s_(std::move(s)) {}

  TransferUid allocate_transfer_uid() {
    return run([&](Session& s) { return s.allocate_transfer_uid(); });
  }
  TransferStatus read(py::handle lo, py::handle ro, py::handle size, py::handle uid,
                      std::optional<bool> notify, py::handle message) {
    return single(Op::READ, lo, ro, size, uid, notify, message);
  }
  TransferStatus write(py::handle lo, py::handle ro, py::handle size, py::handle uid,
                       std::optional<bool> notify, py::handle message) {
    return single(Op::WRITE, lo, ro, size, uid, notify, message);
  }
  TransferStatus batch(Op op, py::handle los, py::handle ros, py::handle sizes, py::handle uid,
                       std::optional<bool> notify, py::handle message) {
    auto l = to_sizes(los, "local_offsets"), r = to_sizes(ros, "remote_offsets"),
         n = to_sizes(sizes, "sizes");
    TransferUid u = to_u64(uid, "transfer_uid");
    auto m = to_message(message);
    return run([&](Session& s) {
      return op == Op::READ ? s.batch_read(l, r, n, u, notify, std::move(m))
                            : s.batch_write(l, r, n, u, notify, std::move(m));
    });
  }
  bool alive() {
    py::gil_scoped_release nogil;
    std::shared_lock lk(h_->mu);
    return h_->engine && s_->alive();
  }

 private:
  TransferStatus single(Op op, py::handle lo, py::handle ro, py::handle size, py::handle uid,
                        std::optional<bool> notify, py::handle message) {
    size_t l = to_size(lo, "local_offset"), r = to_size(ro, "remote_offset"),
           n = to_size(size, "size");
    TransferUid u = to_u64(uid, "transfer_uid");
    auto m = to_message(message);
    return run([&](Session& s) {
      return op == Op::READ ? s.read(l, r, n, u, notify, std::move(m))
                            : s.write(l, r, n, u, notify, std::move(m));
    });
  }
  template <class F>
  auto run(F&& fn) -> decltype(fn(std::declval<Session&>())) {
    return h_->with_engine([&](Engine&) { return fn(*s_); });
  }

  HolderPtr h_;
  std::unique_ptr<Session> s_;
};

class PyEngine {
 public:
  PyEngine(const std::string& key, std::optional<EngineConfig> config)
      : h_(std::make_shared<EngineHolder>()) {
    EngineConfig cfg = config.value_or(EngineConfig{});
    h_->key = key;
    py::gil_scoped_release nogil;
    h_->engine = std::make_unique<Engine>(key, std::move(cfg));
  }

  const std::string& key() const { return h_->key; }
  bool closed() const { return !h_->engine; }
  void close() { h_->close(); }

  EngineDesc desc() {
    return h_->with_engine([](Engine& e) { return e.desc(); });
  }

  void create_backend(py::handle type, py::handle config) {
    std::string name = backend_name(type);
    std::string settings = settings_json(config);
    Result r = h_->with_engine([&](Engine& e) { return e.add_backend(name, settings); });
    // Bad settings are the caller's (ValueError); a plugin that is missing, does not
    // load or does not start is a setup failure (TransferError, with the core's code).
    if (r.code == StatusCode::ERR_INVALID_ARGS) check(r);
    if (!r.ok()) raise_transfer(r.code, r.message);
  }
  void remove_backend(py::handle type) {
    std::string name = backend_name(type);
    check(h_->with_engine([&](Engine& e) { return e.remove_backend(name); }));
  }
  std::vector<std::string> backends() {
    return h_->with_engine([](Engine& e) { return e.backends(); });
  }

  void register_remote_engine(py::handle desc) {
    EngineDesc d = py::isinstance<EngineDesc>(desc) ? py::cast<EngineDesc>(desc)
                                                    : EngineDesc::unpack(from_buffer(desc));
    check(h_->with_engine([&](Engine& e) { return e.register_remote_engine(d); }));
  }
  void deregister_remote_engine(py::handle desc_or_key) {
    std::string k;
    if (py::isinstance<EngineDesc>(desc_or_key))
      k = py::cast<EngineDesc&>(desc_or_key).key;
    else if (py::isinstance<py::str>(desc_or_key))
      k = py::cast<std::string>(desc_or_key);
    else
      throw py::type_error("deregister_remote_engine takes an EngineDesc or an engine key");
    check(h_->with_engine([&](Engine& e) { return e.deregister_remote_engine(k); }));
  }

  MemoryDesc register_memory(py::handle ptr, py::handle size, int device_id, py::handle mem_loc) {
    uintptr_t p = to_pointer(ptr);
    size_t n = to_size(size, "size");
    MemoryLocation loc = to_location(mem_loc);
    return h_->with_engine([&](Engine& e) {
      return e.register_memory(reinterpret_cast<void*>(p), n, device_id, loc);
    });
  }

  MemoryDesc register_buffer(py::handle obj) {
    auto view = std::make_unique<Py_buffer>();
    if (PyObject_GetBuffer(obj.ptr(), view.get(), PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
      PyErr_Clear();
      std::string tname = py::str(py::type::handle_of(obj).attr("__name__"));
      if (!PyObject_CheckBuffer(obj.ptr()))
        throw py::type_error("register_buffer: " + tname +
                             " does not support the buffer protocol (for tensors use "
                             "register_torch_tensor)");
      Py_buffer ro;
      if (PyObject_GetBuffer(obj.ptr(), &ro, PyBUF_C_CONTIGUOUS) == 0) {
        PyBuffer_Release(&ro);
        raise_value("register_buffer: the " + tname + " is read-only; ferry needs writable memory");
      }
      PyErr_Clear();
      raise_value("register_buffer: the " + tname + " is not C-contiguous");
    }
    // From here the capsule owns the export and releases it when dropped.
    Py_buffer* raw = view.release();
    py::capsule hold(raw, [](void* p) {
      auto* v = static_cast<Py_buffer*>(p);
      PyBuffer_Release(v);
      delete v;
    });
    if (raw->len <= 0) raise_value("register_buffer: the buffer is empty");
    void* addr = raw->buf;
    size_t len = static_cast<size_t>(raw->len);
    MemoryDesc d = h_->with_engine(
        [&](Engine& e) { return e.register_memory(addr, len, -1, MemoryLocation::CPU); });
    h_->keep[d.id] = std::move(hold);
    return d;
  }

  MemoryDesc register_torch_tensor(py::handle t) {
    uintptr_t ptr = 0;
    size_t nbytes = 0;
    int device = -1;
    MemoryLocation loc = MemoryLocation::CPU;
    if (py::hasattr(t, "data_ptr") && py::hasattr(t, "element_size")) {  // torch.Tensor
      if (py::hasattr(t, "is_contiguous") && !py::cast<bool>(t.attr("is_contiguous")()))
        raise_value("register_torch_tensor: the tensor is not contiguous (call .contiguous())");
      py::object dev = t.attr("device");
      std::string type = py::cast<std::string>(dev.attr("type"));
      if (type == "cuda") {
        loc = MemoryLocation::GPU;
        py::object idx = dev.attr("index");
        device = idx.is_none() ? 0 : py::cast<int>(idx);
      } else if (type != "cpu") {
        raise_value("register_torch_tensor: tensors on '" + type +
                    "' are not supported (cpu, cuda)");
      }
      nbytes =
          to_size(t.attr("numel")(), "numel") * to_size(t.attr("element_size")(), "element_size");
      ptr = static_cast<uintptr_t>(to_u64(t.attr("data_ptr")(), "data_ptr"));
    } else if (py::hasattr(t, "__cuda_array_interface__")) {  // CuPy, Numba, ...
      py::dict cai = t.attr("__cuda_array_interface__");
      py::tuple shape = cai["shape"];
      std::string typestr = py::cast<std::string>(cai["typestr"]);
      size_t item = 0;
      for (char c : typestr)
        if (std::isdigit(static_cast<unsigned char>(c)))
          item = item * 10 + static_cast<size_t>(c - '0');
      size_t count = 1;
      for (py::handle s : shape) count *= to_size(s, "shape");
      if (cai.contains("strides") && !cai["strides"].is_none()) {
        py::tuple strides = cai["strides"];
        size_t expect = item;
        for (size_t i = shape.size(); i-- > 0;) {
          size_t dim = to_size(shape[i], "shape");
          if (dim > 1 && to_size(strides[i], "strides") != expect)
            raise_value("register_torch_tensor: the array is not C-contiguous");
          expect *= dim;
        }
      }
      nbytes = count * item;
      ptr = static_cast<uintptr_t>(to_u64(py::tuple(cai["data"])[0], "data"));
      loc = MemoryLocation::GPU;
      device = 0;
      if (py::hasattr(t, "device") && py::hasattr(t.attr("device"), "id"))
        device = py::cast<int>(t.attr("device").attr("id"));
    } else {
      throw py::type_error(
          "register_torch_tensor takes a torch.Tensor (or an object with "
          "__cuda_array_interface__); for numpy arrays use register_buffer");
    }
    if (nbytes == 0) raise_value("register_torch_tensor: the tensor is empty");
    if (ptr == 0) raise_value("register_torch_tensor: the tensor has no storage");
    MemoryDesc d = h_->with_engine([&](Engine& e) {
      return e.register_memory(reinterpret_cast<void*>(ptr), nbytes, device, loc);
    });
    h_->keep[d.id] = py::reinterpret_borrow<py::object>(t);
    return d;
  }

  void deregister_memory(const MemoryDesc& m) {
    check(h_->with_engine([&](Engine& e) { return e.deregister_memory(m); }));
    if (m.engine_key == h_->key) h_->keep.erase(m.id);
  }

  TransferUid allocate_transfer_uid() {
    return h_->with_engine([](Engine& e) { return e.allocate_transfer_uid(); });
  }

  TransferStatus single(Op op, const MemoryDesc& local, py::handle lo, const MemoryDesc& remote,
                        py::handle ro, py::handle size, py::handle uid, std::optional<bool> notify,
                        py::handle message) {
    size_t l = to_size(lo, "local_offset"), r = to_size(ro, "remote_offset"),
           n = to_size(size, "size");
    TransferUid u = to_u64(uid, "transfer_uid");
    auto m = to_message(message);
    return h_->with_engine([&](Engine& e) {
      return op == Op::READ ? e.read(local, l, remote, r, n, u, notify, std::move(m))
                            : e.write(local, l, remote, r, n, u, notify, std::move(m));
    });
  }

  TransferStatus batch(Op op, const MemoryDesc& local, py::handle los, const MemoryDesc& remote,
                       py::handle ros, py::handle sizes, py::handle uid, std::optional<bool> notify,
                       py::handle message) {
    auto l = to_sizes(los, "local_offsets"), r = to_sizes(ros, "remote_offsets"),
         n = to_sizes(sizes, "sizes");
    TransferUid u = to_u64(uid, "transfer_uid");
    auto m = to_message(message);
    return h_->with_engine([&](Engine& e) {
      return op == Op::READ ? e.batch_read(local, l, remote, r, n, u, notify, std::move(m))
                            : e.batch_write(local, l, remote, r, n, u, notify, std::move(m));
    });
  }

  TransferStatus send_notification(const std::string& remote_key, py::handle message) {
    auto m = to_message(message);
    if (!m) raise(StatusCode::ERR_INVALID_ARGS, "message must be bytes-like or str, not None");
    return h_->with_engine([&](Engine& e) { return e.send_notification(remote_key, *m); });
  }

  TransferStatus transfer(const std::string& op, const std::vector<MemoryDesc>& locals,
                          const std::vector<MemoryDesc>& remotes, py::handle items, py::handle uid,
                          std::optional<bool> notify, py::handle message) {
    Op o = to_op(op);
    std::vector<TransferItem> v;
    if (PyObject_CheckBuffer(items.ptr())) {  // an int64 array of 5 columns (or flat)
      auto flat = to_sizes(items, "items", /*allow_2d=*/true);
      if (flat.size() % 5 != 0) raise_value("items: an array of 5 columns");
      for (size_t i = 0; i < flat.size(); i += 5)
        v.push_back({flat[i], flat[i + 1], flat[i + 2], flat[i + 3], flat[i + 4]});
    } else {
      size_t i = 0;
      for (py::handle it : items) {
        auto f = to_sizes(it, ("items[" + std::to_string(i++) + "]").c_str());
        if (f.size() != 5)
          raise_value("items: each is (local, local_offset, remote, remote_offset, size)");
        v.push_back({f[0], f[1], f[2], f[3], f[4]});
      }
    }
    TransferUid u = to_u64(uid, "transfer_uid");
    auto m = to_message(message);
    return h_->with_engine(
        [&](Engine& e) { return e.transfer(o, locals, remotes, v, u, notify, std::move(m)); });
  }

  PreparedList prepare_list(const std::vector<MemoryDesc>& regions, py::handle entries) {
    std::vector<ListEntry> v;
    if (PyObject_CheckBuffer(entries.ptr())) {
      auto flat = to_sizes(entries, "entries", /*allow_2d=*/true);
      if (flat.size() % 3 != 0) raise_value("entries: an array of 3 columns");
      for (size_t i = 0; i < flat.size(); i += 3) v.push_back({flat[i], flat[i + 1], flat[i + 2]});
    } else {
      size_t i = 0;
      for (py::handle it : entries) {
        auto f = to_sizes(it, ("entries[" + std::to_string(i++) + "]").c_str());
        if (f.size() != 3) raise_value("entries: each is (region, offset, size)");
        v.push_back({f[0], f[1], f[2]});
      }
    }
    return h_->with_engine([&](Engine& e) { return e.prepare_list(regions, v); });
  }

  TransferStatus transfer_prepared(const std::string& op, const PreparedList& local,
                                   py::handle local_indices, const PreparedList& remote,
                                   py::handle remote_indices, py::handle uid,
                                   std::optional<bool> notify, py::handle message) {
    Op o = to_op(op);
    auto l = to_sizes(local_indices, "local_indices"),
         r = to_sizes(remote_indices, "remote_indices");
    if (l.size() != r.size()) raise_value("local_indices and remote_indices differ in length");
    TransferUid u = to_u64(uid, "transfer_uid");
    auto m = to_message(message);
    return h_->with_engine([&](Engine& e) {
      // size_t and int64_t share their layout; indices above INT64_MAX are refused there.
      return e.transfer(o, local, reinterpret_cast<const int64_t*>(l.data()), remote,
                        reinterpret_cast<const int64_t*>(r.data()), l.size(), u, notify,
                        std::move(m));
    });
  }

  py::dict get_new_notifications() {
    auto got = h_->with_engine([](Engine& e) { return e.get_new_notifications(); });
    return notifications_dict(got);
  }

  py::dict wait_notifications(py::handle timeout_ms) {
    auto got = wait_in_slices<std::map<std::string, std::vector<std::string>>>(
        to_timeout(timeout_ms), [&](milliseconds slice) {
          auto m = h_->with_engine([&](Engine& e) { return e.wait_notifications(slice); });
          return m.empty() ? std::nullopt : std::make_optional(std::move(m));
        });
    return notifications_dict(got ? *got : std::map<std::string, std::vector<std::string>>{});
  }

  int notification_fd() {
    return h_->with_engine([](Engine& e) { return e.notification_fd(); });
  }

  std::optional<PySession> create_session(const MemoryDesc& local, const MemoryDesc& remote,
                                          bool raise_on_failure) {
    Result why;
    auto s = h_->with_engine([&](Engine& e) { return e.create_session(local, remote, &why); });
    if (!s) {
      if (raise_on_failure) raise(why.code, why.message);
      return std::nullopt;
    }
    return PySession(h_, std::move(s));
  }

  std::optional<TransferStatus> pop_inbound(const std::string& remote_key, py::handle uid) {
    TransferUid u = to_u64(uid, "transfer_uid");
    return h_->with_engine([&](Engine& e) { return e.pop_inbound_transfer_status(remote_key, u); });
  }

  std::optional<TransferStatus> wait_inbound(const std::string& remote_key, py::handle uid,
                                             py::handle timeout_ms) {
    TransferUid u = to_u64(uid, "transfer_uid");
    return wait_in_slices<TransferStatus>(to_timeout(timeout_ms), [&](milliseconds slice) {
      return h_->with_engine(
          [&](Engine& e) { return e.wait_inbound_transfer_status(remote_key, u, slice); });
    });
  }

  py::dict stats() {
    EngineStats s = h_->with_engine([](Engine& e) { return e.stats(); });
    py::dict backends;
    for (const auto& [name, b] : s.backends) {
      py::dict d;
      d["bytes"] = b.bytes;
      d["transfers"] = b.transfers;
      d["failures"] = b.failures;
      d["failovers"] = b.failovers;
      d["quarantines"] = b.quarantines;
      d["stray_completions"] = b.stray_completions;
      d["detail"] = b.detail;
      py::dict plugin;
      for (const auto& [k, v] : b.plugin) plugin[py::str(k)] = v;
      d["plugin"] = plugin;
      backends[py::str(name)] = d;
    }
    py::dict out;
    out["backends"] = backends;
    out["inbound_notifications"] = s.inbound_notifications;
    out["inbound_dropped"] = s.inbound_dropped;
    out["notifications_received"] = s.notifications_received;
    out["notifications_refused"] = s.notifications_refused;
    out["notifications_unread"] = s.notifications_unread;
    out["ctrl_rejected"] = s.ctrl_rejected;
    out["ctrl_unix_connections"] = s.ctrl_unix_connections;
    out["notifies_resent"] = s.notifies_resent;
    out["notifies_unanswered"] = s.notifies_unanswered;
    out["fences"] = s.fences;
    out["fence_unknown"] = s.fence_unknown;
    out["fenced_peers"] = s.fenced_peers;
    return out;
  }

  std::string policy_source() {
    return h_->with_engine([](Engine& e) { return e.policy_source(); });
  }

  // ---- running in a cluster (issue 21): /metrics and the metadata store ----
  std::string metrics_address() {
    return h_->with_engine([](Engine& e) { return e.metrics_address(); });
  }
  void publish_memory(const std::string& name, const MemoryDesc& mem) {
    check(h_->with_engine([&](Engine& e) { return e.publish_memory(name, mem); }));
  }
  void unpublish_memory(const std::string& name) {
    check(h_->with_engine([&](Engine& e) { return e.unpublish_memory(name); }));
  }
  void fetch_remote_engine(const std::string& key, py::handle wait_ms) {
    const milliseconds w(static_cast<int64_t>(to_u64(wait_ms, "wait_ms")));
    check(h_->with_engine([&](Engine& e) { return e.fetch_remote_engine(key, w); }));
  }
  MemoryDesc fetch_memory(const std::string& key, const std::string& name, py::handle wait_ms) {
    const milliseconds w(static_cast<int64_t>(to_u64(wait_ms, "wait_ms")));
    Result why;
    auto m = h_->with_engine([&](Engine& e) { return e.fetch_memory(key, name, w, &why); });
    if (!m) raise(why.code, why.message);
    return *m;
  }

 private:
  HolderPtr h_;
};

bool wait_all_py(const std::vector<TransferStatus>& statuses, py::handle timeout_ms) {
  auto timeout = to_timeout(timeout_ms);
  const auto start = Clock::now();
  for (const auto& s : statuses) {
    std::optional<milliseconds> left;
    if (timeout) {
      left = *timeout - std::chrono::duration_cast<milliseconds>(Clock::now() - start);
      if (*left < milliseconds(0)) left = milliseconds(0);
    }
    if (!wait_status(s, left)) return false;
  }
  return true;
}

std::string status_repr(const TransferStatus& s) {
  std::string r = std::string("<TransferStatus ") + to_string(s.Code());
  std::string m = s.Message();
  if (!m.empty()) r += ": " + m;
  return r + ">";
}

// EngineConfig::auth_token, where the core has it.
template <class C>
void set_auth_token(C& c, const std::string& token) {
  if constexpr (requires { c.auth_token = token; }) {
    c.auth_token = token;
  } else if (!token.empty()) {
    raise_value("auth_token: this ferry core has no authentication");
  }
}
template <class C>
std::string get_auth_token(const C& c) {
  if constexpr (requires { std::string(c.auth_token); })
    return c.auth_token;
  else
    return {};
}

// Lets an enum compare with plain ints too (StatusCode.ERR_TIMEOUT == 16, code > 10),
// as an IntEnum would.
template <class E>
void int_comparable(py::enum_<E>& cls) {
  auto as_int = [](py::handle v) -> std::optional<long long> {
    if (py::isinstance<E>(v)) return static_cast<long long>(py::cast<E>(v));
    if (PyLong_Check(v.ptr())) return py::cast<long long>(v);
    return std::nullopt;
  };
  auto op = [as_int](auto cmp) {
    return [as_int, cmp](E a, py::handle b) -> py::object {
      auto y = as_int(b);
      if (!y) return py::reinterpret_borrow<py::object>(Py_NotImplemented);
      return py::bool_(cmp(static_cast<long long>(a), *y));
    };
  };
  // Replace (not overload) pybind11's strict comparisons.
  for (const char* name : {"__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"})
    if (py::hasattr(cls, name) && PyObject_DelAttrString(cls.ptr(), name) != 0) PyErr_Clear();
  cls.def("__eq__", op(std::equal_to<long long>()), py::is_operator())
      .def("__ne__", op(std::not_equal_to<long long>()), py::is_operator())
      .def("__lt__", op(std::less<long long>()), py::is_operator())
      .def("__le__", op(std::less_equal<long long>()), py::is_operator())
      .def("__gt__", op(std::greater<long long>()), py::is_operator())
      .def("__ge__", op(std::greater_equal<long long>()), py::is_operator());
}

}  // namespace

PYBIND11_MODULE(_ferry, m) {
  m.doc() =
      "ferry: one-sided READ/WRITE between registered memory of two processes, with "
      "MORI-IO's Python API (IOEngine, backends, EngineDesc/MemoryDesc, TransferStatus).";
#ifdef FERRY_VERSION
  m.attr("__version__") = FERRY_VERSION;
#endif

  g_transfer_error = new_exception(
      m, "TransferError", PyExc_RuntimeError,
      "A setup call failed for a reason other than its arguments: a backend that does not "
      "load or start, a closed engine, a session that cannot be served. `.code` is the "
      "StatusCode. Transfer outcomes are never raised: they are in TransferStatus.");
  g_invalid_error =
      new_exception(m, "InvalidArgumentError", PyExc_ValueError,
                    "Bad arguments (ValueError): null or empty memory, a malformed descriptor, bad "
                    "backend settings. `.code` is StatusCode.ERR_INVALID_ARGS.");
  g_not_found_error = new_exception(
      m, "NotFoundError", PyExc_LookupError,
      "Something named is not there (LookupError): memory, an engine or a backend that is "
      "not registered. `.code` is StatusCode.ERR_NOT_FOUND.");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const BindingError& e) {
      set_python_error(e.code, e.message, e.transfer_error);
    } catch (const ferry::Error& e) {
      set_python_error(e.code(), e.what());
    }
  });

  py::enum_<StatusCode> status_code(
      m, "StatusCode", py::arithmetic(),
      "Transfer and call outcome codes (MORI-IO's, plus ERR_TIMEOUT and "
      "ERR_TRANSPORT). Errors are > 10.");
  status_code.value("SUCCESS", StatusCode::SUCCESS)
      .value("INIT", StatusCode::INIT)
      .value("IN_PROGRESS", StatusCode::IN_PROGRESS)
      .value("ERR_INVALID_ARGS", StatusCode::ERR_INVALID_ARGS)
      .value("ERR_NOT_FOUND", StatusCode::ERR_NOT_FOUND)
      .value("ERR_RDMA_OP", StatusCode::ERR_RDMA_OP)
      .value("ERR_BAD_STATE", StatusCode::ERR_BAD_STATE)
      .value("ERR_GPU_OP", StatusCode::ERR_GPU_OP)
      .value("ERR_TIMEOUT", StatusCode::ERR_TIMEOUT)
      .value("ERR_TRANSPORT", StatusCode::ERR_TRANSPORT)
      .value("ERR_OUTCOME_UNKNOWN", StatusCode::ERR_OUTCOME_UNKNOWN)
      .value("ERR_CANCELLED", StatusCode::ERR_CANCELLED);
  int_comparable(status_code);

  py::enum_<MemoryLocation>(m, "MemoryLocationType", "Where registered memory lives.")
      .value("Unknown", MemoryLocation::UNKNOWN)
      .value("CPU", MemoryLocation::CPU)
      .value("GPU", MemoryLocation::GPU);

  py::enum_<BackendType>(m, "BackendType",
                         "The backends ferry ships plugins for. create_backend() also takes "
                         "their names ('tcp', 'rdma', 'xgmi', 'ofi') or any plugin name.")
      .value("Unknown", BackendType::Unknown)
      .value("XGMI", BackendType::XGMI)
      .value("RDMA", BackendType::RDMA)
      .value("TCP", BackendType::TCP)
      .value("OFI", BackendType::OFI);

  py::class_<EngineConfig>(m, "IOEngineConfig",
                           "Engine settings: host (address the control listener binds and "
                           "advertises), port (0 = any free port), node_id, policy_file, "
                           "plugin_dirs, timeout_ms (per-transfer deadline; 0 = the policy's), "
                           "auth_token (shared secret peers must prove), stats_socket (serve "
                           "stats() as JSON on this Unix socket for `ferry stats PATH`).")
      .def(py::init([](const std::string& host, py::handle port, const std::string& node_id,
                       const std::string& policy_file, const std::vector<std::string>& plugin_dirs,
                       py::handle timeout_ms, const std::string& auth_token,
                       const std::string& stats_socket, const std::string& metrics_address,
                       const std::vector<std::string>& etcd_endpoints,
                       const std::string& etcd_namespace, py::handle etcd_lease_ms) {
             EngineConfig c;
             c.host = host;
             uint64_t p = to_u64(port, "port");
             if (p > 65535) raise_value("port must be 0..65535");
             c.port = static_cast<uint16_t>(p);
             c.node_id = node_id;
             c.policy_file = policy_file;
             c.plugin_dirs = plugin_dirs;
             c.timeout = milliseconds(static_cast<int64_t>(to_u64(timeout_ms, "timeout_ms")));
             set_auth_token(c, auth_token);
             c.stats_socket = stats_socket;
             c.metrics_address = metrics_address;
             c.metadata.etcd = etcd_endpoints;
             c.metadata.ns = etcd_namespace;
             c.metadata.lease =
                 milliseconds(static_cast<int64_t>(to_u64(etcd_lease_ms, "etcd_lease_ms")));
             return c;
           }),
           py::arg("host") = "127.0.0.1", py::arg("port") = 0, py::arg("node_id") = "",
           py::arg("policy_file") = "", py::arg("plugin_dirs") = std::vector<std::string>{},
           py::arg("timeout_ms") = 0, py::arg("auth_token") = "", py::arg("stats_socket") = "",
           py::arg("metrics_address") = "", py::arg("etcd_endpoints") = std::vector<std::string>{},
           py::arg("etcd_namespace") = "", py::arg("etcd_lease_ms") = 0)
      .def_readwrite("host", &EngineConfig::host)
      .def_property(
          "port", [](const EngineConfig& c) { return c.port; },
          [](EngineConfig& c, py::handle v) {
            uint64_t p = to_u64(v, "port");
            if (p > 65535) raise_value("port must be 0..65535");
            c.port = static_cast<uint16_t>(p);
          })
      .def_readwrite("node_id", &EngineConfig::node_id)
      .def_readwrite("policy_file", &EngineConfig::policy_file)
      .def_readwrite("plugin_dirs", &EngineConfig::plugin_dirs)
      .def_readwrite("stats_socket", &EngineConfig::stats_socket,
                     "Unix socket serving stats() as JSON ({key}, {pid} replaced); empty: "
                     "FERRY_STATS_SOCKET, then none.")
      .def_readwrite("metrics_address", &EngineConfig::metrics_address,
                     "Serve Prometheus metrics at http://HOST:PORT/metrics (port 0: any free "
                     "one); empty: FERRY_METRICS_ADDR, then none.")
      .def_property(
          "etcd_endpoints", [](const EngineConfig& c) { return c.metadata.etcd; },
          [](EngineConfig& c, const std::vector<std::string>& v) { c.metadata.etcd = v; },
          "etcd endpoints of the metadata store; empty: FERRY_ETCD_ENDPOINTS, then the "
          "policy's metadata: etcd:, then none.")
      .def_property(
          "etcd_namespace", [](const EngineConfig& c) { return c.metadata.ns; },
          [](EngineConfig& c, const std::string& v) { c.metadata.ns = v; },
          "Key prefix in etcd; empty: FERRY_ETCD_NAMESPACE, the policy's, then 'ferry'.")
      .def_property(
          "etcd_lease_ms", [](const EngineConfig& c) { return c.metadata.lease.count(); },
          [](EngineConfig& c, py::handle v) {
            c.metadata.lease = milliseconds(static_cast<int64_t>(to_u64(v, "etcd_lease_ms")));
          },
          "Lease on what this engine publishes (at least 2000); 0: FERRY_ETCD_LEASE, the "
          "policy's, then 10 s.")
      .def_property(
          "timeout_ms", [](const EngineConfig& c) { return c.timeout.count(); },
          [](EngineConfig& c, py::handle v) {
            c.timeout = milliseconds(static_cast<int64_t>(to_u64(v, "timeout_ms")));
          })
      .def_property(
          "inbound_max_per_peer",
          [](const EngineConfig& c) { return static_cast<uint64_t>(c.inbound_max_per_peer); },
          [](EngineConfig& c, py::handle v) {
            c.inbound_max_per_peer = static_cast<size_t>(to_u64(v, "inbound_max_per_peer"));
          },
          "Un-popped inbound statuses kept per initiator (the oldest go first; 0: no limit).")
      .def_property(
          "inbound_max_age_ms", [](const EngineConfig& c) { return c.inbound_max_age.count(); },
          [](EngineConfig& c, py::handle v) {
            c.inbound_max_age = milliseconds(static_cast<int64_t>(to_u64(v, "inbound_max_age_ms")));
          },
          "Un-popped inbound statuses older than this are dropped (0: no limit).")
      .def_property(
          "control_idle_close_ms",
          [](const EngineConfig& c) { return c.control_idle_close.count(); },
          [](EngineConfig& c, py::handle v) {
            c.control_idle_close =
                milliseconds(static_cast<int64_t>(to_u64(v, "control_idle_close_ms")));
          },
          "A control-plane connection to a peer unused this long is closed at both ends "
          "(reconnected on its next use; 0: never).")
      .def_readwrite("notify", &EngineConfig::notify,
                     "Whether transfers notify their target when a call leaves notify=None: "
                     "True/False, or None for the policy file's `notify:` (else True).")
      .def_property(
          "auth_token", [](const EngineConfig& c) { return get_auth_token(c); },
          [](EngineConfig& c, const std::string& t) { set_auth_token(c, t); },
          "Optional cluster-wide secret every peer must prove on top of the engine's "
          "descriptor (HMAC challenge; never sent). Empty: FERRY_AUTH_TOKEN, then none.")
      .def("__repr__", [](const EngineConfig& c) {
        return "IOEngineConfig(host='" + c.host + "', port=" + std::to_string(c.port) +
               (c.node_id.empty() ? "" : ", node_id='" + c.node_id + "'") +
               (c.policy_file.empty() ? "" : ", policy_file='" + c.policy_file + "'") +
               ", timeout_ms=" + std::to_string(c.timeout.count()) +
               (get_auth_token(c).empty() ? "" : ", auth_token=<set>") + ")";
      });

  py::class_<EngineDesc>(m, "EngineDesc",
                         "Everything a peer needs to reach an engine. Send pack() out of band "
                         "and give EngineDesc.unpack(bytes) to register_remote_engine().")
      .def_readonly("key", &EngineDesc::key)
      .def_readonly("host", &EngineDesc::host)
      .def_readonly("port", &EngineDesc::port)
      .def_readonly("node_id", &EngineDesc::node_id)
      .def_readonly("pid", &EngineDesc::pid)
      .def_property_readonly(
          "backends", [](const EngineDesc& d) { return backends_dict(d.backends); },
          "Backend name -> opaque connection blob.")
      .def(
          "pack", [](const EngineDesc& d) { return to_bytes(d.pack()); },
          "Serialize to compact bytes (msgpack).")
      .def_static(
          "unpack", [](py::handle b) { return EngineDesc::unpack(from_buffer(b)); },
          py::arg("data"),
          "Decode pack()'s bytes; a truncated or forged blob raises InvalidArgumentError.")
      .def("to_json", &EngineDesc::to_json, "A readable JSON form.")
      .def(py::self == py::self)
      .def(py::self != py::self)
      .def("__repr__",
           [](const EngineDesc& d) {
             std::string b;
             for (const auto& [k, v] : d.backends) b += (b.empty() ? "" : ",") + k;
             return "EngineDesc(key='" + d.key + "', host='" + d.host +
                    "', port=" + std::to_string(d.port) + ", pid=" + std::to_string(d.pid) +
                    ", backends=[" + b + "])";
           })
      .def(py::pickle([](const EngineDesc& d) { return to_bytes(d.pack()); },
                      [](const py::bytes& b) { return EngineDesc::unpack(from_buffer(b)); }));

  py::class_<MemoryDesc>(m, "MemoryDesc",
                         "A registered memory region. Send pack() to the peer, which passes "
                         "MemoryDesc.unpack(bytes) as the remote side of its transfers.")
      .def_readonly("engine_key", &MemoryDesc::engine_key)
      .def_readonly("id", &MemoryDesc::id)
      .def_readonly("location", &MemoryDesc::location)
      .def_readonly("device", &MemoryDesc::device)
      .def_readonly("device_id", &MemoryDesc::device)
      .def_readonly("bus_id", &MemoryDesc::bus_id)
      .def_readonly("addr", &MemoryDesc::addr)
      .def_readonly("size", &MemoryDesc::size)
      .def_property_readonly(
          "backends", [](const MemoryDesc& d) { return backends_dict(d.backends); },
          "Backend name -> opaque memory blob (rkey, IPC handle, ...).")
      .def(
          "pack", [](const MemoryDesc& d) { return to_bytes(d.pack()); },
          "Serialize to compact bytes (msgpack).")
      .def_static(
          "unpack", [](py::handle b) { return MemoryDesc::unpack(from_buffer(b)); },
          py::arg("data"),
          "Decode pack()'s bytes; a truncated or forged blob raises InvalidArgumentError.")
      .def("to_json", &MemoryDesc::to_json, "A readable JSON form.")
      .def(py::self == py::self)
      .def(py::self != py::self)
      .def("__repr__",
           [](const MemoryDesc& d) {
             return "MemoryDesc(engine_key='" + d.engine_key + "', id=" + std::to_string(d.id) +
                    ", location=" + to_string(d.location) + ", device=" + std::to_string(d.device) +
                    ", size=" + std::to_string(d.size) + ")";
           })
      .def(py::pickle([](const MemoryDesc& d) { return to_bytes(d.pack()); },
                      [](const py::bytes& b) { return MemoryDesc::unpack(from_buffer(b)); }));

  py::class_<TransferStatus>(m, "TransferStatus",
                             "One transfer's state, shared by every copy. The first final code "
                             "sticks. Wait()/WaitFor() release the GIL.")
      .def(py::init<>())
      .def("Code", &TransferStatus::Code, "The current StatusCode.")
      .def("Message", &TransferStatus::Message, "Why it failed ('' on success).")
      .def("Init", &TransferStatus::Init, "Not started.")
      .def("InProgress", &TransferStatus::InProgress, "Not ended yet (INIT or IN_PROGRESS).")
      .def("Succeeded", &TransferStatus::Succeeded, "Ended with SUCCESS: the bytes are delivered.")
      .def("Failed", &TransferStatus::Failed, "Ended with an error code.")
      .def(
          "Wait",
          [](const TransferStatus& s) {
            wait_status(s, std::nullopt);
            return s.Code();
          },
          "Block until the transfer ends (every transfer ends by its deadline); returns its "
          "StatusCode. Releases the GIL; Ctrl-C interrupts the wait, not the transfer.")
      .def(
          "WaitFor",
          [](const TransferStatus& s, py::handle ms) { return wait_status(s, to_timeout(ms)); },
          py::arg("timeout_ms"),
          "Block at most timeout_ms milliseconds; True when the transfer has ended. 0: a poll "
          "that drives the backend once (as C++ WaitFor(0)).")
      .def(
          "Cancel",
          [](const TransferStatus& s) {
            py::gil_scoped_release nogil;
            return s.Cancel();
          },
          "Ask the transfer to end ERR_CANCELLED once nothing more of it can land (an "
          "attempt in flight is fenced at its target or waited for); it may still end "
          "SUCCESS if everything had landed. False when it had already ended (a no-op). "
          "Does not wait: Wait() for the outcome.")
      .def(
          "ElapsedUs",
          [](const TransferStatus& s) {
            return std::chrono::duration_cast<std::chrono::microseconds>(s.Elapsed()).count();
          },
          "Microseconds from when the transfer was posted to when it ended (to now while it "
          "has not).")
      .def("__repr__", &status_repr);

  py::class_<PySession>(m, "IOEngineSession",
                        "Transfers between one local and one remote region, resolved once "
                        "(IOEngine.create_session). Offsets are bytes into the two regions.")
      .def("allocate_transfer_uid", &PySession::allocate_transfer_uid)
      .def("read", &PySession::read, py::arg("local_offset"), py::arg("remote_offset"),
           py::arg("size"), py::arg("transfer_uid"), py::arg("notify") = py::none(),
           py::arg("message") = py::none(),
           "One-sided READ remote -> local; returns a TransferStatus. message: bytes for the "
           "target's get_new_notifications(), delivered once the data is here.")
      .def("write", &PySession::write, py::arg("local_offset"), py::arg("remote_offset"),
           py::arg("size"), py::arg("transfer_uid"), py::arg("notify") = py::none(),
           py::arg("message") = py::none(),
           "One-sided WRITE local -> remote; returns a TransferStatus. message: bytes for the "
           "target's get_new_notifications(), delivered once the data landed.")
      .def(
          "batch_read",
          [](PySession& s, py::handle lo, py::handle ro, py::handle sz, py::handle uid,
             std::optional<bool> n,
             py::handle msg) { return s.batch(Op::READ, lo, ro, sz, uid, n, msg); },
          py::arg("local_offsets"), py::arg("remote_offsets"), py::arg("sizes"),
          py::arg("transfer_uid"), py::arg("notify") = py::none(), py::arg("message") = py::none(),
          "READ many (local_offset, remote_offset, size) items as one transfer.")
      .def(
          "batch_write",
          [](PySession& s, py::handle lo, py::handle ro, py::handle sz, py::handle uid,
             std::optional<bool> n,
             py::handle msg) { return s.batch(Op::WRITE, lo, ro, sz, uid, n, msg); },
          py::arg("local_offsets"), py::arg("remote_offsets"), py::arg("sizes"),
          py::arg("transfer_uid"), py::arg("notify") = py::none(), py::arg("message") = py::none(),
          "WRITE many (local_offset, remote_offset, size) items as one transfer.")
      .def("alive", &PySession::alive,
           "False once the engine is closed or the memory or peer is deregistered.");

  py::class_<PreparedList>(m, "PreparedList",
                           "Region slices checked once (IOEngine.prepare_list), posted by index "
                           "arrays (IOEngine.transfer_prepared).")
      .def("__len__", &PreparedList::size)
      .def_property_readonly("local", &PreparedList::local)
      .def_property_readonly("engine_key", &PreparedList::engine_key)
      .def("__repr__", [](const PreparedList& l) {
        return "<PreparedList " + std::string(l.local() ? "local" : "remote") + " '" +
               l.engine_key() + "' " + std::to_string(l.size()) + " entries>";
      });

  py::class_<PyEngine>(m, "IOEngine",
                       "One engine per process: backends, registered memory, remote engines "
                       "and transfers. Usable as a context manager (close() on exit).")
      .def(py::init<const std::string&, std::optional<EngineConfig>>(), py::arg("key"),
           py::arg("config") = py::none(),
           "Bind the control listener (config.port 0 = any free port) and load the policy.")
      .def_property_readonly("key", &PyEngine::key)
      .def_property_readonly("closed", &PyEngine::closed)
      .def("close", &PyEngine::close,
           "End the engine: backends stop, transfers in flight end, kept buffers are released. "
           "Sessions made from it refuse further work. Idempotent.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyEngine& e, py::args) { e.close(); })
      .def("get_engine_desc", &PyEngine::desc, "This engine's EngineDesc, to send to peers.")
      .def("create_backend", &PyEngine::create_backend, py::arg("type"),
           py::arg("config") = py::none(),
           "Load and start a backend plugin: a BackendType or a name ('tcp', 'rdma', 'xgmi', "
           "'ofi', any libferry-<name>.so). config: None (the policy's settings), a dict or JSON "
           "string of plugin settings, or a *BackendConfig. Raises TransferError when the "
           "plugin cannot load or start, InvalidArgumentError for bad settings.")
      .def("remove_backend", &PyEngine::remove_backend, py::arg("type"))
      .def("backends", &PyEngine::backends, "Names of the loaded backends.")
      .def("register_remote_engine", &PyEngine::register_remote_engine, py::arg("engine_desc"),
           "Register a peer from its EngineDesc (or its packed bytes).")
      .def("deregister_remote_engine", &PyEngine::deregister_remote_engine, py::arg("engine_desc"),
           "Forget a peer (an EngineDesc or its key).")
      .def("register_memory", &PyEngine::register_memory, py::arg("ptr"), py::arg("size"),
           py::arg("device_id") = -1, py::arg("mem_loc") = MemoryLocation::UNKNOWN,
           "Register raw memory (ptr: int address, ctypes pointer or capsule). mem_loc Unknown: "
           "the core detects CPU or GPU from the pointer. The caller keeps the memory alive "
           "until deregister_memory().")
      .def("register_buffer", &PyEngine::register_buffer, py::arg("obj"),
           "Register a writable, C-contiguous buffer-protocol object (numpy array, bytearray, "
           "mmap, memoryview). The engine holds the buffer until deregister_memory()/close().")
      .def("register_torch_tensor", &PyEngine::register_torch_tensor, py::arg("tensor"),
           "Register a contiguous torch.Tensor (CPU or CUDA; or any object with "
           "__cuda_array_interface__). The engine holds a reference to it. torch is never "
           "imported by ferry.")
      .def("deregister_memory", &PyEngine::deregister_memory, py::arg("mem_desc"),
           "Deregister local memory (waits for its transfers in flight to end).")
      .def("allocate_transfer_uid", &PyEngine::allocate_transfer_uid)
      .def(
          "read",
          [](PyEngine& e, const MemoryDesc& l, py::handle lo, const MemoryDesc& r, py::handle ro,
             py::handle sz, py::handle uid, std::optional<bool> n,
             py::handle msg) { return e.single(Op::READ, l, lo, r, ro, sz, uid, n, msg); },
          py::arg("local_mem"), py::arg("local_offset"), py::arg("remote_mem"),
          py::arg("remote_offset"), py::arg("size"), py::arg("transfer_uid"),
          py::arg("notify") = py::none(), py::arg("message") = py::none(),
          "One-sided READ remote -> local. Returns a TransferStatus; bad offsets or unknown "
          "memory end it at once (ERR_INVALID_ARGS / ERR_NOT_FOUND).")
      .def(
          "write",
          [](PyEngine& e, const MemoryDesc& l, py::handle lo, const MemoryDesc& r, py::handle ro,
             py::handle sz, py::handle uid, std::optional<bool> n,
             py::handle msg) { return e.single(Op::WRITE, l, lo, r, ro, sz, uid, n, msg); },
          py::arg("local_mem"), py::arg("local_offset"), py::arg("remote_mem"),
          py::arg("remote_offset"), py::arg("size"), py::arg("transfer_uid"),
          py::arg("notify") = py::none(), py::arg("message") = py::none(),
          "One-sided WRITE local -> remote. Returns a TransferStatus. message: bytes delivered "
          "to the target's get_new_notifications() once the data landed (exactly once); the "
          "status succeeds only after that.")
      .def(
          "batch_read",
          [](PyEngine& e, const MemoryDesc& l, py::handle lo, const MemoryDesc& r, py::handle ro,
             py::handle sz, py::handle uid, std::optional<bool> n,
             py::handle msg) { return e.batch(Op::READ, l, lo, r, ro, sz, uid, n, msg); },
          py::arg("local_mem"), py::arg("local_offsets"), py::arg("remote_mem"),
          py::arg("remote_offsets"), py::arg("sizes"), py::arg("transfer_uid"),
          py::arg("notify") = py::none(), py::arg("message") = py::none(),
          "READ many items (sequences or int64 numpy arrays of offsets and sizes) as one "
          "transfer with one status.")
      .def(
          "batch_write",
          [](PyEngine& e, const MemoryDesc& l, py::handle lo, const MemoryDesc& r, py::handle ro,
             py::handle sz, py::handle uid, std::optional<bool> n,
             py::handle msg) { return e.batch(Op::WRITE, l, lo, r, ro, sz, uid, n, msg); },
          py::arg("local_mem"), py::arg("local_offsets"), py::arg("remote_mem"),
          py::arg("remote_offsets"), py::arg("sizes"), py::arg("transfer_uid"),
          py::arg("notify") = py::none(), py::arg("message") = py::none(),
          "WRITE many items as one transfer with one status.")
      .def("transfer", &PyEngine::transfer, py::arg("op"), py::arg("local_mems"),
           py::arg("remote_mems"), py::arg("items"), py::arg("transfer_uid"),
           py::arg("notify") = py::none(), py::arg("message") = py::none(),
           "One transfer over many regions of one remote engine: op 'read'/'write'; items "
           "(local, local_offset, remote, remote_offset, size) index local_mems / remote_mems "
           "(a sequence of 5-tuples or an int64 array of 5 columns). One status; the target "
           "hears of it (notify, message) once, after all the data.")
      .def("prepare_list", &PyEngine::prepare_list, py::arg("mems"), py::arg("entries"),
           "A PreparedList of (region, offset, size) slices of mems (all this engine's, or "
           "all one registered peer's), checked once; entries: 3-tuples or an int64 array of 3 "
           "columns.")
      .def("transfer_prepared", &PyEngine::transfer_prepared, py::arg("op"), py::arg("local_list"),
           py::arg("local_indices"), py::arg("remote_list"), py::arg("remote_indices"),
           py::arg("transfer_uid"), py::arg("notify") = py::none(), py::arg("message") = py::none(),
           "Item i: local_list[local_indices[i]] <-> remote_list[remote_indices[i]] (equal "
           "sizes), as one transfer (int64 numpy arrays are read in place).")
      .def("send_notification", &PyEngine::send_notification, py::arg("remote_key"),
           py::arg("message"),
           "Send a notification message (bytes or str, at most 64 KiB) to engine remote_key; "
           "returns a TransferStatus: SUCCESS once the target took it (exactly once, in order "
           "per target).")
      .def("get_new_notifications", &PyEngine::get_new_notifications,
           "Target side: {remote_key: [bytes, ...]} of every message that arrived since the "
           "last call, in arrival order (the inbox is emptied).")
      .def("wait_notifications", &PyEngine::wait_notifications, py::arg("timeout_ms") = py::none(),
           "As get_new_notifications, waiting up to timeout_ms (None: no limit) for one to "
           "arrive; {} when none did. Releases the GIL.")
      .def("notification_fd", &PyEngine::notification_fd,
           "A file descriptor readable while messages are unread (asyncio: "
           "loop.add_reader(fd, ...), then get_new_notifications()). Never read it.")
      .def("create_session", &PyEngine::create_session, py::arg("local_mem"), py::arg("remote_mem"),
           py::kw_only(), py::arg("raise_on_failure") = false,
           "A session for repeated transfers between the two regions, or None when no backend "
           "can serve them (as MORI-IO); raise_on_failure=True raises the reason instead.")
      .def("pop_inbound_transfer_status", &PyEngine::pop_inbound, py::arg("remote_key"),
           py::arg("transfer_uid"),
           "Target side: the status of transfer_uid from engine remote_key if it has landed "
           "(removed from the table), else None.")
      .def("wait_inbound", &PyEngine::wait_inbound, py::arg("remote_key"), py::arg("transfer_uid"),
           py::arg("timeout_ms") = py::none(),
           "As pop_inbound_transfer_status, waiting up to timeout_ms (None: no limit) for it to "
           "land. Releases the GIL.")
      .def("stats", &PyEngine::stats,
           "Counters: {'backends': {name: {bytes, transfers, failures, failovers, quarantines}}, "
           "'inbound_notifications', 'inbound_dropped', 'ctrl_rejected', 'ctrl_unix_connections', "
           "'notifies_resent', 'notifies_unanswered', 'fences', 'fence_unknown', "
           "'fenced_peers', 'notifications_received', 'notifications_refused', "
           "'notifications_unread'}.")
      .def("policy_source", &PyEngine::policy_source,
           "Where the routing policy came from ('built-in' or a file name).")
      .def("metrics_address", &PyEngine::metrics_address,
           "'host:port' of the Prometheus /metrics endpoint; '' when it is off.")
      .def("publish_memory", &PyEngine::publish_memory, py::arg("name"), py::arg("mem"),
           "Publish a MemoryDesc of this engine in the metadata store (etcd) as name.")
      .def("unpublish_memory", &PyEngine::unpublish_memory, py::arg("name"))
      .def("fetch_remote_engine", &PyEngine::fetch_remote_engine, py::arg("key"),
           py::arg("wait_ms") = 0,
           "Fetch engine key's descriptor from the metadata store, register it and follow it "
           "(deregistered when its lease expires); waits up to wait_ms for it to appear. "
           "Releases the GIL.")
      .def("fetch_memory", &PyEngine::fetch_memory, py::arg("key"), py::arg("name"),
           py::arg("wait_ms") = 0,
           "The MemoryDesc engine key published as name, waiting up to wait_ms. Releases the GIL.")
      .def_static("wait_all", &wait_all_py, py::arg("statuses"), py::arg("timeout_ms") = py::none(),
                  "Wait for every status; False if any did not end within timeout_ms.")
      .def("__repr__", [](const PyEngine& e) {
        return "<IOEngine '" + e.key() + "'" + (e.closed() ? " closed" : "") + ">";
      });

  m.def("wait_all", &wait_all_py, py::arg("statuses"), py::arg("timeout_ms") = py::none(),
        "Wait for every TransferStatus (GIL released); False if any did not end within "
        "timeout_ms (None: no limit).");

  m.def(
      "set_log_level",
      [](const std::string& level) {
        if (!ferry::set_log_level(level))
          raise_value("set_log_level: '" + level + "' is not error, warn, info or debug");
      },
      py::arg("level"),
      "ferry's log verbosity from now on: 'error', 'warn' (the default, or FERRY_LOG_LEVEL), "
      "'info' or 'debug'. ValueError for another name.");

  m.def(
      "list_plugins",
      [](const std::vector<std::string>& extra_dirs) {
        std::vector<PluginInfo> found;
        {
          py::gil_scoped_release nogil;
          found = discover_plugins(extra_dirs);
        }
        py::list out;
        for (const auto& p : found) {
          py::dict d;
          d["name"] = p.name;
          d["path"] = p.path;
          d["loaded"] = p.loaded;
          d["error"] = p.error;
          d["version"] = p.version;
          d["abi"] = std::to_string(p.abi_major) + "." + std::to_string(p.abi_minor);
          d["caps"] = caps_to_string(p.caps);
          d["description"] = p.description;
          d["warning"] = p.warning;  // the table's size and its abi_minor disagree, else ""
          out.append(d);
        }
        return out;
      },
      py::arg("extra_dirs") = std::vector<std::string>{},
      "Every plugin on the search path (FERRY_PLUGIN_PATH, extra_dirs, <libdir>/ferry/plugins), "
      "loaded or why not (what `ferry info` prints).");
}
