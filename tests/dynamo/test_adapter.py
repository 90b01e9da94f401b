"""Dynamo's request dicts as the engine's requests (skippy_scheduler/dynamo/adapter.py): what
maps, what is refused with a reason, and BOS lined up with direct traffic. No Dynamo needed."""
from __future__ import annotations

import pytest

from skippy_scheduler.dynamo.adapter import Unsupported, Vocabulary, map_request

VOCAB = Vocabulary(n_vocab=100, n_ctx_seq=64, bos=1)


def test_greedy_request_maps_to_the_fast_path_with_bos_in_front():
    m = map_request({"token_ids": [5, 6, 7], "sampling_options": {"temperature": 0},
                     "stop_conditions": {"max_tokens": 4}}, VOCAB)
    assert (m.prompt, m.max_tokens, m.sampling, m.bos_added) == ([1, 5, 6, 7], 4, None, True)


def test_bos_is_not_doubled_and_can_be_left_out():
    assert map_request({"token_ids": [1, 5]}, VOCAB).prompt == [1, 5]
    assert map_request({"token_ids": [5]}, VOCAB, add_bos=False).prompt == [5]
    assert map_request({"token_ids": [5]}, Vocabulary(100, 64, None)).prompt == [5]


def test_max_tokens_defaults_to_what_the_lane_leaves():
    assert map_request({"token_ids": [5, 6]}, VOCAB).max_tokens == 64 - 3


def test_sampling_and_stop_conditions_map():
    m = map_request({"token_ids": [5], "sampling_options": {
        "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 7,
        "presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.1,
        "n": 1, "include_stop_str_in_output": False},
        "stop_conditions": {"max_tokens": 8, "min_tokens": 2, "ignore_eos": True,
                            "stop_token_ids_hidden": [2, 9], "stop": ["x"]}}, VOCAB)
    s = m.sampling
    assert s is not None
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.7, 0.9, 40, 0.05, 7)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, 0.25, 1.1)
    assert s.ignore_eos and s.min_end_position == 2 + 2 and tuple(s.min_end_tokens) == (2, 9)
    assert m.stop_ids == {2, 9} and m.min_tokens == 2
    # The client's own stop ids join the hidden ones, as Dynamo's backends merge them.
    both = map_request({"token_ids": [5], "stop_conditions": {
        "stop_token_ids_hidden": [2], "stop_token_ids": [11, 2], "min_tokens": 1}}, VOCAB)
    assert both.stop_ids == {2, 11}
    assert both.sampling is not None and tuple(both.sampling.min_end_tokens) == (2, 11)
    with pytest.raises(Unsupported, match="stop_token_ids must be token ids"):
        map_request({"token_ids": [5], "stop_conditions": {"stop_token_ids": ["x"]}}, VOCAB)


@pytest.mark.parametrize("request_, reason", [
    ({"sampling_options": {"n": 2}}, "several choices"),
    ({"sampling_options": {"best_of": 3}}, "best_of"),
    ({"sampling_options": {"use_beam_search": True}}, "beam search"),
    ({"sampling_options": {"guided_decoding": {"json": {}}}}, "guided decoding"),
    ({"output_options": {"logprobs": 1}}, "log-probabilities"),
    ({"stop_conditions": {"max_thinking_tokens": 10}}, "thinking budget"),
    ({"stop_conditions": {"max_tokens": 100}}, "exceed"),
    ({"sampling_options": {"temperature": 3}}, "temperature"),
])
def test_what_has_no_counterpart_is_refused_with_the_reason(request_, reason):
    with pytest.raises(Unsupported, match=reason):
        map_request({"token_ids": [5, 6], **request_}, VOCAB)


def test_bad_prompts_are_refused():
    for tokens in ([], [100], [True], None):
        with pytest.raises(Unsupported):
            map_request({"token_ids": tokens}, VOCAB)
    with pytest.raises(Unsupported, match="no room"):
        map_request({"token_ids": list(range(2, 66))}, VOCAB)


