#!/usr/bin/env python3
"""Conversations per second of the peer preprocessing: transformers'
apply_chat_template (fast tokenizer) with the render-boundary algorithm, one
thread, on the same fixture conversations and templates as benches/chat.rs
(14 OpenAI-style conversations x 30 a run, median of N runs).

    venv/bin/python scripts/bench_chat_vs_transformers.py [--runs 7]
    cargo bench --bench chat -- --runs 7      # Strata, same work
"""
import json
import statistics
import sys
import time
from pathlib import Path

from transformers import PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parent.parent / "tests/fixtures/chat"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system", "tool": "tool"}


def conversations():
    out = []
    for line in (ROOT / "conversations.openai.jsonl").read_text().splitlines():
        row = json.loads(line)
        msgs = []
        for m in row["messages"]:
            msg = {"role": ROLES.get(m["role"], "assistant"), "content": m["content"]}
            msg.update({k: v for k, v in m.items() if k not in ("role", "content") and v is not None})
            msgs.append(msg)
        while msgs and msgs[-1]["role"] != "assistant":
            msgs.pop()
        out.append((msgs, row.get("tools")))
    return out


def rows(tok, template, msgs, tools):
    def ids(m, gen):
        text = tok.apply_chat_template(m, chat_template=template, tokenize=False, add_generation_prompt=gen, tools=tools)
        return tok(text, add_special_tokens=False)["input_ids"]
    tokens = 0
    for j, m in enumerate(msgs):
        if m["role"] != "assistant" or j == 0:
            continue
        prompt, row = ids(msgs[:j], True), ids(msgs[:j + 1], False)
        if row[:len(prompt)] != prompt:
            ids(msgs[:j], False)
        tokens += len(row)
    return tokens


def main():
    runs = int(sys.argv[sys.argv.index("--runs") + 1]) if "--runs" in sys.argv else 7
    tok = PreTrainedTokenizerFast(tokenizer_file=str(ROOT / "tokenizer.json"), bos_token="<|begin_of_text|>",
                                  eos_token="<|im_end|>", pad_token="<|endoftext|>")
    convs = conversations()
    reps = 30
    print(f"transformers apply_chat_template + fast tokenizer, one thread, {len(convs) * reps} conversations a run:")
    for name in ["chatml", "llama3", "qwen3"]:
        template = (ROOT / "templates" / f"{name}.jinja").read_text()
        per_s = []
        for _ in range(runs):
            t = time.perf_counter()
            for _ in range(reps):
                for msgs, tools in convs:
                    if msgs:
                        try:
                            rows(tok, template, msgs, tools)
                        except Exception:
                            pass
            per_s.append(len(convs) * reps / (time.perf_counter() - t))
        print(f"  {name:<8} {statistics.median(per_s):>8.0f} conversations/s  (median of {runs})")


if __name__ == "__main__":
    main()
