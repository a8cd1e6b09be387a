"""Build kvfleet's container images without a registry or a Docker daemon (buildah, podman, skopeo, debootstrap).

`images/build.py` is the command line (`make images`, `make image-test`); images/README.md says how it works.
"""
