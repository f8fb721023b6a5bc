"""Resolve cascades' tiers (InferenceService names) to the model names their workers serve.

Shared by the router (which cascades it serves), ``sluice up`` (a multi-document manifest)
and the operator (the ``InvalidSpec`` condition of a cascade that cannot be served): all
three accept and refuse the same cascades, with the same words.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sluice.api.service import CascadeSpec, load_manifests


@dataclass(frozen=True)
class Resolved:
    """A cascade that can be served.

    Attributes:
        service: the cascade's InferenceService name.
        name: its served name (``spec.model.name``): what clients send.
        spec: its ``spec.cascade``.
        models: the tiers' served model names, in ``spec.tiers`` order.
    """

    service: str
    name: str
    spec: CascadeSpec
    models: tuple[str, ...]


def resolve_cascades(services: Mapping[str, tuple[str | None, CascadeSpec | None]]
                     ) -> tuple[dict[str, Resolved], dict[str, str]]:
    """Check each cascade's tiers against the InferenceServices of its namespace.

    Args:
        services: InferenceService name → (served model name, ``spec.cascade`` or None).

    Returns:
        (served cascade name → ``Resolved``, InferenceService name → the problem of a
        cascade that cannot be served, naming the field): a tier that names no
        InferenceService, a tier that is a cascade itself (cascades do not nest, so no
        cycle), or a cascade whose name is a tier's served model name.
    """
    served: dict[str, Resolved] = {}
    problems: dict[str, str] = {}
    for service, (name, spec) in sorted(services.items()):
        if spec is None or name is None:
            continue
        models: list[str] = []
        for i, tier in enumerate(spec.tiers):
            model, nested = services.get(tier, (None, None))
            if tier not in services:
                problems[service] = f"spec.cascade.tiers[{i}]: no InferenceService {tier!r} " \
                    "in this namespace"
            elif nested is not None:
                problems[service] = f"spec.cascade.tiers[{i}]: {tier!r} is a cascade itself; " \
                    "tiers must serve a model"
            elif model is None:
                problems[service] = f"spec.cascade.tiers[{i}]: {tier!r} serves no model"
            elif model == name:
                problems[service] = f"spec.cascade.tiers[{i}]: {tier!r} serves the model " \
                    f"name {name!r}, the cascade's own"
            else:
                models.append(model)
            if service in problems:
                break
        if service not in problems:
            served[name] = Resolved(service, name, spec, tuple(models))
    return served, problems


def manifest_cascades(path: str | Path) -> dict[str, Resolved]:
    """The cascades of an InferenceService manifest file, tiers resolved within it: served
    name → ``Resolved``.

    Raises:
        ValueError: the file does not validate, or a cascade's tiers do not resolve (the
            message names the InferenceService and the field).
    """
    services = load_manifests(path)
    resolved, problems = resolve_cascades(
        {s.metadata.name: (s.spec.model.name, s.spec.cascade) for s in services})
    if problems:
        raise ValueError("; ".join(f"{name}: {problem}" for name, problem in problems.items()))
    return resolved
