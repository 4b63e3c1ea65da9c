"""The JSON codec: exact round trips without pickle, refusal of what it cannot store."""

from __future__ import annotations

import json
import math
from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard import CheckpointError
from trainguard.resilience._codec import Encoder, decode, tensor_refs

scalars = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
    | st.text() | st.binary(max_size=16)
)
keys = st.integers() | st.text(max_size=8) | st.just("__tg__") | st.booleans()
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.lists(inner, max_size=4).map(tuple)
    | st.dictionaries(keys, inner, max_size=4),
    max_leaves=20,
)


def roundtrip(value):
    enc = Encoder()
    doc = json.loads(json.dumps(enc.encode(value, "x"), allow_nan=False))  # must be strict JSON
    return decode(doc, enc.tensors), enc


def same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


@settings(max_examples=200, deadline=None)
@given(values)
def test_any_plain_value_round_trips_exactly(value):
    back, _ = roundtrip(value)
    assert same(value, back)


def test_types_that_json_would_blur_come_back_as_they_were():
    value = {
        0: (1, 2.5, -0.0),
        "betas": (0.9, 0.999),
        "nan": math.nan,
        "inf": -math.inf,
        "np": np.arange(6, dtype=np.uint32).reshape(2, 3),
        "npscalar": np.float64(0.1),
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "set": {1, 2},
    }
    back, enc = roundtrip(value)
    assert enc.tensors == {}
    assert back[0] == (1, 2.5, -0.0) and math.copysign(1, back[0][2]) == -1
    assert back["betas"] == (0.9, 0.999) and isinstance(back["betas"], tuple)
    assert math.isnan(back["nan"]) and back["inf"] == -math.inf
    assert back["np"].dtype == np.uint32 and back["np"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert type(back["npscalar"]) is np.float64 and back["npscalar"] == np.float64(0.1)
    assert back["dtype"] is torch.bfloat16 and back["size"] == torch.Size([2, 3]) and back["set"] == {1, 2}


def test_tensors_are_taken_out_by_path_and_put_back():
    w = torch.randn(3, 2)
    sd = OrderedDict([("fc.weight", w), ("fc.bias", torch.zeros(3))])
    sd._metadata = {"": {"version": 1}}  # what nn.Module.state_dict() attaches
    enc = Encoder()
    doc = enc.encode({"model": sd, "state": {0: {"step": torch.tensor(3.0)}}}, "obj")
    assert sorted(enc.tensors) == ["obj/model/fc.bias", "obj/model/fc.weight", "obj/state/0/step"]
    assert [r["shape"] for r in tensor_refs(doc)] == [[3, 2], [3], []]
    back = decode(json.loads(json.dumps(doc)), enc.tensors)
    assert isinstance(back["model"], OrderedDict) and back["model"]._metadata == {"": {"version": 1}}
    assert back["model"]["fc.weight"] is w


def test_colliding_paths_get_distinct_keys():
    enc = Encoder()
    enc.encode({"a/b": torch.zeros(1), "a": {"b": torch.ones(1)}}, "p")
    assert len(enc.tensors) == 2


@pytest.mark.parametrize("bad", [object(), lambda: 1, np.array([object()], dtype=object)])
def test_objects_that_would_need_pickle_are_refused_with_their_path(bad):
    with pytest.raises(CheckpointError, match=r"obj/inner/k.*never pickles|numpy array of dtype object at obj/inner/k"):
        Encoder().encode({"inner": {"k": bad}}, "obj")


def test_unknown_tags_in_a_manifest_are_rejected():
    with pytest.raises(CheckpointError, match="unknown value kind"):
        decode({"__tg__": "pickle", "v": "gASVAAAAAAAAAACMAQ=="}, {})
    with pytest.raises(CheckpointError, match="missing from the checkpoint data"):
        decode({"__tg__": "tensor", "key": "nope", "dtype": "float32", "shape": []}, {})


class _ListLike:
    """fastcore's ``L`` in a few lines: no list subclass, but a registered ``collections.abc.Sequence``
    (fastai's ``Optimizer.state_dict()`` holds its per-group hyper-parameters in one)."""

    def __init__(self, items):
        self.items = list(items)

    def __getitem__(self, i):
        return self.items[i]

    def __len__(self):
        return len(self.items)


def test_a_sequence_that_is_no_list_comes_back_as_a_list():
    # TrainState(optimizer=learn.opt) on a fastai Learner raised "cannot checkpoint a
    # fastcore.foundation.L at optimizer/hypers" at the first save. A namedtuple comes back as a
    # tuple already: the container's class is code, its items are the state.
    from collections.abc import Sequence

    Sequence.register(_ListLike)
    hypers = _ListLike([{"lr": 1e-3, "mom": 0.9, "wd": 0.01}, {"lr": 1e-2, "mom": 0.9, "wd": 0.0}])
    state = {"state": [{"grad_avg": torch.ones(3), "step": 4}], "hypers": hypers}
    back, enc = roundtrip(state)
    assert back["hypers"] == [{"lr": 1e-3, "mom": 0.9, "wd": 0.01}, {"lr": 1e-2, "mom": 0.9, "wd": 0.0}]
    assert torch.equal(back["state"][0]["grad_avg"], torch.ones(3)) and back["state"][0]["step"] == 4
