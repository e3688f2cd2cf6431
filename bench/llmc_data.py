"""Random-token data for llm.c's train_gpt2cu, the GPU check's llm.c peer.

    python3 llmc_data.py OUT.bin [TOKENS]      (TOKENS defaults to 4,000,000)

llm.c reads a header of 256 little-endian int32 (magic 20240520, version 1, the token
count, the rest zero) followed by the tokens as uint16. The tokens are drawn uniformly
from GPT-2's 50,257 with a fixed seed, so two runs write the same file. Standard library
only: the GPU machine need not have numpy.
"""
import array
import random
import struct
import sys

MAGIC, VERSION, GPT2_VOCAB = 20240520, 1, 50257


def main(argv):
    if len(argv) < 2:
        sys.exit("usage: llmc_data.py OUT.bin [TOKENS]")
    count = int(argv[2]) if len(argv) > 2 else 4_000_000
    header = struct.pack("<256i", MAGIC, VERSION, count, *([0] * 253))
    draw = random.Random(0)
    tokens = array.array("H", draw.choices(range(GPT2_VOCAB), k=count))
    if sys.byteorder != "little":
        tokens.byteswap()
    with open(argv[1], "wb") as out:
        out.write(header)
        tokens.tofile(out)


if __name__ == "__main__":
    main(sys.argv)
