// The RecordFunction callbacks: which calls a dispatch mode would see, and their records.
//
// A TorchDispatchMode sees an operator call when it reaches the Python dispatch key, which lies
// below autograd and above the kernels. RecordFunction fires at every dispatcher call, so the
// rule keeps exactly the calls that would reach that key:
//   * a CompositeImplicitAutograd operator (linear, matmul, reshape, ...) is decomposed above it
//     by autograd's layer: not seen itself, its calls are (with that layer off, in inference
//     mode, it is seen whole);
//   * calls made by a seen operator run below the Python key (its kernel, a factory's backend):
//     not seen, except where autocast wraps it: an operator with an autocast kernel, autocast
//     on, casts its inputs (seen: the dispatch mode sees those casts) and calls itself again,
//     which is the call seen, not the outer one; in autocast's own calls below autograd (the
//     thread-local excluded set holds autograd or ADInplaceOrView) nothing is seen;
//   * calls made with the Python key excluded (torch.tensor's internal allocation) are not;
//   * operators that autograd handles without redispatching (detach_, requires_grad_) never are.
// Records are taken at the end of each call, in the order a dispatch mode would have finished
// them, and numbered then (seq), as the Python recorder numbers them.
#include "core.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/SavedTensorHooks.h>
#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>

#include <pthread.h>

#include <algorithm>

#include <chrono>
#include <cstring>

