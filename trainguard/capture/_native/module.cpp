// Python bindings of the native core: the Core object, the drain into record tuples, summaries.
#include "core.h"

#include <ATen/SequenceNumber.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/utils/pybind.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <future>
#include <map>
#include <thread>
#include <unordered_map>

namespace py = pybind11;
using namespace tg;

namespace {

PyObject* g_dtype_names[256] = {nullptr};  // ScalarType -> "float32"
PyObject* g_phase_names[4] = {nullptr};
PyObject *g_op = nullptr, *g_written = nullptr, *g_input = nullptr, *g_d = nullptr, *g_cpu = nullptr;

PyObject* steal(PyObject* o) {
  if (o == nullptr) throw py::error_already_set();
  return o;
}

// The drain's tuples hold only numbers, strings, None, devices and other such tuples: they can
// never be part of a reference cycle, so they are taken off the garbage collector's lists at
// once. Tracked, tens of thousands of them per second made the collector run on the drain
// thread again and again and, once the writer's window promoted them, traverse every object of
// the process in full collections (MLP step, no_tensor: the collector was ~4% of the process's
// CPU time, 60% of the drain thread's).
PyObject* untracked(PyObject* o) {
  PyObject_GC_UnTrack(o);
  return o;
}

PyObject* floats(const Summary& s) {
  PyObject* t = steal(PyTuple_New(s.n));
  for (int i = 0; i < s.n; ++i) PyTuple_SET_ITEM(t, i, steal(PyFloat_FromDouble(s.v[i])));
  return untracked(t);
}

struct PyCore {
  std::unique_ptr<Core> core;
  std::unordered_map<std::string, PyObject*> devices;  // str(device) for the records
  std::unordered_map<std::string, py::object> device_objs;  // torch.device for deferred rows
  // The sizes of the last batch drained (see drain), at most MAX_RESERVE records' worth.
  static constexpr size_t MAX_RESERVE = 2 * FLUSH_RECORDS;
  size_t last_records = 0, last_inputs = 0, last_outputs = 0, last_dims = 0;
  pid_t pid = getpid();

  // A copy of the parent's core in a forked child (a DataLoader worker): dead there. Its lock
  // may have been held by a thread the child does not have, and its threads are gone; every
  // method returns at once without touching it (see recorder.cpp's fork handlers).
  bool dead() const { return g_forked.load(std::memory_order_relaxed) && pid != getpid(); }

  PyCore(int mode, int strategy, py::object wanted_fn, py::list dtypes, py::object on_new_stack) {
    core = std::make_unique<Core>();
    core->mode = mode;
    core->strategy = strategy;
    if (!wanted_fn.is_none()) {
      core->wanted_fn = wanted_fn.ptr();
      Py_INCREF(core->wanted_fn);
    }
    if (!dtypes.is_none() && py::len(dtypes) > 0) {
      core->has_dtypes = true;
      for (auto d : dtypes) core->dtypes.insert((int)reinterpret_cast<THPDtype*>(d.ptr())->scalar_type);
    }
    core->stacks = stacks_new(on_new_stack.is_none() ? nullptr : on_new_stack.ptr());
  }

  ~PyCore() {
    if (dead()) {
      (void)core.release();  // its tables may be mid-change: left as they are
      return;
    }
    uninstall(core.get());
    core->named.for_each([](uint64_t, Named& n) {
      Py_XDECREF(n.name);
      Py_XDECREF(n.what);
    });
    Py_XDECREF(core->wanted_fn);
    Py_XDECREF(core->on_owner);
    stacks_free(core->stacks);
    for (auto& kv : devices) Py_DECREF(kv.second);
    clear_meta_tuples();
    for (auto& kv : named_refs) Py_DECREF(kv.second);
    Py_XDECREF(input_none);
  }

  bool start() { return !dead() && install(core.get()); }
  void stop() {
    if (!dead()) uninstall(core.get());
  }
  int slot() const { return core->slot; }

  void set_owner_hooks(py::object module_type, py::object ctx_type, py::object on_owner) {
    // With the GIL, before start(): the types live as long as torch, the callable is owned.
    core->module_type = reinterpret_cast<PyTypeObject*>(module_type.ptr());
    core->ctx_type = reinterpret_cast<PyTypeObject*>(ctx_type.ptr());
    Py_XDECREF(core->on_owner);
    core->on_owner = on_owner.ptr();
    Py_INCREF(core->on_owner);
  }

