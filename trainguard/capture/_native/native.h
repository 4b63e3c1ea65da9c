// Shared declarations of trainguard's native recorder core (see __init__.py and docs/recorder.md).
#pragma once
#include <Python.h>
#include <ATen/core/Tensor.h>
#include <array>
#include <cstdint>
#include <vector>

namespace tg {

// Summary modes, in the order of trainguard.store.MODES.
enum Mode : int { NO_TENSOR = 0, CURT = 1, CONCISE = 2, FULL = 3, SHAPE = 4, FULL_TENSOR = 5, STATS = 6 };
int mode_fields(int mode);

struct Summary {
  int n = 0;  // number of fields
  std::array<double, 11> v{};
};

// The exact summary of a tensor's values (CPU, or any device for sparse/meta bookkeeping).
Summary summarize(const at::Tensor& t, int mode, bool expect_nonfinite = false);
Summary unknown_summary(int mode, int64_t n);
int health_of(int mode, const Summary& s);
// The summary kernel's vector pass: 0 baseline (SSE2 on x86-64, the compiler's on others), 1 AVX2.
// simd_level(level) selects min(level, simd_max()) (level < 0: no change) and returns the old one.
int simd_level(int level);
int simd_max();  // bit flags 1 NaN, 2 +inf, 4 -inf
// The summary as a float64 tensor on the tensor's device, computed with device ops (no sync).
at::Tensor summarize_deferred(const at::Tensor& t, int mode);

// Stacks: the calling Python thread's frames, interned. 0 = no Python caller.
// Held while a callback calls Python with the GIL: an error the op is raising (a saved-tensor
// hook's, as torch.utils.checkpoint's _StopRecomputationError ending a recompute early) stays
// pending through it. Cleared by our call, or failing it, the op returned NULL with no error set:
// "SystemError: <built-in method tanh> returned NULL without setting an exception".
struct KeepPyError {
  PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
  KeepPyError() { PyErr_Fetch(&type, &value, &tb); }
  ~KeepPyError() {
    if (type != nullptr) {
      PyErr_Clear();
      PyErr_Restore(type, value, tb);
    }
  }
  KeepPyError(const KeepPyError&) = delete;
  KeepPyError& operator=(const KeepPyError&) = delete;
};

struct StackTable;
StackTable* stacks_new(PyObject* on_new_stack);
void stacks_free(StackTable*);
int64_t stacks_capture(StackTable*);
// What a stack's frames say where no module hook claims its op (trainguard.capture._stacks.
// frame_hint, handed back by the new-stack callback): the depth of the frame running a module's
// method and of a custom autograd.Function's forward, -1 none; false when the stack has neither.
bool stacks_hint(StackTable*, int64_t sid, int* owner, int* fn);
// The first argument (self, ctx) of the calling thread's frame ``depth`` frames out from the
// innermost; borrowed, alive while that frame runs; nullptr where there is none.
PyObject* stacks_local0(int depth);

}  // namespace tg