namespace tg {

std::atomic<int64_t> g_step{0};
std::atomic<int> g_in_optimizer{0};
std::atomic<bool> g_forked{false};
thread_local int64_t tl_module[MAX_CORES] = {0};
thread_local bool tl_paused = false;

namespace {

// ------------------------------------------------------------------ operators
// Per thread, a cache of operators by the schema's name pointer in front of the shared table:
// plain arrays of pointers, so that reading them needs no thread_local guard (every dispatcher
// call asks, recorded or not). Open addressing with linear probing, never evicting: a
// direct-mapped cache let two hot operators that shared a slot evict each other at every call,
// and each miss took the shared table's lock (cleanrl's PPO: find_op was as costly as the
// producers table). A full cache (more operators than OP_CACHE / 2 on one thread) starts over.
constexpr size_t OP_CACHE = 2048;
thread_local const char* tl_op_keys[OP_CACHE] = {nullptr};
thread_local OpInfo* tl_op_infos[OP_CACHE] = {nullptr};
thread_local size_t tl_op_count = 0;

size_t op_slot(const char* key) { return (size_t)(((uintptr_t)key * 0x9E3779B97F4A7C15ull) >> 53); }  // 11 bits

OpInfo* lookup_op_slow(const at::RecordFunction& fn, const char* key) {
  OpInfo* info = find_op(fn, key);  // the shared table (ops.cpp)
  if (info == nullptr) return nullptr;  // a RecordFunction that is not an operator call: not cached
  if (2 * (tl_op_count + 1) > OP_CACHE) {
    for (auto& k : tl_op_keys) k = nullptr;
    tl_op_count = 0;
  }
  size_t k = op_slot(key);
  while (tl_op_keys[k] != nullptr) k = (k + 1) & (OP_CACHE - 1);
  tl_op_keys[k] = key;
  tl_op_infos[k] = info;
  ++tl_op_count;
  return info;
}

inline OpInfo* lookup_op(const at::RecordFunction& fn) {
  const char* key = fn.name();
  for (size_t k = op_slot(key);; k = (k + 1) & (OP_CACHE - 1)) {
    const char* kk = tl_op_keys[k];
    if (C10_LIKELY(kk == key)) return tl_op_infos[k];
    if (kk == nullptr) return lookup_op_slow(fn, key);
  }
}

// ------------------------------------------------------------------ cores and their slots
Core* g_cores[MAX_CORES] = {nullptr};
std::mutex g_cores_mu;

struct Ctx : at::ObserverContext {
  Core* core = nullptr;  // the core that began it (a slot may hold another one by its end)
  OpInfo* op = nullptr;
  bool seen = false;
  bool wrapper = false;  // autocast may run around this call (see the rule above)
  bool opaque = false;   // a call on a tensor subclass, or under another mode: not recorded, its calls are
  bool in_node = false;  // run by the autograd engine (the backward pass)
  bool recompute = false;  // ... as a forward pass activation checkpointing runs again (see recomputes)
  uint64_t node_nr = 0;  // that node's sequence number (AccumulateGrad's is UINT64_MAX)
  c10::SmallVector<Input, 6> inputs;
  c10::intrusive_ptr<c10::TensorImpl> first;  // the first tensor input (alias summaries)
  c10::SmallVector<at::Tensor, 1> written;  // a collective's first argument (recv_ writes it), a void op's writes
  Ctx* collective = nullptr;  // a call made right inside a collective's kernel (not recorded): see on_start
  c10::SmallVector<at::Tensor, 1> inner;  // a collective's: the tensors those calls made (see on_start)
  // A forward call no module hook claims: its stack, taken as it begins, and what its frames say
  // (see by_frames): read before its inputs, whose names a module named there gives.
  int64_t stack = -1;  // -1: not taken yet
  int64_t claimed = 0;
  bool in_fn = false;
};

void by_frames(Core* c, int64_t sid, int64_t* mid, bool* in_fn);
bool wanted(Core* c, OpInfo* op);

// This thread's open recorded calls per core, innermost last. A call that is not recorded gets
// no context at all: only recorded calls decide whether an inner call is (see on_start).
thread_local std::vector<Ctx*> tl_open[MAX_CORES];

struct Pause {
  bool old;
  Pause() : old(tl_paused) { tl_paused = true; }
  ~Pause() { tl_paused = old; }
};

// Whether a call that autograd's engine runs with grad mode on belongs to a forward pass run again
// inside a backward pass: its outputs are forward values (a causal mask's -inf absorbed by softmax),
// not gradients, and the backward of its own graph is traced back to it. torch.utils.checkpoint
// recomputes inside saved-tensor hooks of its own (use_reentrant=False), or in the backward of its
// CheckpointFunction (use_reentrant=True); a custom autograd.Function's backward that re-runs a
// function under enable_grad to take its vector-Jacobian product (torchdiffeq's adjoint method) is
// the same. A backward pass that builds a graph (create_graph=True, a gradient penalty) also runs
// with grad mode on, in the C++ nodes of the built-in ops.
bool recomputes(const c10::intrusive_ptr<torch::autograd::Node>& node) {
  if (!at::SavedTensorDefaultHooks::get_tls_state().stack.empty()) return true;
  // A node's Python object takes the GIL: asked once per node (a recompute makes many calls in one).
  thread_local const torch::autograd::Node* last = nullptr;
  thread_local uint64_t last_nr = 0;
  thread_local bool last_answer = false;
  if (node.get() != last || node->sequence_nr() != last_nr) {
    last = node.get();
    last_nr = node->sequence_nr();
    PyGILState_STATE gs = PyGILState_Ensure();
    PyObject* obj = torch::autograd::functionToPyObject(node);  // a custom Function's backward: its ctx
    last_answer = obj != nullptr && !torch::autograd::THPCppFunction_Check(obj);
    if (obj == nullptr) PyErr_Clear();
    Py_XDECREF(obj);
    PyGILState_Release(gs);
  }
  return last_answer;
}

struct Unsure {};  // a call under another dispatch mode, or on a tensor subclass
struct Tracing {};  // a call a compiler makes on fake tensors

// Whether every dispatch mode on the stack is PyTorch's own check around the first call of a
// compiled graph holding a custom op (AOT autograd's _AnalyzeCustomOpInputOutputMode): it
// passes each call on, and the call it makes is recorded as any other. Asked only with a mode
// on the stack (rare: a graph's first call, a user's mode), so taking the GIL here is cheap.
bool only_pytorch_checks() {
  PyGILState_STATE gs = PyGILState_Ensure();
  bool only = true;
  const int64_t n = c10::impl::TorchDispatchModeTLS::stack_len();
  for (int64_t i = 0; i < n && only; ++i) {
    PyObject* mode = c10::impl::TorchDispatchModeTLS::get_stack_at(i)->ptr(getPyInterpreter());
    only = mode != nullptr && std::strcmp(Py_TYPE(mode)->tp_name, "_AnalyzeCustomOpInputOutputMode") == 0;
  }
  PyGILState_Release(gs);
  return only;
}

bool is_unsure_tensor(const at::Tensor& t) {
  auto ks = t.key_set();
  return ks.has(c10::DispatchKey::Python) || t.is_nested() || ks.has(c10::DispatchKey::Functionalize);
}

// Tensors among an op's results, as the Python recorder sees them: a single list result is
// its elements; otherwise each tensor result (lists inside tuples are not looked into).
using Tensors = c10::SmallVector<at::Tensor, 4>;
void output_tensors(const std::vector<c10::IValue>& outs, Tensors& out);

// What a collective wrote (capture/_local.written): every tensor in its results, lists of lists
// too (``allgather_`` returns its output lists and a Work); for ``recv_``, which returns only
// the Work, the buffers it was given.
void tensors_in(const c10::IValue& v, Tensors& out) {
  if (v.isTensor()) {
    if (v.toTensor().defined()) out.push_back(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList())
      if (t.defined()) out.push_back(t);
  } else if (v.isList() || v.isTuple()) {
    for (const c10::IValue& e : v.isList() ? v.toListRef() : v.toTupleRef().elements()) tensors_in(e, out);
  }
}

void written_tensors(const std::vector<c10::IValue>& outs, Ctx* ctx, Tensors& out) {
  for (const auto& v : outs) tensors_in(v, out);
  if (out.empty() && ctx->op->name.find(".recv") != std::string::npos)
    out.insert(out.end(), ctx->written.begin(), ctx->written.end());
}

void output_tensors(const std::vector<c10::IValue>& outs, Tensors& out) {
  if (outs.size() == 1 && outs[0].isTensorList()) {
    for (const at::Tensor& t : outs[0].toTensorList())
      if (t.defined()) out.push_back(t);
    return;
  }
  for (const auto& v : outs)
    if (v.isTensor() && v.toTensor().defined()) out.push_back(v.toTensor());
}

// Whether ops= keeps this op; asked of Python once per op (called without the core's lock).
bool wanted(Core* c, OpInfo* op) {
  if (c->wanted_fn == nullptr) return true;  // no ops= filter
  {
    std::lock_guard<std::mutex> g(c->wanted_mu);
    if ((int)c->wanted.size() > op->index && c->wanted[op->index] >= 0) return c->wanted[op->index] == 1;
  }
  int8_t w = 1;
  if (c->wanted_fn != nullptr) {
    PyGILState_STATE gs = PyGILState_Ensure();
    PyObject* r = PyObject_CallFunctionObjArgs(c->wanted_fn, op->py_name, nullptr);
    w = (r != nullptr && PyObject_IsTrue(r) == 1) ? 1 : 0;
    if (r == nullptr) PyErr_Clear();
    Py_XDECREF(r);
    PyGILState_Release(gs);
  }
  std::lock_guard<std::mutex> g(c->wanted_mu);
  if ((int)c->wanted.size() <= op->index) c->wanted.resize(op->index + 1, -1);
  c->wanted[op->index] = w;
  return w == 1;
}

void fail(Core* c, OpInfo* op, const char* what) {
  std::lock_guard<std::mutex> g(c->mu);
  c->failures++;
  if (c->failed_ops.insert(op->name).second) c->failed.emplace_back(op->name, what);
}

// ------------------------------------------------------------------ the callbacks
template <int K>
std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  if (tl_paused) return nullptr;
  Core* c = g_cores[K];
  if (c == nullptr || !c->active.load(std::memory_order_relaxed)) return nullptr;
  OpInfo* op = lookup_op(fn);
  if (op == nullptr) return nullptr;  // not an operator: its calls are judged by what encloses it
  auto& open = tl_open[K];
  bool in_seen = false, in_opaque = false;
  Ctx* seen_parent = nullptr;
  for (auto it = open.rbegin(); it != open.rend(); ++it) {
    if ((*it)->seen) {
      in_seen = true;
      seen_parent = *it;
      break;
    }
    in_opaque = in_opaque || (*it)->opaque;
  }
  auto ex = c10::impl::tls_local_dispatch_key_set().excluded_;
  bool below = ex.has(c10::DispatchKey::ADInplaceOrView) || ex.has(c10::DispatchKey::AutogradFunctionality);
  bool hidden = ex.has(c10::DispatchKey::Python) || (in_seen && (below || !seen_parent->wrapper)) ||
                at::in_parallel_region();
  // A call right inside a collective's kernel, on this thread: gloo's reduce-scatter reduces a
  // clone of its input, which it splits into the output only when the program waits for it (a
  // split and a copy_ recorded after the collective). What such a call makes, the collective
  // wrote: it becomes their producer (end_record), so that the split reads the collective's
  // values, not a tensor no op made. Not recorded.
  if (hidden && in_seen && seen_parent->op->collective && open.back() == seen_parent &&
      (uint64_t)pthread_self() == c->owner_thread) {
    auto ctx = std::make_unique<Ctx>();
    ctx->core = c;
    ctx->op = op;
    ctx->collective = seen_parent;
    open.push_back(ctx.get());
    return ctx;
  }
  // A composite is decomposed above the Python key by autograd's layer; with that layer off
  // (inference mode, or below autograd) it reaches the key whole.
  if (hidden || !(op->kind == OP_SEEN || (op->kind == OP_COMPOSITE && below))) return nullptr;
  // Another thread that inherited the recording thread's callbacks (at::ThreadLocalState), and
  // not autograd's engine running a backward node: a collective's worker, whose state was taken
  // inside the collective's kernel (gloo runs its copies there), where a dispatch mode has popped
  // itself. Not seen.
  if ((uint64_t)pthread_self() != c->owner_thread && torch::autograd::get_current_node() == nullptr) return nullptr;
  auto ctx = std::make_unique<Ctx>();
  ctx->core = c;
  ctx->op = op;
  ctx->seen = true;
  ctx->wrapper = (op->autocast_cpu && !ex.has(c10::DispatchKey::AutocastCPU)) ||
                 (op->autocast_cuda && !ex.has(c10::DispatchKey::AutocastCUDA));
  if (seen_parent != nullptr && seen_parent->op == op) seen_parent->seen = false;  // a wrapper
  try {
    if (c10::impl::TorchDispatchModeTLS::stack_len() > 0) {
      // A compiler tracing on fake tensors (AOT autograd's lazy backward compile, outside
      // Dynamo's compile lock): the dispatch mode drops these calls too, uncounted.
      if (c10::impl::TorchDispatchModeTLS::get_mode(c10::impl::TorchDispatchModeKey::FAKE).has_value())
        throw Tracing{};
      if (only_pytorch_checks()) throw Tracing{};  // its inner call is the one recorded
      throw Unsure{};
    }
    auto node = torch::autograd::get_current_node();
    ctx->in_node = node != nullptr;
    ctx->node_nr = node ? node->sequence_nr() : 0;
    ctx->recompute = node != nullptr && c10::GradMode::is_enabled() && recomputes(node);
    if ((!ctx->in_node || ctx->recompute) && tl_module[c->slot] == 0 &&
        g_in_optimizer.load(std::memory_order_relaxed) == 0 && wanted(c, op)) {
      ctx->stack = stacks_capture(c->stacks);
      if (ctx->stack != 0) by_frames(c, ctx->stack, &ctx->claimed, &ctx->in_fn);
    }
    auto inputs = fn.inputs();
    bool writes = !op->writes.empty() && (op->writes_if < 0 || (op->writes_if < (int)inputs.size() &&
                                                                inputs[op->writes_if].isBool() &&
                                                                inputs[op->writes_if].toBool()));
    if ((op->collective && !inputs.empty()) || writes) {
      Tensors w;
      if (op->collective) tensors_in(inputs[0], w);
      for (int i : op->writes)
        if (writes && i < (int)inputs.size()) tensors_in(inputs[i], w);
      ctx->written.assign(w.begin(), w.end());
    }
    std::lock_guard<std::mutex> g(c->mu);
    auto add = [&](const at::Tensor& t) {
      // A Python number passed where a tensor is expected reaches a dispatch mode as the number.
      if (t.unsafeGetTensorImpl()->is_wrapped_number()) return;
      if (is_unsure_tensor(t)) throw Unsure{};
      // Inside a subclass's call, calls on meta tensors are its bookkeeping (DTensor propagates
      // shardings on fake tensors); the calls on the tensors it holds are the program's.
      if (in_opaque && t.is_meta()) throw Tracing{};
      if (!ctx->first) ctx->first = t.getIntrusivePtr();
      ctx->inputs.push_back(input_of(c, t, ctx->in_node));
    };
    for (const c10::IValue& v : inputs) {
      if (v.isTensor()) {
        if (v.toTensor().defined()) add(v.toTensor());
      } else if (v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorList()) add(t);
      } else if (v.isList()) {
        auto l = v.toListRef();
        if (l.empty() || !l[0].isTensor()) continue;
        for (const c10::IValue& e : l) {
          if (e.isTensor() && e.toTensor().defined()) add(e.toTensor());
          else ctx->inputs.push_back(Input{1, 0});  // a None inside a list of tensors
        }
      }
    }
  } catch (const Tracing&) {
    return nullptr;
  } catch (const Unsure&) {
    // Not something a RecordFunction observer can record faithfully: count it, and keep the
    // call out of the record. The calls it makes are recorded (a DTensor's on its local shard,
    // a mode's once it has stepped aside): it stays open, unrecorded, to say so to them.
    {
      std::lock_guard<std::mutex> g(c->mu);
      c->unsure++;
      if (c->unsure_seen.insert(op->name).second) c->unsure_ops.push_back(op->name);
    }
    ctx->seen = false;
    ctx->opaque = true;
    ctx->inputs.clear();
    ctx->first.reset();
    ctx->written.clear();
    open.push_back(ctx.get());
    return ctx;
  }
  open.push_back(ctx.get());
  return ctx;
}

