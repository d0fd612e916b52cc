"""`exl3serve-openai --engine-calls per-request` (one Generate call per request): the main tests of
test_live.py again against a front end in that mode on the session's engine (the session's own
front end runs in the default mode, stream, unless $EXL3_ENGINE_CALLS says otherwise)."""

from __future__ import annotations

import copy

import pytest

import stack
# Collected here again: they run against this module's `live` (the per-request front end).
from test_live import (client, test_async_sdk_streaming_and_not,  # noqa: F401
                       test_chat_streaming_equals_not_streaming, test_disconnect_cancels_engine_request,
                       test_engine_refusals_name_the_field, test_greedy_tokens_equal_direct_generate,
                       test_health_and_metrics, test_logprobs, test_stop_string_not_returned, tok)


@pytest.fixture(scope="module")
def live(live, tmp_path_factory):
    """The session's stack with a per-request front end in place of its own."""
    fe, url = stack.start_frontend(live.engine, live.model, tmp_path_factory.mktemp("logs-pr"),
                                   engine_calls="per-request")
    other = copy.copy(live)
    other.url, other.base = url, url[: -len("/v1")]
    yield other
    fe.stop()
