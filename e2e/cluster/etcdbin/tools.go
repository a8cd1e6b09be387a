//go:build tools

// Package etcdbin only pins the etcd server module; build.sh runs `go build go.etcd.io/etcd/server/v3`.
package etcdbin

import _ "go.etcd.io/etcd/server/v3"