  void forget_owner(uintptr_t address) {
    if (dead()) return;
    std::lock_guard<std::mutex> g(core->owners_mu);
    core->owners.erase(reinterpret_cast<const PyObject*>(address));
  }

  void set_module(int64_t mid) {
    if (core->slot >= 0) tl_module[core->slot] = mid;
  }

  void name_tensor(const at::Tensor& t, py::str name, py::str what) {
    if (dead()) return;
    std::lock_guard<std::mutex> g(core->mu);
    auto* impl = t.unsafeGetTensorImpl();
    if (core->named.find(impl_key(impl))) return;  // the first name stays, as in ModuleTracker
    Py_INCREF(name.ptr());
    Py_INCREF(what.ptr());
    core->named.emplace(impl_key(impl), Named{c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()), name.ptr(), what.ptr()});
  }

  void on_step(int64_t step) {
    if (dead()) return;
    Dead swept;  // dropped after the lock (Core::dead_impls)
    std::lock_guard<std::mutex> g(core->mu);
    // Every step, although a sweep scans every slot (a table grown large once by a PPO rollout is
    // scanned whole at each step, 29-40 us): sweeping only once the tables had grown by half kept
    // dead entries, and with them memory, across steps: the transformer block's peak RSS under
    // full_health went from 1.05x plain to 1.37x (bench_recorder), past the 1.1x target.
    core->sweep();
    swept.take(core.get());
    if (core->fwd_nodes.size() > 4096) core->prune_fwd_nodes(step);
  }

  PyObject* device_str(const c10::Device& d) {
    if (d.is_cpu()) return g_cpu;
    std::string k = d.str();
    auto it = devices.find(k);
    if (it != devices.end()) return it->second;
    PyObject* s = steal(PyUnicode_FromString(k.c_str()));
    devices.emplace(k, s);
    return s;
  }

  py::object device_obj(const c10::Device& d) {
    std::string k = d.str();
    auto it = device_objs.find(k);
    if (it != device_objs.end()) return it->second;
    py::object o = py::reinterpret_steal<py::object>(THPDevice_New(d));
    device_objs.emplace(k, o);
    return o;
  }

  // Parts of the record tuples that repeat are made once and shared by the records (tuples
  // are immutable): ("input", None), ("param"|"buffer", name), and (dtype, shape, device).
  PyObject* input_none = nullptr;
  std::map<std::pair<PyObject*, PyObject*>, PyObject*> named_refs;  // each tuple holds its key
  struct DimsHash {
    size_t operator()(const std::vector<int64_t>& v) const {
      size_t h = 1469598103934665603ull;
      for (int64_t x : v) h = (h ^ (size_t)x) * 1099511628211ull;
      return h;
    }
  };
  std::unordered_map<std::vector<int64_t>, PyObject*, DimsHash> meta_tuples;  // (dtype, device, sizes...)
  std::vector<int64_t> meta_key;
  static constexpr size_t META_TUPLES_MAX = 1 << 14;

  PyObject* input_ref() {
    if (input_none == nullptr) input_none = untracked(steal(PyTuple_Pack(2, g_input, Py_None)));
    Py_INCREF(input_none);
    return input_none;
  }

  PyObject* named_ref(PyObject* what, PyObject* name) {
    auto key = std::make_pair(what, name);
    auto it = named_refs.find(key);
    if (it == named_refs.end())
      it = named_refs.emplace(key, untracked(steal(PyTuple_Pack(2, what, name)))).first;
    Py_INCREF(it->second);
    return it->second;
  }

  PyObject* meta_tuple(const Output& o, const int64_t* dims) {
    meta_key.clear();
    meta_key.push_back((int64_t)o.dtype);
    meta_key.push_back(((int64_t)o.device.type() << 16) | (int64_t)(uint16_t)o.device.index());
    meta_key.insert(meta_key.end(), dims + o.dims, dims + o.dims + o.ndim);
    auto it = meta_tuples.find(meta_key);
    if (it == meta_tuples.end()) {
      if (meta_tuples.size() >= META_TUPLES_MAX) clear_meta_tuples();
      PyObject* shape = steal(PyTuple_New((Py_ssize_t)o.ndim));
      for (size_t k = 0; k < o.ndim; ++k) PyTuple_SET_ITEM(shape, k, steal(PyLong_FromLongLong(dims[o.dims + k])));
      untracked(shape);
      PyObject* dt = g_dtype_names[(int)o.dtype];
      PyObject* m = untracked(steal(PyTuple_Pack(3, dt ? dt : Py_None, shape, device_str(o.device))));
      Py_DECREF(shape);
      it = meta_tuples.emplace(meta_key, m).first;
    }
    Py_INCREF(it->second);
    return it->second;
  }

