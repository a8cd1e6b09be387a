"""`make demo`: the kvfleet story on the local cluster, ending with a chat answered by team-a's pod.

1. the local control plane (real apiserver, scheduler, Kueue, fake GPU nodes, and the engine kubelet that runs
   a real `kvfleet serve` for each engine pod) is up;
2. the Helm chart is installed (CRDs, RBAC, ResourceFlavors), the samples applied (two tenants in one
   cohort, a model each), and the operator runs as a local process against the cluster;
3. team-a's model is admitted and Ready (each pod Ready once its engine, the embedded SmolLM2 on CPU, answers
   /health); team-b's second model waits on quota with Kueue's reason, and is admitted once team-a scales down;
4. team-a's pod answers a chat request through the `openai` client, at the pod's own (loopback) IP;
5. the gateway (a local process, as the operator is) answers a chat with team-a's key by a pod of team-a's
   ModelDeployment, and refuses team-b's key for it (e2e/demo_gateway.py);
6. team-a/sleepy, at zero replicas, wakes from a request at the gateway: refused with 429 and Kueue's reason
   while team-b borrows team-a's spare GPUs, woken (first-token latency shown) once they come back, and back to
   zero after its scaleDownDelaySeconds.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "e2e" / "cluster"))

from kvfleet.operator.kube import Kube  # noqa: E402
from kvfleet.operator.testing import OperatorProcess, condition, install_crds, wait_for  # noqa: E402

from demo_gateway import gateway_act, wake_act  # noqa: E402
from localcluster import control  # noqa: E402
from localcluster.layout import Layout  # noqa: E402

API = "serving.kvfleet.dev/v1alpha1"
MANIFESTS = REPO / "manifests"
BOLD, DIM, GREEN, YELLOW, END = ("\033[1m", "\033[2m", "\033[32m", "\033[33m", "\033[0m") if sys.stdout.isatty() \
    else ("",) * 5


def say(text: str) -> None:
    print(f"\n{BOLD}==> {text}{END}", flush=True)


def note(text: str, color: str = "") -> None:
    print(f"    {color}{text}{END if color else ''}", flush=True)


class Demo:
    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.kube = Kube.from_kubeconfig(str(layout.kubeconfig))

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> str:
        argv = [str(self.layout.binary("kubectl")), f"--kubeconfig={self.layout.kubeconfig}", *args]
        proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False)  # noqa: S603
        if check and proc.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {proc.stderr.strip()}")
        return proc.stdout

    def helm(self, *args: str) -> str:
        argv = [str(self.layout.binary("helm")), f"--kubeconfig={self.layout.kubeconfig}", *args]
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)  # noqa: S603
        if proc.returncode != 0:
            raise RuntimeError(f"helm {' '.join(args)}: {proc.stderr.strip()}")
        return proc.stdout

    def status(self, ns: str, name: str) -> dict[str, Any]:
        return (self.kube.get(API, "modeldeployments", name, ns) or {}).get("status") or {}

    def wait_ready(self, ns: str, name: str, replicas: int, timeout: float = 420) -> dict[str, Any]:
        # Ready pods: each engine (SmolLM2 on CPU) has loaded and answers /health; on two busy cores that can
        # take a few minutes when several start at once.
        return wait_for(f"{ns}/{name} ready", lambda: (s := self.status(ns, name)).get("readyReplicas") == replicas
                        and s.get("admittedReplicas") == replicas and s, timeout=timeout)

    def cluster_status_engines(self) -> list[str]:
        """The engine kubelet's engines, as `make cluster-status` lists them."""
        return control.describe_engines(control.engines(self.layout)).splitlines()

    def show_mdeps(self) -> None:
        for line in self.kubectl("get", "mdep", "-A").rstrip().splitlines():
            note(line, DIM)

    def reset(self) -> None:
        """Start from the samples as written (a previous run scaled things)."""
        for f in ("team-a-sleepy.yaml", "team-b-summarizer.yaml", "team-b-coder.yaml", "team-a-chat.yaml"):
            self.kubectl("delete", "--ignore-not-found", "--wait=true", "-f", str(MANIFESTS / f), check=False)


