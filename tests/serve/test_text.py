"""Incremental detokenisation and stop strings, on synthetic pieces (no model needed)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_scheduler.serve.text import Detokenizer, StopMatcher


def test_a_character_split_over_byte_tokens_waits_until_it_is_whole():
    pieces = [b"a", b"\xe2", b"\x82", b"\xac", b"b", b"\xff"]  # "€" is e2 82 ac
    d = Detokenizer(pieces)
    assert [d.add(t) for t in range(5)] == ["a", "", "", "\u20ac", "b"]
    assert d.add(5) == "\ufffd" and d.flush() == ""
    d = Detokenizer(pieces)
    assert d.add(1) == "" and d.flush() == "\ufffd"  # an unfinished character at the end


def test_stop_across_chunks_is_cut_and_never_sent():
    m = StopMatcher(["STOP"])
    assert m.push("abc S") == ("abc ", False)
    assert m.push("T") == ("", False)
    assert m.push("O") == ("", False)  # "STO" could still become "STOP"
    assert m.push("Pyz") == ("", True)
    assert m.stopped and m.push("more") == ("", True) and m.flush() == ""
    m = StopMatcher(["STOP"])
    assert m.push("ST") == ("", False) and m.push("Ox") == ("STOx", False)


def test_held_text_is_released_when_it_cannot_start_a_stop():
    m = StopMatcher(["ab", "xyz"])
    assert m.push("qx") == ("q", False)
    assert m.push("yq") == ("xyq", False)
    assert m.push("a") == ("", False)
    assert m.flush() == "a"


def test_earliest_stop_wins():
    m = StopMatcher(["cd", "b"])
    assert m.push("abcd") == ("a", True)


def test_the_first_stop_to_complete_ends_the_text():
    m = StopMatcher(["a", "baa"])
    assert m.push("ba") == ("b", True)  # "baa" could still have come, but "a" is complete


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="abc\u20ac", max_size=40),
       st.lists(st.text(alphabet="abc\u20ac", min_size=1, max_size=4), max_size=3),
       st.lists(st.integers(0, 40), max_size=10))
def test_streamed_text_equals_the_text_cut_at_the_first_stop(text, stops, cuts):
    cuts = sorted(set(c for c in cuts if c <= len(text)))
    chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    m = StopMatcher(stops)
    out = []
    stopped = False
    for chunk in chunks:
        piece, stopped = m.push(chunk)
        out.append(piece)
        if stopped:
            break
    if not stopped:
        out.append(m.flush())
    # Generation ends at the first chunk after which some stop string is present; the text
    # ends where the earliest of the strings present then begins.
    expected, hit = text, False
    ends = [sum(len(c) for c in chunks[:i + 1]) for i in range(len(chunks))]
    for end in ends:
        hits = [text[:end].find(s) for s in stops if s in text[:end]]
        if hits:
            expected, hit = text[:min(hits)], True
            break
    assert "".join(out) == expected
    assert stopped == hit
