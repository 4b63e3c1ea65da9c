// The native recorder's state: one Core per recording (at most MAX_CORES at once).
#pragma once
#include "flat.h"
#include "native.h"

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <c10/util/SmallVector.h>

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>

namespace at {
struct RecordFunction;
}

namespace tg {

constexpr int MAX_CORES = 8;

// Memory for the core's long-lived tables (producers, saved outputs, forward nodes: their arrays,
// see flat.h), kept apart from malloc's heap. They outlive a step and grow between the program's
// tensor allocations; on malloc's main heap the tables' entries pinned freed tensor memory in the
// middle of the heap (never returned to the system): the transformer block's peak RSS was 1.3x
// plain with full_health (main arena 341 MB for 133 MB in use, against 219 MB for plain). Slabs
// of fixed-size slots from mmap, recycled per size; large blocks mmap'd each.
void* pool_alloc(size_t bytes);
void pool_free(void* p, size_t bytes);
extern std::mutex g_pool_mu;  // the pool's (tables.cpp)
extern std::mutex g_ops_mu;   // the operators table's (ops.cpp)

inline uint64_t impl_key(const c10::TensorImpl* impl) { return (uint64_t)(uintptr_t)impl; }

// What an operator is to a dispatch mode, fixed per operator for the process.
enum OpKind : int8_t {
  OP_SEEN = 0,         // reaches the Python dispatch key: a dispatch mode records it
  OP_COMPOSITE = 1,    // decomposed above the Python key (CompositeImplicitAutograd): its calls are
  OP_NEVER = 2,        // handled entirely by autograd (detach_, requires_grad_, ...) or a profiler marker
};

struct OpInfo {
  int index;
  std::string name;    // "aten.addmm.default"
  PyObject* py_name;   // the same, as a str (owned; never freed)
  OpKind kind;
  bool alloc;          // uninitialised outputs (trainguard.capture._summary.ALLOCATION_OPS)
  bool alias;          // outputs hold the first input's values (ALIAS_OPS)
  int known = -1;      // how many leading outputs hold values, a workspace after them (WORKSPACE_OUTPUTS); -1 all
  bool view;           // its schema returns an alias of an input (a view, or an in-place op's self)
  bool inplace = false;  // its schema writes its first argument (add_, copy_, fill_: capture/_recorder_mode.op_facts)
  bool autocast_cpu, autocast_cuda;  // has an autocast kernel (a wrapper that calls the op again)
  // Its class for the taint rule (capture/_taint.py: DEFAULT 0, VIEW 1, COPY 2, ALLOC 3, RENORM 4,
  // READ 5, COLLECTIVE 6; -1 not known) and whether it overwrites its first input.
  int8_t taint_cls = -1;
  bool overwrite = false;
  // A communication op (taint class COLLECTIVE): what it writes arrives from other ranks after it
  // returns, while another thread fills it in. Those tensors are its outputs, never read.
  bool collective = false;
  // An op that returns nothing (_foreach_add_, _fused_adam_): the positions of the arguments it
  // writes, whose tensors are its records' outputs (capture/_local.written_args).
  std::vector<int> writes;
  // Batch norm's kernels (capture/_taint.STATS_WRITES): they write arguments 3 and 4 (the running
  // statistics), recorded after what they return, when the argument at writes_if is true (-1: always).
  int writes_if = -1;
};

// The taint classes of capture/_taint.py that the core's fast path needs.
enum TaintClass : int8_t { T_DEFAULT = 0, T_VIEW = 1, T_COPY = 2, T_ALLOC = 3, T_RENORM = 4, T_READ = 5,
                           T_COLLECTIVE = 6 };

struct Input {
  int8_t kind;   // 0 op, 1 input, 2 named (param/buffer)
  int64_t ref;   // producer seq (kind 0)
  PyObject* name = nullptr;  // kind 2: borrowed from the Core's named table
  PyObject* what = nullptr;  // kind 2: "param" or "buffer"
  bool maybe = false;        // kind 0: its producer may hold a taint state (see Producer)
  // kind 0 with ``maybe``: a view whose base a later op wrote (the base's producer is later than
  // the view's): handed over as ("written", seq), see capture/_taint.WRITTEN.
  bool written = false;
};

// A record's inputs, outputs and output sizes live in the Core's flat buffers (Core::inputs,
// outputs, dims), appended per record and swapped out whole by the drain: no allocation per
// record on the training thread (a record with vectors of its own made four to six, each freed
// later on the drain thread).
struct Output {
  at::ScalarType dtype;
  int8_t summary = 0;  // 0 none, 1 immediate values, 2 deferred row
  c10::Device device{c10::kCPU};
  uint32_t ndim = 0;
  size_t dims = 0;     // its sizes: Core::dims[dims, dims + ndim)
  Summary s;
  int64_t row = 0;
};

struct Record {
  int64_t seq, step;
  int8_t phase;        // 0 forward, 1 backward, 2 optimizer, 3 other
  int8_t taint = -1;   // 0: finite, judged here (see Core::last_seq); -1: the Python judge decides
  int health;          // -1: not known on the host yet (deferred summaries)
  OpInfo* op;
  int64_t module, stack, fwd_seq;  // 0 / 0 / -1: none
  uint32_t nin = 0, nout = 0;
  size_t in0 = 0, out0 = 0;        // Core::inputs[in0, in0 + nin), Core::outputs[out0, out0 + nout)
  std::vector<at::Tensor> payloads;  // full_tensor: host copies
};

struct Producer {
  c10::weak_intrusive_ptr<c10::TensorImpl> ref;
  int64_t seq;
  int64_t stack;
  bool has_summary;
  Summary s;
  int64_t version;  // -1: none (inference tensor)
  int health;       // the producing op's health bits over all its outputs; -1 not known on the host
  // Whether the Python judge (capture/_taint.Tracker) may hold a state for this seq: false only
  // when its record was certainly judged finite (see Core::last_seq).
  bool maybe;
};

// An output autograd may save for its own backward: such a tensor is saved as a new TensorImpl
// over the same storage (SavedVariable's tensor_data()), which the dispatch mode sees as its
// own detach of the output. The backward op that reads it is given the output's producer,
// found by storage and geometry.
struct Saved {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  int64_t offset;
  int8_t dtype;
  c10::SmallVector<int64_t, 6> sizes, strides;  // inline: no allocation of their own
  int64_t seq;
  bool maybe;  // as Producer::maybe
};

struct Named {
  c10::weak_intrusive_ptr<c10::TensorImpl> ref;
  PyObject* name;
  PyObject* what;
};

struct FwdNode {
  int64_t seq, module, stack, step, order;
};

struct Core {
  int slot = -1;
  int mode = FULL;
  int strategy = 0;  // 0 auto, 1 immediate, 2 deferred
  bool has_dtypes = false;
  std::unordered_set<int> dtypes;  // ScalarType values
  PyObject* wanted_fn = nullptr;   // callable(name) -> bool, for ops=...
  std::mutex wanted_mu;
  std::vector<int8_t> wanted;      // per OpInfo index: -1 unknown
  StackTable* stacks = nullptr;
  // Ops no module hook claims (see recorder.cpp's by_frames): nn.Module and autograd.Function's
  // ctx types, the callable that names a module whose method runs (owned), and the modules it
  // named, by address (a module's entry goes when it dies: forget_owner, from a weakref callback).
  PyTypeObject* module_type = nullptr;
  PyTypeObject* ctx_type = nullptr;
  PyObject* on_owner = nullptr;
  std::mutex owners_mu;
  std::unordered_map<const PyObject*, int64_t> owners;
  std::atomic<bool> active{false};
  uint64_t handle = 0;
  uint64_t owner_thread = 0;

