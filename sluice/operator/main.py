"""`sluice operator`: run the InferenceService operator (kopf) against the current cluster.

Credentials: the pod's service account in a cluster, else ``$KUBECONFIG`` / ~/.kube/config.
kopf is imported only in ``run``, so ``sluice --help`` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex

from sluice.argtypes import http_url, positive_count, positive_seconds
from sluice.operator.resources import (
    DEFAULT_WORKER_IMAGE,
    MODEL_CACHE_DEFAULT,
    ModelCache,
    OperatorConfig,
)
from sluice.operator.routers import DEFAULT_ROUTER_SELECTOR
from sluice.operator.settings import OperatorOptions

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", dest="namespaces", default=None,
                       help="serve InferenceServices in this namespace (repeatable; default: "
                            "$SLUICE_NAMESPACES, comma-separated, else all namespaces)")
    scope.add_argument("-A", "--all-namespaces", action="store_true",
                       help="serve every namespace (needs a ClusterRole)")
    parser.add_argument("--worker-image", default=env("SLUICE_WORKER_IMAGE", DEFAULT_WORKER_IMAGE),
                        help="image of worker pods (default: $SLUICE_WORKER_IMAGE or "
                             "%(default)s)")
    parser.add_argument("--vllm-worker-image", default=env("SLUICE_VLLM_WORKER_IMAGE"),
                        help="image of `engine: vllm` worker pods (default: "
                             "$SLUICE_VLLM_WORKER_IMAGE, else --worker-image)")
    parser.add_argument("--model-cache", type=ModelCache.parse,
                        default=ModelCache.parse(env("SLUICE_MODEL_CACHE", MODEL_CACHE_DEFAULT)),
                        help="$SLUICE_HOME of worker pods for sluice:// models: emptyDir "
                             "(fetched per pod), hostPath:/abs/path, pvc:CLAIM, or image "
                             "(baked into the worker image) (default: $SLUICE_MODEL_CACHE or "
                             "emptyDir)")
    parser.add_argument("--worker-command", default=env("SLUICE_WORKER_COMMAND", "sluice"),
                        help="the worker container's executable, shell-quoted words "
                             "(default: %(default)s)")
    parser.add_argument("--worker-log-level", default=None,
                        help="--log-level of worker pods (default: the operator's)")
    parser.add_argument("--image-pull-policy", default="IfNotPresent",
                        choices=("IfNotPresent", "Always", "Never"))
    parser.add_argument("--no-endpoint-probe", dest="probe", action="store_false",
                        help="report Ready from the Deployment and Endpoints alone, without "
                             "GETting a worker's /health (when the operator cannot reach pods)")
    parser.add_argument("--resync-seconds", type=positive_seconds, default=30.0,
                        help="reconcile every InferenceService this often: children edited or "
                             "missing are put back, status recomputed (default: %(default)s)")
    parser.add_argument("--request-timeout", type=positive_seconds, default=15.0,
                        help="seconds for each API request (default: %(default)s)")
    parser.add_argument("--watch-timeout", type=positive_count, default=300,
                        help="seconds the API server keeps each watch open (default: "
                             "%(default)s)")
    parser.add_argument("--autoscale-interval", type=positive_seconds, default=5.0, metavar="SECONDS",
                        help="seconds between the autoscaler's rounds over InferenceServices "
                             "with spec.autoscaling.enabled (default: %(default)s)")
    parser.add_argument("--router-selector", default=DEFAULT_ROUTER_SELECTOR,
                        help="label selector of the router pods whose /autoscale/demand the "
                             "autoscaler reads (default: %(default)s, the chart's)")
    parser.add_argument("--router-namespace", default=None,
                        help="namespace of those router pods (default: each "
                             "InferenceService's own, where the chart's router serves it)")
    parser.add_argument("--router", action="append", dest="router_urls", default=[],
                        metavar="URL", type=http_url,
                        help="a router outside the cluster whose /autoscale/demand counts too, "
                             "e.g. http://127.0.0.1:8000 (repeatable)")
    parser.add_argument("--metrics-port", type=_port_or_zero, default=0,
                        help="serve the autoscaler's Prometheus metrics (sluice_autoscaler_*) "
                             "on this port at /metrics; 0: off (default: %(default)s)")
    parser.add_argument("--metrics-host", default="0.0.0.0",
                        help="address of --metrics-port (default: %(default)s)")
    parser.add_argument("--liveness", metavar="URL", default=None,
                        help="serve kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--operator-log-level", default=None,
                        help="log level of the operator alone (default: sluice --log-level)")


def _port_or_zero(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: a port 1-65535, or 0 for none")
    return value


def options_from(args: argparse.Namespace) -> OperatorOptions:
    """The options these parsed flags mean."""
    if args.all_namespaces:
        namespaces: tuple[str, ...] = ()
    elif args.namespaces:
        namespaces = tuple(args.namespaces)
    else:
        namespaces = OperatorOptions.from_env().namespaces
    config = OperatorConfig(
        worker_image=args.worker_image, vllm_worker_image=args.vllm_worker_image or None,
        model_cache=args.model_cache, worker_command=tuple(shlex.split(args.worker_command)),
        worker_log_level=(args.worker_log_level or getattr(args, "log_level", "INFO")).upper(),
        image_pull_policy=args.image_pull_policy)
    return OperatorOptions(config=config, namespaces=namespaces, probe=args.probe,
                           resync_seconds=args.resync_seconds,
                           request_timeout=args.request_timeout,
                           watch_timeout=args.watch_timeout,
                           autoscale_interval=args.autoscale_interval,
                           metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                           router_selector=args.router_selector,
                           router_namespace=args.router_namespace or None,
                           router_urls=tuple(args.router_urls))


def run(args: argparse.Namespace) -> int:
    """Run until SIGTERM/SIGINT. Exit code 2 for bad options."""
    try:
        options = options_from(args)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    if args.operator_log_level:
        logging.getLogger().setLevel(args.operator_log_level.upper())
    import kopf

    import sluice.operator.handlers  # noqa: F401  (registers the handlers)

    logger.info("sluice operator: %s", ", ".join(options.namespaces) or "all namespaces")
    kopf.run(standalone=True, clusterwide=not options.namespaces,
             namespaces=list(options.namespaces), liveness_endpoint=args.liveness,
             memo=kopf.Memo(options=options))
    return 0
