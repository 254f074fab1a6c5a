"""Scanned vs unrolled layers on this device: decode speed and compile time of plain decoding.

    python experiments/layer_loop.py --model qwen2.5-coder-1.5b --tokens 24 --repeats 2

Runs the two layouts one after the other in this process (same prompt, greedy) and prints the best
decode tokens/s of each and their ratio, with the check that both produce the same tokens.
"""

from __future__ import annotations

import argparse

from hsdjax.frontends.api import Generator, load_model


def measure(model_name: str, layer_loop: str, tokens: int, repeats: int) -> tuple[float, float, list[int]]:
    gen = Generator(load_model(model_name, layer_loop=layer_loop))
    ids = gen.encode_prompt("Write a long story about a dragon who learns to code in Python.")
    first = gen.generate(ids, max_new_tokens=tokens)[0]
    best = 0.0
    for _ in range(repeats):
        r = gen.generate(ids, max_new_tokens=tokens)[0]
        best = max(best, (r.new_tokens - 1) / r.decode_s)
    return best, first.compile_s, r.tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results = {loop: measure(args.model, loop, args.tokens, args.repeats) for loop in ("scan", "unrolled")}
    for loop, (speed, compile_s, _) in results.items():
        print(f"{loop:<9} best decode {speed:6.2f} tok/s   compile {compile_s:5.1f} s (0 if cached)")
    print(f"unrolled / scan: {results['unrolled'][0] / results['scan'][0]:.2f}x; "
          f"same tokens: {results['unrolled'][2] == results['scan'][2]}")


if __name__ == "__main__":
    main()
