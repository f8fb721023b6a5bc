"""The `sluice` command: up | worker | router | models | operator | bench | profile | simulate |
cascade.

Each component module exposes ``add_arguments(parser)`` and ``run(args) -> int`` and keeps
heavy imports (torch) inside ``run``, so ``sluice router --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from sluice.local.parent import watch_parent

COMMANDS = {
    "up": ("sluice.local.supervisor", "run an InferenceService manifest as local processes"),
    "worker": ("sluice.worker.server", "serve one model over the OpenAI API"),
    "router": ("sluice.router.app", "OpenAI API front for one or more workers"),
    "models": ("sluice.models.cli", "fetch and list models in the local store"),
    "operator": ("sluice.operator.main", "run the InferenceService operator (kopf)"),
    "bench": ("sluice.bench.cli", "load an OpenAI endpoint: TTFT/ITL/E2E, goodput, cost"),
    "profile": ("sluice.bench.profile", "one replica's capacity (req/s) at the SLO's tail, "
                "for spec.autoscaling.capacityRPS"),
    "simulate": ("sluice.sim.cli", "replay a trace through the real routing and autoscaling "
                 "policies on a virtual clock, against baselines and an oracle"),
    "cascade": ("sluice.cascade.cli", "record a cascade's tiers on an eval set; calibrate "
                "its escalation threshold"),
}


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag gets one line and a pointer to ``--help`` (exit 2), not the
    whole usage (twenty lines for ``sluice router``) above the error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen component; returns the process exit code."""
    parser = Parser(prog="sluice", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
        modules[name] = module
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    watch_parent()  # a sluice up child: stop with the supervisor
    return modules[args.command].run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