void end_record(Core* c, Ctx* ctx, const at::RecordFunction& fn);

template <int K>
void on_end(const at::RecordFunction& fn, at::ObserverContext* base) {
  if (base == nullptr) return;  // began before this core was installed, or while paused
  auto* ctx = static_cast<Ctx*>(base);
  auto& open = tl_open[K];
  for (auto it = open.rbegin(); it != open.rend(); ++it)
    if (*it == ctx) {
      open.erase(std::next(it).base());
      break;
    }
  Core* c = g_cores[K];
  if (ctx->collective != nullptr) {  // the collective is still open: it encloses this call
    Tensors outs;
    output_tensors(fn.outputs(), outs);
    ctx->collective->inner.append(outs.begin(), outs.end());
    return;
  }
  if (!ctx->seen || c != ctx->core || !c->active.load(std::memory_order_relaxed) || tl_paused) return;
  Pause pause;  // our own tensor work below is not recorded
  try {
    end_record(c, ctx, fn);
  } catch (const std::exception& e) {
    fail(c, ctx->op, e.what());
  }
}

// An op no module hook claims, outside an optimizer step: the module whose method runs it (0
// none) and whether it runs in a custom autograd.Function's forward whose output autograd
// differentiates (the dispatch mode's _by_frames, on the same frames). Per op only the hinted
// frames' first locals are read; a module met for the first time is named in Python, with the GIL.
void by_frames(Core* c, int64_t sid, int64_t* mid, bool* in_fn) {
  int owner = -1, fn = -1;
  if (!stacks_hint(c->stacks, sid, &owner, &fn)) return;
  if (owner >= 0 && c->module_type != nullptr) {
    PyObject* m = stacks_local0(owner);
    if (m != nullptr && PyObject_TypeCheck(m, c->module_type)) {
      {
        std::lock_guard<std::mutex> g(c->owners_mu);
        auto it = c->owners.find(m);
        if (it != c->owners.end()) {
          *mid = it->second;
          return;
        }
      }
      int64_t id = 0;
      if (c->on_owner != nullptr) {
        PyGILState_STATE gs = PyGILState_Ensure();
        PyObject* r = PyObject_CallFunctionObjArgs(c->on_owner, m, nullptr);
        if (r != nullptr) {
          id = PyLong_AsLongLong(r);
          Py_DECREF(r);
        }
        if (PyErr_Occurred()) {
          PyErr_Clear();  // observing training never fails the op
          id = 0;
        }
        PyGILState_Release(gs);
      }
      if (id > 0) {
        std::lock_guard<std::mutex> g(c->owners_mu);
        c->owners[m] = id;
        *mid = id;
        return;
      }
    }
  }
  if (fn >= 0 && c->ctx_type != nullptr && !c10::GradMode::is_enabled()) {
    PyObject* x = stacks_local0(fn);
    if (x != nullptr && PyObject_TypeCheck(x, c->ctx_type)) {
      PyObject* need = reinterpret_cast<THPFunction*>(x)->needs_input_grad;
      if (need != nullptr && PyTuple_Check(need))
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(need); ++i)
          if (PyTuple_GET_ITEM(need, i) == Py_True) *in_fn = true;
    }
  }
}

