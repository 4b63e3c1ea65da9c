// The core's tables (core.h): who produced each live tensor, the outputs autograd may save, the
// forward ops of autograd's nodes; their entries, their sweeps, and the memory they live in.
#include "core.h"

#include <sys/mman.h>

#include <algorithm>

namespace tg {

int64_t version_of(c10::TensorImpl* impl) {
  return impl->is_inference() ? -1 : (int64_t)impl->version_counter().current_version();
}

namespace {

bool has_plain_storage(const at::Tensor& t) {
  // a tensor of a trace with dynamic shapes (a compile of a second length) has no offset to read
  return t.layout() == at::kStrided && t.unsafeGetTensorImpl()->has_storage() &&
         !t.unsafeGetTensorImpl()->has_symbolic_sizes_strides();
}

uint64_t geometry_key(const at::Tensor& t) {
  uint64_t h = (uint64_t)(uintptr_t)t.storage().unsafeGetStorageImpl();
  auto mix = [&h](uint64_t v) { h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
  mix((uint64_t)t.storage_offset());
  mix((uint64_t)t.scalar_type());
  for (int64_t d : t.sizes()) mix((uint64_t)d);
  for (int64_t s : t.strides()) mix((uint64_t)s);
  return h;
}

bool same_geometry(const Saved& s, const at::Tensor& t) {
  return !s.storage.expired() && s.storage._unsafe_get_target() == t.storage().unsafeGetStorageImpl() &&
         s.offset == t.storage_offset() && s.dtype == (int8_t)t.scalar_type() && t.sizes().equals(s.sizes) &&
         t.strides().equals(s.strides);
}

}  // namespace

Input input_of(Core* c, const at::Tensor& t, bool in_node) {
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  Named* n = c->named.find(impl_key(impl));
  if (n != nullptr && !n->ref.expired() && n->ref._unsafe_get_target() == impl) return Input{2, 0, n->name, n->what};
  Producer* p = c->producers.find(impl_key(impl));
  if (p != nullptr && !p->ref.expired()) {
    Input in{0, p->seq};
    in.maybe = p->maybe;
    if (t.is_view()) {
      Producer* b = c->producers.find(impl_key(t._base().unsafeGetTensorImpl()));
      bool later = b != nullptr && !b->ref.expired() && b->seq > p->seq;
      if (later && b->health > 0 && b->maybe) {
        // a later op wrote a non-finite value into its base through another view: the view
        // holds that write now (mambapy's in-place scan through views of X = X.transpose(2, 1),
        // returned as X.transpose(2, 1)). (_recorder_mode._written_through_base: the same)
        in.ref = b->seq;
        in.maybe = true;
      } else if (p->maybe) {
        in.written = later;  // a view whose base a later op wrote (see Input::written)
      }
    }
    return in;
  }
  // A saved output, unpacked in a backward node (see Saved). Not in the forward pass: the dispatch
  // mode, the reference, sees no producer there (a foreach optimizer's inputs that share an
  // output's memory and geometry).
  if (in_node) {
    if (const Saved* s = saved_of(c, t)) {
      Input in{0, s->seq};
      in.maybe = s->maybe;
      return in;
    }
  }
  return Input{1, 0};
}

const Saved* saved_of(Core* c, const at::Tensor& t) {
  if (c->saved.empty() || !has_plain_storage(t)) return nullptr;
  Saved* s = c->saved.find(geometry_key(t));
  return s != nullptr && same_geometry(*s, t) ? s : nullptr;
}

namespace {
void remember_saved(Core* c, const at::Tensor& o, int64_t seq, int64_t view_of, bool maybe) {
  uint64_t key = geometry_key(o);
  if (view_of >= 0) {  // a view of that output with its geometry (expand to the same shape) stays behind it
    Saved* s = c->saved.find(key);
    if (s != nullptr && s->seq == view_of && same_geometry(*s, o)) return;
  }
  Saved s{o.storage().getWeakStorageImpl(), o.storage_offset(), (int8_t)o.scalar_type(),
          c10::SmallVector<int64_t, 6>(o.sizes().begin(), o.sizes().end()),
          c10::SmallVector<int64_t, 6>(o.strides().begin(), o.strides().end()), seq, maybe};
  if (Saved* old = c->saved.find(key)) c->dead_storages.push_back(std::move(old->storage));  // see Core::dead_impls
  c->saved.insert_or_assign(key, std::move(s));
  if (c->saved.size() > c->saved_sweep_at) c->sweep();
}

}  // namespace

// ``view_of``: for a view op, the producer of its first input (-1 none): the view must not hide
// that output among the saved ones (expand to the same shape has the same geometry; see Saved).
void register_output(Core* c, const at::Tensor& o, int64_t seq, int64_t stack, const Summary* s, int64_t view_of,
                     int health, bool maybe) {
  c10::TensorImpl* impl = o.unsafeGetTensorImpl();
  Producer* p = c->producers.find(impl_key(impl));
  if (p != nullptr && !p->ref.expired()) {
    p->seq = seq;  // an in-place op: the tensor now holds this op's output
    p->stack = stack;
    p->has_summary = s != nullptr;
    if (s) p->s = *s;
    p->version = version_of(impl);
    p->health = health;
    p->maybe = maybe;
    if (o.requires_grad() && has_plain_storage(o)) remember_saved(c, o, seq, view_of, maybe);
    return;
  }
  // An output that requires grad may be saved for backward under another TensorImpl.
  if (o.requires_grad() && has_plain_storage(o)) remember_saved(c, o, seq, view_of, maybe);
  if (p != nullptr) c->dead_impls.push_back(std::move(p->ref));  // expired: dropped later (Core::dead_impls)
  c->producers.insert_or_assign(impl_key(impl), Producer{c10::weak_intrusive_ptr<c10::TensorImpl>(o.getIntrusivePtr()),
                                                        seq, stack, s != nullptr, s ? *s : Summary{},
                                                        version_of(impl), health, maybe});
  if (c->producers.size() > c->sweep_at) c->sweep();
}

void set_producer(Core* c, const at::Tensor& t, int64_t seq, int64_t stack, bool finite) {
  // A compiled graph's output, judged in Python. Judged finite there (``finite``: its graph's
  // flag says nothing inside was non-finite and no input was tainted), its consumers take the
  // fast path as an eager op's would; else its health is not known here (-1), and it may hold a
  // taint state, so its consumers go to the Python judge.
  if (finite) register_output(c, t, seq, stack, nullptr, -1, 0, false);
  else register_output(c, t, seq, stack, nullptr, -1, -1, true);
}

// ------------------------------------------------------------------ the tables' memory (core.h)
std::mutex g_pool_mu;

namespace {
constexpr size_t POOL_SLOT = 64;                // size classes: multiples of 64 bytes
constexpr size_t POOL_MAX = 1024;               // larger blocks: their own mapping
constexpr size_t POOL_SLAB = size_t(256) << 10;  // slots are carved from 256 KiB mappings
void* g_free[POOL_MAX / POOL_SLOT + 1] = {nullptr};  // per size class, a list through the slots
char* g_slab = nullptr;
size_t g_slab_left = 0;

void* map(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  return p;
}
size_t pages(size_t bytes) { return (bytes + 4095) & ~size_t(4095); }

// A block's size class: 0 bytes get the smallest (a block of their own, as operator new gives).
size_t size_class(size_t bytes) { return bytes == 0 ? 1 : (bytes + POOL_SLOT - 1) / POOL_SLOT; }
}  // namespace

void* pool_alloc(size_t bytes) {
  if (bytes > POOL_MAX) return map(pages(bytes));
  size_t k = size_class(bytes);
  std::lock_guard<std::mutex> g(g_pool_mu);
  if (void* p = g_free[k]) {
    g_free[k] = *static_cast<void**>(p);
    return p;
  }
  size_t size = k * POOL_SLOT;
  if (g_slab_left < size) {
    g_slab = static_cast<char*>(map(POOL_SLAB));  // the rest of the old slab stays unused
    g_slab_left = POOL_SLAB;
  }
  void* p = g_slab;
  g_slab += size;
  g_slab_left -= size;
  return p;
}

void pool_free(void* p, size_t bytes) {
  if (p == nullptr) return;
  if (bytes > POOL_MAX) {
    munmap(p, pages(bytes));
    return;
  }
  size_t k = size_class(bytes);
  std::lock_guard<std::mutex> g(g_pool_mu);
  *static_cast<void**>(p) = g_free[k];
  g_free[k] = p;
}

void Core::sweep() {
  // The references go to dead_impls / dead_storages, dropped once the lock is let go (see there).
  producers.erase_if([this](Producer& p) {
    if (!p.ref.expired()) return false;
    dead_impls.push_back(std::move(p.ref));
    return true;
  });
  sweep_at = std::max<size_t>(4096, 2 * producers.size());
  saved.erase_if([this](Saved& s) {
    if (!s.storage.expired()) return false;
    dead_storages.push_back(std::move(s.storage));
    return true;
  });
  saved_sweep_at = std::max<size_t>(4096, 2 * saved.size());
}

void Core::prune_fwd_nodes(int64_t step) {
  // As Recorder._prune_fwd_nodes: the last two steps, then the newest half past half the limit.
  if (step < 0) step = g_step.load();
  std::vector<std::pair<uint64_t, FwdNode>> items;
  fwd_nodes.for_each([&](uint64_t k, const FwdNode& n) {
    if (n.step >= step - 2) items.emplace_back(k, n);
  });
  std::sort(items.begin(), items.end(), [](auto& a, auto& b) { return a.second.order < b.second.order; });
  size_t from = items.size() > FWD_NODES_MAX / 2 ? items.size() / 2 : 0;
  fwd_nodes.clear();
  for (size_t i = from; i < items.size(); ++i) fwd_nodes.emplace(items[i].first, std::move(items[i].second));
}

}  // namespace tg