  void clear_meta_tuples() {
    for (auto& kv : meta_tuples) Py_DECREF(kv.second);
    meta_tuples.clear();
  }

  PyObject* record_tuple(const Record& r, const Input* inputs, const Output* outputs, const int64_t* dims,
                         int nfields) {
    PyObject* ins = steal(PyTuple_New((Py_ssize_t)r.nin));
    for (size_t i = 0; i < r.nin; ++i) {
      const Input& in = inputs[r.in0 + i];
      PyObject* e;
      if (in.kind == 0) {
        e = steal(PyTuple_New(2));
        PyObject* kind = in.written ? g_written : g_op;
        Py_INCREF(kind);
        PyTuple_SET_ITEM(e, 0, kind);
        PyTuple_SET_ITEM(e, 1, steal(PyLong_FromLongLong(in.ref)));
        untracked(e);
      } else if (in.kind == 2) {
        e = named_ref(in.what, in.name);
      } else {
        e = input_ref();
      }
      PyTuple_SET_ITEM(ins, i, e);
    }
    untracked(ins);
    PyObject* metas = steal(PyTuple_New((Py_ssize_t)r.nout));
    PyObject* sums = nfields ? steal(PyTuple_New((Py_ssize_t)r.nout)) : nullptr;
    for (size_t i = 0; i < r.nout; ++i) {
      const Output& o = outputs[r.out0 + i];
      PyTuple_SET_ITEM(metas, i, meta_tuple(o, dims));
      if (sums) {
        PyObject* s;
        if (o.summary == 2) {
          py::object dev = device_obj(o.device);
          s = untracked(steal(Py_BuildValue("(OOL)", g_d, dev.ptr(), (long long)o.row)));
        } else {
          s = floats(o.s);
        }
        PyTuple_SET_ITEM(sums, i, s);
      }
    }
    untracked(metas);
    if (sums) untracked(sums);
    PyObject* health = r.health < 0 ? (Py_INCREF(Py_None), Py_None) : steal(PyLong_FromLong(r.health));
    PyObject* mod = r.module ? steal(PyLong_FromLongLong(r.module)) : (Py_INCREF(Py_None), Py_None);
    PyObject* stack = r.stack ? steal(PyLong_FromLongLong(r.stack)) : (Py_INCREF(Py_None), Py_None);
    PyObject* fwd = r.fwd_seq >= 0 ? steal(PyLong_FromLongLong(r.fwd_seq)) : (Py_INCREF(Py_None), Py_None);
    PyObject* t = steal(PyTuple_New(13));
    PyTuple_SET_ITEM(t, 0, steal(PyLong_FromLongLong(r.seq)));
    PyTuple_SET_ITEM(t, 1, steal(PyLong_FromLongLong(r.step)));
    Py_INCREF(g_phase_names[r.phase]);
    PyTuple_SET_ITEM(t, 2, g_phase_names[r.phase]);
    Py_INCREF(r.op->py_name);
    PyTuple_SET_ITEM(t, 3, r.op->py_name);
    PyTuple_SET_ITEM(t, 4, mod);
    PyTuple_SET_ITEM(t, 5, stack);
    PyTuple_SET_ITEM(t, 6, fwd);
    PyTuple_SET_ITEM(t, 7, health);
    PyTuple_SET_ITEM(t, 8, ins);
    PyTuple_SET_ITEM(t, 9, metas);
    if (sums) PyTuple_SET_ITEM(t, 10, sums);
    else { Py_INCREF(Py_None); PyTuple_SET_ITEM(t, 10, Py_None); }
    // taint, origin: finite where the core's fast path judged it (Core::last_seq), else judged
    // in Python (capture/_taint.Tracker) when the batch is drained
    PyTuple_SET_ITEM(t, 11, r.taint == 0 ? steal(PyLong_FromLong(0)) : (Py_INCREF(Py_None), Py_None));
    Py_INCREF(Py_None);
    PyTuple_SET_ITEM(t, 12, Py_None);
    return untracked(t);
  }

