"""`Request.plain_stops`: true exactly when nothing but a stop token, EOS or max_tokens can end a
request after a pass (postprocess then rules a stop out without the whole stop check)."""

from __future__ import annotations

import pytest

from replicas.protocol import GuidedDecoding, SamplingParams
from replicas.request import Request

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("params", "plain"), [
    (SamplingParams(max_tokens=4), True),
    (SamplingParams(max_tokens=4, stop_token_ids=[3], ignore_eos=True), True),
    (SamplingParams(max_tokens=4, stop=["x"]), False),
    (SamplingParams(max_tokens=4, min_tokens=2), False),
    (SamplingParams(max_tokens=4, guided=GuidedDecoding("regex", "a+")), False),
])
def test_plain_stops(params: SamplingParams, plain: bool) -> None:
    assert Request("r", [1, 2], params).plain_stops is plain
