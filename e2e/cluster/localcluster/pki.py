"""Certificates and keys of the local control plane, made with the openssl command line.

A CA; a separate request-header (front-proxy) CA and its client; the apiserver's serving certificate (SANs
127.0.0.1 and localhost); client certificates for the admin (group system:masters), the controller manager and the
scheduler (the users RBAC's bootstrap roles name); an RSA key pair that signs and verifies service-account tokens;
and Kueue's webhook CA and certificate. Each file is made once and kept while the cluster lives.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DAYS = "3650"


@dataclass(frozen=True)
class ClientIdentity:
    """A client certificate's file stem, user name (CN) and groups (O)."""

    stem: str
    user: str
    groups: tuple[str, ...] = ()


ADMIN = ClientIdentity("admin", "kubernetes-admin", ("system:masters",))
CONTROLLER_MANAGER = ClientIdentity("controller-manager", "system:kube-controller-manager")
SCHEDULER = ClientIdentity("scheduler", "system:kube-scheduler")
# The engine kubelet: its own user, allowed by the ClusterRole in manifests.engine_kubelet_rbac().
ENGINE_KUBELET = ClientIdentity("engine-kubelet", "kvfleet:engine-kubelet")
CLIENTS = (ADMIN, CONTROLLER_MANAGER, SCHEDULER, ENGINE_KUBELET)
FRONT_PROXY_CLIENT = "front-proxy-client"

APISERVER_SANS = (
    "IP:127.0.0.1",
    "DNS:localhost",
    "DNS:kubernetes",
    "DNS:kubernetes.default",
    "DNS:kubernetes.default.svc",
    "DNS:kubernetes.default.svc.cluster.local",
    "IP:10.96.0.1",
)


def subject(common_name: str, organizations: tuple[str, ...] = ()) -> str:
    """An openssl -subj string; rejects characters that would change its meaning."""
    for part in (common_name, *organizations):
        if any(c in part for c in "/=+\n"):
            raise ValueError(f"certificate subject part {part!r} contains a reserved character")
    return "".join(f"/O={o}" for o in organizations) + f"/CN={common_name}"


def leaf_extensions(server: bool, sans: tuple[str, ...] = ()) -> str:
    """The x509v3 extension section for a serving or client leaf certificate."""
    lines = [
        "basicConstraints=critical,CA:FALSE",
        "keyUsage=critical,digitalSignature,keyEncipherment",
        f"extendedKeyUsage={'serverAuth' if server else 'clientAuth'}",
    ]
    if sans:
        lines.append("subjectAltName=" + ",".join(sans))
    return "\n".join(lines) + "\n"


def _openssl(*args: str, stdin: bytes | None = None) -> None:
    if shutil.which("openssl") is None:
        raise RuntimeError("the openssl command is needed to make the cluster's certificates (apt-get install openssl)")
    proc = subprocess.run(["openssl", *args], input=stdin, capture_output=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {proc.stderr.decode(errors='replace').strip()}")


def _key(path: Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path))
    path.chmod(0o600)


def _rsa_pkcs1_key(path: Path) -> None:
    """An RSA key in PKCS#1 form: the only CA key form Kueue's certificate rotator parses."""
    _openssl("genrsa", "-traditional", "-out", str(path), "2048")
    path.chmod(0o600)


def _ca(pki: Path, stem: str, common_name: str, organizations: tuple[str, ...] = (), san: str = "",
        rsa_pkcs1: bool = False) -> None:  # fmt: skip
    (_rsa_pkcs1_key if rsa_pkcs1 else _key)(pki / f"{stem}.key")
    extra = ["-addext", f"subjectAltName={san}"] if san else []
    _openssl(
        "req", "-x509", "-new", "-key", str(pki / f"{stem}.key"), "-subj", subject(common_name, organizations),
        "-days", DAYS, "-sha256", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature", *extra, "-out", str(pki / f"{stem}.crt"),
    )  # fmt: skip


def _leaf(pki: Path, stem: str, subj: str, extensions: str, ca: str = "ca") -> None:
    key, csr, crt, ext = (pki / f"{stem}{suffix}" for suffix in (".key", ".csr", ".crt", ".ext"))
    _key(key)
    ext.write_text(extensions)
    _openssl("req", "-new", "-key", str(key), "-subj", subj, "-out", str(csr))
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(pki / f"{ca}.crt"), "-CAkey", str(pki / f"{ca}.key"),
        "-CAcreateserial", "-days", DAYS, "-sha256", "-extfile", str(ext), "-out", str(crt),
    )  # fmt: skip
    csr.unlink()
    ext.unlink()


def ensure_pki(pki: Path) -> None:
    """Makes every missing certificate and key under `pki`; existing ones are kept."""
    pki.mkdir(parents=True, exist_ok=True)
    if not (pki / "ca.crt").exists():
        log.info("making the cluster CA in %s", pki)
        _ca(pki, "ca", "kvfleet-local-ca")
    if not (pki / "front-proxy-ca.crt").exists():
        # The aggregation layer's request-header CA: separate, as kubeadm does; components read it from the
        # extension-apiserver-authentication ConfigMap and complain while it is missing.
        _ca(pki, "front-proxy-ca", "kvfleet-front-proxy-ca")
        _leaf(pki, FRONT_PROXY_CLIENT, subject(FRONT_PROXY_CLIENT), leaf_extensions(False), ca="front-proxy-ca")
    if not (pki / "apiserver.crt").exists():
        _leaf(pki, "apiserver", subject("kube-apiserver"), leaf_extensions(True, APISERVER_SANS))
    for client in CLIENTS:
        if not (pki / f"{client.stem}.crt").exists():
            _leaf(pki, client.stem, subject(client.user, client.groups), leaf_extensions(False))
    if not (pki / "sa.key").exists():
        # RSA: the algorithm every token consumer accepts.
        _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(pki / "sa.key"))
        (pki / "sa.key").chmod(0o600)
        _openssl("pkey", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))


def ensure_kueue_webhook_pki(pki: Path, service_dns: str) -> None:
    """The CA and serving certificate of Kueue's webhook server, made the way its certificate rotator checks them.

    Kueue's rotator (open-policy-agent/cert-controller) keeps a Secret's certificates when the CA verifies for the
    DNS name "kueue-ca" and the server certificate for "<service>.<namespace>.svc"; ours also name 127.0.0.1, where
    the apiserver reaches the conversion webhook. Seeding the Secret with them keeps the rotator from replacing them.
    """
    pki.mkdir(parents=True, exist_ok=True)
    if not (pki / "kueue-ca.crt").exists():
        _ca(pki, "kueue-ca", "kueue-ca", ("kueue",), san="DNS:kueue-ca", rsa_pkcs1=True)
    if not (pki / "kueue-webhook.crt").exists():
        sans = (f"DNS:{service_dns}", "IP:127.0.0.1")
        _leaf(pki, "kueue-webhook", subject(service_dns), leaf_extensions(True, sans), ca="kueue-ca")
