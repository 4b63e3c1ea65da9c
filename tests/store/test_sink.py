"""The sink's cached JSON texts of inputs and outputs are the texts ``json`` writes."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from trainguard.store._sink import Sink, _plain_dumps

_names = st.text(max_size=8)
_inputs = st.lists(st.one_of(
    st.tuples(st.just("op"), st.integers(min_value=0)),
    st.tuples(st.sampled_from(["param", "buffer"]), _names),
    st.tuples(st.just("input"), st.none()),
    st.tuples(st.just("op"), st.one_of(st.booleans(), st.floats(allow_nan=False), st.none())),
), max_size=5).map(tuple)
_outputs = st.lists(st.one_of(
    st.tuples(st.sampled_from(["float32", "bfloat16", "int64"]),
              st.lists(st.one_of(st.integers(0, 4), st.booleans(), st.just(1.0)), max_size=3).map(tuple),
              st.sampled_from(["cpu", "cuda:0"])),
    st.none(),
), max_size=3).map(tuple)


def _sink() -> Sink:
    sink = object.__new__(Sink)  # only the text cache: no database
    sink._texts = {}
    return sink


@given(st.lists(st.tuples(_inputs, _outputs), max_size=20))
def test_cached_texts_equal_json(records):
    sink = _sink()
    for _ in range(2):  # the second pass reads the cache
        for inputs, outputs in records:
            assert sink._inputs_text(inputs) == _plain_dumps(inputs)
            assert sink._text(outputs) == _plain_dumps(outputs)


def test_equal_values_of_other_types_keep_their_own_text():
    # True == 1 == 1.0 as dict keys; the stored JSON must still say true, 1 and 1.0
    sink = _sink()
    texts = [sink._text((("float32", (v,), "cpu"),)) for v in (1, True, 1.0, 1)]
    assert texts == ['[["float32",[1],"cpu"]]', '[["float32",[true],"cpu"]]', '[["float32",[1.0],"cpu"]]',
                     '[["float32",[1],"cpu"]]']
    assert sink._inputs_text((("op", True), ("op", 7), ("param", "0.weight"))) == \
        '[["op",true],["op",7],["param","0.weight"]]'
    assert sink._text((math.nan, math.inf)) == "[NaN,Infinity]"  # as json writes them
