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


def _rec(seq, inputs, taint=0, origin=None, health=0):
    # seq, step, phase, op, module, stack, fwd_seq, health, inputs, outputs, summary, taint, origin
    return (seq, 0, "forward", "aten.div.Tensor", None, None, None, health, inputs,
            (("float32", (3,), "cpu"),), None, taint, origin)


def test_keep_all_record_sent_again_after_its_commit_keeps_one_row_and_its_edges(tmp_path):
    # A value that turns harmful more than a commit after it was made (late.py: w * 2 / zeros,
    # consumed by z - z 2.5 s later) is sent again with its new taint. With buffer=-1 the sink
    # inserted the row again with its edges: the div was listed twice among mul's consumers
    # (22 edges against 20 with buffer=1000).
    from trainguard.store._codec import T_HARMFUL
    from trainguard.store._schema import connect

    sink = Sink(tmp_path, mode="no_tensor", buffer=-1)
    sink.handle(("exec", [_rec(0, ()), _rec(1, ()), _rec(2, (("op", 0), ("op", 1)))], []))
    sink.commit()
    sink.handle(("exec", [_rec(3, (("op", 2),)), _rec(4, (("op", 3),))], []))
    sink.handle(("exec", [_rec(2, (("op", 0), ("op", 1)), taint=T_HARMFUL, origin=2, health=1)], [2]))
    sink.commit(final=True)
    con = connect(tmp_path / "run.sqlite", create=False)
    assert con.execute("SELECT producer, consumer, slot FROM edges ORDER BY consumer, slot").fetchall() == \
        [(0, 2, 0), (1, 2, 1), (2, 3, 0), (3, 4, 0)]
    assert con.execute("SELECT seq, taint, origin, pinned FROM executions ORDER BY seq").fetchall() == \
        [(0, 0, None, 0), (1, 0, None, 0), (2, T_HARMFUL, 2, 1), (3, 0, None, 0), (4, 0, None, 0)]
