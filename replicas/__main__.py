"""Try the engine without Ray: `python -m replicas --prompt "..." --max-tokens N` streams text."""

from __future__ import annotations

import argparse
import sys
import time

from replicas.config import DEFAULT_MODEL, POLICIES, EngineConfig
from replicas.protocol import SamplingParams


def reason(exc: ValueError) -> str:
    """The refusal in a line: a settings error as its messages alone (pydantic's carry the input
    echoed back and a link)."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    return "; ".join(str(e.get("msg", "")).removeprefix("Value error, ") for e in errors())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m replicas", description=__doc__)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="HF model directory, .gguf file, hub id, or embedded:smollm2|tiny|mid")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--stop", action="append", default=[])
    ap.add_argument("--policy", choices=POLICIES, default="stall_free")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="shard the model over this many ranks (worker processes; gloo on CPU, nccl on GPUs)")
    args = ap.parse_args(argv)
    engine = None
    try:
        # What the arguments alone decide is refused before torch and the model load (seconds).
        if not args.prompt and not args.chat:
            raise ValueError("prompt must not be empty")
        config = EngineConfig(policy=args.policy, tensor_parallel_size=args.tensor_parallel_size)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop)
        from replicas.engine import Engine

        engine = Engine.from_pretrained(args.model, config)
        prompt = args.prompt
        if args.chat:
            prompt = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        req = engine.add_request(prompt, params)
    except ValueError as exc:
        print(f"error: {reason(exc)}", file=sys.stderr)
        if engine is not None:
            engine.close()
        return 2
    start = time.perf_counter()
    try:
        while engine.has_unfinished():
            for out in engine.step():
                sys.stdout.write(out.delta_text)
                sys.stdout.flush()
    finally:
        engine.close()
    elapsed = time.perf_counter() - start
    n = len(req.output_token_ids)
    print(f"\n[{n} tokens in {elapsed:.2f}s, finish_reason={req.finish_reason}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