void end_record(Core* c, Ctx* ctx, const at::RecordFunction& fn) {
  OpInfo* op = ctx->op;
  Tensors outs;
  if (op->collective) {
    written_tensors(fn.outputs(), ctx, outs);
    // What the calls inside its kernel made (its own buffers) are its outputs too, unrecorded.
    auto it = std::remove_if(ctx->inner.begin(), ctx->inner.end(), [&](const at::Tensor& t) {
      for (auto& o : outs)
        if (o.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) return true;
      return false;
    });
    ctx->inner.erase(it, ctx->inner.end());
  } else {
    output_tensors(fn.outputs(), outs);  // then the arguments it wrote (none returned, or batch norm's statistics)
    outs.append(ctx->written.begin(), ctx->written.end());
  }
  int64_t nr = at::sequence_number::peek();
  int nfields = mode_fields(c->mode);
  bool keep = wanted(c, op);

  int64_t view_of = -1;
  if (op->view && !ctx->inputs.empty() && ctx->inputs[0].kind == 0) view_of = ctx->inputs[0].ref;
  // A forward op's stack, read before the lock is taken (a stack never seen before takes the GIL).
  bool backward = ctx->in_node && !ctx->recompute;
  int64_t fwd_stack = keep && !backward ? (ctx->stack >= 0 ? ctx->stack : stacks_capture(c->stacks)) : 0;
  int64_t claimed = ctx->claimed;
  bool in_fn = ctx->in_fn;

  std::unique_lock<std::mutex> g(c->mu);
  int64_t seq = c->seq++;
  if (!keep) {  // filtered out: consumers still learn who made their inputs
    for (auto& o : outs) register_output(c, o, seq, 0, nullptr, view_of);
    for (auto& o : ctx->inner) register_output(c, o, seq, 0, nullptr, -1);
    c->last_nr = nr;
    return;
  }
  Record r;
  r.seq = seq;
  r.op = op;
  r.fwd_seq = -1;
  r.module = 0;
  r.stack = 0;
  if (backward) {
    r.phase = 1;
    FwdNode* n = c->fwd_nodes.find(ctx->node_nr);
    if (n != nullptr && n->seq >= 0) {
      r.fwd_seq = n->seq;
      r.module = n->module;
      r.stack = n->stack;
    } else {
      // no recorded op made this node, or a custom autograd.Function did (seq -1): its Python
      // backward runs here, at lines of its own (mambapy's reverse scan)
      if (n != nullptr) r.module = n->module;
      g.unlock();
      r.stack = stacks_capture(c->stacks);
      g.lock();
    }
    if (nr != c->last_nr && c10::GradMode::is_enabled() && !outs.empty() && outs[0].defined() &&
        outs[0].is_cpu()) {
      // create_graph=True (second-order MAML): this backward op made the autograd node numbered
      // nr - 1, whose backward (the double backward) inherits the forward op's module and stack
      // through it. On the CPU only: an accelerator's backward runs on a device thread, whose
      // sequence numbers are not the forward thread's. (_recorder_mode.py: the same)
      int64_t step = g_step.load(std::memory_order_relaxed);
      auto key = (uint64_t)(nr - 1);
      FwdNode* m = c->fwd_nodes.find(key);
      if (m != nullptr) *m = FwdNode{seq, r.module, r.stack, step, m->order};
      else c->fwd_nodes.emplace(key, FwdNode{seq, r.module, r.stack, step, c->fwd_order++});
      if (c->fwd_nodes.size() > FWD_NODES_MAX) c->prune_fwd_nodes(-1);
    }
  } else {
    r.module = tl_module[c->slot];
    if (r.module == 0) r.module = claimed;
    r.stack = fwd_stack;
    if (g_in_optimizer.load(std::memory_order_relaxed) > 0) r.phase = 2;
    else if (r.module != 0 || c10::GradMode::is_enabled() || in_fn) r.phase = 0;
    else r.phase = 3;
    if (nr != c->last_nr) {
      // This call made the autograd node numbered nr - 1; with grad mode off it made none: the
      // custom autograd.Function whose forward runs it did, whose backward is not this call's
      // (seq -1: the backward's ops take their own stacks). (_recorder_mode.py: the same)
      int64_t step = g_step.load(std::memory_order_relaxed);
      auto key = (uint64_t)(nr - 1);
      bool made = c10::GradMode::is_enabled();
      FwdNode node{made ? seq : -1, r.module, made ? r.stack : 0, step, 0};
      FwdNode* n = c->fwd_nodes.find(key);
      if (n != nullptr) *n = FwdNode{node.seq, node.module, node.stack, step, n->order};
      else c->fwd_nodes.emplace(key, FwdNode{node.seq, node.module, node.stack, step, c->fwd_order++});
      if (c->fwd_nodes.size() > FWD_NODES_MAX) c->prune_fwd_nodes(-1);
    }
  }
  if (c->has_dtypes) {
    bool any = false;
    for (auto& o : outs) any = any || c->dtypes.count((int)o.scalar_type());
    if (!any) {
      for (auto& o : outs) register_output(c, o, seq, r.stack, nullptr, view_of);
      for (auto& o : ctx->inner) register_output(c, o, seq, r.stack, nullptr, -1);
      c->last_nr = nr;
      return;
    }
  }
  r.step = g_step.load(std::memory_order_relaxed);
  // A pure alias holds its input's values: reuse that summary while nothing wrote to it since.
  bool have_alias = false;
  Summary alias;
  if (op->alias && ctx->first && nfields) {
    Producer* p = c->producers.find(impl_key(ctx->first.get()));
    if (p != nullptr && !p->ref.expired() && p->has_summary && p->version >= 0 &&
        p->version == version_of(ctx->first.get())) {
      have_alias = true;
      alias = p->s;
    }
  }
  // Summaries first, without the lock (no_tensor makes none: the lock stays); then everything
  // the drain takes, in one locked section (a drain between a device summary and its record
  // would split them).
  bool work = nfields != 0 || c->mode == FULL_TENSOR;
  if (work) g.unlock();
  int health = 0;
  bool immediate_only = true;
  c10::SmallVector<Output, 2> metas;
  Tensors device_rows;
  for (auto& o : outs) {
    Output m;
    m.dtype = o.scalar_type();
    m.device = o.device();
    if (nfields) {
      bool cpu = m.device.is_cpu();
      m.summary = 1;
      // uninitialised memory, another rank's, or a workspace after the op's result: no evidence
      if (op->alloc || op->collective || (op->known >= 0 && (int64_t)metas.size() >= op->known)) {
        m.s = unknown_summary(c->mode, o.numel());
      } else if (have_alias) {
        m.s = alias;
      } else if ((cpu && c->strategy != 2) || c->strategy == 1 || o.is_meta() || o.layout() != at::kStrided) {
        m.s = summarize(o, c->mode);
      } else {
        immediate_only = false;
        m.summary = 2;
        device_rows.push_back(summarize_deferred(o, c->mode));
      }
      if (m.summary == 1) health |= health_of(c->mode, m.s);
    }
    metas.push_back(m);
  }
  if (c->mode == FULL_TENSOR && !op->collective) {  // (a collective's values are not there yet)
    // full_tensor copies values to the host by definition (a device sync there).
    for (auto& o : outs) {
      at::Tensor d = o.detach();
      auto fmt = o.layout() == at::kStrided ? c10::MemoryFormat::Contiguous : c10::MemoryFormat::Preserve;
      r.payloads.push_back(d.to(at::TensorOptions().device(c10::kCPU), false, true, fmt));
    }
  }
  if (work) g.lock();
  r.in0 = c->inputs.size();
  r.nin = (uint32_t)ctx->inputs.size();
  c->inputs.insert(c->inputs.end(), ctx->inputs.begin(), ctx->inputs.end());
  r.out0 = c->outputs.size();
  r.nout = (uint32_t)metas.size();
  size_t k = 0;
  for (size_t i = 0; i < outs.size(); ++i) {
    Output& m = metas[i];
    if (m.summary == 2) {
      auto dit = c->deferred.begin();
      for (; dit != c->deferred.end(); ++dit)
        if (dit->first == m.device) break;
      if (dit == c->deferred.end()) dit = c->deferred.insert(c->deferred.end(), {m.device, {}});
      m.row = (int64_t)dit->second.size();
      dit->second.push_back(std::move(device_rows[k++]));
    }
    auto sizes = outs[i].sizes();
    m.dims = c->dims.size();
    m.ndim = (uint32_t)sizes.size();
    c->dims.insert(c->dims.end(), sizes.begin(), sizes.end());
    c->outputs.push_back(m);
  }
  r.health = immediate_only ? health : -1;
  // The taint fast path (see Core::last_seq).
  int cls = op->taint_cls;
  bool in_maybe = false;
  for (size_t i = (op->overwrite ? 1 : 0); i < ctx->inputs.size(); ++i)
    in_maybe = in_maybe || (ctx->inputs[i].kind == 0 && ctx->inputs[i].maybe);
  bool maybe = cls < 0 || cls == T_ALLOC || r.health != 0 ||
               (in_maybe && (cls == T_VIEW || cls == T_COPY || cls == T_READ || cls == T_COLLECTIVE));
  // What only the Python judge can settle; the rest goes to it for the order of phases alone.
  bool serious = cls < 0 || cls == T_ALLOC || r.health != 0 || in_maybe;
  if (!serious && seq == c->last_seq + 1 && r.phase == c->last_phase)
    r.taint = 0;
  if (serious) c->serious++;
  if (seq > c->last_seq) {
    c->last_seq = seq;
    c->last_phase = r.phase;
  }
  // A collective's output never lends its summary to a later view: its values arrive after
  // this, without moving the version counter.
  for (size_t i = 0; i < outs.size(); ++i)
    register_output(c, outs[i], seq, r.stack, metas[i].summary == 1 && !op->collective ? &metas[i].s : nullptr,
                    view_of, r.health, maybe);
  for (auto& o : ctx->inner) register_output(c, o, seq, r.stack, nullptr, -1, r.health, maybe);
  // An in-place write of a non-finite value (or one not summarised yet) through a view: the base
  // holds it now, and its readers must find this op, not the base's maker (``x[5, 0, 2, 2] = inf``
  // in a data set a DataLoader reads later). A finite write leaves the rest of the base as it was.
  if (op->inplace && r.health != 0 && !outs.empty() && outs[0].defined() && outs[0].is_view())
    register_output(c, at::Tensor(outs[0]._base()), seq, r.stack, nullptr, -1, r.health, maybe);
  for (auto& p : r.payloads) c->payload_bytes += p.nbytes();
  c->records.push_back(std::move(r));
  c->recorded++;
  c->last_nr = nr;
  if (health) c->bad = true;
  bool over = c->records.size() > MAX_PENDING_RECORDS || c->payload_bytes > MAX_PENDING_BYTES;
  if (c->records.size() >= FLUSH_RECORDS || health || over) c->cv.notify_all();
  // Wait for the drain when far behind; never while holding the GIL (the drain needs it).
  if (over && !PyGILState_Check())
    c->drained.wait_for(g, std::chrono::seconds(30), [&] {
      return !c->active.load() || (c->records.size() <= MAX_PENDING_RECORDS / 2 && c->payload_bytes <= MAX_PENDING_BYTES / 2);
    });
}