  std::mutex mu;  // everything below
  std::condition_variable cv;
  int64_t seq = 0, recorded = 0, failures = 0, unsure = 0;
  int64_t last_nr = 0;
  std::vector<Record> records;  // and their inputs, outputs and sizes (see Output):
  std::vector<Input> inputs;
  std::vector<Output> outputs;
  std::vector<int64_t> dims;
  // The taint fast path. Tracker.judge keeps a state only for outputs that are not finite
  // (unknown, pending, harmful), and a record's taint is finite with no effect on the tracker
  // when its outputs are finite (health 0), its op allocates nothing (not ALLOC) and none of its
  // inputs' producers holds a state: such a record is judged here (taint 0) and the Python judge
  // never sees it. Which producers may hold a state follows the rule's table: ALLOC, any
  // non-finite or not yet known health, and views, copies, reads and collectives of such inputs
  // (a finite output of any other class is finite whatever came in). The judge also notices the
  // start of each backward pass by the phase of consecutive records, so a record whose phase
  // differs from the record before it (seq - 1; a gap or another thread's record in between
  // counts as different) always goes to the judge.
  int64_t last_seq = -1;
  int8_t last_phase = -1;
  // Records waiting for the drain whose taint only the Python judge can settle (not finite, not
  // known yet, ALLOC, or an input whose producer may hold a state): without them and without
  // any state held in Python, judging the waiting records changes nothing, and a compiled
  // graph's call need not drain them first (see NativeBackend.python_records).
  int64_t serious = 0;
  size_t payload_bytes = 0;  // full_tensor host copies waiting in records
  std::condition_variable drained;
  bool bad = false;
  FlatMap<Producer> producers;  // by TensorImpl (impl_key)
  size_t sweep_at = 4096;
  FlatMap<Saved> saved;  // by storage and geometry (see Saved)
  size_t saved_sweep_at = 4096;
  FlatMap<Named> named;  // parameters and buffers, by TensorImpl (impl_key)
  FlatMap<FwdNode> fwd_nodes;  // by the autograd node's sequence number
  int64_t fwd_order = 0;
  std::vector<std::pair<c10::Device, std::vector<at::Tensor>>> deferred;
  std::vector<std::pair<std::string, std::string>> failed;  // (op, message), first per op
  std::unordered_set<std::string> failed_ops;
  std::vector<std::string> unsure_ops;
  std::unordered_set<std::string> unsure_seen;