def install(demo: Demo) -> None:
    say("Installing the Helm chart (CRDs, RBAC, ResourceFlavors h200/l40s); the operator runs locally")
    install_crds(lambda *a, **k: demo.kubectl(*a))
    demo.helm("upgrade", "--install", "kvfleet", str(REPO / "charts" / "kvfleet"), "--namespace", "kvfleet-system",
              "--create-namespace", "--set", "operator.enabled=false", "--wait")
    for line in demo.helm("status", "kvfleet", "--namespace", "kvfleet-system").splitlines()[:4]:
        note(line, DIM)


def story(demo: Demo) -> None:
    say("Applying the samples: two tenants sharing the cohort 'gpus', one model each")
    demo.reset()
    demo.kubectl("apply", "-f", str(MANIFESTS / "tenants.yaml"))
    note("kubectl apply -f manifests/tenants.yaml")
    for tenant in ("team-a", "team-b"):  # the operator makes the namespaces, queues, policy and RBAC
        wait_for(f"LocalQueue of {tenant}", lambda t=tenant: demo.kube.get("kueue.x-k8s.io/v1beta2", "localqueues",
                                                                           t, t), timeout=60)
    note("tenant namespaces team-a and team-b: LocalQueue, NetworkPolicy, RoleBinding ready")
    for f in ("team-a-chat.yaml", "team-b-coder.yaml"):
        demo.kubectl("apply", "-f", str(MANIFESTS / f))
        note(f"kubectl apply -f manifests/{f}")
    note("team-a owns 4 H200 GPUs; team-b owns 2 and may borrow 2 more from the cohort")

    say("team-a/chat (kvfleet engine, 2 replicas x 2 GPUs) and team-b/coder (vLLM, 1 x 2 GPUs)")
    note("each pod runs a real `kvfleet serve` on CPU (SmolLM2) at its IP; Ready once /health answers", DIM)
    for ns, name, n in (("team-a", "chat", 2), ("team-b", "coder", 1)):
        st = demo.wait_ready(ns, name, n)
        note(f"{ns}/{name}: {st['admittedReplicas']}/{st['desiredReplicas']} admitted by Kueue, "
             f"{st['readyReplicas']} Ready, endpoint {st['endpoint']}", GREEN)
    demo.show_mdeps()

    say("team-b adds a second model (2 GPUs): its quota is used, the cohort's spare H200s are team-a's")
    demo.kubectl("apply", "-f", str(MANIFESTS / "team-b-summarizer.yaml"))
    mdep = wait_for("summarizer waiting on quota", lambda: (m := demo.kube.get(API, "modeldeployments", "summarizer",
                                                                                "team-b"))
                    and (condition(m, "QuotaExceeded") or {}).get("status") == "True" and m, timeout=60)
    quota = condition(mdep, "QuotaExceeded")
    note(f"team-b/summarizer: Admitted={condition(mdep, 'Admitted')['status']} "
         f"reason={quota['reason']}", YELLOW)
    note(f"Kueue says: {quota['message']}", YELLOW)
    time.sleep(2)
    pods = demo.kube.list("v1", "pods", "team-b", "serving.kvfleet.dev/modeldeployment=summarizer")
    note(f"pods of summarizer: {len(pods)} (none may run before admission)")

    say("team-a scales chat down to 1 replica: 2 H200 GPUs go back to the cohort")
    demo.kubectl("scale", "mdep/chat", "--replicas=1", "--namespace", "team-a")
    note("kubectl scale mdep/chat --replicas=1 -n team-a")
    st = demo.wait_ready("team-b", "summarizer", 1)
    note(f"team-b/summarizer: admitted (borrowing from the cohort) and Ready, endpoint {st['endpoint']}", GREEN)
    demo.show_mdeps()
    gpus = wait_for("team-b's usage", lambda: [g for g in ((demo.kube.get(API, "tenants", "team-b") or {})
                                                           .get("status") or {}).get("gpus", [])
                                               if g["flavor"] == "h200" and g["inUse"] == 4] and
                    demo.kube.get(API, "tenants", "team-b")["status"]["gpus"], timeout=30)
    for g in gpus:
        note(f"tenant team-b, flavor {g['flavor']}: {g['inUse']} GPUs in use (nominal {g['nominal']}), "
             f"{g['pending']} pending", DIM)


