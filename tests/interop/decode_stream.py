"""Replies detokenized as vLLM 0.19.1 detokenizes them, for `tests/interop.rs`.

vLLM's `FastIncrementalDetokenizer` (vllm/v1/engine/detokenizer.py) makes a
reply's text with a `tokenizers` `DecodeStream` primed with the prompt's ids,
stepped once per generated id; where a step raises tokenizers' "Invalid prefix
encountered", it starts a fresh stream (no prompt) and steps the id again. This
script runs that loop, with the installed `tokenizers`, on the cases Strata's
test gives it, and writes the texts.

    python decode_stream.py make-sp DIR        writes DIR/tokenizer.json: a Llama 2 /
                                              Mistral-style SentencePiece BPE (Metaspace,
                                              byte fallback, a decoder that strips the
                                              text's leading space)
    python decode_stream.py decode CASES OUT   CASES: JSON Lines of {"tokenizer", "prompt",
                                              "ids", "skip"}; OUT: a JSON list of texts
"""

import json
import sys

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
from tokenizers.decoders import DecodeStream


def make_sp(out_dir):
    # Ids 0..2 specials, 3..258 the byte tokens <0x00>..<0xFF>, then pieces.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    pieces = ["▁", "a", "b", "c", "d", "e", "h", "l", "o", "r", "w", "é", "日", "本"]
    for p in pieces:
        vocab[p] = len(vocab)
    merges = [("▁", "h"), ("▁h", "e"), ("l", "l"), ("▁he", "ll"), ("▁hell", "o"), ("▁", "w"), ("o", "r"),
              ("▁w", "or"), ("▁wor", "l"), ("▁worl", "d"), ("a", "b"), ("▁", "ab"), ("c", "d"), ("日", "本")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    # As Llama 2's and Mistral's tokenizer.json: a prepended "▁", spaces as "▁", and a
    # decoder that turns them back and strips the one space the text begins with.
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken("<unk>", special=True), AddedToken("<s>", special=True),
                            AddedToken("</s>", special=True)])
    tok.save(f"{out_dir}/tokenizer.json")


def reply(tok, prompt, ids, skip):
    stream = DecodeStream(ids=prompt, skip_special_tokens=skip)
    out = ""
    for t in ids:
        try:
            text = stream.step(tok, t)
        except Exception as e:  # noqa: BLE001 - the one vLLM recovers from, else raised
            if not str(e).startswith("Invalid prefix encountered"):
                raise
            stream = DecodeStream(skip_special_tokens=skip)
            text = stream.step(tok, t)
        out += text or ""
    return out


def decode(cases, out):
    toks = {}
    texts = []
    for line in open(cases):
        c = json.loads(line)
        tok = toks.setdefault(c["tokenizer"], Tokenizer.from_file(c["tokenizer"]))
        texts.append(reply(tok, c["prompt"], c["ids"], c["skip"]))
    json.dump(texts, open(out, "w"), ensure_ascii=False)


if __name__ == "__main__":
    {"make-sp": lambda: make_sp(sys.argv[2]), "decode": lambda: decode(sys.argv[2], sys.argv[3])}[sys.argv[1]]()
