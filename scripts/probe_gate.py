"""Probe: what the draft gate records round by round at one request (mode, tokens, ms, both estimates).

    python scripts/probe_gate.py [NUM_PROMPTS]     # mt-bench prompts, 48 tokens each, the default drafter
"""

import sys
import time

from dspark.drafters import load_drafter
from dspark.engine import Request
from dspark.eval.datasets import load_prompts
from dspark.factory import build_engine
from dspark.gate import DraftGate
from dspark.loading import load_target
from dspark.text import eos_token_ids, prompt_ids


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    loaded = load_target("default", "auto")
    drafter = load_drafter("default+ngram", loaded.model)
    gate = DraftGate()
    engine = build_engine(loaded, drafter, scheduler="dspark", max_concurrency=1, draft_gate=gate)
    record, log = gate.record, []

    def logged(num_requests, drafted, tokens, seconds):
        record(num_requests, drafted, tokens, seconds)
        rates = gate.rates[num_requests]
        log.append(("D" if drafted else "p", round(tokens, 2), round(1000 * seconds, 1),
                    round(rates[True].throughput, 1), round(rates[False].throughput, 1)))

    gate.record = logged
    for text in load_prompts("../shared/eval_datasets/mt-bench.jsonl", count):
        request = Request(prompt_ids(loaded, text), 48, eos_token_ids=eos_token_ids(loaded))
        start = time.perf_counter()
        engine.run([request])
        rate = len(request.output_ids) / (time.perf_counter() - start)
        print(f"request: {len(request.output_ids)} tokens, {rate:.1f} tokens/s, {request.stats.num_rounds} rounds")
    print("(mode, tokens, ms, draft tokens/s, plain tokens/s) per recorded round:", log)
    print(gate.summary())


if __name__ == "__main__":
    main()