  // (records, deferred {device: [tensors]} or None, payloads [(seq, slot, tensor)], bad,
  //  failures [(op, message)], unsure [op], live, judge, cut) — everything since the last drain.
  //  With ``live``, the seqs of the producers of live tensors at the moment of the drain (a later
  //  record can only name those as inputs), else None. ``judge``: the indices of the records
  //  the Python judge must see (taint None), ``cut`` the index of the first record whose health
  //  is not known on the host yet (len(records) if none). ``live_if_bad``: ``live`` also when the
  //  batch holds a non-finite value (its states are the judge's first since the last prune).
  py::tuple drain(bool want_live, bool live_if_bad) {
    if (dead())
      return py::make_tuple(py::list(), py::none(), py::list(), false, py::list(), py::list(),
                            want_live ? py::object(py::list()) : py::object(py::none()), py::list(), 0);
    // The buffers the recording thread appends to next, allocated here, on the drain's thread,
    // as large as the last batch's (so that the training thread does not grow them again).
    std::vector<Record> recs;
    std::vector<Input> ins;
    std::vector<Output> outs;
    std::vector<int64_t> dims;
    recs.reserve(std::min(last_records, MAX_RESERVE));
    ins.reserve(std::min(last_inputs, 4 * MAX_RESERVE));
    outs.reserve(std::min(last_outputs, 2 * MAX_RESERVE));
    dims.reserve(std::min(last_dims, 8 * MAX_RESERVE));
    std::vector<std::pair<c10::Device, std::vector<at::Tensor>>> deferred;
    std::vector<std::pair<std::string, std::string>> failed;
    std::vector<std::string> unsure;
    std::vector<int64_t> live;
    Dead swept;  // what the sweeps since the last drain let go of, dropped after the lock (Core::dead_impls)
    bool bad;
    {
      std::lock_guard<std::mutex> g(core->mu);
      want_live = want_live || (live_if_bad && core->bad);
      if (want_live) {
        core->sweep();
        live.reserve(core->producers.size() + core->saved.size());
        core->producers.for_each([&](uint64_t, const Producer& p) { live.push_back(p.seq); });
        core->saved.for_each([&](uint64_t, const Saved& s) { live.push_back(s.seq); });  // held by autograd (see Saved)
      }
      swept.take(core.get());
      if (!core->records.empty()) {  // else the core keeps its (reserved) buffers
        recs.swap(core->records);
        ins.swap(core->inputs);
        outs.swap(core->outputs);
        dims.swap(core->dims);
      }
      deferred.swap(core->deferred);
      failed.swap(core->failed);
      unsure.swap(core->unsure_ops);
      bad = core->bad;
      core->bad = false;
      core->serious = 0;
      core->payload_bytes = 0;
      core->drained.notify_all();
    }
    // Threads other than the recording one (autograd's device threads) may append out of order.
    if (!std::is_sorted(recs.begin(), recs.end(), [](auto& a, auto& b) { return a.seq < b.seq; }))
      std::sort(recs.begin(), recs.end(), [](auto& a, auto& b) { return a.seq < b.seq; });
    if (!recs.empty()) {
      last_records = recs.size();
      last_inputs = ins.size();
      last_outputs = outs.size();
      last_dims = dims.size();
    }
    int nfields = mode_fields(core->mode);
    py::list out;
    py::list payloads;
    py::list judge;
    size_t cut = recs.size();
    for (size_t i = 0; i < recs.size(); ++i) {
      const Record& r = recs[i];
      if (r.taint != 0) judge.append(py::int_(i));
      if (r.health < 0 && cut == recs.size()) cut = i;
      out.append(py::reinterpret_steal<py::object>(record_tuple(r, ins.data(), outs.data(), dims.data(), nfields)));
      for (size_t k = 0; k < r.payloads.size(); ++k) payloads.append(py::make_tuple(r.seq, k, r.payloads[k]));
    }
    py::object dd = py::none();
    if (!deferred.empty()) {
      py::dict d;
      for (auto& kv : deferred) d[device_obj(kv.first)] = py::cast(kv.second);
      dd = d;
    }
    py::list fl;
    for (auto& f : failed) fl.append(py::make_tuple(f.first, f.second));
    py::object lv = want_live ? py::cast(live) : py::none();
    return py::make_tuple(out, dd, payloads, bad, fl, py::cast(unsure), lv, judge, cut);
  }

