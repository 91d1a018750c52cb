"""``python -m packcuda demo [--device cpu|cuda]``: a short end-to-end run on a synthetic packed batch."""
import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m packcuda")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run the end-to-end demo and check its results")
    d.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    d.add_argument("--seed", type=int, default=0)
    sub.add_parser("cmake-prefix-path", help="print the directory for CMAKE_PREFIX_PATH")
    args = p.parse_args(argv)
    if args.cmd == "demo":
        from .demo import run

        return run(device=args.device, seed=args.seed)
    if args.cmd == "cmake-prefix-path":
        from . import cmake_prefix_path

        print(cmake_prefix_path())
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
