"""Multiple-choice accuracy as lm-evaluation-harness scores it, through the HTTP API and with HF.

    python -m loadtests.bench.mc_eval --url http://127.0.0.1:8000 [--model embedded:smollm2]

The items and the scoring (one `/v1/completions` request per option, as lm-eval's
`local-completions` sends it, and the same sums from HF's own forward) are the tests' own:
`tests/support/multiple_choice.py`, which the real-model HTTP test runs too.
"""

from __future__ import annotations

import argparse

from tests.support.multiple_choice import MULTIPLE_CHOICE, encode_pairs, mc_accuracy, mc_picks, score_hf, score_http


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--model", default="embedded:smollm2", help="the served model (its tokenizer is loaded here)")
    p.add_argument("--served-name", help="the name clients send (default: the model with ':' made '-')")
    p.add_argument("--hf", action="store_true", help="also score with HF in this process and compare")
    args = p.parse_args()
    from replicas.loading.model_files import load_tokenizer

    pairs = encode_pairs(load_tokenizer(args.model), MULTIPLE_CHOICE)
    served = args.served_name or args.model.replace(":", "-")
    http_picks = mc_picks(MULTIPLE_CHOICE, score_http(args.url, served, pairs))
    print(f"through the server: {mc_accuracy(MULTIPLE_CHOICE, http_picks):.0%} of {len(MULTIPLE_CHOICE)} items")
    if args.hf:
        from replicas.loading.models import load_model

        hf_picks = mc_picks(MULTIPLE_CHOICE, score_hf(load_model(args.model)[0], pairs))
        same = sum(a == b for a, b in zip(http_picks, hf_picks))
        print(f"with HF:            {mc_accuracy(MULTIPLE_CHOICE, hf_picks):.0%}; same pick on {same}/{len(hf_picks)}")


if __name__ == "__main__":
    main()