def pod_chat(demo: Demo) -> None:
    say("team-a's pod answers: the `openai` client at the pod's IP (its engine: SmolLM2-135M-Instruct on CPU)")
    import httpx
    from openai import OpenAI

    pods = [p for p in demo.kube.list("v1", "pods", "team-a", "serving.kvfleet.dev/modeldeployment=chat")
            if not p["metadata"].get("deletionTimestamp") and any(
                c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])]
    pod = pods[0]
    ip, port = pod["status"]["podIP"], pod["spec"]["containers"][0]["ports"][0]["containerPort"]
    note(f"pod {pod['metadata']['name']} on {pod['spec']['nodeName']}: http://{ip}:{port}/v1")
    client = OpenAI(base_url=f"http://{ip}:{port}/v1", api_key="not-needed", http_client=httpx.Client(trust_env=False))
    model = client.models.list().data[0].id
    question = "In one sentence, what is a GPU?"
    note(f"model {model}; user: {question}")
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                           max_tokens=48, temperature=0)
    note(f"assistant: {(reply.choices[0].message.content or '').strip()}", GREEN)
    note(f"usage: {json.dumps(reply.usage.model_dump() if reply.usage else {})}", DIM)
    for line in demo.cluster_status_engines():
        note(line, DIM)


def main() -> int:
    layout = Layout.for_checkout()
    say("Local control plane (make cluster-up): etcd, kube-apiserver, scheduler, controller manager, kwok, Kueue")
    control.up(layout)
    demo = Demo(layout)
    for line in demo.kubectl("get", "nodes", "-L", "kvfleet.dev/gpu-flavor").rstrip().splitlines():
        note(line, DIM)
    op_log = Path(layout.logs) / "operator-demo.log"
    install(demo)
    # the autoscaler every 5 s (default 15): sleepy goes back to zero soon after its delay
    operator = OperatorProcess(str(layout.kubeconfig), op_log, peering="kvfleet", identity="kvfleet-demo",
                               env={"KVFLEET_AUTOSCALE_INTERVAL": "5"})
    try:
        operator.start()
        note(f"operator: {' '.join(operator.argv()[1:])}  (log: {op_log})", DIM)
        story(demo)
        pod_chat(demo)
        keys = gateway_act(str(layout.kubeconfig), Path(layout.logs), demo.kubectl, say, note, GREEN, YELLOW, DIM)
        wake_act(str(layout.kubeconfig), Path(layout.logs), demo.kube, demo.kubectl, MANIFESTS, keys, say, note,
                 GREEN, YELLOW, DIM)
    finally:
        operator.stop()
    say("Continue by hand")
    kc = layout.kubeconfig
    print(f"""    export KUBECONFIG={kc} PATH={REPO}/.cluster/bin:$PATH
    .venv/bin/python -m kvfleet.operator --kubeconfig {kc} --peering kvfleet &   # the operator
    kubectl get tenants,mdep -A ; kubectl get workloads -A          # state and Kueue admission
    kubectl scale mdep/chat --replicas=3 -n team-a                   # beyond quota: watch it wait
    kubectl describe mdep/summarizer -n team-b                       # conditions and Events
    kubectl get pods -n team-a -o wide                               # engine pods and their IPs
    curl http://POD_IP:8000/v1/models                                # an engine pod's OpenAI API
    .venv/bin/kvfleet gateway --kubeconfig {kc} --keys-namespace kvfleet-system --port 8080 &   # the gateway
    curl -H "Authorization: Bearer $KEY" 127.0.0.1:8080/v1/models    # KEY: in Secret kvfleet-system/team-a-keys
    make cluster-status                                              # components, nodes, engines (pid, state)
    make cluster-down                                                # stop the cluster and every engine""")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