@pytest.mark.parametrize("request_, reason", [
    ({"sampling_options": {"allowed_token_ids": [3, 4]}}, "allowed_token_ids"),
    ({"sampling_options": {"bad_words_token_ids": [[7]]}}, "bad_words_token_ids"),
    ({"sampling_options": {"logit_bias": {"7": -100}}}, "logit_bias"),
    ({"sampling_options": {"some_new_constraint": 3}}, "some_new_constraint"),
    ({"extra_args": {"sampling_options": {"logit_bias": {"7": -100}}}},
     r"extra_args\.sampling_options"),
])
def test_constraints_nothing_enforces_are_refused_not_ignored(request_, reason):
    with pytest.raises(Unsupported, match=reason):
        map_request({"token_ids": [5, 6], **request_}, VOCAB)


def test_constraints_left_empty_are_accepted():
    m = map_request({"token_ids": [5], "sampling_options": {
        "allowed_token_ids": None, "bad_words_token_ids": [], "logit_bias": {},
        "include_stop_str_in_output": False}, "extra_args": {"sampling_options": {},
                                                              "nvext": {"x": 1}}}, VOCAB)
    assert m.prompt == [1, 5]


@pytest.mark.parametrize("key", ["detokenize", "skip_special_tokens",
                                 "spaces_between_special_tokens"])
def test_how_the_frontend_detokenizes_is_not_refused(key):
    """Options about the text the frontend makes of the tokens constrain no token here."""
    for value in (True, False, None):
        assert map_request({"token_ids": [5], "sampling_options": {key: value}},
                           VOCAB).prompt == [1, 5]


def test_dynamo_priorities_map_onto_the_engines_in_order():
    def priority(value):
        return map_request({"token_ids": [5], "routing": {"priority": value}}, VOCAB).priority

    low, minus_one, zero, one, high = (priority(p) for p in
                                       (-(1 << 31), -1, 0, 1, (1 << 31) - 1))
    assert (low, high) == (0, (1 << 32) - 1)  # within the engine's range (unsigned)
    assert low < minus_one < zero < one < high  # higher first in both
    assert map_request({"token_ids": [5]}, VOCAB).priority == zero
    assert map_request({"token_ids": [5], "routing": {}}, VOCAB).priority == zero
    assert priority(None) == zero
    for bad in (1 << 31, -(1 << 31) - 1, 1.5, "2", True):
        with pytest.raises(Unsupported, match="routing.priority"):
            priority(bad)


@pytest.mark.parametrize("request_, reason", [
    ({"stop_conditions": {"stop_token_ids": [-1], "min_tokens": 1}}, "-1 is not in"),
    ({"stop_conditions": {"stop_token_ids": [1 << 40], "min_tokens": 1}}, "is not in"),
    ({"stop_conditions": {"stop_token_ids_hidden": [100]}}, "100 is not in"),
    ({"stop_conditions": ["x"]}, "stop_conditions must be an object"),
    ({"sampling_options": 3}, "sampling_options must be an object"),
    ({"output_options": "x"}, "output_options must be an object"),
    ({"routing": [1]}, "routing must be an object"),
    ({"extra_args": 1}, "extra_args must be an object"),
])
def test_malformed_fields_are_refused_with_the_reason(request_, reason):
    with pytest.raises(Unsupported, match=reason):
        map_request({"token_ids": [5, 6], **request_}, VOCAB)


def test_packed_token_ids_are_unpacked_as_dynamo_packs_them():
    import array
    import sys

    ids = array.array("i", [5, 6, 99])
    if sys.byteorder != "little":
        ids.byteswap()
    packed = ids.tobytes()  # DYN_TOKEN_IDS_AS_BYTES: little-endian int32s
    for value in (packed, bytearray(packed), memoryview(packed)):
        assert map_request({"token_ids": value}, VOCAB).prompt == [1, 5, 6, 99]
    assert map_request({"token_ids": (5, 6)}, VOCAB).prompt == [1, 5, 6]
    with pytest.raises(Unsupported, match="not a multiple of 4"):
        map_request({"token_ids": packed[:-1]}, VOCAB)
    with pytest.raises(Unsupported, match="-1 is not in the vocabulary"):
        map_request({"token_ids": (-1).to_bytes(4, "little", signed=True)}, VOCAB)
    with pytest.raises(Unsupported, match="no prompt tokens"):
        map_request({"token_ids": b""}, VOCAB)
    with pytest.raises(Unsupported, match="token_ids must be a list"):
        map_request({"token_ids": "5 6"}, VOCAB)
