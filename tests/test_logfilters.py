"""Dropping other libraries' log messages by the pattern of their start, once per logger however often asked."""

import logging

from gpo.logfilters import drop_messages


def test_messages_with_a_dropped_start_are_dropped_others_kept_and_asking_again_adds_nothing(caplog):
    drop_messages("gpo.tests.chatty", r"\w*RotaryEmbedding: Failed", "Both `max_new_tokens`")
    drop_messages("gpo.tests.chatty", r"\w*RotaryEmbedding: Failed", "Both `max_new_tokens`")
    chatty = logging.getLogger("gpo.tests.chatty")
    assert len(chatty.filters) == 1
    with caplog.at_level(logging.WARNING, logger="gpo.tests.chatty"):
        chatty.warning("%s: Failed to load weights", "RotaryEmbedding")
        chatty.warning("%s: Failed to load weights", "Llama3RotaryEmbedding")
        chatty.warning("Both `max_new_tokens` (=4) and `max_length` (=20) seem to have been set.")
        chatty.warning("%s: Failed to load weights", "LlamaAttention")
    assert [record.getMessage() for record in caplog.records] == ["LlamaAttention: Failed to load weights"]
