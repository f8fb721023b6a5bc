"""`sluice models fetch NAME | list`."""

from __future__ import annotations

import argparse
import sys

from sluice.models import store


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    fetch = sub.add_parser("fetch", help="fetch, verify and convert a model into the store")
    fetch.add_argument("name", nargs="?", default=store.DEFAULT_MODEL)
    sub.add_parser("list", help="list registered models and whether they are fetched")


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "fetch":
            print(store.fetch(args.name))
        else:
            for spec in store.REGISTRY.values():
                path = store.model_dir(spec.name)
                state = "fetched" if (path / store.DONE_MARKER).exists() else "not fetched"
                print(f"{spec.name:32} {state:12} {path}")
    except store.ModelStoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
