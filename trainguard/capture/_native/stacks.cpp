// Python stacks for the native core, read from the interpreter's frame chain without the GIL.
//
// The thread that runs an op is inside the Python frames that called it, so its chain of
// _PyInterpreterFrame cannot change while the op's callback runs: reading (code, instruction)
// pairs needs no lock and allocates nothing. A stack is keyed exactly as StackInterner keys it
// (the innermost frame and up to 64 callers), so both backends number stacks alike. Only a stack
// never seen before takes the GIL: its frames are symbolised, their code objects kept alive (so
// that a known key can never be reused by another code object) and handed to Python once.
#include "native.h"

#if PY_VERSION_HEX < 0x030B0000 || PY_VERSION_HEX >= 0x030D0000
#error "trainguard's native core reads the frames of CPython 3.11 and 3.12"
#endif
#define Py_BUILD_CORE
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE

#include <array>
#include <atomic>
#include <mutex>
#include <unordered_map>

namespace tg {

namespace {
constexpr int MAX_DEPTH = 64;  // trainguard.capture._stacks.MAX_DEPTH

struct Key {
  std::vector<std::pair<const void*, int>> frames;
  size_t hash = 0;
  bool operator==(const Key& o) const { return hash == o.hash && frames == o.frames; }
};
struct KeyHash {
  size_t operator()(const Key& k) const { return k.hash; }
};

_PyInterpreterFrame* complete(_PyInterpreterFrame* f) {
  while (f != nullptr && _PyFrame_IsIncomplete(f)) f = f->previous;
  return f;
}
}  // namespace

struct StackTable {
  uint64_t uid = 0;  // never reused: a thread's cached entries of a freed table never match
  PyObject* on_new = nullptr;
  std::mutex mu;
  std::unordered_map<Key, int64_t, KeyHash> ids;
  std::vector<PyObject*> codes;
  std::unordered_map<int64_t, std::pair<int, int>> hints;  // stacks with a hint only
};

namespace {
std::atomic<uint64_t> g_table_uid{0};

// Per thread, the stacks it met last, direct-mapped by hash, in front of the table's map and
// its lock (an op's stack is usually one this thread met in the step before: a loop's next op).
// A training step runs from a few hundred call sites (cleanrl's PPO: its rollout, its update);
// with 64 entries they missed each other and most ops took the table's lock and hashed their
// whole key again.
struct Recent {
  uint64_t table = 0;
  size_t hash = 0;
  int64_t id = 0;
  std::vector<std::pair<const void*, int>> frames;
};
constexpr size_t RECENT = 1024;
thread_local std::array<Recent, RECENT> tl_recent;

int64_t remember(const StackTable* table, const Key& key, int64_t id) {
  Recent& e = tl_recent[key.hash & (RECENT - 1)];
  e.table = table->uid;
  e.hash = key.hash;
  e.id = id;
  e.frames = key.frames;
  return id;
}
}  // namespace

StackTable* stacks_new(PyObject* on_new_stack) {
  auto* t = new StackTable();
  t->uid = ++g_table_uid;
  Py_XINCREF(on_new_stack);
  t->on_new = on_new_stack;
  return t;
}

void stacks_free(StackTable* t) {
  // With the GIL (called from Python).
  for (PyObject* c : t->codes) Py_DECREF(c);
  Py_XDECREF(t->on_new);
  delete t;
}

// The id of a stack not seen before (the GIL held): interned, and announced to the writer.
int64_t symbolise(StackTable* table, const Key& key, _PyInterpreterFrame* top) {
  int64_t sid;
  PyObject* frames = PyList_New(0);
  {
    std::lock_guard<std::mutex> g(table->mu);
    auto it = table->ids.find(key);
    if (it != table->ids.end()) {
      Py_DECREF(frames);
      return it->second;
    }
    sid = (int64_t)table->ids.size() + 1;
    table->ids.emplace(key, sid);
    int depth = 0;
    for (_PyInterpreterFrame* f = top; f != nullptr && depth <= MAX_DEPTH; f = complete(f->previous), ++depth) {
      PyObject* code = reinterpret_cast<PyObject*>(f->f_code);
      Py_INCREF(code);
      table->codes.push_back(code);
      if (depth == MAX_DEPTH) break;  // part of the key (kept alive), not shown
      int line = PyCode_Addr2Line(f->f_code, _PyInterpreterFrame_LASTI(f) * (int)sizeof(_Py_CODEUNIT));
      PyObject* fr = Py_BuildValue("(OiO)", f->f_code->co_filename, line < 0 ? 0 : line, f->f_code->co_name);
      PyList_Append(frames, fr);
      Py_DECREF(fr);
    }
  }
  PyList_Reverse(frames);  // outermost first
  if (table->on_new != nullptr) {
    PyObject* r = PyObject_CallFunction(table->on_new, "LO", (long long)sid, frames);
    if (r == nullptr) PyErr_Clear();  // a writer that failed must not fail the op
    // (owner, fn) depths (trainguard.capture._stacks.frame_hint), read from the live frames
    if (r != nullptr && PyTuple_Check(r) && PyTuple_GET_SIZE(r) == 2) {
      int owner = (int)PyLong_AsLong(PyTuple_GET_ITEM(r, 0));
      int fn = (int)PyLong_AsLong(PyTuple_GET_ITEM(r, 1));
      if (PyErr_Occurred()) PyErr_Clear();
      else if (owner >= 0 || fn >= 0) {
        std::lock_guard<std::mutex> g(table->mu);
        table->hints[sid] = {owner, fn};
      }
    }
    Py_XDECREF(r);
  }
  Py_DECREF(frames);
  return sid;
}

int64_t stacks_capture(StackTable* table) {
  PyThreadState* ts = PyGILState_GetThisThreadState();
  if (ts == nullptr) return 0;  // a thread with no Python caller
  _PyInterpreterFrame* top = complete(ts->cframe->current_frame);
  if (top == nullptr) return 0;
  thread_local Key key;
  key.frames.clear();
  size_t h = 1469598103934665603ull;
  // The innermost frame and MAX_DEPTH callers, as StackInterner's (prefix, code, lasti) key.
  for (_PyInterpreterFrame* f = top; f != nullptr && (int)key.frames.size() <= MAX_DEPTH;
       f = complete(f->previous)) {
    int lasti = _PyInterpreterFrame_LASTI(f);
    key.frames.emplace_back(f->f_code, lasti);
    h = (h ^ reinterpret_cast<size_t>(f->f_code)) * 1099511628211ull;
    h = (h ^ static_cast<size_t>(lasti)) * 1099511628211ull;
  }
  key.hash = h;
  {
    const Recent& e = tl_recent[h & (RECENT - 1)];
    if (e.table == table->uid && e.hash == h && e.frames == key.frames) return e.id;
  }
  {
    std::lock_guard<std::mutex> g(table->mu);
    auto it = table->ids.find(key);
    if (it != table->ids.end()) return remember(table, key, it->second);
  }
  // A new stack: symbolise it with the GIL (never while holding the table's lock), keeping an
  // error the op is raising pending through it (native.h, KeepPyError).
  PyGILState_STATE gs = PyGILState_Ensure();
  int64_t sid;
  {
    KeepPyError keep;
    sid = symbolise(table, key, top);
  }
  PyGILState_Release(gs);
  return sid;
}

bool stacks_hint(StackTable* table, int64_t sid, int* owner, int* fn) {
  std::lock_guard<std::mutex> g(table->mu);
  if (table->hints.empty()) return false;
  auto it = table->hints.find(sid);
  if (it == table->hints.end()) return false;
  *owner = it->second.first;
  *fn = it->second.second;
  return true;
}

PyObject* stacks_local0(int depth) {
  PyThreadState* ts = PyGILState_GetThisThreadState();
  if (ts == nullptr) return nullptr;
  _PyInterpreterFrame* f = complete(ts->cframe->current_frame);
  for (int i = 0; f != nullptr && i < depth; ++i) f = complete(f->previous);
  if (f == nullptr || f->f_code->co_argcount < 1) return nullptr;
  PyObject* o = f->localsplus[0];
  if (o != nullptr && PyCell_Check(o)) o = PyCell_GET(o);  // captured by a closure in the method
  return o;
}

}  // namespace tg
