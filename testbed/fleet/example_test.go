package fleet_test

import (
	"context"
	"fmt"

	"github.com/loxilb-llm/loxilb/testbed/enginesim"
	"github.com/loxilb-llm/loxilb/testbed/fleet"
)

// Four vLLM emulators with two DP ranks each, modelled delays off.
func ExampleStart() {
	cfg := enginesim.Config{Engine: enginesim.EngineVLLM, DPRanks: 2, Seed: "0", TimeScaleSet: true}
	f, err := fleet.Start(context.Background(), fleet.Uniform(4, cfg), fleet.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer f.Stop()
	for _, m := range f.Members {
		fmt.Println(m.Name, len(m.ZMQPorts), m.ReplayPorts[0]-m.ZMQPorts[0])
	}
	// Output:
	// vllm-both-0 2 1000
	// vllm-both-1 2 1000
	// vllm-both-2 2 1000
	// vllm-both-3 2 1000
}