  // The weak references the tables let go of (sweeps, replaced entries), kept here until the
  // core's lock is released (``Dead``): the last reference to a TensorImpl runs its destructor,
  // which can run Python. A per-channel quantized tensor's quantizer holds its scales, a tensor
  // with a Python object once Python read it (QAT's converted weights): freeing that object lets
  // the GIL go inside torch and runs weakref callbacks, and under the lock the drain thread,
  // holding the GIL and waiting for the lock, deadlocked the training thread at its step's sweep.
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> dead_impls;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> dead_storages;

  void sweep();
  void prune_fwd_nodes(int64_t step);
};

// Declared before the lock guard, taken from the core under the lock: the references it holds
// are dropped after the lock is let go (see Core::dead_impls).
struct Dead {
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> impls;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> storages;
  void take(Core* c) {
    impls.swap(c->dead_impls);
    storages.swap(c->dead_storages);
  }
};

// Process-wide state shared with Python's hooks.
extern std::atomic<int64_t> g_step;
extern std::atomic<int> g_in_optimizer;
extern std::atomic<bool> g_forked;  // this process is a fork's child (see recorder.cpp's fork handlers)
extern thread_local int64_t tl_module[MAX_CORES];
extern thread_local bool tl_paused;

// Every FLUSH_RECORDS records (or soon after a non-finite value) the drain thread is woken.
constexpr size_t FLUSH_RECORDS = 4096;
// Back-pressure: past this many waiting records, or bytes of full_tensor copies, the recording
// thread waits for the drain (as the dispatch mode waits on the writer's queue), so memory stays
// bounded when the writer cannot keep up.
constexpr size_t MAX_PENDING_RECORDS = 1 << 17;
constexpr size_t MAX_PENDING_BYTES = size_t(256) << 20;
// trainguard.capture._recorder.FWD_NODES_MAX
constexpr size_t FWD_NODES_MAX = 200000;

bool install(Core* core);
void uninstall(Core* core);
// ``t`` now holds the values of record ``seq`` made in Python (a compiled graph's output);
// called with the core's lock held.
void set_producer(Core* core, const at::Tensor& t, int64_t seq, int64_t stack, bool finite);
void set_op_names(std::unordered_set<std::string> alloc, std::unordered_set<std::string> alias,
                  std::unordered_map<std::string, int> stats, std::unordered_map<std::string, int> workspace);
// callable(op name) -> (taint class, overwrites its first input, in place): _recorder.op_facts_by_name
void set_op_classes(PyObject* resolver);
OpInfo* op_by_index(int index);
// The operator a RecordFunction calls, from the shared table (made on first sight); nullptr when
// it is not an operator call (ops.cpp; the callbacks cache it per thread).
OpInfo* find_op(const at::RecordFunction& fn, const char* key);

// The tables (tables.cpp), with the core's lock held. An input's producer, name or none; and
// ``o`` now holds the values of record ``seq`` (``view_of``: for a view op, the producer of its
// first input, else -1; ``s`` its summary, when made on the host).
Input input_of(Core* c, const at::Tensor& t, bool in_node);
// The output autograd may save that ``t`` shares storage and geometry with (a SavedVariable's
// unpacked tensor, or ``output.data``: both a new TensorImpl that no op made), or null.
const Saved* saved_of(Core* c, const at::Tensor& t);
void register_output(Core* c, const at::Tensor& o, int64_t seq, int64_t stack, const Summary* s, int64_t view_of,
                     int health = 0, bool maybe = false);
int64_t version_of(c10::TensorImpl* impl);  // -1: an inference tensor (no version counter)

}  // namespace tg
