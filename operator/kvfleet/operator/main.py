"""The operator process: `kopf run -m kvfleet.operator.main`, `python -m kvfleet.operator`
or `kvfleet operator`. Health (kopf liveness) and metrics listen on 127.0.0.1 by default."""
from __future__ import annotations

import argparse
import hashlib
import importlib
import logging
import os
import socket
from typing import Any, Mapping, Sequence

import kopf

from . import handlers as _handlers  # noqa: F401  (registers the handlers)
from . import metrics
from .constants import GROUP
from .credentials import EXPLICIT_KUBECONFIG_ENV
from .credentials import load as load_credentials

log = logging.getLogger("kvfleet.operator")


def _load_optional(module: str) -> None:
    """Plug in the autoscaler's handlers when that part is installed."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise


_load_optional("kvfleet.operator.autoscaler.handlers")


def peering_priority(env: Mapping[str, str] | None = None) -> int:
    """This instance's kopf peering priority: distinct per instance, stable across its restarts.

    kopf pauses *every* operator when peers share a priority, so replicas at the default priority
    would all stand still. A priority from the identity (`POD_ID`, the pod's name) makes the
    highest one active and the others wait until it is gone (failover within the peering
    lifetime). `KVFLEET_PEERING_PRIORITY` sets it explicitly.
    """
    env = os.environ if env is None else env
    explicit = env.get("KVFLEET_PEERING_PRIORITY")
    if explicit:
        try:
            return int(explicit)
        except ValueError:
            raise ValueError(f"KVFLEET_PEERING_PRIORITY must be an integer, got {explicit!r}") from None
    identity = env.get("POD_ID") or f"{socket.gethostname()}/{os.getpid()}"
    return int.from_bytes(hashlib.sha256(identity.encode()).digest()[:4], "big") % 1_000_000_000 + 1


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Progress in annotations only: the status schema belongs to the CRD, not to kopf.
    settings.persistence.finalizer = f"{GROUP}/kopf-finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # our own Events say what matters
    settings.peering.name = os.environ.get("KVFLEET_PEERING_NAME", "kvfleet")
    settings.peering.lifetime = int(os.environ.get("KVFLEET_PEERING_LIFETIME", "30"))
    settings.peering.stealth = True
    settings.peering.priority = peering_priority()  # also when started as `kopf run -m kvfleet.operator.main`
    settings.execution.max_workers = int(os.environ.get("KVFLEET_MAX_WORKERS", "8"))
    settings.watching.server_timeout = 300
    port = int(os.environ.get("KVFLEET_METRICS_PORT", "0"))
    if port:
        metrics.serve(port, os.environ.get("KVFLEET_METRICS_ADDR", "127.0.0.1"))


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    """The same credentials as the operator's own client: --kubeconfig, else in-cluster, else $KUBECONFIG (read
    now; kopf logs in again on a 401, which re-reads a rotated token)."""
    creds = load_credentials()
    token = creds.token()
    return kopf.ConnectionInfo(
        server=creds.server, ca_data=creds.ca_pem.encode() if creds.ca_pem else None, insecure=creds.insecure,
        certificate_data=creds.client_cert_pem, private_key_data=creds.client_key_pem,
        scheme="Bearer" if token else None, token=token)


@kopf.on.probe(id="reconciles")
def probe_reconciles(**_: Any) -> float:
    """Reconciliations so far (shown by the liveness endpoint)."""
    return sum(sample.value for family in metrics.RECONCILES.collect() for sample in family.samples
               if sample.name.endswith("_total"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfleet operator", description="Run the kvfleet operator.")
    parser.add_argument("--kubeconfig",
                        help="kubeconfig file, used before in-cluster (default: in-cluster, then $KUBECONFIG)")
    parser.add_argument("--liveness", default="http://127.0.0.1:8080/healthz",
                        help="kopf liveness endpoint URL")
    parser.add_argument("--metrics-port", type=int, default=int(os.environ.get("KVFLEET_METRICS_PORT", "8090")),
                        help="Prometheus metrics port (0: off)")
    parser.add_argument("--metrics-addr", default=os.environ.get("KVFLEET_METRICS_ADDR", "127.0.0.1"))
    parser.add_argument("--peering", default=os.environ.get("KVFLEET_PEERING_NAME", "kvfleet"),
                        help="kopf peering name (one active operator per peering)")
    parser.add_argument("--standalone", action="store_true", help="no peering")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # Quiet by default: one line per API request (httpx) or per handler run (kopf) is noise.
    if args.log_level.upper() != "DEBUG":
        logging.getLogger("httpx").setLevel(logging.WARNING)
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    if args.kubeconfig:   # for kopf's login and the handlers' client, which read it in `credentials.load`
        os.environ[EXPLICIT_KUBECONFIG_ENV] = args.kubeconfig
    os.environ["KVFLEET_METRICS_PORT"] = str(args.metrics_port)
    os.environ["KVFLEET_METRICS_ADDR"] = args.metrics_addr
    os.environ["KVFLEET_PEERING_NAME"] = args.peering
    if args.metrics_port:
        metrics.serve(args.metrics_port, args.metrics_addr)  # fail fast on a taken port
    # A peering name makes peering mandatory in kopf, which would pause a standalone operator.
    kopf.run(clusterwide=True, liveness_endpoint=args.liveness or None,
             standalone=True if args.standalone else None,
             peering_name=None if args.standalone else args.peering,
             priority=peering_priority())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
