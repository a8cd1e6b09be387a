"""The engine kubelet: what a kubelet does for kvfleet's engine pods, on the local cluster's fake GPU nodes.

kwok keeps the fake nodes alive and gives every pod a loopback IP; for the pods of a kvfleet engine (label
`app.kubernetes.io/name=kvfleet-engine`) kwok stops there (see `manifests.kwok_stages`), and this process takes over:
it runs a real `kvfleet serve` (CPU, a local model) bound to the pod's IP and container port, turns the pod Ready
only while the engine's `/health` answers 200, restarts a dead engine with a kubelet's back-off, and on deletion
stops the engine (SIGTERM, then SIGKILL after a bound) before it removes the pod.

Modules: `pods` (what a pod asks for, and the engine command that serves it; pure), `status` (pod status patches
and restart back-off; pure), `probes` (startup/readiness/liveness over `/health`), `models` (which local model
serves a pod), `processes` (spawning, stopping and recording engine processes), `secret_volumes` (Secret volumes
in the kubelet's layout, updated by one rename when their Secret changes), `api` (the apiserver client),
`supervisor` (the loop that ties them), `__main__` (the process).
"""