template <int K>
bool install_slot(Core* c) {
  c->handle = at::addThreadLocalCallback(at::RecordFunctionCallback(&on_start<K>, &on_end<K>)
                                             .needsInputs(true)
                                             .needsOutputs(true)
                                             .scopes({at::RecordScope::FUNCTION}));
  return true;
}

using Installer = bool (*)(Core*);
const Installer g_installers[MAX_CORES] = {&install_slot<0>, &install_slot<1>, &install_slot<2>, &install_slot<3>,
                                           &install_slot<4>, &install_slot<5>, &install_slot<6>, &install_slot<7>};
// A slot whose callback could not be removed (stopped from another thread) stays taken.
bool g_slot_taken[MAX_CORES] = {false};

// A fork copies every lock as it is: one held at that moment by another thread (a callback of a
// second recording thread or of autograd's device threads, a drain) stays held in the child for
// ever. The process-wide locks are taken around the fork (no thread waits for anything while it
// holds one, so the fork waits at most for one table or pool operation): the child gets them
// free and their tables consistent, and can record a run of its own. A core's lock cannot be
// (a drain holds it for long), so the cores the child inherits are dead in it: their slots are
// emptied (their callbacks, still installed on the forking thread, find no core) and their
// Python methods return at once (module.cpp), as the threads that fed and drained them are gone.
void fork_prepare() {
  g_cores_mu.lock();
  g_ops_mu.lock();
  g_pool_mu.lock();
}

