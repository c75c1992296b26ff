"""Local GEMM of a transposed weight: ``x @ W_t`` with ``W_t [in, out]`` against ``F.linear(x, W)``.

autoshard stores every colwise weight transposed, so a colwise linear's local
product is ``x @ W_t`` on a contiguous ``[in, out]`` tensor instead of
``F.linear`` on ``[out, in]``. Both are one GEMM (cuBLAS picks the transpose
flag), and this measures that they cost the same, on Llama-3-8B's projection
shapes (hidden 4096, kv 1024, MLP 14336; 8192 tokens) in bf16 on a GPU. On a
CPU the shapes are scaled down 8x and only show that the check runs.

Prints one line per shape and ``gemm ratio worst <r>``; exits 1 if a transposed
product differs from ``F.linear`` beyond bf16 rounding.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

# (name, in_features, out_features) of Llama-3-8B's linears
SHAPES = (("wq", 4096, 4096), ("wk/wv", 4096, 1024), ("w1/w3", 4096, 14336), ("w2", 14336, 4096), ("wo", 4096, 4096))
TOKENS = 8192


def _time(fn, device: str, repeats: int) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    scale = 1 if args.device == "cuda" else 8
    dtype = torch.bfloat16
    torch.manual_seed(0)
    worst = 0.0
    for name, n_in, n_out in SHAPES:
        n_in, n_out, tokens = n_in // scale, n_out // scale, TOKENS // scale
        x = torch.randn(tokens, n_in, device=args.device, dtype=dtype)
        weight = torch.randn(n_out, n_in, device=args.device, dtype=dtype) / n_in**0.5
        weight_t = weight.t().contiguous()  # stored [in, out], as autoshard stores colwise weights
        diff = ((x @ weight_t).float() - F.linear(x, weight).float()).abs().max().item()
        if diff > 5e-2:
            print(f"FAILED: {name}: x @ W_t differs from F.linear by {diff:.3e}", file=sys.stderr)
            return 1
        linear = _time(lambda x=x, w=weight: F.linear(x, w), args.device, args.repeats)
        transposed = _time(lambda x=x, w=weight_t: x @ w, args.device, args.repeats)
        ratio = transposed / linear
        worst = max(worst, ratio)
        print(f"{name:<6} [{tokens}x{n_in}] @ [{n_in}x{n_out}] bf16 {args.device}: "
              f"F.linear {linear * 1e3:8.3f} ms, x @ W_t {transposed * 1e3:8.3f} ms, ratio {ratio:.3f}")
    print(f"gemm ratio worst {worst:.3f} ({args.device}{', shapes / 8' if scale > 1 else ''})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
