"""Installing Kueue's API (CRDs, namespace, webhook Secret) and checking Kueue kept the certificates we seeded."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable

import yaml

from . import manifests, pki
from .layout import Layout

Kubectl = Callable[..., str]


def install_api(layout: Layout, kubectl: Kubectl) -> None:
    """Kueue's CRDs (conversion webhook on loopback), its namespace and its seeded webhook Secret."""
    pki.ensure_kueue_webhook_pki(layout.pki, manifests.KUEUE_WEBHOOK_DNS)
    files = {name: (layout.pki / name).read_bytes() for name in
             ("kueue-ca.crt", "kueue-ca.key", "kueue-webhook.crt", "kueue-webhook.key")}  # fmt: skip
    # Kueue's webhook server reads its certificate from certDir (in a cluster, the Secret mounted there).
    cert_dir = layout.run / "kueue-certs"
    cert_dir.mkdir(parents=True, exist_ok=True)
    copies = (("ca.crt", "kueue-ca.crt"), ("tls.crt", "kueue-webhook.crt"), ("tls.key", "kueue-webhook.key"))
    for target, source in copies:
        (cert_dir / target).write_bytes(files[source])
        (cert_dir / target).chmod(0o600)
    url = f"https://127.0.0.1:{layout.port('kueue_webhook')}/convert"
    crd_files = sorted(layout.binary("kueue-crds").glob("*.yaml"))
    crds = [manifests.with_conversion_webhook(yaml.safe_load(f.read_text()), url) for f in crd_files]
    bootstrap = manifests.kueue_bootstrap_objects(*files.values())
    # Server-side: the Workload CRD is too large for the last-applied annotation of client-side apply.
    kubectl(layout, "apply", "--server-side", "--field-manager=kvfleet-cluster", "-f", "-",
            stdin=yaml.safe_dump_all(crds + bootstrap, sort_keys=False))  # fmt: skip
    wait_established(layout, kubectl, [c["metadata"]["name"] for c in crds])


def wait_established(layout: Layout, kubectl: Kubectl, names: list[str], timeout: float = 60.0) -> None:
    """Waits until every named CRD is Established. (`kubectl wait --for=condition=Established` fails at once on a
    CRD whose status has no conditions yet, which a busy apiserver shows for a moment after the apply.)"""
    deadline = time.monotonic() + timeout
    while True:
        items = json.loads(kubectl(layout, "get", "crd", "-o", "json")).get("items") or []
        established = {c["metadata"]["name"] for c in items
                       if any(k.get("type") == "Established" and k.get("status") == "True"
                              for k in (c.get("status") or {}).get("conditions") or [])}  # fmt: skip
        waiting = sorted(set(names) - established)
        if not waiting:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"CRDs not Established after {timeout:.0f} s: {', '.join(waiting)}")
        time.sleep(0.5)


def check_kept_our_certificate(layout: Layout, kubectl: Kubectl) -> None:
    """Fails when Kueue's rotator replaced the seeded certificate (conversion via 127.0.0.1 would then fail)."""
    out = kubectl(layout, "get", "secret", "-n", manifests.KUEUE_NAMESPACE, manifests.KUEUE_WEBHOOK_SECRET,
                  "-o", "jsonpath={.data.tls\\.crt}")  # fmt: skip
    if base64.b64decode(out) != (layout.pki / "kueue-webhook.crt").read_bytes():
        raise RuntimeError("Kueue's certificate rotator replaced the seeded webhook certificate; see kueue.log")
