// Command kubectl runs the upstream kubectl of the pinned release, as its own main does.
package main

import (
	"os"

	_ "k8s.io/client-go/plugin/pkg/client/auth" // client auth plugins
	"k8s.io/component-base/cli"
	"k8s.io/component-base/logs"
	"k8s.io/kubectl/pkg/cmd"
	"k8s.io/kubectl/pkg/cmd/util"
)

func main() {
	// Verbosity is parsed before the command is built, as upstream does, so klog works during construction.
	logs.GlogSetter(cmd.GetLogVerbosity(os.Args)) // nolint:errcheck
	if err := cli.RunNoErrOutput(cmd.NewDefaultKubectlCommand()); err != nil {
		util.CheckErr(err)
	}
}
