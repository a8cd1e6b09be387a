"""The kvfleet gateway: one OpenAI-compatible endpoint per cluster in front of every ModelDeployment.

A request's API key names its tenant (`keys`), its `model` resolves within that tenant (`catalog`),
a replica of the model is chosen (`dispatch` -> `routing`, from the load the gateway sees and the
engines report), and the request is proxied to it (`proxy`), streams passing through unbuffered.
What the gateway knows of the cluster is one immutable `Snapshot` (`snapshot`), rebuilt from the
API server's watch streams (`kube`, `discovery`) or a static file (`static`).

Decisions are pure functions (keys, catalog, prefix, routing, requests, sse); I/O stays at the edges
(kube, discovery, scrape, proxy, app). Nothing here imports torch.
"""
