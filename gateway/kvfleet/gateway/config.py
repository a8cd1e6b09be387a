"""Flags of `kvfleet gateway`, each also read from `KVFLEET_GATEWAY_<FLAG>` (the chart sets those)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from kvfleet.gateway.dispatch import DEFAULT_CAPACITY, DispatchConfig
from kvfleet.gateway.fairness import POLICIES as FAIRNESS
from kvfleet.gateway.prefix import PrefixConfig
from kvfleet.gateway.proxy import ProxyConfig
from kvfleet.gateway.routing import POLICIES, RoutingConfig
from kvfleet.gateway.waking import HoldConfig

ENV_PREFIX = "KVFLEET_GATEWAY_"
LOOPBACK_ENV = "KVFLEET_LOOPBACK_ONLY"


@dataclass(frozen=True)
class Flag:
    name: str
    help: str
    type: Callable[[str], Any] = str
    default: Any = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None


FLAGS: tuple[Flag, ...] = (
    Flag("--host", "Address to listen on.", default="0.0.0.0"),
    Flag("--port", "Port of the OpenAI-compatible API.", int, 8080),
    Flag("--metrics-host", "Address of the Prometheus /metrics listener (not the API's: tenants must not "
         "read other tenants' numbers).", default="127.0.0.1"),
    Flag("--metrics-port", "Port of /metrics; 0 turns it off.", int, 9090),
    Flag("--kubeconfig", "Kubeconfig to watch the cluster with (default: the pod's service account, else "
         "$KUBECONFIG).", metavar="FILE"),
    Flag("--keys-namespace", "Namespace of the Secrets Tenants name in spec.gateway.apiKeySecrets (default: "
         "the gateway's own, $POD_NAMESPACE, else kvfleet-system).", metavar="NAMESPACE"),
    Flag("--config", "Static tenants, keys and replicas from a YAML file instead of the cluster (outside "
         "Kubernetes: tests, benchmarks).", metavar="FILE"),
    Flag("--routing", "Replica choice: prefix (cached prefix with bounded load), least-load, round-robin.",
         default="prefix", choices=POLICIES),
    Flag("--load-factor", "c of bounded loads: a replica takes a request while its load is below "
         "ceil(c * mean load).", float, 1.25),
    Flag("--kv-high", "KV-cache use (0..1) above which a replica is skipped while others have room.", float, 0.95),
    Flag("--prefix-block-chars", "Characters per prefix block of a text prompt.", int, 256),
    Flag("--prefix-block-tokens", "Token ids per prefix block of a token-id prompt.", int, 64),
    Flag("--prefix-max-blocks", "Leading blocks of a prompt that routing looks at.", int, 64),
    Flag("--prefix-index-blocks", "Prefix blocks remembered per replica (LRU).", int, 16384),
    Flag("--max-request-bytes", "Largest request body; larger ones get 413 without being sent on.", int,
         32 * 2**20),
    Flag("--scrape-interval", "Seconds between reads of each engine's /metrics (queue depth, KV use).", float,
         1.0),
    Flag("--connect-timeout", "Seconds to connect to a replica before trying another.", float, 5.0),
    Flag("--read-timeout", "Longest silence from a replica, in seconds (a non-streamed answer is one silence).",
         float, 600.0),
    Flag("--eject-seconds", "How long a replica that failed to answer gets no requests.", float, 5.0),
    Flag("--shutdown-grace-period", "Seconds requests in flight may take to finish after SIGTERM.", float, 30.0),
    Flag("--fairness", "Order of requests waiting for a saturated model: vtc (virtual token counter, by tenant "
         "weight, a slot kept for an idle active tenant) or fifo (arrival order).", default="vtc", choices=FAIRNESS),
    Flag("--replica-capacity", "Requests one replica runs at once when its ModelDeployment sets no "
         "engine.maxNumSeqs (more wait at the gateway).", int, DEFAULT_CAPACITY),
    Flag("--active-seconds", "A tenant with a request to a model in this many seconds is active there (vtc keeps "
         "a slot free for its next request while it has none).", float, 10.0),
    Flag("--admission-timeout", "Seconds a request held for a model at zero waits for Kueue to admit a replica "
         "before a 503.", float, 60.0),
    Flag("--wake-timeout", "Seconds a request held for a model at zero waits for a ready replica before a 504.",
         float, 300.0),
    Flag("--queue-timeout", "Seconds a request waits for a slot on a saturated model before a 503.", float, 120.0),
    Flag("--quota-retry-after", "Retry-After (seconds) of a 429 for a model Kueue keeps at zero.", int, 30),
    Flag("--max-queued-per-tenant", "Requests a tenant may have waiting per model at one gateway replica; more get "
         "429.", int, 100),
    Flag("--peers", "Other gateway replicas' metrics URLs, comma-separated (outside a cluster), whose usage "
         "counts against tenants' limits.", metavar="URLS"),
    Flag("--peer-selector", "Label selector of the gateway's pods in its namespace: their usage counts against "
         "tenants' limits (the pod itself, $POD_NAME, is left out).", metavar="SELECTOR"),
    Flag("--peer-sync-interval", "Seconds between reads of the peers' usage.", float, 0.5),
    Flag("--log-level", "Log level.", default="info", choices=("debug", "info", "warning", "error")),
)


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def add_args(parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
    env = os.environ if env is None else env
    for flag in FLAGS:
        name = env_name(flag.name)
        default = flag.default
        if name in env:
            try:
                default = flag.type(env[name])
            except ValueError as exc:
                raise SystemExit(f"kvfleet gateway: error: {name}={env[name]!r} is invalid: {exc}") from None
        shown = "" if flag.default is None else "; default: %(default)s"
        parser.add_argument(flag.name, dest=flag.name.lstrip("-").replace("-", "_"), type=flag.type, default=default,
                            choices=flag.choices, metavar=flag.metavar, help=f"{flag.help} (env {name}{shown})")


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "0.0.0.0"
    port: int = 8080
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9090
    kubeconfig: str | None = None
    keys_namespace: str = "kvfleet-system"
    static_config: str | None = None
    routing: RoutingConfig = RoutingConfig()
    prefix: PrefixConfig = PrefixConfig()
    proxy: ProxyConfig = ProxyConfig()
    prefix_index_blocks: int = 16384
    max_request_bytes: int = 32 * 2**20
    scrape_interval: float = 1.0
    eject_seconds: float = 5.0
    shutdown_grace_period: float = 30.0
    log_level: str = "info"
    loopback_only: bool = False  # KVFLEET_LOOPBACK_ONLY: never send anything to a replica off 127.0.0.0/8
    dispatch: DispatchConfig = DispatchConfig()
    peers: tuple[str, ...] = ()
    peer_selector: str | None = None
    pod_name: str | None = None
    namespace: str = "kvfleet-system"  # the gateway's own ($POD_NAMESPACE, else the key namespace): its peers'
    peer_sync_interval: float = 0.5


def config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> GatewayConfig:
    """The config, or ValueError naming the flag."""
    env = os.environ if env is None else env
    positive = ("port", "max_request_bytes", "prefix_block_chars", "prefix_block_tokens", "prefix_max_blocks",
                "prefix_index_blocks")
    for name in positive:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("scrape_interval", "connect_timeout", "read_timeout", "admission_timeout", "wake_timeout",
                 "queue_timeout", "peer_sync_interval"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    for name in ("replica_capacity", "max_queued_per_tenant", "quota_retry_after"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("metrics_port", "eject_seconds", "shutdown_grace_period", "active_seconds"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
    if not 0 < args.kv_high <= 1:
        raise ValueError("--kv-high must be in (0, 1]")
    try:
        routing = RoutingConfig(policy=args.routing, load_factor=args.load_factor, kv_high=args.kv_high)
    except ValueError as exc:
        raise ValueError(f"--load-factor: {exc}") from None
    peers = tuple(p.strip().rstrip("/") for p in (args.peers or "").split(",") if p.strip())
    for peer in peers:
        if not peer.startswith("http://"):
            raise ValueError(f"--peers: {peer!r} is not an http:// URL")
    hold = HoldConfig(admission_timeout=args.admission_timeout, wake_timeout=args.wake_timeout,
                      queue_timeout=args.queue_timeout, quota_retry_after=args.quota_retry_after,
                      max_queued_per_tenant=args.max_queued_per_tenant)
    return GatewayConfig(
        host=args.host, port=args.port, metrics_host=args.metrics_host, metrics_port=args.metrics_port,
        kubeconfig=args.kubeconfig, keys_namespace=args.keys_namespace or env.get("POD_NAMESPACE") or "kvfleet-system",
        static_config=args.config, routing=routing,
        prefix=PrefixConfig(args.prefix_block_chars, args.prefix_block_tokens, args.prefix_max_blocks),
        proxy=ProxyConfig(connect_timeout=args.connect_timeout, read_timeout=args.read_timeout),
        prefix_index_blocks=args.prefix_index_blocks, max_request_bytes=args.max_request_bytes,
        scrape_interval=args.scrape_interval, eject_seconds=args.eject_seconds,
        shutdown_grace_period=args.shutdown_grace_period, log_level=args.log_level,
        loopback_only=env.get(LOOPBACK_ENV, "").strip().lower() in ("1", "true", "yes", "on"),
        dispatch=DispatchConfig(fairness=args.fairness, hold=hold, replica_capacity=args.replica_capacity,
                                active_seconds=args.active_seconds),
        peers=peers, peer_selector=args.peer_selector or None, pod_name=env.get("POD_NAME") or None,
        namespace=env.get("POD_NAMESPACE") or args.keys_namespace or "kvfleet-system",
        peer_sync_interval=args.peer_sync_interval)


def parse_config(argv: Sequence[str], env: Mapping[str, str] | None = None) -> GatewayConfig:
    parser = build_parser(env)
    args = parser.parse_args(list(argv))
    try:
        return config_from_args(args, env)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvfleet gateway",
        description="One OpenAI-compatible endpoint in front of every ModelDeployment: tenants by API key, "
                    "models within the tenant, prefix- and load-aware routing to ready replicas.")
    add_args(parser, env)
    return parser
