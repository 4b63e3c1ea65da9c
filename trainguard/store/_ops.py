"""Facts about operators by name, shared by the recorder and the analysis (no torch here)."""

from __future__ import annotations

# Ops whose output holds exactly the values of their first input (same multiset of elements),
# so its summary is the input's: views, transposes, detach, clone.
ALIAS_OPS = frozenset(
    {"aten.view.default", "aten._unsafe_view.default", "aten.t.default", "aten.transpose.int",
     "aten.permute.default", "aten.detach.default", "aten.alias.default", "aten.unsqueeze.default",
     "aten.squeeze.default", "aten.squeeze.dim", "aten.squeeze.dims", "aten._reshape_alias.default",
     "aten.clone.default", "aten.lift_fresh.default", "aten.view_as.default", "aten.reshape.default",
     "aten.flatten.using_ints", "aten.numpy_T.default", "aten.mT.default", "aten.adjoint.default"}
)