  // (seq, health) of the op that made ``t``'s current values, or None (not made by a recorded
  // op): the program reads ``t`` (capture/_reads.py).
  py::object producer_of(const at::Tensor& t) {
    if (dead()) return py::none();
    std::lock_guard<std::mutex> g(core->mu);
    Producer* p = core->producers.find(impl_key(t.unsafeGetTensorImpl()));
    if (p == nullptr || p->ref.expired()) {
      // ``loss.data``, which the program reads as ``loss.to('cpu').data.numpy()`` (normflows'
      // examples): a new TensorImpl over the output's storage, made by no op. The output it
      // aliases was remembered if it required grad; its health is the judge's (-1: not known).
      const tg::Saved* s = tg::saved_of(core.get(), t);
      if (s == nullptr) return py::none();
      return py::make_tuple(s->seq, -1);
    }
    return py::make_tuple(p->seq, p->health);
  }

  // Records made in Python (compiled graphs, capture/_compile_run.py) between the core's: ``n``
  // seqs after every op recorded so far, returned as the first. The autograd nodes made until now
  // belong to them (as the Python recorder sets last_nr after a graph call).
  int64_t reserve(int64_t n) {
    if (dead()) return core->seq;
    std::lock_guard<std::mutex> g(core->mu);
    int64_t base = core->seq;
    core->seq += n;
    core->last_nr = at::sequence_number::peek();
    return base;
  }

  void set_producer(const at::Tensor& t, int64_t seq, int64_t stack, bool finite) {
    if (dead()) return;
    std::lock_guard<std::mutex> g(core->mu);
    tg::set_producer(core.get(), t, seq, stack, finite);
  }

  // Whether a waiting record needs the Python judge for more than the order of phases (see
  // Core::serious), or a non-finite value was recorded since the last drain.
  bool needs_judge() {
    if (dead()) return false;
    std::lock_guard<std::mutex> g(core->mu);
    return core->serious > 0 || core->bad;
  }

  // torch is about to swap ``t`` (torch.utils.swap_tensors refuses a TensorImpl with weak
  // references): drop the core's. Returns (name, kind) when ``t`` was named, for the caller to
  // name it again after the swap (a parameter keeps its identity), else None.
  py::object release(const at::Tensor& t) {
    if (dead()) return py::none();
    std::lock_guard<std::mutex> g(core->mu);
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    core->producers.erase(impl_key(impl));
    Named* n = core->named.find(impl_key(impl));
    if (n == nullptr) return py::none();
    py::object out = py::make_tuple(py::reinterpret_steal<py::object>(n->name),
                                    py::reinterpret_steal<py::object>(n->what));
    core->named.erase(impl_key(impl));
    return out;
  }

  size_t pending() {
    if (dead()) return 0;
    std::lock_guard<std::mutex> g(core->mu);
    return core->records.size();
  }

  // Wait (without the GIL) until FLUSH_RECORDS are pending, a non-finite value was recorded, or
  // the timeout passed; True when a drain is due now.
  bool wait(double timeout) {
    if (dead()) return false;
    py::gil_scoped_release nogil;
    std::unique_lock<std::mutex> g(core->mu);
    return core->cv.wait_for(g, std::chrono::duration<double>(timeout),
                             [&] { return core->bad || core->records.size() >= FLUSH_RECORDS || !core->active; });
  }

  void wake() {
    if (dead()) return;
    std::lock_guard<std::mutex> g(core->mu);
    core->cv.notify_all();
    core->drained.notify_all();
  }

  // For tests: a thread of its own takes this core's lock and the process-wide ones (the
  // operators table's, the pool's), as a thread inside a callback does, and holds them for
  // ``seconds``; returns once they are held. The core must outlive the hold.
  void hold_locks(double seconds) {
    Core* c = core.get();
    auto held = std::make_shared<std::promise<void>>();
    auto ready = held->get_future();
    std::thread([c, held, seconds] {
      std::lock_guard<std::mutex> a(c->mu);
      std::lock_guard<std::mutex> b(g_ops_mu);
      std::lock_guard<std::mutex> p(g_pool_mu);
      held->set_value();
      std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    }).detach();
    py::gil_scoped_release nogil;
    ready.wait();
  }

