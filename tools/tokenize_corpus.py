#!/usr/bin/env python3
"""Tokenise text files with a model's own transformers tokenizer into an llm.c token file.

    python tools/tokenize_corpus.py --tokenizer MODEL_DIR --out train.bin corpus.txt [more.txt ...]

`headroom train --data-tokens train.bin` reads the result. The file is llm.c's: a header of 256
little-endian int32 (20240520, version 1 for uint16 ids or 2 for uint32, the number of ids, and the
tokenizer's vocabulary size, which headroom checks against the model's), then the ids. MODEL_DIR is
a directory from `save_pretrained` (or anything `AutoTokenizer.from_pretrained` accepts offline).
Each file is tokenised in pieces of about 1 MiB cut at line ends, and ends with the tokenizer's
end-of-text id when it has one (--no-eos leaves it out). The output is written atomically.
"""
import argparse
import array
import os
import sys
import tempfile

MAGIC = 20240520
PIECE = 1 << 20


def pieces(path):
    """The file's text in pieces of about PIECE bytes, each ending at a line end."""
    with open(path, encoding="utf-8") as f:
        carry = ""
        while True:
            block = f.read(PIECE)
            if not block:
                break
            block = carry + block
            cut = block.rfind("\n") + 1
            if cut == 0:
                carry = block
                continue
            carry = block[cut:]
            yield block[:cut]
        if carry:
            yield carry


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True, help="the model's tokenizer directory (save_pretrained)")
    ap.add_argument("--out", required=True, help="the token file to write")
    ap.add_argument("--no-eos", action="store_true", help="do not end each file with the end-of-text id")
    ap.add_argument("inputs", nargs="+", help="UTF-8 text files")
    args = ap.parse_args()

    for path in args.inputs:
        if not os.path.isfile(path):
            sys.exit(f"tokenize: '{path}' is not a file")
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    except Exception as e:  # the library's own message says what is missing
        sys.exit(f"tokenize: cannot load a tokenizer from '{args.tokenizer}': {str(e).splitlines()[0]}")

    vocab = len(tok)
    ids = array.array("H" if vocab <= 1 << 16 else "I")
    for path in args.inputs:
        total = os.path.getsize(path)
        done = 0
        for text in pieces(path):
            ids.extend(tok(text, add_special_tokens=False)["input_ids"])
            done += len(text.encode("utf-8"))
            print(f"\r{path}: {100 * done // max(total, 1)}%  {len(ids):,} ids", end="", file=sys.stderr)
        if not args.no_eos and tok.eos_token_id is not None:
            ids.append(tok.eos_token_id)
        print(file=sys.stderr)
    if len(ids) >= 1 << 31:
        sys.exit(f"tokenize: {len(ids):,} ids is more than one llm.c file holds (2^31 - 1); split the input")

    header = array.array("i", [0] * 256)
    header[0], header[1], header[2], header[3] = MAGIC, 1 if ids.typecode == "H" else 2, len(ids), vocab
    if sys.byteorder != "little":
        header.byteswap()
        ids.byteswap()
    out_dir = os.path.dirname(os.path.abspath(args.out))
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".tokenize-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header.tobytes())
            f.write(ids.tobytes())
        os.replace(tmp, args.out)
    except BaseException:
        os.unlink(tmp)
        raise
    print(f"{args.out}: {len(ids):,} ids, uint{16 if ids.typecode == 'H' else 32}, vocabulary {vocab}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
