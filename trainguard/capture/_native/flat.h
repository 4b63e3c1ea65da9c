// The core's tables as open-addressing hash tables: one array of keys and one of entries in
// memory of their own (pool_alloc, see core.h), linear probing, backward-shift deletion. A
// lookup is one multiply and a short scan of adjacent keys; an insert allocates nothing (the
// node-based std::unordered_map allocated a node per entry, freed it at the sweep, and divided
// by a prime bucket count at every lookup: the largest part of the core's own per-op work on
// the training thread). Used with the core's lock held.
#pragma once
#include <cstddef>
#include <cstdint>
#include <new>
#include <utility>

namespace tg {

void* pool_alloc(size_t bytes);
void pool_free(void* p, size_t bytes);

template <typename V>
class FlatMap {
 public:
  static constexpr uint64_t EMPTY = ~uint64_t(0);  // an empty slot; a key of this value is taken as EMPTY - 1

  FlatMap() = default;
  FlatMap(const FlatMap&) = delete;
  FlatMap& operator=(const FlatMap&) = delete;
  ~FlatMap() { release(); }

  size_t size() const { return n_; }
  bool empty() const { return n_ == 0; }

  V* find(uint64_t k) {
    if (n_ == 0) return nullptr;
    if (k == EMPTY) k = EMPTY - 1;  // as emplace takes it
    for (size_t i = slot(k);; i = (i + 1) & mask_) {
      if (keys_[i] == k) return &vals_[i];
      if (keys_[i] == EMPTY) return nullptr;
    }
  }

  // The entry of ``k`` (a new one made from ``v`` when absent), and whether it is new; an
  // existing entry is left as it is.
  std::pair<V*, bool> emplace(uint64_t k, V&& v) {
    if (k == EMPTY) k = EMPTY - 1;  // never a key: taken as its neighbour (as a hash collision)
    if (2 * (n_ + 1) > cap_) grow();
    size_t i = slot(k);
    for (; keys_[i] != EMPTY; i = (i + 1) & mask_)
      if (keys_[i] == k) return {&vals_[i], false};
    keys_[i] = k;
    new (&vals_[i]) V(std::move(v));
    ++n_;
    return {&vals_[i], true};
  }

  void insert_or_assign(uint64_t k, V&& v) {
    auto r = emplace(k, std::move(v));
    if (!r.second) *r.first = std::move(v);
  }

  bool erase(uint64_t k) {
    V* v = find(k);
    if (v == nullptr) return false;
    erase_slot((size_t)(v - vals_));
    return true;
  }

  // Calls f(key, entry) for each entry.
  template <typename F>
  void for_each(F&& f) {
    for (size_t i = 0; i < cap_; ++i)
      if (keys_[i] != EMPTY) f(keys_[i], vals_[i]);
  }

  // Removes the entries for which dead(entry) holds, in place (the arrays keep their size, as
  // the node table kept its buckets: the next step needs them again). The scan starts after an empty
  // slot: no run of keys crosses it, so an entry that a deletion moves back lands in a slot
  // the scan has not left yet (checked again).
  template <typename F>
  void erase_if(F&& dead) {
    if (n_ == 0) return;
    size_t start = 0;
    while (keys_[start] != EMPTY) ++start;  // there is one: at most half the slots are used
    for (size_t c = 1; c <= cap_;) {
      size_t i = (start + c) & mask_;
      if (keys_[i] != EMPTY && dead(vals_[i])) erase_slot(i);
      else ++c;
    }
  }

  void clear() { release(); }

 private:
  uint64_t* keys_ = nullptr;
  V* vals_ = nullptr;
  size_t cap_ = 0, mask_ = 0, n_ = 0;
  int shift_ = 64;

  size_t slot(uint64_t k) const { return (size_t)((k * 0x9E3779B97F4A7C15ull) >> shift_); }

  void grow() { rehash(cap_ ? 2 * cap_ : 16); }

  void rehash(size_t cap) {
    uint64_t* old_keys = keys_;
    V* old_vals = vals_;
    size_t old_cap = cap_;
    keys_ = static_cast<uint64_t*>(pool_alloc(cap * sizeof(uint64_t)));
    vals_ = static_cast<V*>(pool_alloc(cap * sizeof(V)));
    for (size_t i = 0; i < cap; ++i) keys_[i] = EMPTY;
    cap_ = cap;
    mask_ = cap - 1;
    shift_ = 64 - __builtin_ctzll(cap);
    for (size_t i = 0; i < old_cap; ++i) {
      if (old_keys[i] == EMPTY) continue;
      size_t j = slot(old_keys[i]);
      while (keys_[j] != EMPTY) j = (j + 1) & mask_;
      keys_[j] = old_keys[i];
      new (&vals_[j]) V(std::move(old_vals[i]));
      old_vals[i].~V();
    }
    if (old_cap) {
      pool_free(old_keys, old_cap * sizeof(uint64_t));
      pool_free(old_vals, old_cap * sizeof(V));
    }
  }

  // Knuth's deletion for linear probing: later entries of the run move back into the hole
  // when their home slot does not lie (cyclically) between the hole and themselves.
  void erase_slot(size_t hole) {
    vals_[hole].~V();
    keys_[hole] = EMPTY;
    --n_;
    for (size_t j = (hole + 1) & mask_; keys_[j] != EMPTY; j = (j + 1) & mask_) {
      size_t home = slot(keys_[j]);
      bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
      if (stays) continue;
      keys_[hole] = keys_[j];
      new (&vals_[hole]) V(std::move(vals_[j]));
      vals_[j].~V();
      keys_[j] = EMPTY;
      hole = j;
    }
  }

  void release() {
    for (size_t i = 0; i < cap_; ++i)
      if (keys_[i] != EMPTY) vals_[i].~V();
    if (cap_) {
      pool_free(keys_, cap_ * sizeof(uint64_t));
      pool_free(vals_, cap_ * sizeof(V));
    }
    keys_ = nullptr;
    vals_ = nullptr;
    cap_ = mask_ = n_ = 0;
    shift_ = 64;
  }
};

}  // namespace tg
