"""The one mapping from an InferenceService spec to ``sluice worker`` flags.

``sluice up`` (local processes) and the operator (pod args) both call ``worker_arguments``,
so a manifest means the same worker wherever it runs. The flags ``sluice worker`` accepts
are read from its own argument parser, so a spec field the worker cannot honour is an error
here, not a silently ignored option.
"""

from __future__ import annotations

import argparse
import functools

from sluice.api.service import InferenceService


def worker_arguments(service: InferenceService, model: str) -> list[str]:
    """The ``sluice worker`` flags for this manifest (without --host/--port).

    Args:
        service: the validated manifest.
        model: what ``--model`` gets: a model folder, or a store name the worker resolves
            under ``$SLUICE_HOME``.

    Raises:
        ValueError: the manifest asks for something ``sluice worker`` has no flag for.
    """
    spec = service.spec
    supported = worker_flags()
    wanted: list[tuple[str, object | None]] = [("--model", model),
                                               ("--served-model-name", spec.model.name)]
    options = spec.engine.native.model_dump(exclude_none=True)
    for group in [k for k, v in options.items() if isinstance(v, dict)]:  # speculative.method
        options.update({f"{group}_{k}": v for k, v in options.pop(group).items()})
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):  # argparse BooleanOptionalAction: --x / --no-x
            wanted.append((flag if value else "--no-" + flag[2:], None))
        else:
            wanted.append((flag, value))
    if spec.model.tokenizer is not None:  # (an empty one is None: the model's own)
        wanted.append(("--tokenizer", spec.model.tokenizer))
    if spec.engine.name != "native":
        wanted.append(("--engine", spec.engine.name))
    if spec.resources.gpu:
        wanted.append(("--device", "cuda"))
    argv: list[str] = []
    for flag, value in wanted:
        if supported is not None and flag not in supported:
            raise ValueError(f"{flag} (from the manifest) is not supported by `sluice worker`")
        argv += [flag] if value is None else [flag, str(value)]
    return argv


@functools.cache
def worker_flags() -> frozenset[str] | None:
    """The option strings ``sluice worker`` accepts, or None if it cannot be imported."""
    try:
        from sluice.worker import server
    except ImportError:
        return None
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    return frozenset(s for action in parser._actions for s in action.option_strings)
