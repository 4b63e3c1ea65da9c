// The operators table: what each operator is to a dispatch mode (OpInfo), made once per
// operator for the process and shared by every core and thread. The callbacks look operators up
// through a per-thread cache in front of this table (recorder.cpp).
#include "core.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>

#include <mutex>
#include <unordered_map>

namespace tg {

std::mutex g_ops_mu;

namespace {

std::unordered_map<const char*, OpInfo*> g_ops;  // keyed by the schema's name (stable per operator)
std::vector<OpInfo*> g_op_list;
std::unordered_set<std::string> g_alloc, g_alias;
std::unordered_map<std::string, int> g_stats;  // batch norm's kernels: the position of `training`
std::unordered_map<std::string, int> g_workspace;  // op -> how many leading outputs hold values
PyObject* g_op_classes = nullptr;  // see set_op_classes
const std::unordered_set<std::string> g_never = {
    "aten::detach_", "aten::requires_grad_", "aten::retain_grad", "aten::set_data", "aten::data",
    "aten::_fw_primal", "aten::_make_dual", "aten::is_leaf", "aten::output_nr", "aten::_version",
    "aten::retains_grad"};

OpInfo* make_op(const c10::OperatorName& on, const char* key) {
  // Built with the GIL (its taint facts come from Python) but without g_ops_mu, which is
  // never held while anything is waited for: Python code may let another thread take the
  // GIL, and that thread may be waiting for the lock in find_op.
  PyGILState_STATE gs = PyGILState_Ensure();
  auto* info = new OpInfo();
  std::string base = on.name;  // "aten::addmm"
  auto sep = base.find("::");
  info->name = base.substr(0, sep) + "." + base.substr(sep + 2) + "." +
               (on.overload_name.empty() ? std::string("default") : on.overload_name);
  info->py_name = PyUnicode_InternFromString(info->name.c_str());
  info->autocast_cpu = info->autocast_cuda = false;
  info->view = false;
  info->kind = OP_SEEN;
  if (g_never.count(base) || base.rfind("profiler::", 0) == 0) {
    info->kind = OP_NEVER;
  } else {
    auto op = c10::Dispatcher::singleton().findOp(on);
    if (op && op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd))
      info->kind = OP_COMPOSITE;
    if (op) {
      info->autocast_cpu = op->hasKernelForDispatchKey(c10::DispatchKey::AutocastCPU);
      info->autocast_cuda = op->hasKernelForDispatchKey(c10::DispatchKey::AutocastCUDA);
      if (op->hasSchema()) {
        const auto& rets = op->schema().returns();
        info->view = !rets.empty() && rets[0].alias_info() != nullptr && !rets[0].alias_info()->isWrite();
        const auto& args = op->schema().arguments();
        info->inplace = !args.empty() && args[0].alias_info() != nullptr && args[0].alias_info()->isWrite();
        bool amp = base.rfind("aten::_amp_", 0) == 0;  // AMP's own checks (see capture/_local.written_args)
        for (size_t i = 0; rets.empty() && !amp && i < args.size(); ++i)
          if (args[i].alias_info() != nullptr && args[i].alias_info()->isWrite()) info->writes.push_back((int)i);
      }
    }
  }
  PyObject* classes;
  {
    std::lock_guard<std::mutex> g(g_ops_mu);
    info->alloc = g_alloc.count(info->name) > 0;
    info->alias = g_alias.count(info->name) > 0;
    auto ws = g_workspace.find(info->name);
    if (ws != g_workspace.end()) info->known = ws->second;
    auto st = g_stats.find(info->name);
    if (st != g_stats.end()) {
      info->writes = {3, 4};
      info->writes_if = st->second;
    }
    classes = g_op_classes;
    Py_XINCREF(classes);
  }
  if (classes != nullptr) {
    bool paused = tl_paused;
    tl_paused = true;  // ops the resolver runs are not recorded
    PyObject* r = PyObject_CallFunctionObjArgs(classes, info->py_name, nullptr);
    tl_paused = paused;
    int cls = -1, ow = 0;
    if (r != nullptr && PyTuple_Check(r) && PyTuple_GET_SIZE(r) >= 2) {
      cls = (int)PyLong_AsLong(PyTuple_GET_ITEM(r, 0));
      ow = PyObject_IsTrue(PyTuple_GET_ITEM(r, 1));
    }
    if (PyErr_Occurred()) {  // not known: every record of it goes to the Python judge
      PyErr_Clear();
      cls = -1;
      ow = 0;
    }
    Py_XDECREF(r);
    Py_DECREF(classes);
    info->taint_cls = (int8_t)cls;
    info->overwrite = ow == 1;
    info->collective = cls == T_COLLECTIVE;
    if (info->collective) info->writes.clear();  // what a collective wrote: see recorder.cpp
  }
  OpInfo* out;
  {
    std::lock_guard<std::mutex> g(g_ops_mu);
    auto git = g_ops.find(key);
    if (git != g_ops.end()) {
      out = git->second;  // another thread made it meanwhile
    } else {
      info->index = (int)g_op_list.size();
      g_ops.emplace(key, info);
      g_op_list.push_back(info);
      out = info;
    }
  }
  if (out != info) {
    Py_DECREF(info->py_name);
    delete info;
  }
  PyGILState_Release(gs);
  return out;
}

}  // namespace

OpInfo* find_op(const at::RecordFunction& fn, const char* key) {
  {
    // Known to another thread, or evicted from this thread's cache: the lock alone (nothing
    // is waited for while it is held).
    std::lock_guard<std::mutex> g(g_ops_mu);
    auto git = g_ops.find(key);
    if (git != g_ops.end()) return git->second;
  }
  auto on = fn.operator_name();
  if (!on) return nullptr;  // a RecordFunction that is not an operator call
  return make_op(*on, key);
}

void set_op_classes(PyObject* resolver) {
  std::lock_guard<std::mutex> g(g_ops_mu);
  Py_XINCREF(resolver);
  Py_XDECREF(g_op_classes);  // with the GIL (called from Python)
  g_op_classes = resolver;
}

void set_op_names(std::unordered_set<std::string> alloc, std::unordered_set<std::string> alias,
                  std::unordered_map<std::string, int> stats, std::unordered_map<std::string, int> workspace) {
  std::lock_guard<std::mutex> g(g_ops_mu);
  g_stats = std::move(stats);
  g_workspace = std::move(workspace);
  g_alloc = std::move(alloc);
  g_alias = std::move(alias);
}

OpInfo* op_by_index(int index) {
  std::lock_guard<std::mutex> g(g_ops_mu);
  return g_op_list.at(index);
}

}  // namespace tg