void fork_parent() {
  g_pool_mu.unlock();
  g_ops_mu.unlock();
  g_cores_mu.unlock();
}

void fork_child() {
  fork_parent();
  g_forked.store(true);
  for (auto& c : g_cores) c = nullptr;  // their slots stay taken: the callbacks are still installed
}
}  // namespace

bool install(Core* c) {
  static std::once_flag fork_once;
  std::call_once(fork_once, [] { pthread_atfork(&fork_prepare, &fork_parent, &fork_child); });
  std::lock_guard<std::mutex> g(g_cores_mu);
  for (int k = 0; k < MAX_CORES; ++k) {
    if (g_slot_taken[k]) continue;
    g_slot_taken[k] = true;
    c->slot = k;
    c->owner_thread = (uint64_t)pthread_self();
    c->last_nr = at::sequence_number::peek();
    tl_module[k] = 0;
    tl_open[k].clear();
    g_cores[k] = c;
    c->active.store(true);
    g_installers[k](c);
    return true;
  }
  return false;
}

void uninstall(Core* c) {
  std::lock_guard<std::mutex> g(g_cores_mu);
  c->active.store(false);
  if (c->slot < 0) return;
  if ((uint64_t)pthread_self() == c->owner_thread) {
    // A thread-local callback can only be removed on its own thread; an end callback may still
    // arrive for a call that began before (its context carries what it needs, and the slot's core
    // is checked before use).
    at::removeCallback(c->handle);
    g_slot_taken[c->slot] = false;
    tl_open[c->slot].clear();
  }
  g_cores[c->slot] = nullptr;
  c->slot = -1;
}

}  // namespace tg
