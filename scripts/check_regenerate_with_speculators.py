"""Replays a `strata generate` run through speculators' own regeneration loop.

speculators 0.9's `regenerate_conversation` (speculators/cli/regenerate_responses.py)
drives each conversation of the input, exactly as `speculators regenerate-responses`
does, against a stand-in for the vLLM server: each request's messages are rendered
with transformers' `apply_chat_template(add_generation_prompt=True)` and tokenized
without special tokens (vLLM's chat endpoint), and the reply is the completion
Strata drew for that turn, its `content` detokenized as vLLM 0.19.1's
`FastIncrementalDetokenizer` does (a `tokenizers` `DecodeStream` primed with the
prompt's ids, special tokens skipped, the stop token dropped). The check:
every prompt the tool asks for is, token for token, the prompt of Strata's row;
the tool makes as many generations per conversation, refuses the same records,
and writes the same `id`, `primary_id`, `input_ids`, `loss_mask` and `text`.

    python scripts/check_regenerate_with_speculators.py MODEL DATA.jsonl OUT
    (OUT: a `strata generate` output directory; rows without tools)
"""

import asyncio
import json
import sys

from transformers import AutoTokenizer

import importlib
import os

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "interop"))
from decode_stream import reply as vllm_reply  # noqa: E402

rr = importlib.import_module("speculators.cli.regenerate_responses")
from speculators.data_generation.configs import DatasetConfig


def main(model, data, out):
    tok = AutoTokenizer.from_pretrained(model)
    manifest = json.load(open(f"{out}/manifest.json"))
    stops = set(manifest["generation"]["stop_token_ids"])
    lines = [json.loads(l) for l in open(f"{out}/regenerated.jsonl")]
    by_conv = {}
    for l in lines:
        by_conv.setdefault(l["primary_id"], []).append(l)
    config = DatasetConfig(name="data", hf_path=data, split="train", prompt_field="prompt")
    kwargs = json.loads((manifest.get("prepare") or {}).get("chat_template_kwargs") or "{}")
    parser = manifest["generation"].get("reasoning_parser")
    reasons = {s["id"]: s["reason"] for s in manifest.get("skipped", [])}
    checked_prompts = 0
    refused = []
    for index, row in enumerate(json.loads(l) for l in open(data) if l.strip()):
        prepared = rr.prepare_row(row, config)
        conv_id = rr._primary_identifier(row)
        strata_rows = by_conv.get(conv_id, [])
        if prepared is None:
            assert not strata_rows, f"{conv_id}: the tool skips it, Strata wrote rows"
            refused.append(conv_id)
            continue
        _, turns, results = prepared
        item = {"idx": index, "primary_id": conv_id, "turns": turns, "tools": rr.extract_tools(row),
                "tool_results": results}
        calls = []

        async def post(payload):
            k = len(calls)
            calls.append(payload)
            text = tok.apply_chat_template(payload["messages"], tools=payload.get("tools"),
                                           add_generation_prompt=True, tokenize=False, **kwargs)
            prompt = tok(text, add_special_tokens=False)["input_ids"]
            if payload.get("tools") and not manifest["generation"].get("tool_call_parser"):
                # vLLM without --tool-call-parser answers "auto" tool choice with a 400.
                raise rr.InvalidResponseError('HTTP 400: "auto" tool choice requires --tool-call-parser')
            if k >= len(strata_rows):
                # Strata refused the record at this generation (its reply was empty): the
                # tool must fail the conversation on such a reply too.
                assert reasons.get(conv_id, "").startswith(f"empty assistant generation (sample {k})"), \
                    f"{conv_id}: the tool asks for generation {k}, Strata made {len(strata_rows)}"
                return {"prompt_token_ids": [0], "choices": [{"message": {"content": ""}, "token_ids": [0]}]}
            s = strata_rows[k]
            p = s["metadata"]["usage"]["prompt_tokens"]
            assert s["input_ids"][:p] == prompt, f"{conv_id} gen {k}: the prompt differs\n{text!r}"
            completion = s["input_ids"][p:]
            finish = s["metadata"]["finish_reason"]
            body = completion[:-1] if finish == "stop" and completion[-1] in stops else completion
            content = vllm_reply(tok._tokenizer, prompt, body, True)
            if parser in ("qwen3", "deepseek_r1"):
                # vLLM's parser: drop up to <think>, content after </think> (None if empty);
                # without </think> all is reasoning, unless qwen3 with thinking off.
                _, sep, after = content.partition("<think>")
                content = after if sep else content
                if "</think>" in content:
                    content = content.partition("</think>")[2] or None
                elif not (parser == "qwen3" and kwargs.get("enable_thinking", True) is False):
                    content = None
            return {"prompt_token_ids": prompt,
                    "choices": [{"message": {"content": content}, "token_ids": completion,
                                 "finish_reason": finish}],
                    "usage": s["metadata"]["usage"]}

        samples = []
        try:
            asyncio.run(rr.regenerate_conversation(
                post, item, model="m", max_tokens=manifest["generation"]["max_tokens"],
                endpoint="strata generate", sampling_params={}, samples=samples,
                detokenize=lambda ids: tok.decode(ids, skip_special_tokens=False)))
        except Exception as e:  # the tool's worker fails the conversation on any error
            # The tool fails the conversation (an empty reply, a 400): Strata must have refused it.
            assert not strata_rows, f"{conv_id}: the tool fails it ({e}), Strata wrote rows"
            refused.append(conv_id)
            continue
        checked_prompts += len(calls)
        assert len(samples) == len(strata_rows), f"{conv_id}: {len(samples)} generations vs {len(strata_rows)}"
        for a, b in zip(samples, strata_rows):
            for key in ("id", "primary_id", "input_ids", "loss_mask", "text"):
                assert a[key] == b[key], f"{conv_id}: {key} differs: {a[key]!r} vs {b[key]!r}"
    skipped = {s["id"] for s in manifest.get("skipped", [])}
    assert set(refused) <= skipped | set(refused) and len(refused) == len(skipped), (refused, skipped)
    print(f"ok: {len(lines)} generations of {len(by_conv)} conversations, {checked_prompts} prompts equal "
          f"to the tool's, {len(refused)} records refused by both")


if __name__ == "__main__":
    main(*sys.argv[1:4])
