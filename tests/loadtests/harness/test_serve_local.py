"""`--set` writes app settings the way serve_config.yaml nests them."""

from __future__ import annotations

import pytest

from app.args import AppArgs
from loadtests.harness.serve_local import merge_args, parse_sets

pytestmark = pytest.mark.unit


def test_dotted_sets_fill_nested_records_and_merge() -> None:
    sets = parse_sets(["model=embedded:tiny", "engine.policy=dynamic", "engine.max_num_seqs=4",
                       'replica={"max_queued_tokens": 64}', "replica.stream_interval_ms=0", "num_cpus=0.5"])
    assert sets == {"model": "embedded:tiny", "engine": {"policy": "dynamic", "max_num_seqs": 4},
                    "replica": {"max_queued_tokens": 64, "stream_interval_ms": 0}, "num_cpus": 0.5}
    args = AppArgs.model_validate(merge_args({"engine": {"queue_timeout_s": 10}}, sets))
    assert (args.engine.policy, args.engine.max_num_seqs, args.engine.queue_timeout_s) == ("dynamic", 4, 10)
    with pytest.raises(ValueError, match="key=value"):
        parse_sets(["engine.policy"])
