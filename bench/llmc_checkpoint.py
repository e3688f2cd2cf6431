"""A GPT-2 checkpoint in llm.c's format with random weights, for llm.c's CPU trainer
train_gpt2 (the CPU peer of `meshtrain bench train`).

    python3 llmc_checkpoint.py OUT.bin [--layers 12 --heads 12 --hidden 768]

llm.c reads a header of 256 little-endian int32 (magic 20240326, version 3, max sequence
length, vocabulary, layers, heads, channels, padded vocabulary; the rest zero) followed by
the fp32 parameters in its order: wte (Vp x C), wpe (maxT x C), then per kind over all
layers ln1 weight and bias, qkv weight and bias, attention projection weight and bias, ln2
weight and bias, MLP weight and bias, MLP projection weight and bias, and last the final
LayerNorm's weight and bias. Weights are drawn uniformly from +-0.02 with a fixed seed
(a tiled block, so that 124M values take a second), LayerNorm weights are 1 and biases 0;
a speed comparison needs the shapes, not trained values. Standard library only.
"""
import argparse
import array
import random
import struct
import sys

MAGIC, VERSION = 20240326, 3


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--padded-vocab", type=int, default=50304)
    p.add_argument("--max-seq", type=int, default=1024)
    a = p.parse_args(argv[1:])
    L, C, V, Vp, T = a.layers, a.hidden, a.vocab, a.padded_vocab, a.max_seq
    draw = random.Random(0)
    block = array.array("f", (draw.uniform(-0.02, 0.02) for _ in range(1 << 20)))
    ones, zeros = array.array("f", [1.0]), array.array("f", [0.0])

    def weights(n, out):  # n random values, from the tiled block at a varying offset
        start = draw.randrange(len(block))
        while n > 0:
            take = min(n, len(block) - start)
            block[start:start + take].tofile(out)
            n -= take
            start = 0

    def constant(value, n, out):
        (value * n).tofile(out)

    header = struct.pack("<256i", MAGIC, VERSION, T, V, L, a.heads, C, Vp, *([0] * 248))
    with open(a.out, "wb") as out:
        out.write(header)
        weights(Vp * C, out)                 # wte
        weights(T * C, out)                  # wpe
        constant(ones, L * C, out)           # ln1w
        constant(zeros, L * C, out)          # ln1b
        weights(L * 3 * C * C, out)          # qkvw
        constant(zeros, L * 3 * C, out)      # qkvb
        weights(L * C * C, out)              # attprojw
        constant(zeros, L * C, out)          # attprojb
        constant(ones, L * C, out)           # ln2w
        constant(zeros, L * C, out)          # ln2b
        weights(L * 4 * C * C, out)          # fcw
        constant(zeros, L * 4 * C, out)      # fcb
        weights(L * C * 4 * C, out)          # fcprojw
        constant(zeros, L * C, out)          # fcprojb
        constant(ones, C, out)               # lnfw
        constant(zeros, C, out)              # lnfb
    if sys.byteorder != "little":
        sys.exit("llmc_checkpoint.py: writes little-endian floats only")


if __name__ == "__main__":
    main(sys.argv)
