// Command kube-controller-manager runs the upstream kube-controller-manager of the pinned k8s.io/kubernetes release, as its own main does.
package main

import (
	"os"
	_ "time/tzdata" // time zones for CronJob, as upstream

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"          // JSON log format
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // client-go metrics
	_ "k8s.io/component-base/metrics/prometheus/version"  // version metric
	"k8s.io/kubernetes/cmd/kube-controller-manager/app"
)

func main() {
	os.Exit(cli.Run(app.NewControllerManagerCommand()))
}