  py::dict counts() {
    std::unique_lock<std::mutex> g(core->mu, std::defer_lock);
    if (!dead()) g.lock();  // in a child nothing else touches its copy: read as it is
    py::dict d;
    d["seq"] = core->seq;
    d["recorded"] = core->recorded;
    d["failures"] = core->failures;
    d["unsure"] = core->unsure;
    d["producers"] = core->producers.size();
    d["fwd_nodes"] = core->fwd_nodes.size();
    return d;
  }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "trainguard's native recorder core (RecordFunction callbacks, summaries, stacks)";
  g_op = PyUnicode_InternFromString("op");
  g_written = PyUnicode_InternFromString("written");
  g_input = PyUnicode_InternFromString("input");
  g_d = PyUnicode_InternFromString("d");
  g_cpu = PyUnicode_InternFromString("cpu");
  const char* phases[4] = {"forward", "backward", "optimizer", "other"};
  for (int i = 0; i < 4; ++i) g_phase_names[i] = PyUnicode_InternFromString(phases[i]);

  m.def("configure", [](py::list dtype_names, std::vector<std::string> alloc, std::vector<std::string> alias,
                         std::unordered_map<std::string, int> stats, std::unordered_map<std::string, int> workspace) {
    for (auto item : dtype_names) {
      auto pair = item.cast<py::tuple>();
      int st = (int)reinterpret_cast<THPDtype*>(pair[0].ptr())->scalar_type;
      if (st >= 0 && st < 256 && g_dtype_names[st] == nullptr) {
        g_dtype_names[st] = pair[1].ptr();
        Py_INCREF(g_dtype_names[st]);
      }
    }
    set_op_names({alloc.begin(), alloc.end()}, {alias.begin(), alias.end()}, std::move(stats), std::move(workspace));
  });
  m.def("summarize", [](const at::Tensor& t, int mode, bool expect_nonfinite) {
    bool old = tl_paused;
    tl_paused = true;
    Summary s;
    try {
      s = summarize(t.detach(), mode, expect_nonfinite);
    } catch (...) {
      tl_paused = old;
      throw;
    }
    tl_paused = old;
    return py::reinterpret_steal<py::tuple>(floats(s));
  }, py::arg("t"), py::arg("mode"), py::arg("expect_nonfinite") = false);
  // The summary kernel's vector pass (tests run every pass this CPU has): (old level, best level).
  m.def("_simd", [](int level) { return std::make_pair(simd_level(level), simd_max()); }, py::arg("level") = -1);
  m.def("set_paused", [](bool p) {
    bool old = tl_paused;
    tl_paused = p;
    return old;
  }, "Pause (True) or resume recording of this thread's ops; returns the previous state.");
  m.def("set_op_classes", [](py::object resolver) { set_op_classes(resolver.ptr()); },
        "The taint facts of an op by name: callable(name) -> (class, overwrites, in place).");
  m.def("set_step", [](int64_t s) { g_step.store(s); });
  m.def("set_in_optimizer", [](int n) { g_in_optimizer.store(n); });
  m.def("forked", []() { return g_forked.load(); });
  m.def("_pool_blocks", [](std::vector<size_t> sizes) {
    std::vector<uintptr_t> out;
    for (size_t n : sizes) out.push_back((uintptr_t)pool_alloc(n));
    for (size_t i = 0; i < sizes.size(); ++i) pool_free((void*)out[i], sizes[i]);
    return out;
  }, "For tests: the addresses the tables' pool hands out for blocks of these sizes, in order (freed after).");

  py::class_<PyCore>(m, "Core")
      .def(py::init<int, int, py::object, py::list, py::object>(), py::arg("mode"), py::arg("strategy"),
           py::arg("wanted"), py::arg("dtypes"), py::arg("on_new_stack"))
      .def("start", &PyCore::start)
      .def("stop", &PyCore::stop)
      .def_property_readonly("slot", &PyCore::slot)
      .def("set_module", &PyCore::set_module)
      .def("set_owner_hooks", &PyCore::set_owner_hooks)
      .def("forget_owner", &PyCore::forget_owner)
      .def("name_tensor", &PyCore::name_tensor)
      .def("on_step", &PyCore::on_step)
      .def("drain", &PyCore::drain, py::arg("live") = false, py::arg("live_if_bad") = false)
      .def("producer_of", &PyCore::producer_of)
      .def("reserve", &PyCore::reserve)
      .def("set_producer", &PyCore::set_producer, py::arg("t"), py::arg("seq"), py::arg("stack"),
           py::arg("finite") = false)
      .def("needs_judge", &PyCore::needs_judge)
      .def("release", &PyCore::release)
      .def("pending", &PyCore::pending)
      .def("wait", &PyCore::wait)
      .def("wake", &PyCore::wake)
      .def("counts", &PyCore::counts)
      .def("_hold_locks", &PyCore::hold_locks);
}
