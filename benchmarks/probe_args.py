"""Command lines of the standalone probes: positional arguments, and `--help` from the module's docstring."""

from __future__ import annotations

import argparse


def parse(argv: list[str], doc: str | None, prog: str, *names: str, optional: tuple[str, ...] = ()) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in names:
        p.add_argument(name)
    for name in optional:
        p.add_argument(name, nargs="?")
    return p.parse_args(argv)
